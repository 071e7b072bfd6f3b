"""A linear's input quantized as a W8A8 kernel quantizes it, for scoring a W8A8 artifact by what it
computes (``quantkit.loading`` applies it to every quantized linear's input).

A scale per token from the row's largest magnitude (dynamic) or one stored per-tensor scale (static),
onto INT8, as vLLM's kernel does, the consumer that serves the scheme: divide by ``absmax / 127``, round
to nearest even and saturate to [−128, 127] (``dynamic_scaled_int8_quant``: the PTX
``cvt.rni.sat.s8.f32``). compressed-tensors' own simulated forward divides by ``absmax / 127.5``
instead, which is not what the served model computes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ActivationGrid:
    """``kind``: "int8"; ``dynamic``: a scale per token, else the one static scale."""

    kind: str
    dynamic: bool = True

    def __post_init__(self) -> None:
        if self.kind not in LARGEST:
            raise ValueError(f"activation kind must be one of {tuple(LARGEST)}, got {self.kind!r}")

    @property
    def largest(self) -> float:
        return LARGEST[self.kind]

    def fake_quantize(self, x: Tensor, scale: Tensor | None = None) -> Tensor:
        """``x`` [..., K] quantized and dequantized, in x's dtype (arithmetic in float32). ``scale``: the
        static per-tensor scale, required when not ``dynamic``."""
        values = x.float()
        if self.dynamic:
            scale = values.abs().amax(dim=-1, keepdim=True) / self.largest
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero token stays zero
        elif scale is None:
            raise ValueError("a static activation grid needs its stored scale")
        codes = (values / scale).round().clamp(-128, 127)  # torch.round: to nearest even
        return (codes * scale).to(x.dtype)


# the largest magnitude each activation type's scale maps to
LARGEST = {"int8": 127.0}
