"""Ternary linears (BitCPM4 weights, quantkit's bit-plane format) on the CPU.

Decode rows run ``ternary_gemv`` (kernels/cpu_ops) on the stored planes: per 16 weights two
AVX-512 masked adds (into a + sum and a - sum), no multiplies, 2.5 bits read per weight at g32
(planes plus float16 scales) where the packed int4 kernel reads 4.25 at g128. Compute-bound, not
bandwidth-bound: 2.0-2.6x a bf16 GEMV at MiniCPM4.1-8B's shapes, below int4's 2.6-3.4x
(``python -m quantkit.eval.bench.bench_linear``). Prefill rows multiply by the bf16 dequantized
weight on AMX, like the 4-bit linears. Without a compiler, decode also uses the dequantized weight.
"""
from __future__ import annotations

import torch
from quantkit.kernels import cpu_ops
from quantkit.kernels.linear.packed import PackedLinear, fused_bias

from quantkit.formats.ternary import LANES, ternary_tensors, unpack_planes
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
        width = self.in_features if self.group_size == -1 else self.group_size
        scales = self.scales.float().repeat_interleave(width, dim=1)[:, :self.in_features]
        return (unpack_planes(self.planes).float() * scales).to(dtype)

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
