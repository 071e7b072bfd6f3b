"""A block type's integer codes and the grid they sit on, for solvers that choose the codes.

Every block type quantkit can solve on stores, per sub-block, codes ``q`` in ``0..maxq`` with
``weight = level(q) · scale + offset``. For most types the level is the code itself, an affine grid
(Q4_0: scale d, offset −8d; Q4_1: d and the stored minimum; Q4_K: d·scale₆ and −dmin·min₆; ...); the
non-uniform types (IQ4_NL, IQ4_XS) give each code a level from a fixed codebook (``values``), offset 0.
A ``Codec`` reads that grid out of quantized blocks, and writes other codes into them while keeping the
block's scales: so GPTQ can take the scales llama.cpp's own quantizer chose and replace its
round-to-nearest codes with error-compensated ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Codec:
    sub_block: int  # weights sharing one (scale, offset)
    maxq: int
    grid: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # blocks [n, B] -> (scale, offset) float32 [n, subs]
    codes: Callable[[np.ndarray], np.ndarray]  # blocks [n, B] -> codes uint8 [n, block]
    with_codes: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (blocks [n, B], codes [n, block]) -> blocks [n, B]
    # the level each code 0..maxq stands for (float32, ascending), or None: the code is its own level
    values: np.ndarray | None = None

    def level(self, codes: np.ndarray) -> np.ndarray:
        """float32 levels of ``codes``: weight = level · scale + offset."""
        return codes.astype(np.float32) if self.values is None else self.values[codes]
