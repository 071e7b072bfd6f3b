"""Weight-only int8 with one scale per output row, for the LM head of a quantized model.

The head is the largest single matrix a decode step reads (49152 x 576 on the default model,
73448 x 4096 on MiniCPM4.1-8B) and quantizing it is what llama.cpp does too (its Q4_0 files store
``output.weight`` as Q6_K). Decode uses PyTorch's int8 weight-only kernel; more rows multiply by
the bf16 dequantized weight.
"""
from __future__ import annotations

import torch
from torch import nn

from quantkit.kernels.linear.int4 import DECODE_ROWS


class Int8RowLinear(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        weight = weight.float()
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("codes", torch.round(weight / scales[:, None]).to(torch.int8))
        self.register_buffer("scales", scales.bfloat16())
        self.out_features, self.in_features = weight.shape
        self._dequantized: torch.Tensor | None = None

    @property
    def weight_bytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 2

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self._dequantized is None or self._dequantized.dtype != dtype:
            self._dequantized = (self.codes.float() * self.scales.float()[:, None]).to(dtype)
        return self._dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= DECODE_ROWS and x.dtype == torch.bfloat16:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)
        else:
            out = rows @ self.dequantized(x.dtype).T
        return out.view(*x.shape[:-1], self.out_features)
