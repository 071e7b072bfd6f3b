"""Triton W8A8 kernels: INT8 × INT8 (RTX 4090 sm_89 and Jetson Orin sm_87) and FP8 E4M3 × E4M3 (sm_89
only: Ampere's and Orin's tensor cores have no FP8) linears whose activations are quantized as
``quantkit.activation_quant`` specifies, per token (dynamic) or by the stored per-tensor scale (static).

A forward is two kernels. ``_quantize_rows_kernel`` turns each row of x into int8 or E4M3 codes and its
float32 scale, bit for bit what ``ActivationGrid.fake_quantize`` computes: IEEE quotients, ties to even,
saturation, and each scheme's own way into the grid's units (dynamic INT8 multiplies by 127 / max|x|,
static INT8 divides by the scale, FP8 multiplies by the scale's reciprocal). ``_gemm_kernel``
multiplies those codes by the stored weight codes [N, K] on tensor-core dots (int8 accumulating exactly
in int32; E4M3 in float32, whose products of two 4-bit significands are exact) and scales in its
epilogue: out = acc · act_scale[m] · weight_scale[n] (+ bias), stored in x's dtype. The weight is an
8-bit symmetric per-channel ``QuantizedTensor`` (codes q − 128 as int8) or an ``FP8Tensor`` (scale per
channel or per tensor, broadcast to one float32 per row). Decode and prefill share the GEMM with their
own tiles (``LAUNCH_CONFIGS``).

No GPU exists where quantkit is tested: the kernels are proven under ``TRITON_INTERPRET=1`` on CPU
tensors (tests/test_triton_w8a8.py). Measured in that interpreter (triton 3.9.0): it loads float8e4nv
tensors, decodes all 254 finite E4M3 codes exactly, and runs ``tl.dot`` on E4M3 operands exactly (it
widens them to float16 and multiplies in float32), so the FP8 path runs there as it is written for
the GPU. But its float32 → float8e4nv cast of a value off the E4M3 grid is not the hardware's
(``cvt.rn.satfinite``): no saturation, ties away from zero, and a rounding carry out of the mantissa is
lost (1000 → 256, −31.98 → −16); values already on the grid convert exactly. ``libdevice.rint`` does
not run in it. The activation kernel therefore rounds onto the grid itself, in float32 arithmetic that
is exact (power-of-two steps, ties to even from an integer truncation), and casts only values already
on the grid: the same codes on both. The interpreter also truncates a float32 → bf16 store, where a GPU
rounds to nearest even; the tests allow one bf16 step for it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from quantkit.activation_quant import KINDS, ActivationGrid
from quantkit.device import require_capability
from quantkit.fp8 import E4M3, FP8Tensor
from quantkit.kernels.linear import triton_w4a16
from quantkit.kernels.linear.int8 import CENTRE
from quantkit.kernels.linear.triton_w4a16 import LaunchConfig, store_rows
from quantkit.kernels.linear.w8a8 import int8_channel_refusal
from quantkit.quant import QuantizedTensor

FP8_CAPABILITY = (8, 9)  # Ada: the first tensor cores with E4M3 inputs
# Tensor-core dots need at least 16 rows: decode pads its few rows to one tile and spreads N thinly
# (weight-bandwidth-bound: RTX 4090 128 SMs at 1008 GB/s, AGX Orin 16 SMs at 204.8 GB/s, so wider
# column tiles there). Prefill tiles are int8/E4M3 MMA multiples (k 32); K tiles of 128 one-byte codes.
# Shared memory per stage is (block_m + block_n) · block_k bytes: 32 KB × 3 within the 4090's 99 KB a
# block, 24 KB × 3 within Orin's 163 KB.
LAUNCH_CONFIGS: dict[tuple[int, int], dict[str, LaunchConfig]] = {
    (8, 9): {"decode": LaunchConfig(block_n=32, block_k=256, block_m=16, num_warps=4, num_stages=4),
             "prefill": LaunchConfig(block_n=128, block_k=128, block_m=128, num_warps=8, num_stages=3)},
    (8, 7): {"decode": LaunchConfig(block_n=64, block_k=256, block_m=16, num_warps=4, num_stages=3),
             "prefill": LaunchConfig(block_n=128, block_k=128, block_m=64, num_warps=4, num_stages=3)},
}
DECODE_MAX_ROWS = 16
QUANT_BLOCK = 1024  # columns per step of the activation kernel (one program per row)
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def launch_config(capability: tuple[int, int], kind: str) -> LaunchConfig:
    """This module's entry for a GPU ("decode" or "prefill"), as ``triton_w4a16.launch_config`` picks it."""
    return triton_w4a16.launch_config(capability, kind, LAUNCH_CONFIGS)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """A CUDA device's compute capability; None for the CPU (the interpreter)."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def require_fp8(device: torch.device) -> None:
    capability = device_capability(device)
    if capability is not None and capability < FP8_CAPABILITY:
        major, minor = capability
        raise RuntimeError(f"{device} has compute capability {major}.{minor}; FP8 (E4M3) W8A8 needs "
                           f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer (RTX 4090). Use an INT8 W8A8 or "
                           "a 4-bit artifact on this GPU.")


@triton.jit
def _round_half_even(y):
    """float32 y (|y| < 2^31) to the nearest integer, ties to even, as float32 (libdevice.rint's result)."""
    whole = y.to(tl.int32)  # toward zero
    rest = tl.abs(y - whole.to(tl.float32))  # exact: y's own fraction bits
    away = (rest > 0.5) | ((rest == 0.5) & ((whole & 1) != 0))
    return tl.where(away, whole + tl.where(y < 0, -1, 1), whole).to(tl.float32)


@triton.jit
def _onto_e4m3(v):
    """float32 v with |v| <= 448 rounded to the nearest E4M3 value, ties to even, as float32: the step of
    a value in [2^e, 2^(e+1)) is 2^(e-3) (3 mantissa bits), and 2^-9 for every value below 2^-6 (the
    subnormals); the scaling by powers of two is exact. The sign comes from the bits, so −0 stays −0."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    up = ((130 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
    down = ((124 + exponent) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    magnitude = _round_half_even(tl.abs(v) * up) * down
    return tl.where(bits < 0, -magnitude, magnitude)


@triton.jit
def _quantize_rows_kernel(x_ptr, codes_ptr, scales_ptr, static_ptr, K, LARGEST: tl.constexpr,
                          SMALLEST_SCALE: tl.constexpr, FP8: tl.constexpr, DYNAMIC: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * K
    # div_rn throughout: Triton's plain fp32 division is approximate on a GPU, torch's is IEEE
    if DYNAMIC:
        absmax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            absmax = tl.maximum(absmax, tl.abs(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)))
        top = tl.max(absmax, axis=0)
        scale = tl.math.div_rn(top, LARGEST)
        if FP8:
            scale = tl.maximum(scale, SMALLEST_SCALE)
        else:
            scale = tl.where(scale > 0, scale, 1.0)
            # vLLM's dynamic INT8 multiplies by 127 / max|x| (a quotient of its own, not 1 / scale: in
            # rare ties the two round differently); 0 where that is not finite (an all-zero token, or
            # one so small that the quotient overflows), as activation_quant has it
            quotient = tl.math.div_rn(LARGEST, tl.where(top > 0, top, 1.0))
            multiplier = tl.where((top > 0) & (quotient < float("inf")), quotient, 0.0)
    else:
        scale = tl.load(static_ptr)
    inverse = tl.math.div_rn(1.0, scale)  # FP8 multiplies by the reciprocal, as vLLM's kernel does
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        values = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        if FP8:
            grid = _onto_e4m3(tl.minimum(tl.maximum(values * inverse, -LARGEST), LARGEST))
            tl.store(codes_ptr + row * K + offs, grid.to(tl.float8e4nv), mask=offs < K)
        else:
            if DYNAMIC:
                scaled = values * multiplier
            else:
                scaled = tl.math.div_rn(values, scale)  # a static INT8 scale divides
            # saturating before rounding gives the same integers (the bounds are integers)
            grid = _round_half_even(tl.minimum(tl.maximum(scaled, -128.0), 127.0))
            tl.store(codes_ptr + row * K + offs, grid.to(tl.int8), mask=offs < K)
    tl.store(scales_ptr + row, scale)


@triton.jit
def _gemm_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, M, K, N, FP8: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a_mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        w_mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
        a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :] * K + offs_k[:, None]  # W^T tile [BLOCK_K, BLOCK_N] of row-major W
        if FP8:
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            acc = tl.dot(a, w, acc)
        else:
            a = tl.load(a_ptrs, mask=a_mask, other=0)
            w = tl.load(w_ptrs, mask=w_mask, other=0)
            acc += tl.dot(a, w, out_dtype=tl.int32)
    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    store_rows(out_ptr, out, offs_m, offs_n, M, N)  # cast to out's dtype by the store


def quantize_rows(x: torch.Tensor, activations: ActivationGrid,
                  input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K] int8 or float8_e4m3fn, scales float32 [M]); codes · scale is
    ``activations.fake_quantize(x.float(), input_scale)`` exactly."""
    M, K = x.shape
    kind = KINDS[activations.kind]
    fp8 = activations.kind == "fp8"
    if not activations.dynamic and input_scale is None:
        raise ValueError("a static activation grid needs its stored input_scale")
    x = x.contiguous()
    codes = torch.empty(M, K, dtype=E4M3 if fp8 else torch.int8, device=x.device)
    scales = torch.empty(M, dtype=torch.float32, device=x.device)
    static = scales if activations.dynamic else input_scale.to(device=x.device, dtype=torch.float32)
    if M:
        _quantize_rows_kernel[(M,)](x, codes, scales, static, K, LARGEST=kind.largest,
                                    SMALLEST_SCALE=kind.smallest_scale, FP8=fp8, DYNAMIC=activations.dynamic,
                                    BLOCK_K=min(QUANT_BLOCK, triton.next_power_of_2(K)), num_warps=4)
    return codes, scales


def w8a8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, activations: ActivationGrid,
                input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                config: LaunchConfig | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) with its activations quantized, @ weight [N, K] (int8 or E4M3 codes)
    scaled by weight_scale float32 [N], + bias -> [M, N] in x's dtype."""
    M, K = x.shape
    N = weight.shape[0]
    fp8 = weight.dtype == E4M3
    capability = device_capability(x.device)
    if fp8:
        require_fp8(x.device)
    codes, scales = quantize_rows(x, activations, input_scale)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    c = config or launch_config(capability or (8, 9), "decode" if M <= DECODE_MAX_ROWS else "prefill")
    grid = (triton.cdiv(M, c.block_m), triton.cdiv(N, c.block_n))
    _gemm_kernel[grid](codes, weight, scales, weight_scale, scales if bias is None else bias, out, M, K, N,
                       FP8=fp8, HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                       num_warps=c.num_warps, num_stages=c.num_stages)
    return out


class TritonW8A8Linear(nn.Module):
    """A W8A8 linear on the Triton kernels: int8 weight codes with int8 activations, or E4M3 with E4M3."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, activations: ActivationGrid,
                 input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        """weight int8 or float8_e4m3fn [N, K], weight_scale float32 [N] (w = code · scale)."""
        super().__init__()
        kind = "fp8" if weight.dtype == E4M3 else "int8" if weight.dtype == torch.int8 else None
        if kind is None or weight.dim() != 2:
            raise ValueError(f"W8A8 weight codes must be a 2-D int8 or {E4M3} tensor, got {weight.dtype} "
                             f"{list(weight.shape)}")
        if activations.kind != kind:
            raise ValueError(f"{kind} weight codes multiply {kind} activations on these kernels, got "
                             f"{activations.kind} activations")
        if activations.dynamic and input_scale is not None:
            raise ValueError("a dynamic activation grid picks each token's scale: it takes no input_scale")
        if not activations.dynamic:
            if input_scale is None or input_scale.numel() != 1:
                raise ValueError("a static activation grid needs its one stored input_scale")
            input_scale = input_scale.float().reshape(1)
            if not (torch.isfinite(input_scale).all() and (input_scale > 0).all()):
                raise ValueError(f"input_scale must be one positive finite float, got {input_scale.item()}")
        self.out_features, self.in_features = weight.shape
        if tuple(weight_scale.shape) != (self.out_features,):
            raise ValueError(f"weight_scale must be [{self.out_features}], got {list(weight_scale.shape)}")
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
        self.activations = activations
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().contiguous())
        self.register_buffer("input_scale", input_scale)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())
        self.backend = "triton"

    @classmethod
    def from_int8_record(cls, record: QuantizedTensor, bias: torch.Tensor | None = None,
                         activations: ActivationGrid = ActivationGrid("int8"),
                         input_scale: torch.Tensor | None = None) -> "TritonW8A8Linear":
        """An 8-bit symmetric per-channel record: codes q in 0..255 around the zero point 128 become the
        signed q − 128, its one scale per row float32."""
        refusal = int8_channel_refusal(record)
        if refusal:
            raise ValueError(f"the INT8 W8A8 kernels need 8-bit symmetric per-channel codes: {refusal}")
        capability = device_capability(record.codes.device)
        if capability is not None:
            require_capability(capability)
        codes = (record.codes.to(torch.int16) - CENTRE).to(torch.int8)
        return cls(codes, record.scales.float().reshape(-1), activations, input_scale, bias)

    @classmethod
    def from_fp8_record(cls, record: FP8Tensor, bias: torch.Tensor | None = None,
                        activations: ActivationGrid = ActivationGrid("fp8"),
                        input_scale: torch.Tensor | None = None) -> "TritonW8A8Linear":
        """An E4M3 record with a scale per channel or per tensor (broadcast to every row). Refused on a
        CUDA GPU older than sm_89."""
        require_fp8(record.values.device)
        scale = record.scale.float().reshape(-1).expand(record.shape[0])
        return cls(record.values, scale, activations, input_scale, bias)

    @property
    def weight_bytes(self) -> int:
        """What a decode step reads: one byte per weight and the float32 row scales the kernel reads."""
        return self.weight.numel() + self.weight_scale.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in INPUT_DTYPES:
            raise ValueError(f"TritonW8A8Linear takes {INPUT_DTYPES} inputs, got {x.dtype}")
        rows = x.reshape(-1, self.in_features)
        out = w8a8_matmul(rows, self.weight, self.weight_scale, self.activations, self.input_scale, self.bias)
        return out.view(*x.shape[:-1], self.out_features)
