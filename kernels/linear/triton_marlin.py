"""Triton W4A16 kernels over the Marlin layout: a GEMV for decode (M = 1) and a GEMM for prefill.

The weight stays exactly as ``quantkit.formats.marlin`` writes it: ``B`` int32 [K/16, 2N] (16×16
tiles, runs of four tiles permuted so each MMA fragment is contiguous, 8 codes per word) and ``s``
fp16 [G, N] in Marlin's scale order; symmetric 4-bit, W[k, n] = (q[k, n] - 8) · scale[k // group, n].
Activations are fp16/bf16/fp32, accumulation float32.

Decoding the layout is closed-form index arithmetic inside the kernel, not an index table: inverting
``_weight_perm`` gives, for element (k, n) with row r = k % 16 and column c = n % 16 of its tile,

    word   B[k // 16, 128·(n // 64) + 16·(c % 8) + 4·((r % 8) // 2) + (n // 16) % 4]
    nibble 2·(c // 8) + r // 8 + 4·(r % 2)

(thread 4·(c % 8) + (r % 8) // 2 of the warp owns the code, as entry 4·(c // 8) + 2·(r // 8) + r % 2
of its fragment, stored at nibble NIBBLE_INTERLEAVE.index(entry)). Scale column n is stored at
64·(n // 64) + 8·(n % 8) + (n % 64) // 8 when G > 1 (an 8×8 transpose), and at
32·(n // 32) + 8·((n % 8) // 2) + 2·((n % 32) // 8) + n % 2 when G = 1. These are a few integer
ops per element, cheaper than a table's extra loads and with nothing to keep in sync with K or N.

Each element gathers its own word, as the GPTQ kernels do; a word's eight codes are read by eight
lanes of the same tile, so the repeats hit in L1. As for the GPTQ kernels, the proof is the
interpreter (``TRITON_INTERPRET=1``, tests/test_triton_marlin.py), not a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from quantkit.formats.marlin import ZERO_POINT, check_marlin, marlin_shapes
from quantkit.kernels.linear.triton_w4a16 import LaunchConfig, current_capability, launch_config, load_rows, store_rows
from quantkit.quant import QuantConfig

_ZERO_POINT = tl.constexpr(ZERO_POINT)  # jit code may only read constexpr globals


@triton.jit
def _dequantized_tile(b_ptr, s_ptr, offs_k, offs_n, K, N, GROUP_SIZE, SINGLE_GROUP: tl.constexpr):
    """W[offs_k, offs_n] as float32, decoded from Marlin's B and s (out-of-range entries are 0)."""
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    r = (offs_k % 16)[:, None]
    c = (offs_n % 16)[None, :]
    word_col = 128 * (offs_n // 64)[None, :] + 16 * (c % 8) + 4 * ((r % 8) // 2) + ((offs_n // 16) % 4)[None, :]
    words = tl.load(b_ptr + (offs_k // 16)[:, None] * (2 * N) + word_col, mask=mask, other=0)
    codes = (words >> (4 * (2 * (c // 8) + r // 8 + 4 * (r % 2)))) & 0xF
    if SINGLE_GROUP:
        q = offs_n % 32
        scale_col = offs_n - q + 8 * ((q % 8) // 2) + 2 * (q // 8) + q % 2
    else:
        q = offs_n % 64
        scale_col = offs_n - q + 8 * (q % 8) + q // 8
    groups = offs_k // GROUP_SIZE
    scales = tl.load(s_ptr + groups[:, None] * N + scale_col[None, :], mask=mask, other=0.0).to(tl.float32)
    return (codes - _ZERO_POINT).to(tl.float32) * scales


@triton.jit
def _gemv_kernel(x_ptr, b_ptr, s_ptr, out_ptr, K, N, GROUP_SIZE, SINGLE_GROUP: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        w = _dequantized_tile(b_ptr, s_ptr, offs_k, offs_n, K, N, GROUP_SIZE, SINGLE_GROUP)
        acc += tl.sum(x[:, None] * w, axis=0)
    tl.store(out_ptr + offs_n, acc, mask=offs_n < N)


@triton.jit
def _gemm_kernel(x_ptr, b_ptr, s_ptr, out_ptr, M, K, N, GROUP_SIZE, SINGLE_GROUP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = load_rows(x_ptr, offs_m, offs_k, M, K)
        w = _dequantized_tile(b_ptr, s_ptr, offs_k, offs_n, K, N, GROUP_SIZE, SINGLE_GROUP)
        acc += tl.dot(x, w)
    store_rows(out_ptr, acc, offs_m, offs_n, M, N)


def marlin_matmul(x: torch.Tensor, B: torch.Tensor, s: torch.Tensor, group_size: int,
                  config: LaunchConfig | None = None) -> torch.Tensor:
    """x [M, K] @ W -> [M, N] float32; the GEMV for one row, the GEMM above."""
    M, K = x.shape
    N = s.shape[1]
    group = K if group_size == -1 else group_size
    single = s.shape[0] == 1  # K == group_size also takes Marlin's single-group scale order
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    x = x.contiguous()
    if M == 1:
        c = config or launch_config(current_capability(), "gemv")
        _gemv_kernel[(triton.cdiv(N, c.block_n),)](x, B, s, out, K, N, group, SINGLE_GROUP=single,
                                                   BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                                                   num_warps=c.num_warps, num_stages=c.num_stages)
    else:
        c = config or launch_config(current_capability(), "gemm")
        grid = (triton.cdiv(M, c.block_m), triton.cdiv(N, c.block_n))
        _gemm_kernel[grid](x, B, s, out, M, K, N, group, SINGLE_GROUP=single, BLOCK_M=c.block_m,
                           BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
    return out


class TritonMarlinLinear(nn.Module):
    """A Marlin-packed 4-bit linear executed by the Triton kernels straight from ``B`` and ``s``."""

    def __init__(self, B: torch.Tensor, s: torch.Tensor, in_features: int, out_features: int, group_size: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        check_marlin(QuantConfig(4, group_size, sym=True), in_features, out_features, name="TritonMarlinLinear")
        shapes = marlin_shapes(in_features, out_features, group_size)
        where = f"TritonMarlinLinear K={in_features} N={out_features} group_size={group_size}"
        for name, tensor, dtype, shape in (("B", B, torch.int32, shapes["qweight"]),
                                           ("s", s, torch.float16, shapes["scales"])):
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise ValueError(f"{where}: {name} must be {dtype} {shape}, got {tensor.dtype} {tuple(tensor.shape)}")
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"{where}: bias must have shape ({out_features},), got {tuple(bias.shape)}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("B", B.contiguous())
        self.register_buffer("s", s.contiguous())
        self.register_buffer("bias", None if bias is None else bias.float())
        self.backend = "triton"

    @classmethod
    def from_marlin_tensors(cls, B, s, in_features: int, out_features: int, group_size: int,
                            bias: torch.Tensor | None = None) -> "TritonMarlinLinear":
        """From a checkpoint's ``qweight`` (B) and ``scales`` (s) as ``marlin_tensors`` wrote them."""
        return cls(B, s, in_features, out_features, group_size, bias)

    @property
    def weight_bytes(self) -> int:
        """What a decode step reads: the packed codes and fp16 scales, as Marlin stores them."""
        return self.B.numel() * 4 + self.s.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = marlin_matmul(rows, self.B, self.s, self.group_size)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
