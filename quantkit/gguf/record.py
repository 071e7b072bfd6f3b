"""A linear weight held as GGUF blocks: the record an algorithm produces for a GGUF block type.

It plays the part ``QuantizedTensor`` plays for the uniform grids (the engine dequantizes it to run
the next layer, formats store it, the export copies it), but its bytes are already what llama.cpp
reads, so nothing is re-rounded on the way to the file.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from quantkit.gguf.types import TYPES, TensorType
from quantkit.quant import require_finite


@dataclass(eq=False)
class GGUFTensor:
    type_name: str
    data: Tensor  # uint8 [N, K / block · block bytes]
    shape: tuple[int, int]  # (N, K)

    def __post_init__(self) -> None:
        if self.type_name not in TYPES:
            raise ValueError(f"unknown GGUF tensor type '{self.type_name}'")
        n, k = self.shape
        tensor_type = TYPES[self.type_name]
        if not tensor_type.fits(k):
            raise ValueError(f"{self.type_name} stores rows in blocks of {tensor_type.block_size}; K = {k} is not")
        expected = (n, tensor_type.row_bytes(k))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(f"{self.type_name} data for a [{n}, {k}] weight must be uint8 {list(expected)}, "
                             f"got {self.data.dtype} {list(self.data.shape)}")

    @classmethod
    def quantize(cls, weight: Tensor, tensor_type: TensorType) -> "GGUFTensor":
        """llama.cpp's own quantizer for the type: the round-to-nearest baseline."""
        w = weight.detach().to(torch.float32)
        require_finite(w)
        data = tensor_type.quantize(np.ascontiguousarray(w.cpu().numpy()))
        return cls(tensor_type.name, torch.from_numpy(data), tuple(w.shape))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight [N, K] llama.cpp computes with."""
        values = TYPES[self.type_name].dequantize(self.data.cpu().numpy(), self.shape[1])
        return torch.from_numpy(values).to(dtype)
