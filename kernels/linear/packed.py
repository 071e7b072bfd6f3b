"""What the CPU's packed linears share: decode rows run the format's packed kernel, other rows
multiply by the dequantized weight (on AMX in bf16), then the bias is added.

Measured at MiniCPM4.1-8B's shapes (``python -m quantkit.eval.bench.bench_linear``): the packed kernels
beat a bf16 matmul for one row and break even by about four, while for hundreds of rows the bf16
matmul on AMX is many times faster than any of them. The kept dequantized weight is reordered once
for oneDNN (``PrepackedLinear``), so that a few rows (a speculative round's verification) cost about
what one row costs on it.
"""
from __future__ import annotations

import torch
from torch import nn

from quantkit.kernels.linear.prepacked import PrepackedLinear, prepackable

DECODE_ROWS = 4  # up to this many rows use the packed kernel
# A module that keeps no dequantized weight (a large model) runs up to this many rows on the packed
# kernel too: dequantizing a whole weight for a draft tree's few nodes costs more than the kernel.
FEW_ROWS = 16


class PackedLinear(nn.Module):
    """Subclasses set ``out_features``, ``bias`` and ``keep_dequantized`` and implement ``decode``
    (the packed kernel on [rows, width], or None when it cannot run) and ``_dequantize`` (the
    weight [N, width] in a dtype); ``prepare`` maps the input onto the packed columns."""

    _kept: tuple[torch.dtype, nn.Module | torch.Tensor] | None = None  # the dequantized weight, prepacked if it can be

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def decode(self, rows: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return self._dequantize(dtype)

    def _rebuilt(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight for one call only (not kept): subclasses may build it in a reused buffer."""
        return self._dequantize(dtype)

    def _dense(self, rows: torch.Tensor) -> torch.Tensor:
        """rows W^T on the dequantized weight; kept (as oneDNN's prepacked copy when it can be) when
        ``keep_dequantized``. A weight made for one call is not worth reordering."""
        if not self.keep_dequantized:
            return rows @ self._rebuilt(rows.dtype).T
        kept = self._kept
        if kept is None or kept[0] != rows.dtype:
            weight = self._dequantize(rows.dtype)
            kept = self._kept = (rows.dtype, PrepackedLinear(weight) if prepackable(weight) else weight)
        dense = kept[1]
        return dense(rows) if isinstance(dense, PrepackedLinear) else rows @ dense.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.prepare(x)
        rows = x.reshape(-1, x.shape[-1])
        few = DECODE_ROWS if self.keep_dequantized else FEW_ROWS
        out = self.decode(rows) if rows.shape[0] <= few else None
        if out is None:
            out = self._dense(rows)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)


def fused_bias(modules: list[nn.Module]) -> tuple[bool, torch.Tensor | None]:
    """(whether the parts' biases can be fused, the concatenated bias or None): all or none must have one."""
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return True, None
    if any(b is None for b in biases):
        return False, None
    return True, torch.cat(biases)
