"""Triton W4A16 kernels over the GPTQ and AutoAWQ layouts: a GEMV for decode and a GEMM for prefill.

The weight stays as the file stores it. GPTQ: ``qweight`` int32 [K/8, N], eight 4-bit codes per word
along K (code k at bits 4·(k mod 8)), group scales [G, N], integer zero points [G, N] and ``g_idx`` [K]
(act-order included); W[k, n] = (q[k, n] - zero[g_idx[k], n]) · scale[g_idx[k], n]. AutoAWQ (``awq``):
``qweight`` int32 [K, N/8] and ``qzeros`` int32 [G, N/8] packed along N in AutoAWQ's nibble order
(column 8c + j at nibble (j mod 2)·4 + j div 2 of word c), the same formula. Activations are
fp16/bf16/fp32, accumulation float32.

No GPU exists where quantkit is tested: the kernels are proven against the reference under
``TRITON_INTERPRET=1`` on CPU tensors (tests/test_triton.py). Launch configurations are a table per
target GPU; speeds on those GPUs are roofline arithmetic (``quantkit roofline``), not measurements.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

from quantkit.device import require_capability
from quantkit.formats.gptq import pack_rows
from quantkit.quant import QuantizedTensor, default_g_idx


@dataclass(frozen=True)
class LaunchConfig:
    block_n: int
    block_k: int
    block_m: int  # GEMM only
    num_warps: int
    num_stages: int


# Decode is bandwidth-bound: enough column tiles to fill every SM (RTX 4090: 128 SMs at 1008 GB/s;
# AGX Orin: 16 Ampere SMs at 204.8 GB/s, so smaller tiles and fewer stages there, whose 192 KB of
# shared memory per SM holds fewer pipelined K tiles). Prefill tiles follow Ampere/Ada tensor-core
# shapes (m16n8k16 multiples).
LAUNCH_CONFIGS: dict[tuple[int, int], dict[str, LaunchConfig]] = {
    (8, 9): {"gemv": LaunchConfig(block_n=128, block_k=128, block_m=1, num_warps=4, num_stages=3),
             "gemm": LaunchConfig(block_n=128, block_k=64, block_m=64, num_warps=8, num_stages=4)},
    (8, 7): {"gemv": LaunchConfig(block_n=64, block_k=128, block_m=1, num_warps=4, num_stages=2),
             "gemm": LaunchConfig(block_n=64, block_k=64, block_m=64, num_warps=4, num_stages=3)},
}
GEMV_MAX_ROWS = 4


def launch_config(capability: tuple[int, int], kind: str,
                  table: dict[tuple[int, int], dict[str, LaunchConfig]] = LAUNCH_CONFIGS) -> LaunchConfig:
    """``table``'s entry for a GPU: its own, else (other Ampere-or-newer GPUs) the RTX 4090's."""
    require_capability(capability)
    return table.get(tuple(capability), table[(8, 9)])[kind]


def current_capability() -> tuple[int, int]:
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability()
    return (8, 9)  # the interpreter on a CPU: exercise the RTX 4090 tiles


@triton.jit
def load_rows(x_ptr, offs_m, offs_k, M, K):
    """The float32 tile x[offs_m, offs_k] of a row-major [M, K] matrix, zero outside it."""
    return tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :],
                   mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0).to(tl.float32)


@triton.jit
def store_rows(out_ptr, acc, offs_m, offs_n, M, N):
    """Write the tile acc to out[offs_m, offs_n] of a row-major [M, N] matrix, inside it only."""
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _dequantized_tile(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, offs_k, offs_n, K, N, AWQ: tl.constexpr):
    """W[offs_k, offs_n] as float32 (out-of-range entries are 0), from the GPTQ or the AWQ layout."""
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    groups = tl.load(g_idx_ptr + offs_k, mask=offs_k < K, other=0)
    scales = tl.load(scales_ptr + groups[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if AWQ:
        shifts = (((offs_n % 2) * 4 + (offs_n % 8) // 2) * 4)[None, :]
        words = tl.load(qweight_ptr + offs_k[:, None] * (N // 8) + offs_n[None, :] // 8, mask=mask, other=0)
        zero_words = tl.load(zeros_ptr + groups[:, None] * (N // 8) + offs_n[None, :] // 8, mask=mask, other=0)
        codes, zeros = (words >> shifts) & 0xF, (zero_words >> shifts) & 0xF
    else:
        words = tl.load(qweight_ptr + (offs_k[:, None] // 8) * N + offs_n[None, :], mask=mask, other=0)
        codes = (words >> ((offs_k[:, None] % 8) * 4)) & 0xF
        zeros = tl.load(zeros_ptr + groups[:, None] * N + offs_n[None, :], mask=mask, other=0)
    return (codes - zeros).to(tl.float32) * scales


@triton.jit
def _gemv_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr, K, N, AWQ: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * K + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        w = _dequantized_tile(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, offs_k, offs_n, K, N, AWQ)
        acc += tl.sum(x[:, None] * w, axis=0)
    tl.store(out_ptr + row * N + offs_n, acc, mask=offs_n < N)


@triton.jit
def _gemm_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr, M, K, N, AWQ: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = load_rows(x_ptr, offs_m, offs_k, M, K)
        w = _dequantized_tile(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, offs_k, offs_n, K, N, AWQ)
        acc += tl.dot(x, w)
    store_rows(out_ptr, acc, offs_m, offs_n, M, N)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor, config: LaunchConfig | None = None, awq: bool = False) -> torch.Tensor:
    """x [M, K] @ W -> [M, N] float32; GEMV for up to GEMV_MAX_ROWS rows, GEMM above. ``awq``: qweight
    and zeros are AutoAWQ's packed ``qweight`` / ``qzeros``."""
    M, K = x.shape
    N = scales.shape[1]
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    x = x.contiguous()
    if M <= GEMV_MAX_ROWS:
        c = config or launch_config(current_capability(), "gemv")
        grid = (M, triton.cdiv(N, c.block_n))
        _gemv_kernel[grid](x, qweight, scales, zeros, g_idx, out, K, N, AWQ=awq, BLOCK_N=c.block_n,
                           BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
    else:
        c = config or launch_config(current_capability(), "gemm")
        grid = (triton.cdiv(M, c.block_m), triton.cdiv(N, c.block_n))
        _gemm_kernel[grid](x, qweight, scales, zeros, g_idx, out, M, K, N, AWQ=awq, BLOCK_M=c.block_m,
                           BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
    return out


class TritonW4A16Linear(nn.Module):
    """A 4-bit linear executed by the Triton kernels over GPTQ-packed codes (``from_record``) or over an
    AutoAWQ checkpoint's stored tensors as they are (``from_awq_tensors``)."""

    def __init__(self, qweight, scales, zeros, g_idx, in_features: int, bias: torch.Tensor | None = None,
                 awq: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, scales.shape[1]
        self.awq = awq
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("g_idx", g_idx)
        self.register_buffer("bias", bias)
        self.backend = "triton"

    @classmethod
    def from_record(cls, record: QuantizedTensor, bias: torch.Tensor | None = None) -> "TritonW4A16Linear":
        if record.config.bits != 4:
            raise ValueError(f"the W4A16 kernels need 4-bit codes, got {record.config.bits}-bit")
        n, k = record.shape
        codes = torch.nn.functional.pad(record.codes.T.int(), (0, 0, 0, -k % 8))  # [K8, N], rows padded to 8
        return cls(pack_rows(codes, 4), record.scales.float(), record.zeros.int(), record.g_idx.int(), k,
                   None if bias is None else bias.float())

    @classmethod
    def from_awq_tensors(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, in_features: int,
                         group_size: int, bias: torch.Tensor | None = None) -> "TritonW4A16Linear":
        """An AWQ linear from its checkpoint tensors (validated by ``quantkit.formats.awq``), unrepacked."""
        return cls(qweight.int().contiguous(), scales.float().contiguous(), qzeros.int().contiguous(),
                   default_g_idx(in_features, group_size).int(), in_features,
                   None if bias is None else bias.float(), awq=True)

    @property
    def weight_bytes(self) -> int:
        """What a decode step reads: the packed codes, fp16 scales and 4-bit zeros as the file stores them."""
        return self.qweight.numel() * 4 + self.scales.numel() * 2 + self.scales.numel() // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = w4a16_matmul(rows, self.qweight, self.scales, self.zeros, self.g_idx, awq=self.awq)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
