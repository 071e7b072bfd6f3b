"""What the CPU's packed linears share: decode rows run the format's packed kernel, other rows
multiply by the dequantized weight (on AMX in bf16), then the bias is added.

Measured at MiniCPM4.1-8B's shapes (``python -m quantkit.eval.bench.bench_linear``): the packed kernels
beat a bf16 matmul for one row and break even by about four, while for hundreds of rows the bf16
matmul on AMX is many times faster than any of them.
"""
from __future__ import annotations

import torch
from torch import nn

DECODE_ROWS = 4  # up to this many rows use the packed kernel


class PackedLinear(nn.Module):
    """Subclasses set ``out_features``, ``bias`` and ``keep_dequantized`` and implement ``decode``
    (the packed kernel on [rows, width], or None when it cannot run) and ``_dequantize`` (the
    weight [N, width] in a dtype); ``prepare`` maps the input onto the packed columns."""

    _dequantized: torch.Tensor | None = None

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def decode(self, rows: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if self._dequantized is not None and self._dequantized.dtype == dtype:
            return self._dequantized
        weight = self._dequantize(dtype)
        if self.keep_dequantized:
            self._dequantized = weight
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.prepare(x)
        rows = x.reshape(-1, x.shape[-1])
        out = self.decode(rows) if rows.shape[0] <= DECODE_ROWS else None
        if out is None:
            out = rows @ self.dequantized(x.dtype).T
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
