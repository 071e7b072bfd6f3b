"""FP8 (E4M3) weights: the grid, the record, and the grid as GPTQ's rounding target.

E4M3 (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, no infinities, largest finite 448) is
what the RTX 4090's sm_89 tensor cores multiply natively. A weight is stored as ``q · s``: q an E4M3
value, s a float32 scale per output channel ("channel") or for the whole tensor ("tensor"), chosen so
the largest |w| maps to 448 (llm-compressor's min/max observer; vLLM loads the scales as float32).
Unlike an integer grid the values are not evenly spaced: between 2^e and 2^(e+1) there are 8 steps, so
a value's rounding step is proportional to its size. Rounding is to nearest, ties to even, saturating
at ±448 (torch's cast, which is the hardware's ``cvt.rn.satfinite.e4m3x2.f32``).

``FP8Solver`` is that grid as GPTQ's rounding target: every column is rounded onto the E4M3 values
under its rows' scales, fixed up front from the unmodified weights (a row's scale covers all of its
columns, so nothing is gained by choosing it late), and GPTQ carries each rounding error into the
columns still to come, as on an integer grid. Error compensation can push a value past 448·s; it
saturates, as the serving kernel's cast would.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
STRATEGIES = ("channel", "tensor")


def to_e4m3(values: Tensor) -> Tensor:
    """float32 values already divided by their scale -> E4M3, nearest even, saturating at ±448."""
    return values.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


@dataclass(frozen=True)
class FloatGrid:
    """E4M3 weights under a float32 scale per output channel or per tensor (``strategy``)."""

    strategy: str = "channel"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"FP8 strategy must be one of {STRATEGIES}, got {self.strategy!r}")

    @property
    def name(self) -> str:
        return f"FP8 E4M3 per {self.strategy}"

    def scale_shape(self, n: int) -> tuple[int, ...]:
        """The stored scale's shape for a weight of N rows (compressed-tensors': [N, 1] or [1])."""
        return (n, 1) if self.strategy == "channel" else (1,)

    def scales(self, weight: Tensor) -> Tensor:
        """float32 scales (``scale_shape``) mapping each row's (or the tensor's) largest |w| to 448. An
        all-zero row gets 1 (its values are 0 whatever the scale); a row so small that absmax / 448 would
        be no normal float32 gets the smallest normal one, which still holds its values (they round to
        E4M3's subnormals or 0, as nothing can do better below 2^-126)."""
        magnitude = weight.detach().abs().float()
        absmax = magnitude.amax(dim=1, keepdim=True) if self.strategy == "channel" else magnitude.amax().reshape(1)
        scale = (absmax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        return torch.where(absmax > 0, scale, torch.ones_like(scale))


@dataclass(eq=False)
class FP8Tensor:
    """A linear weight [N, K] as E4M3 values and their float32 scales."""

    values: Tensor  # float8_e4m3fn [N, K]
    scale: Tensor  # float32, grid.scale_shape(N)
    grid: FloatGrid

    def __post_init__(self) -> None:
        if self.values.dtype != E4M3 or self.values.dim() != 2:
            raise ValueError(f"FP8 values must be a 2-D {E4M3} tensor, got {self.values.dtype} "
                             f"{list(self.values.shape)}")
        expected = self.grid.scale_shape(self.values.shape[0])
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != expected:
            raise ValueError(f"FP8 scale must be float32 {list(expected)}, got {self.scale.dtype} "
                             f"{list(self.scale.shape)}")
        if not (torch.isfinite(self.scale).all() and (self.scale > 0).all()):
            raise ValueError("FP8 scales must be finite and positive")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @classmethod
    def quantize(cls, weight: Tensor, grid: FloatGrid) -> FP8Tensor:
        """Round to nearest under the min/max scales: llm-compressor's FP8 scheme, the baseline."""
        w = weight.detach().float()
        if not torch.isfinite(w).all():
            raise ValueError("weight contains NaN or Inf")
        scale = grid.scales(w)
        return cls(to_e4m3(w / scale), scale, grid)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``q · s`` in float32, then ``dtype``: what compressed-tensors decompresses (it multiplies in the
        scale's dtype) and what an FP8 GEMM's float32 epilogue computes with."""
        return (self.values.float() * self.scale.to(self.values.device)).to(dtype)


class FP8Solver:
    """``FloatGrid`` as GPTQ's rounding grid: ``round`` each column, ``record`` the solver's codes."""

    def __init__(self, grid: FloatGrid, weight: Tensor):
        self.grid = grid
        self.scale = grid.scales(weight)
        self.row_scale = self.scale.reshape(-1).expand(weight.shape[0])  # [N], one per row

    def round(self, position: int, rows: Tensor) -> tuple[Tensor, Tensor]:
        """(codes: the E4M3 bytes as uint8, fake-quantized values) of the column ``rows[0]`` [N]."""
        values = to_e4m3(rows[0] / self.row_scale)
        return values.view(torch.uint8), values.float() * self.row_scale

    def record(self, codes: Tensor) -> FP8Tensor:
        """The record of the solver's ``codes`` [N, K] (natural column order)."""
        return FP8Tensor(codes.view(E4M3).contiguous(), self.scale.contiguous(), self.grid)
