"""Ternary linears (BitCPM4 weights, quantkit's bit-plane format) on the CPU.

Decode rows (1-4) run ``ternary_gemv`` (quantkit/cpu_ops/decode_ops.cpp) on the stored planes, 2.5
bits read per weight at g32 (planes plus float16 scales) where the packed int4 kernel reads 4.25 at
g128. The kernel has three paths, picked when it is compiled (-march=native):

- AVX-512: per 16 weights two masked adds (into a + sum and a - sum), no multiplies.
- AVX2 + FMA (most desktop CPUs): per 8 weights srlv, and, madd_epi16 and cvt turn the word into
  floats +1/-1/0, then one FMA per activation row into a per-group sum.
- portable (ARM NEON, x86 without AVX2): branchless loops that -O3 vectorizes, the trit of each
  lane read from a 256-entry table of {0, 1} floats per byte of the word (+ byte minus - byte).

Measured on a 2-core AVX2 EPYC shared with other jobs (so ratios from back-to-back runs, not
absolute figures). The kernel alone, one thread, 4096x4096 g32, one row: AVX2 1.6-2.0 ms, portable
(built with -mno-avx2) 7.0 ms, the branchy scalar loop they replaced 84 ms. ``OMP_NUM_THREADS=2
python -m quantkit.eval.bench.bench_linear --rows 1,4`` (MiniCPM4.1-8B shapes): one row 0.5-2.4x a
bf16 GEMV (was 0.05-0.09x), where int4 g128 is 1.0-3.3x, so 0.5-1.05x int4's speed; four rows
1.7-3.0x (int4 2.1-4.4x). Decoding the default 135M model on the runtime (2 threads, interleaved
rounds, median of 3): the ternary g32 artifact 4.9x faster than before, on par with the W4 g128
artifact (1.08x, within the noise).
Prefill rows multiply by the bf16 dequantized weight, like the 4-bit linears. Without a compiler,
decode also uses the dequantized weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit import cpu_ops
from quantkit.formats.ternary import LANES, ternary_tensors, unpack_planes
from quantkit.kernels.linear.int4 import DEQUANTIZE_CHUNK
from quantkit.kernels.linear.packed import PackedLinear, fused_bias
from quantkit.quant import QuantizedTensor


class TernaryLinear(PackedLinear):
    def __init__(self, planes: torch.Tensor, scales: torch.Tensor, group_size: int, bias: torch.Tensor | None = None,
                 keep_dequantized: bool = True):
        """planes int32 [N, K/16] and scales float16 [N, G], as the ternary format stores them."""
        super().__init__()
        self.out_features, words = planes.shape
        self.in_features, self.group_size = words * LANES, group_size
        self.register_buffer("planes", planes.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("bias", None if bias is None else bias.float())
        self.keep_dequantized = keep_dequantized
        self._ops = cpu_ops.load()
        self.backend = "cpu"

    @classmethod
    def from_record(cls, record: QuantizedTensor, bias: torch.Tensor | None = None,
                    keep_dequantized: bool = True) -> "TernaryLinear":
        stored = ternary_tensors(record, "")
        return cls(stored["qweight"], stored["scales"], record.config.group_size, bias, keep_dequantized)

    @property
    def weight_bytes(self) -> int:
        return self.planes.numel() * 4 + self.scales.numel() * 2

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """t * s in float32 (exact), rounded to ``dtype``: chunks of rows, each group's scale broadcast
        over its columns (a ragged last group padded with zeros)."""
        n, k = self.out_features, self.in_features
        width = k if self.group_size == -1 else self.group_size
        groups = self.scales.shape[1]
        scales = self.scales.float()[..., None]  # [N, G, 1]
        out = torch.empty(n, k, dtype=dtype, device=self.planes.device)
        step = max(1, DEQUANTIZE_CHUNK // (groups * width))
        for start in range(0, n, step):
            end = min(n, start + step)
            trits = F.pad(unpack_planes(self.planes[start:end]).float(), (0, groups * width - k))
            out[start:end] = (trits.view(end - start, groups, width) * scales[start:end]).flatten(1)[:, :k]
        return out

    def decode(self, rows: torch.Tensor) -> torch.Tensor | None:
        if self._ops is None:
            return None
        return self._ops.ternary_gemv(rows.float().contiguous(), self.planes, self.scales,
                                      self.group_size).to(rows.dtype)

    @classmethod
    def fuse(cls, modules: list["TernaryLinear"]) -> "TernaryLinear | None":
        """One module for linears sharing an input (q/k/v, gate/up): their rows concatenated."""
        first = modules[0]
        if any(m.group_size != first.group_size or m.in_features != first.in_features for m in modules):
            return None
        fusable, bias = fused_bias(modules)
        if not fusable:
            return None
        return cls(torch.cat([m.planes for m in modules]), torch.cat([m.scales for m in modules]),
                   first.group_size, bias, first.keep_dequantized)
