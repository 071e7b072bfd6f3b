"""A linear's input quantized as a W8A8 kernel quantizes it, for scoring a W8A8 artifact by what it
computes (``quantkit.loading`` applies it to every quantized linear's input).

A scale per token from the row's largest magnitude (dynamic) or one stored per-tensor scale (static),
as vLLM's kernels do, the consumer that serves these schemes:

- INT8: divide by ``absmax / 127``, round to nearest even and saturate to [−128, 127]
  (``dynamic_scaled_int8_quant``: the PTX ``cvt.rni.sat.s8.f32``). compressed-tensors' own simulated
  forward divides by ``absmax / 127.5`` instead, which is not what the served model computes.
- FP8 E4M3: the scale is ``absmax / 448``, at least ``1 / (448 · 512)`` (so a near-silent token keeps
  its values in range); the input is multiplied by the scale's reciprocal, saturated to ±448 and cast
  to E4M3, nearest even (``dynamic_per_token_scaled_fp8_quant``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from quantkit.fp8 import E4M3_MAX, to_e4m3


@dataclass(frozen=True)
class Kind:
    largest: float  # the magnitude a token's (or the tensor's) scale maps its largest |x| to
    smallest_scale: float  # a dynamic scale's floor (an all-zero token then stays zero)
    reciprocal: bool  # the kernel multiplies by 1 / scale rather than dividing
    onto_grid: Callable[[Tensor], Tensor]  # scaled float32 values -> the grid's values, as float32


KINDS = {
    "int8": Kind(127.0, 0.0, False, lambda scaled: scaled.round().clamp(-128, 127)),  # torch.round: nearest even
    "fp8": Kind(E4M3_MAX, 1.0 / (E4M3_MAX * 512), True, lambda scaled: to_e4m3(scaled).float()),
}


@dataclass(frozen=True)
class ActivationGrid:
    """``kind``: a key of ``KINDS``; ``dynamic``: a scale per token, else the one static scale."""

    kind: str
    dynamic: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"activation kind must be one of {tuple(KINDS)}, got {self.kind!r}")

    @property
    def largest(self) -> float:
        return KINDS[self.kind].largest

    def static_scale(self, abs_max: Tensor) -> Tensor:
        """The stored per-tensor scale (float32 [1]) from the calibration inputs' max |x| per channel: the
        largest maps to the grid's largest value (llm-compressor's static min/max observer)."""
        largest = abs_max.float().amax().reshape(1) / self.largest
        return torch.where(largest > 0, largest, torch.ones_like(largest))

    def fake_quantize(self, x: Tensor, scale: Tensor | None = None) -> Tensor:
        """``x`` [..., K] quantized and dequantized, in x's dtype (arithmetic in float32). ``scale``: the
        static per-tensor scale, required when not ``dynamic``."""
        kind = KINDS[self.kind]
        values = x.float()
        if self.dynamic:
            scale = values.abs().amax(dim=-1, keepdim=True) / kind.largest
            if kind.smallest_scale:
                scale = scale.clamp(min=kind.smallest_scale)
            else:
                scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        elif scale is None:
            raise ValueError("a static activation grid needs its stored scale")
        else:
            scale = scale.to(values.device)
        scaled = values * (1.0 / scale) if kind.reciprocal else values / scale
        return (kind.onto_grid(scaled) * scale).to(x.dtype)
