"""A linear's input quantized as a W8A8 kernel quantizes it, for scoring a W8A8 artifact by what it
computes (``quantkit.loading`` applies it to every quantized linear's input).

A scale per token from the row's largest magnitude (dynamic) or one stored per-tensor scale (static),
as vLLM's kernels do, the consumer that serves these schemes:

- INT8: the token's scale is ``absmax / 127`` but the values are multiplied by ``127 / absmax`` (a
  float32 quotient of its own, not the scale's reciprocal: in rare ties the two round differently),
  rounded to nearest even and saturated to [−128, 127] (``dynamic_scaled_int8_quant``; the PTX
  ``cvt.rni.sat.s8.f32``); a static scale divides (``static_scaled_int8_quant``). quantkit's CPU
  kernel (``int8_int8_matmul``) quantizes the same way. compressed-tensors' own simulated forward
  divides by ``absmax / 127.5`` instead, which is not what the served model computes.
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


def _quotient(largest: float, top: Tensor) -> Tensor:
    """largest / top correctly rounded (torch computes ``scalar / tensor`` as a reciprocal times the scalar,
    one more rounding), 0 where top is 0."""
    return torch.nan_to_num(torch.full_like(top, largest) / top, posinf=0.0)


# How a kernel brings x into the grid's units, given the scale and the largest of the grid's values:
# by 1 / scale, by dividing, or (vLLM's dynamic INT8) by largest / max|x| of the token, computed from the
# maximum itself (0 for an all-zero token, which then stays zero)
SCALINGS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "reciprocal": lambda values, scale, largest: values * (1.0 / scale),
    "divide": lambda values, scale, largest: values / scale,
    "token max": lambda values, scale, largest: values * _quotient(largest, values.abs().amax(dim=-1, keepdim=True)),
}


@dataclass(frozen=True)
class Kind:
    largest: float  # the magnitude a token's (or the tensor's) scale maps its largest |x| to
    smallest_scale: float  # a dynamic scale's floor (an all-zero token then stays zero)
    dynamic_scaling: str  # a key of SCALINGS
    static_scaling: str
    onto_grid: Callable[[Tensor], Tensor]  # scaled float32 values -> the grid's values, as float32


KINDS = {
    "int8": Kind(127.0, 0.0, "token max", "divide",
                 lambda scaled: scaled.round().clamp(-128, 127)),  # torch.round: nearest even
    "fp8": Kind(E4M3_MAX, 1.0 / (E4M3_MAX * 512), "reciprocal", "reciprocal", lambda scaled: to_e4m3(scaled).float()),
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
        scaled = SCALINGS[kind.dynamic_scaling if self.dynamic else kind.static_scaling](values, scale, kind.largest)
        return (kind.onto_grid(scaled) * scale).to(x.dtype)
