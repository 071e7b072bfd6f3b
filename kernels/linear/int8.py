"""Weight-only int8 with one scale per output row, for the LM head of a quantized model.

The head is the largest single matrix a decode step reads (49152 x 576 on the default model,
73448 x 4096 on MiniCPM4.1-8B) and quantizing it is what llama.cpp does too (its Q4_0 files store
``output.weight`` as Q6_K). Decode uses PyTorch's int8 weight-only kernel; more rows multiply by
the bf16 dequantized weight.
"""
from __future__ import annotations

import torch
from quantkit.kernels.linear.packed import PackedLinear


class Int8RowLinear(PackedLinear):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        weight = weight.float()
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("codes", torch.round(weight / scales[:, None]).to(torch.int8))
        self.register_buffer("scales", scales.bfloat16())
        self.out_features, self.in_features = weight.shape
        self.bias = None
        self.keep_dequantized = True

    @property
    def weight_bytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 2

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.codes.float() * self.scales.float()[:, None]).to(dtype)

    def decode(self, rows: torch.Tensor) -> torch.Tensor | None:
        if rows.dtype != torch.bfloat16:
            return None
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)
