"""llama.cpp's lattice ("i-quant") types: super-blocks of 256 weights whose groups of 4 or 8 magnitudes
are one point of a fixed codebook (the grid), the signs stored apart, one 4-bit (IQ1: 3-bit) scale per
sub-block and one fp16 scale per super-block.

- IQ3_XXS / IQ3_S: groups of 4 on a 256- / 512-point grid of odd levels 1..15, 32-weight sub-blocks.
  IQ3_XXS keeps 7 sign bits per 8 weights (an even number of minus signs, the eighth follows).
- IQ2_XXS / IQ2_XS / IQ2_S: groups of 8 on a 256- / 512- / 1024-point grid of levels 1, 3, 5; 32-, 16-
  and 16-weight sub-blocks; the first two keep 7 sign bits per 8 weights, IQ2_S all 8.
- IQ1_S / IQ1_M: groups of 8 on a 2048-point grid of -1, 0, 1, shifted by ±1/8 per sub-block (per group
  for IQ1_M); IQ1_M spreads its fp16 scale over the top nibbles of the four 3-bit scale words.

Each quantizer repeats ggml's ``quantize_row_iq*_impl`` in float32 with sums in the C code's order, so
the bytes equal llama.cpp's (tested against ``ggml_quantize_chunk``): round each trial scale's
magnitudes to the nearest levels, and where that combination is not a grid point take the best of its
precomputed neighbours (the grid points at the nearest few distances). ggml needs an importance vector
for IQ2_XXS, IQ2_XS and IQ1_S; without one those quantizers refuse, as llama.cpp does. The grids are
gguf-py's tables (``gguf.quants``), the dequantizers repeat gguf-py's arithmetic.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import quants as gguf_quants

# ggml's nearest_int with its wrapped values beyond ±2²² (a least-squares scale can be tiny next to a
# weightless magnitude; the callers clamp)
from quantkit.gguf.kquants import _nearest_int, importance_like, make_qp_quants, ordered_sum
from quantkit.gguf.legacy import half_bytes

QK_K = 256
_F32 = np.float32
# A neighbour search holds about this many candidate values at a time.
_SEARCH_WORK = 1 << 21


def missing_importance(name: str) -> ValueError:
    """The refusal for a type llama.cpp quantizes only with an importance matrix."""
    return ValueError(f"{name} needs an importance matrix (llama.cpp refuses it without one): make one with "
                      "`quantkit imatrix` or use a calibrated recipe")


# ---------------------------------------------------------------------------------------------------
# Grids, their index maps and neighbour lists (``iq2xs_init_impl`` / ``iq3xs_init_impl``)


@dataclass(frozen=True)
class _Grid:
    levels: np.ndarray  # [points, dim] int: each coordinate's level 0..n−1
    index: np.ndarray  # [n^dim] int32: the grid point whose levels have this code (Σ level·n^i), else −1
    neighbours: np.ndarray  # [n^dim, most] int32: off-grid codes' candidate points, −1 padded
    bits: int  # bits per level in a code
    reach: int  # levels 0..reach−1 are what rounding produces

    @functools.cached_property
    def odd(self) -> np.ndarray:
        """The odd levels 2l + 1 of every point, float32 [points, dim]: what the IQ2/IQ3 searches scale."""
        return (2 * self.levels + 1).astype(_F32)

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """How many candidates each code's neighbour list holds (0 on the grid)."""
        return (self.neighbours >= 0).sum(axis=1)

    @property
    def dim(self) -> int:
        return self.levels.shape[1]


@functools.cache
def _grid(gguf_name: str, reachable: int, nwant: int) -> _Grid:
    """The grid of gguf-py's ``gguf_name`` type as levels, and for every code whose levels are all below
    ``reachable`` (what rounding can produce) and that is not a grid point, the grid points at the
    ``nwant`` smallest squared distances, nearest first and by index within a distance (ggml's qsort
    on (distance, index))."""
    table = getattr(gguf_quants, gguf_name)
    table.init_grid()
    values = np.asarray(table.grid, dtype=_F32).reshape(table.grid_shape)
    level_values = np.asarray(table.grid_map, dtype=_F32)
    levels = np.searchsorted(level_values, values).astype(np.int32)
    assert np.array_equal(level_values[levels], values), gguf_name
    bits = 2 if len(level_values) <= 4 else 3
    dim = levels.shape[1]
    shifts = bits * np.arange(dim)
    index = np.full(1 << (bits * dim), -1, dtype=np.int32)
    index[(levels << shifts).sum(axis=1)] = np.arange(len(levels), dtype=np.int32)

    codes_levels = np.stack(np.meshgrid(*[np.arange(reachable)] * dim, indexing="ij"), axis=-1).reshape(-1, dim)
    codes = (codes_levels << shifts).sum(axis=1)
    off = index[codes] < 0
    codes, codes_levels = codes[off], codes_levels[off]
    distance = np.zeros((len(codes), len(levels)), dtype=np.int32)
    for i in range(dim):
        distance += (codes_levels[:, i:i + 1] - levels[None, :, i]) ** 2
    order = np.argsort(distance, axis=1, kind="stable")
    ranked = np.take_along_axis(distance, order, axis=1)
    rank = np.concatenate([np.zeros((len(codes), 1), dtype=np.int32),
                           np.cumsum(np.diff(ranked, axis=1) > 0, axis=1, dtype=np.int32)], axis=1)
    keep = rank < nwant
    most = int(keep.sum(axis=1).max())
    neighbours = np.full((len(index), most), -1, dtype=np.int32)
    neighbours[codes] = np.where(keep, order, -1)[:, :most]
    return _Grid(levels, index, neighbours, bits, reachable)


def _codes(grid: _Grid, levels: np.ndarray) -> np.ndarray:
    """Levels [..., groups, dim] -> the code Σ level·n^i [..., groups]."""
    return (levels << (grid.bits * np.arange(grid.dim))).sum(axis=-1)


def _best_neighbour(grid: _Grid, values: np.ndarray, codes: np.ndarray, xval: np.ndarray, weight: np.ndarray,
                    scale: np.ndarray) -> np.ndarray:
    """For off-grid codes [N], the candidate with the least Σ w·(scale·q − x)² (q the candidate's values,
    ``values`` [points, dim]; the first on ties, as ggml's strict ``<``): grid indices [N]. All float32."""
    found = np.empty(len(codes), dtype=np.int32)
    # Lists run from 1 to a few hundred points: taken shortest first, in chunks of lengths within 2× of
    # each other and of bounded size, little of the work is padding.
    lengths = grid.lengths[codes]
    order = np.argsort(lengths, kind="stable")
    sorted_lengths = lengths[order]
    columns = values.T.copy()  # [dim, points]
    start = 0
    while start < len(order):
        cap = 2 * int(sorted_lengths[start])
        end = min(int(np.searchsorted(sorted_lengths, cap, side="right")),
                  start + max(1, _SEARCH_WORK // (cap * grid.dim)))
        part = order[start:end]
        candidates = grid.neighbours[codes[part], :int(sorted_lengths[end - 1])]
        valid = candidates >= 0
        safe = np.where(valid, candidates, 0)
        s = scale[part][:, None]
        d2 = np.zeros(candidates.shape, dtype=_F32)
        for i in range(grid.dim):
            diff = s * columns[i][safe] - xval[part, i][:, None]
            d2 += weight[part, i][:, None] * diff * diff
        # ggml starts from FLT_MAX with a strict <: an infinite or NaN distance never wins
        d2 = np.where(valid & (d2 < np.finfo(_F32).max), d2, np.inf)
        found[part] = np.take_along_axis(candidates, d2.argmin(axis=1)[:, None], axis=1)[:, 0]
        start = end
    return found


# ---------------------------------------------------------------------------------------------------
# IQ2 / IQ3: the scale search over signed magnitudes


@dataclass(frozen=True)
class _Found:
    """A super-block search's result, per super-block [N, ...]."""

    d: np.ndarray  # fp16 bytes [N, 2]
    scales: np.ndarray  # 4-bit codes [N, subs]
    index: np.ndarray  # grid indices [N, subs, groups]
    signs: np.ndarray  # sign bytes [N, subs, sub/8]
    zero: np.ndarray  # [N, subs] sub-blocks left out
    empty: np.ndarray  # [N] super-blocks with every scale zero


@dataclass(frozen=True)
class _Kind:
    """What differs between the five IQ2/IQ3 quantizers (``quantize_row_iq*_impl``)."""

    name: str
    grid: str  # gguf-py's table
    kmaxq: int  # levels per coordinate (IQ3: 8, IQ2: 3 of the 4 a code could hold)
    nwant: int  # neighbour lists span this many distances
    sub: int  # weights per sub-block (one scale each)
    steps: range  # the trial scales (2·kMaxQ − 1 + step·delta) / max
    delta: float
    eps: float  # a sub-block whose largest magnitude is below this is zero (0: only an all-zero one)
    sigma_factor: float  # σ² = factor · Σx²/256 in the importance weights
    plain: str | None  # weights without importance: "x2" (x²), "sigma" (σ²/4 + x²), None: refused
    even_signs: bool  # 7 sign bits per 8 weights: an odd minus count flips the least important weight
    redo: str  # after the search, re-round at the best scale: "offgrid" groups, "all" if any was, "always"
    fudge: float  # the fp16 scale is (max scale / 31)·fudge
    pack: Callable[[_Found], np.ndarray]  # the block layout
    # (fp16 d as float32 [N, 1], 4-bit scale codes [N, subs]) -> each sub-block's step: weight = step·grid·sign
    step: Callable[[np.ndarray, np.ndarray], np.ndarray]
    scale_codes: Callable[[np.ndarray], np.ndarray]  # blocks [N, bytes] -> the 4-bit scale codes [N, subs]
    qp_start: bool = False  # IQ2_XXS: trial scales around make_qp_quants' fit instead of the max


def _project(grid: _Grid, xval: np.ndarray, waux: np.ndarray, inverse: np.ndarray, scale: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round magnitudes xval [B, S] at 1/``inverse`` to levels, per group of ``dim``; where the levels are
    not a grid point take the best neighbour at ``scale``. (levels [B, S], grid index [B, G], off-grid [B, G])."""
    b, s = xval.shape
    rounded = _nearest_int((_F32(0.5) * ((inverse[:, None] * xval).astype(_F32) - _F32(1))).astype(_F32))
    level = np.clip(rounded, 0, grid.reach - 1).reshape(b, s // grid.dim, grid.dim)
    codes = _codes(grid, level)
    index = grid.index[codes]
    off = index < 0
    if off.any():
        rows = np.nonzero(off)[0]
        index[off] = _best_neighbour(grid, grid.odd, codes[off],
                                     xval.reshape(level.shape)[off], waux.reshape(level.shape)[off], scale[rows])
    return grid.levels[index].reshape(b, s), index, off


def _fit(weight: np.ndarray, xval: np.ndarray, level: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Σ w·x·q and Σ w·q² with q = 2l + 1, in the C loop's order."""
    q = (2 * level + 1).astype(_F32)
    return (ordered_sum(((weight * xval).astype(_F32) * q).astype(_F32)),
            ordered_sum(((weight * q).astype(_F32) * q).astype(_F32)))


def _signed_magnitudes(xb: np.ndarray, weight: np.ndarray, even: bool) -> tuple[np.ndarray, np.ndarray]:
    """(|x| [B, S], sign bytes [B, S/8]). With ``even`` an octet with an odd number of minus signs keeps
    its least important weight (smallest w·x²) positive-signed: its magnitude turns negative instead."""
    b, s = xb.shape
    negative = ~(xb >= 0)  # ggml tests x >= 0, so a NaN counts as negative
    xval = np.where(negative, -xb, xb).astype(_F32)
    octets = negative.reshape(b, s // 8, 8)
    signs = (octets.astype(np.int32) << np.arange(8)).sum(axis=-1)
    if even:
        odd = octets.sum(axis=-1) % 2 == 1
        cost = ((weight * xb).astype(_F32) * xb).astype(_F32).reshape(b, s // 8, 8)
        least = cost.argmin(axis=-1)
        flip = odd[..., None] & (np.arange(8) == least[..., None])
        xval = np.where(flip.reshape(b, s), -xval, xval).astype(_F32)
        signs = (signs ^ np.where(odd, 1 << least, 0)) & 127
    return xval, signs.astype(np.int32)


def _search(kind: _Kind, grid: _Grid, xb: np.ndarray, weight: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One sub-block per row of xb [B, S]: (scale [B], grid index [B, G], sign bytes [B, S/8], zero [B])."""
    kmaxq = kind.kmaxq
    top = _F32(2 * kmaxq - 1)
    waux = np.sqrt(weight).astype(_F32)
    xval, signs = _signed_magnitudes(xb, weight, kind.even_signs)
    largest = xval.max(axis=-1)
    zero = (largest <= 0) if kind.eps == 0 else (largest < _F32(kind.eps))
    if kind.qp_start:
        fitted, _ = make_qp_quants(xval, kmaxq + 1, weight)
        base = (fitted * _F32(kmaxq)).astype(_F32)
        zero |= base <= 0
        scale = fitted
    else:
        base = largest
        scale = (largest / top).astype(_F32)
    base = np.where(zero, _F32(1), base).astype(_F32)
    groups = xb.shape[1] // grid.dim
    best = np.zeros(len(xb), dtype=_F32)
    level = np.zeros(xb.shape, dtype=np.int32)
    on_grid = np.full((len(xb), groups), kind.redo == "offgrid")
    for step in kind.steps:
        inverse = ((top + (_F32(step) * _F32(kind.delta)).astype(_F32)).astype(_F32) / base).astype(_F32)
        trial, _, off = _project(grid, xval, waux, inverse, (_F32(1) / inverse).astype(_F32))
        sumqx, sumq2 = _fit(weight, xval, trial)
        better = (sumq2 > 0) & ((sumqx * sumqx).astype(_F32) > (best * sumq2).astype(_F32))
        scale = np.where(better, sumqx / np.where(better, sumq2, _F32(1)), scale).astype(_F32)
        best = np.where(better, (scale * sumqx).astype(_F32), best).astype(_F32)
        level = np.where(better[:, None], trial, level)
        on_grid = np.where(better[:, None], ~off, on_grid)

    # Re-round at the best scale itself, searching neighbours at that scale.
    if kind.redo == "always":
        redo = scale > 0
        groups_redone = np.ones_like(on_grid)
    else:
        redo = (scale > 0) & (~on_grid).any(axis=1)
        groups_redone = ~on_grid if kind.redo == "offgrid" else np.ones_like(on_grid)
    redo &= ~zero
    if redo.any():
        rows = np.nonzero(redo)[0]
        safe = scale[rows]
        again, _, _ = _project(grid, xval[rows], waux[rows], (_F32(1) / safe).astype(_F32), safe)
        mask = np.repeat(groups_redone[rows], grid.dim, axis=1)
        level[rows] = np.where(mask, again, level[rows])
        sumqx, sumq2 = _fit(weight[rows], xval[rows], level[rows])
        scale[rows] = np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, _F32(1)), safe).astype(_F32)

    flipped = scale < 0  # "should never happen" in ggml: a negative fit flips every sign instead
    scale = np.abs(scale).astype(_F32)
    signs = np.where(flipped[:, None], ~signs & (127 if kind.even_signs else 255), signs)
    index = grid.index[_codes(grid, level.reshape(len(xb), groups, grid.dim))]
    assert (index >= 0).all()
    scale = np.where(zero, _F32(0), scale).astype(_F32)
    index = np.where(zero[:, None], 0, index)
    signs = np.where(zero[:, None], 0, signs)
    return scale, index, signs, zero


def _prepare(name: str, x: np.ndarray, importance: np.ndarray | None, sigma_factor: float, plain: str | None
             ) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """(the rows' shape, super-blocks [N, 256], their weights [N, 256]): qw·√(σ² + x²) with an importance
    vector (σ² = factor · Σx²/256 over the super-block), else the type's plain weights, "x2" x² or
    "sigma" σ²/4 + x²; a type without plain weights (``plain`` None) refuses x alone, as llama.cpp does."""
    x = _whole_blocks(x)
    if importance is None and plain is None:
        raise missing_importance(name)
    qw = None if importance is None else importance_like(importance, x).reshape(-1, QK_K)
    blocks = x.reshape(-1, QK_K)
    square = (blocks * blocks).astype(_F32)
    sigma2 = ((_F32(sigma_factor) * ordered_sum(square)).astype(_F32) / _F32(QK_K)).astype(_F32)[:, None]
    if qw is not None:
        weight = (qw * np.sqrt((sigma2 + square).astype(_F32))).astype(_F32)
    elif plain == "x2":
        weight = square
    else:
        weight = ((_F32(0.25) * sigma2).astype(_F32) + square).astype(_F32)
    return x.shape[:-1], blocks, weight


def _super_scales(scales: np.ndarray, fudge: float, bits: int = 4, divisor: int = 31
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sub-block scales [N, n] -> (fp16 d bytes [N, 2], codes [N, n] 0..2^bits−1, all-zero [N]):
    d = max/divisor, each scale coded as round((s/d − 1)/2)."""
    largest = scales.max(axis=1)
    empty = largest == 0
    d = (largest / _F32(divisor)).astype(_F32)
    stored = (d * _F32(fudge)).astype(_F32) if fudge != 1 else d
    inverse = (_F32(1) / np.where(empty, _F32(1), d)).astype(_F32)[:, None]
    codes = np.clip(_nearest_int((_F32(0.5) * ((inverse * scales).astype(_F32) - _F32(1))).astype(_F32)),
                    0, (1 << bits) - 1)
    return half_bytes(np.where(empty, _F32(0), stored)[:, None]), np.where(empty[:, None], 0, codes), empty


def _whole_blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=_F32)
    if x.shape[-1] % QK_K:
        raise ValueError(f"rows of {x.shape[-1]} values are not whole blocks of {QK_K}")
    return x


def _quantize(kind: _Kind, x: np.ndarray, importance: np.ndarray | None) -> tuple[tuple[int, ...], _Found]:
    grid = _grid(kind.grid, kind.kmaxq, kind.nwant)
    subs = QK_K // kind.sub
    with np.errstate(all="ignore"):
        lead, blocks, weight = _prepare(kind.name, x, importance, kind.sigma_factor, kind.plain)
        scale, index, signs, zero = _search(kind, grid, blocks.reshape(-1, kind.sub), weight.reshape(-1, kind.sub))
        d, codes, empty = _super_scales(scale.reshape(-1, subs), kind.fudge)
    return lead, _Found(d, codes, index.reshape(len(blocks), subs, -1), signs.reshape(len(blocks), subs, -1),
                        zero.reshape(-1, subs), empty)


def _le_bytes(words: np.ndarray, dtype: str) -> np.ndarray:
    """Integer words [N, n] -> their little-endian bytes [N, n·size]."""
    return np.ascontiguousarray(words.astype(dtype)).view(np.uint8).reshape(len(words), -1)


def _pack_iq3_xxs(f: _Found) -> np.ndarray:
    words = (f.signs << (7 * np.arange(4))).sum(axis=-1).astype(np.uint32) | (f.scales.astype(np.uint32) << 28)
    body = np.concatenate([f.index.reshape(len(f.d), -1).astype(np.uint8), _le_bytes(words, "<u4")], axis=1)
    # a super-block whose scales are all zero is written as zeros
    return np.concatenate([f.d, np.where(f.empty[:, None], 0, body).astype(np.uint8)], axis=1)


def _pack_iq3_s(f: _Found) -> np.ndarray:
    n = len(f.d)
    qh = ((f.index >> 8) << np.arange(8)).sum(axis=-1).astype(np.uint8)
    # ggml moves its code and sign pointers only past sub-blocks it quantized: a zero sub-block's
    # successors are written from its place on, and the row's last places stay zero
    qs = np.zeros((n, 8, 8), dtype=np.uint8)
    signs = np.zeros((n, 8, 4), dtype=np.uint8)
    slot = np.cumsum(~f.zero, axis=1) - 1
    rows, subs = np.nonzero(~f.zero)
    qs[rows, slot[rows, subs]] = (f.index[rows, subs] & 255).astype(np.uint8)
    signs[rows, slot[rows, subs]] = f.signs[rows, subs].astype(np.uint8)
    scales = (f.scales[:, 0::2] | f.scales[:, 1::2] << 4).astype(np.uint8)
    return np.concatenate([f.d, qs.reshape(n, -1), qh, signs.reshape(n, -1), scales], axis=1)


def _pack_iq2_xxs(f: _Found) -> np.ndarray:
    words = np.stack([(f.index.astype(np.uint32) << (8 * np.arange(4))).sum(axis=-1),
                      (f.signs << (7 * np.arange(4))).sum(axis=-1).astype(np.uint32)
                      | (f.scales.astype(np.uint32) << 28)], axis=-1).reshape(len(f.d), -1)
    return np.concatenate([f.d, np.where(f.empty[:, None], 0, _le_bytes(words, "<u4")).astype(np.uint8)], axis=1)


def _pack_iq2_xs(f: _Found) -> np.ndarray:
    words = (f.index | f.signs << 9).reshape(len(f.d), -1)
    scales = (f.scales[:, 0::2] | f.scales[:, 1::2] << 4).astype(np.uint8)
    return np.concatenate([f.d, np.where(f.empty[:, None], 0, _le_bytes(words, "<u2")).astype(np.uint8), scales],
                          axis=1)


def _pack_iq2_s(f: _Found) -> np.ndarray:
    n = len(f.d)
    index = f.index.reshape(n, -1)  # 32 groups of 8
    qh = ((index >> 8).reshape(n, 8, 4) << (2 * np.arange(4))).sum(axis=-1).astype(np.uint8)
    scales = (f.scales[:, 0::2] | f.scales[:, 1::2] << 4).astype(np.uint8)
    return np.concatenate([f.d, (index & 255).astype(np.uint8), f.signs.reshape(n, -1).astype(np.uint8), qh, scales],
                          axis=1)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """Bytes [N, n] -> their 4-bit halves [N, 2n], the low one first."""
    return np.stack([b & 15, b >> 4], axis=-1).reshape(len(b), -1)


def _words(b: np.ndarray, dtype: str) -> np.ndarray:
    """Bytes [N, n] -> little-endian words [N, n / size]."""
    return np.ascontiguousarray(b).view(dtype)


def _half_step(d: np.ndarray, codes: np.ndarray) -> np.ndarray:
    return (d * (_F32(0.5) + codes.astype(_F32)) * _F32(0.5)).astype(_F32)


def _quarter_step(d: np.ndarray, codes: np.ndarray) -> np.ndarray:
    return (d * (_F32(0.5) + codes.astype(_F32)) * _F32(0.25)).astype(_F32)


def _odd_step(d: np.ndarray, codes: np.ndarray) -> np.ndarray:
    return (d * (1 + 2 * codes.astype(_F32))).astype(_F32)


_KINDS = {kind.name: kind for kind in (
    _Kind("iq3_xxs", grid="IQ3_XXS", kmaxq=8, nwant=2, sub=32, steps=range(-15, 16), delta=0.2, eps=1e-8,
          sigma_factor=2, plain="x2", even_signs=True, redo="offgrid", fudge=1.0125, pack=_pack_iq3_xxs,
          step=_half_step, scale_codes=lambda b: _words(b[:, 66:98], "<u4") >> 28),
    _Kind("iq3_s", grid="IQ3_S", kmaxq=8, nwant=3, sub=32, steps=range(-9, 10), delta=0.2, eps=0,
          sigma_factor=2, plain="x2", even_signs=False, redo="all", fudge=1.033, pack=_pack_iq3_s, step=_odd_step,
          scale_codes=lambda b: _nibbles(b[:, 106:110])),
    _Kind("iq2_xxs", grid="IQ2_XXS", kmaxq=3, nwant=2, sub=32, steps=range(-6, 7), delta=0.1, eps=1e-15,
          sigma_factor=1, plain=None, even_signs=True, redo="always", fudge=1, pack=_pack_iq2_xxs,
          step=_quarter_step, scale_codes=lambda b: _words(b[:, 2:66], "<u4")[:, 1::2] >> 28, qp_start=True),
    _Kind("iq2_xs", grid="IQ2_XS", kmaxq=3, nwant=2, sub=16, steps=range(-9, 10), delta=0.1, eps=1e-15,
          sigma_factor=1, plain=None, even_signs=True, redo="offgrid", fudge=1, pack=_pack_iq2_xs,
          step=_quarter_step, scale_codes=lambda b: _nibbles(b[:, 66:74])),
    _Kind("iq2_s", grid="IQ2_S", kmaxq=3, nwant=1, sub=16, steps=range(-9, 10), delta=0.1, eps=1e-8,
          sigma_factor=2, plain="sigma", even_signs=False, redo="offgrid", fudge=0.9875, pack=_pack_iq2_s,
          step=_quarter_step, scale_codes=lambda b: _nibbles(b[:, 74:82])),
)}


def _quantizer(name: str) -> Callable[..., np.ndarray]:
    kind = _KINDS[name]

    def quantize(x: np.ndarray, importance: np.ndarray | None = None, row_sigma2: np.ndarray | None = None
                 ) -> np.ndarray:
        lead, found = _quantize(kind, x, importance)
        return kind.pack(found).reshape(*lead, -1)

    quantize.__name__ = f"quantize_{name}"
    quantize.__doc__ = (f"float32 [..., K] (K a multiple of 256) -> {name.upper()} bytes; with ``importance`` "
                        "ggml's weights qw·√(σ² + x²). σ² is the super-block's own, so ``row_sigma2`` is not used.")
    return quantize


quantize_iq3_xxs = _quantizer("iq3_xxs")
quantize_iq3_s = _quantizer("iq3_s")
quantize_iq2_xxs = _quantizer("iq2_xxs")
quantize_iq2_xs = _quantizer("iq2_xs")
quantize_iq2_s = _quantizer("iq2_s")


# ---------------------------------------------------------------------------------------------------
# IQ1_S / IQ1_M: ternary groups, found by an exhaustive split of the sorted weights

# The two shifted ternary value sets (IQ1S_DELTA = IQ1M_DELTA = 1/8): −1 + δ, δ, 1 + δ and −1 − δ, −δ, 1 − δ.
_PLUS = np.array([-0.875, 0.125, 1.125], dtype=_F32)
_MINUS = np.array([-1.125, -0.125, 0.875], dtype=_F32)
_FLT_MAX = np.finfo(_F32).max


class _Best:
    """ggml's running best split: a candidate wins if Σqx² / Σq² beats the best so far, compared as
    sumqx² > best·sumq2 with best = scale·sumqx (the C code's float arithmetic, one candidate at a time)."""

    def __init__(self, n: int, start_scale: np.ndarray):
        self.score = np.full(n, -_FLT_MAX, dtype=_F32)
        self.scale = start_scale.astype(_F32)
        self.i1 = np.full(n, -1)
        self.i2 = np.full(n, -1)
        self.choice = np.zeros(n, dtype=np.int64)

    def offer(self, sumqx: np.ndarray, sumq2: np.ndarray, i1: int, i2: int, choice: int) -> None:
        win = (sumq2 > 0) & ((sumqx * sumqx).astype(_F32) > (self.score * sumq2).astype(_F32))
        self.scale = np.where(win, sumqx / np.where(win, sumq2, _F32(1)), self.scale).astype(_F32)
        self.score = np.where(win, (self.scale * sumqx).astype(_F32), self.score).astype(_F32)
        self.i1 = np.where(win, i1, self.i1)
        self.i2 = np.where(win, i2, self.i2)
        self.choice = np.where(win, choice, self.choice)


def _prefix(values: np.ndarray) -> np.ndarray:
    """[B, n] -> running float32 sums [B, n + 1] from 0, added one at a time."""
    return np.concatenate([np.zeros((len(values), 1), dtype=_F32), np.cumsum(values, axis=1, dtype=_F32)], axis=1)


def _split_iq1_s(xs: np.ndarray, ws: np.ndarray, largest: np.ndarray) -> _Best:
    """Every split of the sorted weights (xs, ws [B, S]) into a low, middle and high third at positions
    i1 ≤ i2, valued −1, 0, 1 shifted by +δ (choice 1) or −δ (choice −1)."""
    n, size = xs.shape
    sumx, sumw = _prefix((ws * xs).astype(_F32)), _prefix(ws)
    best = _Best(n, largest)
    for i1 in range(size + 1):
        low_x, low_w = (sumx[:, i1] - sumx[:, 0]).astype(_F32), (sumw[:, i1] - sumw[:, 0]).astype(_F32)
        for i2 in range(i1, size + 1):
            mid_x, mid_w = (sumx[:, i2] - sumx[:, i1]).astype(_F32), (sumw[:, i2] - sumw[:, i1]).astype(_F32)
            high_x, high_w = (sumx[:, size] - sumx[:, i2]).astype(_F32), (sumw[:, size] - sumw[:, i2]).astype(_F32)
            for choice, v in ((1, _PLUS), (-1, _MINUS)):
                sumqx = ((low_x * v[0]).astype(_F32) + (mid_x * v[1]).astype(_F32) + (high_x * v[2]).astype(_F32))
                sumq2 = (((low_w * v[0]).astype(_F32) * v[0]).astype(_F32)
                         + ((mid_w * v[1]).astype(_F32) * v[1]).astype(_F32)
                         + ((high_w * v[2]).astype(_F32) * v[2]).astype(_F32))
                best.offer(sumqx.astype(_F32), sumq2.astype(_F32), i1, i2, choice)
    return best


def _split_iq1_m(xs: np.ndarray, ws: np.ndarray, half: np.ndarray, largest: np.ndarray) -> _Best:
    """IQ1_M's split: each half of the sub-block (``half`` [B, S], of each sorted weight) takes its own
    shift, so a candidate is a split and one of four shift pairs (choice 0: ++, 1: +−, 2: −+, 3: −−).
    ggml sums per half, using that the level steps are 1 for both value sets."""
    n, size = xs.shape
    wx = (ws * xs).astype(_F32)
    px = [_prefix(np.where(half == h, wx, _F32(0))) for h in (0, 1)]
    pw = [_prefix(np.where(half == h, ws, _F32(0))) for h in (0, 1)]
    p2, m2 = _PLUS[2], _MINUS[2]
    cp1 = (_PLUS[0] * _PLUS[0] - _PLUS[1] * _PLUS[1]).astype(_F32)
    cp2 = (_PLUS[1] * _PLUS[1] - _PLUS[2] * _PLUS[2]).astype(_F32)
    cm1 = (_MINUS[0] * _MINUS[0] - _MINUS[1] * _MINUS[1]).astype(_F32)
    cm2 = (_MINUS[1] * _MINUS[1] - _MINUS[2] * _MINUS[2]).astype(_F32)
    best = _Best(n, largest)
    for i1 in range(size + 1):
        for i2 in range(i1, size + 1):
            qx_p, qx_m, q2_p, q2_m = [], [], [], []
            for h in (0, 1):
                total_x, total_w = px[h][:, size], pw[h][:, size]
                sx = (px[h][:, i1] + px[h][:, i2]).astype(_F32)
                qx_p.append(((total_x * p2).astype(_F32) - sx).astype(_F32))
                qx_m.append(((total_x * m2).astype(_F32) - sx).astype(_F32))
                q2_p.append(((((total_w * p2).astype(_F32) * p2).astype(_F32) + (pw[h][:, i1] * cp1).astype(_F32))
                             .astype(_F32) + (pw[h][:, i2] * cp2).astype(_F32)).astype(_F32))
                q2_m.append(((((total_w * m2).astype(_F32) * m2).astype(_F32) + (pw[h][:, i1] * cm1).astype(_F32))
                             .astype(_F32) + (pw[h][:, i2] * cm2).astype(_F32)).astype(_F32))
            pairs = ((qx_p[0], qx_p[1], q2_p[0], q2_p[1]), (qx_p[0], qx_m[1], q2_p[0], q2_m[1]),
                     (qx_m[0], qx_p[1], q2_m[0], q2_p[1]), (qx_m[0], qx_m[1], q2_m[0], q2_m[1]))
            for choice, (x0, x1, w0, w1) in enumerate(pairs):
                best.offer((x0 + x1).astype(_F32), (w0 + w1).astype(_F32), i1, i2, choice)
    return best


@dataclass(frozen=True)
class _Ternary:
    """What differs between IQ1_S and IQ1_M (``quantize_row_iq1_s_impl`` / ``_m_impl``)."""

    name: str
    sub: int  # weights per sub-block
    eps: float  # a sub-block whose largest |x| is below this is zero
    plain: str | None  # weights without importance ("x2"), None: refused
    # (sorted x, sorted weights, the sort order, the sub-blocks' max |x|) -> the best split and shift choice
    split: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], _Best]
    mirrored: Callable[[np.ndarray], np.ndarray]  # the choice for levels 2 − l (a negative fit flipped)
    plus: Callable[[np.ndarray, int], np.ndarray]  # (choices [B], groups) -> which groups shift by +δ [B, G]
    zero_choice: int  # what a zero sub-block records


def _ternary_values(grid: _Grid, plus: bool) -> np.ndarray:
    return (_PLUS if plus else _MINUS)[grid.levels]


def _quantize_ternary(kind: _Ternary, x: np.ndarray, importance: np.ndarray | None):
    """(rows' shape, scale [N, subs], grid index [N, subs, groups], shift choice [N, subs], zero [N, subs],
    super-blocks [N, 256], weights [N, 256]); IQ1_S's choice is +1/−1 per sub-block, IQ1_M's 0..3."""
    grid = _grid("IQ1_S", 3, 3)
    lead, blocks, weight = _prepare(kind.name, x, importance, 2, kind.plain)
    xb, w = blocks.reshape(-1, kind.sub), weight.reshape(-1, kind.sub)
    n, size = xb.shape
    groups = size // 8
    largest = np.abs(xb).max(axis=1)
    zero = largest < _F32(kind.eps)
    # ggml's qsort of (value, index) by value; glibc sorts it stably (a merge sort), as this does
    order = np.argsort(xb, axis=1, kind="stable")
    xs, ws = np.take_along_axis(xb, order, axis=1), np.take_along_axis(w, order, axis=1)
    best = kind.split(xs, ws, order, largest)
    zero |= best.i1 < 0  # no split had Σq² > 0
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(size)[None, :], axis=1)
    level = np.where(rank < best.i1[:, None], 0, np.where(rank < best.i2[:, None], 1, 2))
    scale, choice = best.scale, best.choice
    flipped = scale < 0  # a negative fit mirrors the levels and the shifts
    level = np.where(flipped[:, None], 2 - level, level)
    scale = np.abs(scale).astype(_F32)
    choice = np.where(flipped, kind.mirrored(choice), choice)
    plus = kind.plus(choice, groups)

    codes = _codes(grid, level.reshape(n, groups, 8))
    index = grid.index[codes]
    off = (index < 0) & ~zero[:, None]
    x_groups, w_groups = xb.reshape(n, groups, 8), w.reshape(n, groups, 8)
    rows = np.broadcast_to(np.arange(n)[:, None], off.shape)
    for sign in (True, False):
        pick = off & (plus == sign)
        if pick.any():
            index[pick] = _best_neighbour(grid, _ternary_values(grid, sign), codes[pick], x_groups[pick],
                                          w_groups[pick], scale[rows[pick]])
    # off the grid somewhere: the scale is refitted to the points taken
    refit = off.any(axis=1)
    if refit.any():
        safe = np.where(index >= 0, index, 0)
        q = np.where(plus[..., None], _ternary_values(grid, True)[safe], _ternary_values(grid, False)[safe])
        q = q.reshape(n, size)
        wq = (w * q).astype(_F32)
        sumqx, sumq2 = ordered_sum((wq * xb).astype(_F32)), ordered_sum((wq * q).astype(_F32))
        better = refit & (sumqx > 0) & (sumq2 > 0)
        scale = np.where(better, sumqx / np.where(better, sumq2, _F32(1)), scale).astype(_F32)
    scale = np.where(zero, _F32(0), scale).astype(_F32)
    index = np.where(zero[:, None], 0, index)
    choice = np.where(zero, kind.zero_choice, choice)
    subs = QK_K // kind.sub
    return (lead, scale.reshape(-1, subs), index.reshape(-1, subs, groups), choice.reshape(-1, subs),
            blocks, weight)


# IQ1_S: one shift per 32-weight sub-block, choice +1 or −1
_IQ1_S = _Ternary("iq1_s", 32, 1e-12, None, lambda xs, ws, order, largest: _split_iq1_s(xs, ws, largest),
                  lambda choice: -choice, lambda choice, groups: np.repeat((choice == 1)[:, None], groups, axis=1),
                  1)
# IQ1_M: 16-weight sub-blocks, one shift per group of 8, choice 0..3 (first group −δ from 2, second if odd)
_IQ1_M = _Ternary("iq1_m", 16, 1e-7, "x2",
                  lambda xs, ws, order, largest: _split_iq1_m(xs, ws, order >= xs.shape[1] // 2, largest),
                  lambda choice: 3 - choice, lambda choice, groups: np.stack([choice < 2, choice % 2 == 0], axis=1),
                  0)


@dataclass(frozen=True)
class _TernaryFound:
    """An IQ1 search's result, one super-block per row."""

    d: np.ndarray  # the fp16 super-block scale's bytes [N, 2]
    scales: np.ndarray  # 3-bit codes [N, subs]
    index: np.ndarray  # grid indices [N, subs, groups]
    choice: np.ndarray  # shift choices [N, subs] (IQ1_S: +1/−1, IQ1_M: 0..3)
    empty: np.ndarray  # [N] super-blocks with every scale zero


def _search_iq1_s(x: np.ndarray, importance: np.ndarray | None) -> tuple[tuple[int, ...], _TernaryFound]:
    with np.errstate(all="ignore"):
        lead, scales, index, choice, _, _ = _quantize_ternary(_IQ1_S, x, importance)
        d, codes, empty = _super_scales(scales, 1.125, bits=3, divisor=15)
    return lead, _TernaryFound(d, codes, index, choice, empty)


def _pack_iq1_s(f: _TernaryFound) -> np.ndarray:
    n = len(f.d)
    qh = (f.index >> 8 << (3 * np.arange(4))).sum(axis=-1)
    qh |= np.where(f.empty[:, None], 0, (f.scales | np.where(f.choice == -1, 8, 0)) << 12)
    return np.concatenate([f.d, (f.index & 255).astype(np.uint8).reshape(n, -1), _le_bytes(qh, "<u2")], axis=1)


def _search_iq1_m(x: np.ndarray, importance: np.ndarray | None) -> tuple[tuple[int, ...], _TernaryFound]:
    """d is refitted over the whole super-block once the 3-bit scales are known."""
    grid = _grid("IQ1_S", 3, 3)
    with np.errstate(all="ignore"):
        lead, scales, index, choice, blocks, weight = _quantize_ternary(_IQ1_M, x, importance)
        _, codes, empty = _super_scales(scales, 1, bits=3, divisor=15)
        n = len(scales)
        d = (scales.max(axis=1) / _F32(15)).astype(_F32)
        plus = _IQ1_M.plus(choice.reshape(-1), 2).reshape(n, -1, 2)
        q = np.where(plus[..., None], _ternary_values(grid, True)[index], _ternary_values(grid, False)[index])
        q = (q * (2 * codes + 1).astype(_F32)[..., None, None]).astype(_F32).reshape(n, QK_K)
        wq = (weight * q).astype(_F32)
        sumqx, sumq2 = ordered_sum((wq * blocks).astype(_F32)), ordered_sum((wq * q).astype(_F32))
        d = np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, _F32(1)), d).astype(_F32)
    return lead, _TernaryFound(half_bytes((d * _F32(1.1125)).astype(_F32)[:, None]), codes, index, choice, empty)


def _pack_iq1_m(f: _TernaryFound) -> np.ndarray:
    n = len(f.d)
    half = f.d.copy().view("<u2")[:, 0].astype(np.int64)
    words = (f.scales.reshape(n, 4, 4) << (3 * np.arange(4))).sum(axis=-1)
    words |= (half[:, None] >> (4 * np.arange(4)) & 15) << 12
    words = np.where(f.empty[:, None], 0, words)
    masks = np.array([0x00, 0x80, 0x08, 0x88])
    qh = (f.index[..., 0] >> 8) | (f.index[..., 1] >> 8) << 4 | np.where(f.empty[:, None], 0, masks[f.choice])
    return np.concatenate([(f.index & 255).astype(np.uint8).reshape(n, -1), qh.astype(np.uint8),
                           _le_bytes(words, "<u2")], axis=1)


def quantize_iq1_s(x: np.ndarray, importance: np.ndarray | None = None, row_sigma2: np.ndarray | None = None
                   ) -> np.ndarray:
    """float32 [..., K] -> IQ1_S bytes [..., K/256 · 50]: d, qs[32] (grid indices' low bytes), qh[8] (uint16:
    3 high index bits per group, the 3-bit scale at bit 12, the −δ shift at bit 15). Needs ``importance``."""
    lead, found = _search_iq1_s(x, importance)
    return _pack_iq1_s(found).reshape(*lead, -1)


def quantize_iq1_m(x: np.ndarray, importance: np.ndarray | None = None, row_sigma2: np.ndarray | None = None
                   ) -> np.ndarray:
    """float32 [..., K] -> IQ1_M bytes [..., K/256 · 56]: qs[32], qh[16] (per group 3 high index bits and
    the −δ shift bit), scales as 4 uint16 of four 3-bit scales each, the fp16 d in their top nibbles."""
    lead, found = _search_iq1_m(x, importance)
    return _pack_iq1_m(found).reshape(*lead, -1)


# ---------------------------------------------------------------------------------------------------
# The lattice types opened up for a solver that chooses the grid points itself (gguf/solver_grid.py)


@dataclass(frozen=True)
class LatticeCodec:
    """llama.cpp's search gives a super-block's scales (and IQ1's shifts), read out of the blocks it
    writes; the solver then picks each unit of 8 weights' grid points (and signs) at those scales, and
    ``pack`` writes them in the type's layout. A weight is step · (point + shift) · sign: IQ2/IQ3 have
    signs and no shift, IQ1 a ±1/8 shift per unit and no signs."""

    grid: str  # gguf-py's table
    sub_block: int  # weights per 4-bit (IQ1: 3-bit) scale
    even_signs: bool  # 7 sign bits per 8 weights (an even count of minus signs)
    # llama.cpp's blocks [N, block bytes] -> their scales (and shifts), every point and sign left 0
    read: Callable[[np.ndarray], _Found | _TernaryFound]
    step: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (fp16 d [N, 1], scale codes [N, subs]) -> steps
    write: Callable  # found -> bytes [N, block bytes]
    # found -> each unit's shift, float32 [N, subs, units]; None: signed, unshifted points
    unit_shifts: Callable[[_TernaryFound], np.ndarray] | None = None

    @property
    def signed(self) -> bool:
        return self.unit_shifts is None

    @functools.cached_property
    def points(self) -> np.ndarray:
        """Every grid point's values as the dequantizer reads them, float32 [points, 4 or 8]."""
        return _table(self.grid)

    def steps(self, found: _Found | _TernaryFound) -> np.ndarray:
        """Each sub-block's step as llama.cpp reads it back, float32 [N, subs]."""
        return self.step(_half(found.d), found.scales)

    def shifts(self, found: _Found | _TernaryFound) -> np.ndarray:
        """Each unit's shift of its points, float32 [N, subs, units per sub-block]."""
        if self.unit_shifts is None:
            return np.zeros((*found.scales.shape, self.sub_block // 8), dtype=_F32)
        return self.unit_shifts(found)

    def pack(self, found: _Found | _TernaryFound, index: np.ndarray, signs: np.ndarray | None) -> np.ndarray:
        """``found``'s super-blocks with other grid points (``index``, as ``found.index``) and sign bytes
        (as ``found.signs``; 7 bits with even signs) -> bytes [N, block bytes]. Every sub-block's points
        are written in place: where llama.cpp found a sub-block empty, the solver's points at its stored
        step are still what the file means (IQ3_S's quantizer would shift the later sub-blocks' codes
        into the empty one's place, which its dequantizer does not undo)."""
        if not self.signed:
            return self.write(dataclasses.replace(found, index=index))
        return self.write(dataclasses.replace(found, index=index, signs=signs, zero=np.zeros_like(found.zero)))


def _read_signed(kind: _Kind, blocks: np.ndarray) -> _Found:
    n, subs = len(blocks), QK_K // kind.sub
    d = blocks[:, :2].copy()
    return _Found(d, kind.scale_codes(blocks).astype(np.int64),
                  np.zeros((n, subs, kind.sub // _table(kind.grid).shape[1]), dtype=np.int64),
                  np.zeros((n, subs, kind.sub // 8), dtype=np.int64), np.zeros((n, subs), dtype=bool),
                  _half(d)[:, 0] == 0)


def _signed_codec(kind: _Kind) -> LatticeCodec:
    return LatticeCodec(kind.grid, kind.sub, kind.even_signs, functools.partial(_read_signed, kind), kind.step,
                        kind.pack)


def _read_iq1_s(blocks: np.ndarray) -> _TernaryFound:
    d = blocks[:, :2].copy()
    qh = _words(blocks[:, 34:50], "<u2").astype(np.int64)  # [N, 8]
    return _TernaryFound(d, (qh >> 12) & 7, np.zeros((len(blocks), 8, 4), dtype=np.int64),
                         np.where(qh & 0x8000, -1, 1), _half(d)[:, 0] == 0)


def _read_iq1_m(blocks: np.ndarray) -> _TernaryFound:
    words = _words(blocks[:, 48:56], "<u2").astype(np.int64)  # [N, 4]: four 3-bit scales and a nibble of d
    half = ((words >> 12) << np.array([0, 4, 8, 12])).sum(axis=1).astype("<u2")
    d = half[:, None].view(np.uint8)
    scales = ((words[..., None] >> (3 * np.arange(4))) & 7).reshape(len(blocks), 16)
    qh = blocks[:, 32:48].astype(np.int64)  # [N, 16]: bit 3 shifts the first group by −δ, bit 7 the second
    choice = 2 * ((qh & 0x08) != 0) + ((qh & 0x80) != 0)
    return _TernaryFound(d, scales, np.zeros((len(blocks), 16, 2), dtype=np.int64), choice, _half(d)[:, 0] == 0)


_DELTA = _F32(gguf_quants.IQ1_S.delta)


def _iq1_s_shifts(found: _TernaryFound) -> np.ndarray:
    return np.repeat(np.where(found.choice == -1, -_DELTA, _DELTA)[..., None], 4, axis=-1).astype(_F32)


def _iq1_m_shifts(found: _TernaryFound) -> np.ndarray:
    plus = _IQ1_M.plus(found.choice.reshape(-1), 2).reshape(*found.choice.shape, 2)
    return np.where(plus, _DELTA, -_DELTA).astype(_F32)


# the types whose grid points a solver can choose
LATTICE_CODECS = {
    **{name: _signed_codec(kind) for name, kind in _KINDS.items()},
    "iq1_s": LatticeCodec("IQ1_S", _IQ1_S.sub, False, _read_iq1_s, _odd_step, _pack_iq1_s, _iq1_s_shifts),
    "iq1_m": LatticeCodec("IQ1_M", _IQ1_M.sub, False, _read_iq1_m, _odd_step, _pack_iq1_m, _iq1_m_shifts),
}


# ---------------------------------------------------------------------------------------------------
# Dequantizers (gguf-py's arithmetic)


@functools.cache
def _table(name: str) -> np.ndarray:
    table = getattr(gguf_quants, name)
    table.init_grid()
    return np.asarray(table.grid, dtype=_F32).reshape(table.grid_shape)


def _sign_bits(octets: np.ndarray) -> np.ndarray:
    """Sign bytes [...] -> ±1 float32 [..., 8], bit i the sign of weight i."""
    return np.where((octets[..., None] >> np.arange(8, dtype=np.uint8)) & 1 == 0, _F32(1), _F32(-1))


def _even_signs(seven: np.ndarray) -> np.ndarray:
    """7-bit sign fields -> ±1 [..., 8]: the eighth bit makes the count of minus signs even."""
    ksigns = np.frombuffer(gguf_quants.IQ2_XXS.ksigns, dtype=np.uint8)
    return _sign_bits(ksigns[seven & 127])


def _half(b: np.ndarray) -> np.ndarray:
    return b.copy().view("<f2").astype(_F32)


def dequantize_iq3_xxs(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(-1, 98)
    d = _half(b[:, :2])
    words = _words(b[:, 66:], "<u4")  # [N, 8]
    db = _half_step(d, _KINDS["iq3_xxs"].scale_codes(b))
    signs = _even_signs(((words[..., None] >> (7 * np.arange(4, dtype=np.uint32))) & 127).astype(np.int64))
    grid = _table("IQ3_XXS")[b[:, 2:66].reshape(-1, 8, 8).astype(np.int64)].reshape(-1, 8, 4, 8)
    return (db[..., None, None] * grid * signs).reshape(*data.shape[:-1], k)


def dequantize_iq3_s(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(-1, 110)
    d = _half(b[:, :2])
    db = _odd_step(d, _KINDS["iq3_s"].scale_codes(b))
    signs = _sign_bits(b[:, 74:106]).reshape(-1, 8, 4, 8)
    qh = ((b[:, 66:74, None] >> np.arange(8, dtype=np.uint8)) & 1).astype(np.int64).reshape(-1, 64)
    index = b[:, 2:66].astype(np.int64) | qh << 8
    grid = _table("IQ3_S")[index].reshape(-1, 8, 4, 8)
    return (db[..., None, None] * grid * signs).reshape(*data.shape[:-1], k)


def dequantize_iq2_xxs(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(-1, 66)
    d = _half(b[:, :2])
    words = _words(b[:, 2:], "<u4").reshape(-1, 8, 2)
    db = _quarter_step(d, _KINDS["iq2_xxs"].scale_codes(b))
    signs = _even_signs(((words[..., 1:] >> (7 * np.arange(4, dtype=np.uint32))) & 127).astype(np.int64))
    index = words[..., 0].copy().view(np.uint8).reshape(-1, 8, 4).astype(np.int64)
    grid = _table("IQ2_XXS")[index]
    return (db[..., None, None] * grid * signs).reshape(*data.shape[:-1], k)


def dequantize_iq2_xs(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(-1, 74)
    d = _half(b[:, :2])
    words = b[:, 2:66].copy().view("<u2").astype(np.int64)  # [N, 32]
    db = _quarter_step(d, _KINDS["iq2_xs"].scale_codes(b))
    signs = _even_signs(words >> 9).reshape(-1, 16, 2, 8)
    grid = _table("IQ2_XS")[words & 511].reshape(-1, 16, 2, 8)
    return (db[..., None, None] * grid * signs).reshape(*data.shape[:-1], k)


def dequantize_iq2_s(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(-1, 82)
    d = _half(b[:, :2])
    db = _quarter_step(d, _KINDS["iq2_s"].scale_codes(b))
    signs = _sign_bits(b[:, 34:66]).reshape(-1, 16, 2, 8)
    qh = ((b[:, 66:74, None] >> (2 * np.arange(4, dtype=np.uint8))) & 3).astype(np.int64).reshape(-1, 32)
    grid = _table("IQ2_S")[b[:, 2:34].astype(np.int64) | qh << 8].reshape(-1, 16, 2, 8)
    return (db[..., None, None] * grid * signs).reshape(*data.shape[:-1], k)


def dequantize_iq1_s(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(-1, 50)
    d = _half(b[:, :2])
    qh = b[:, 34:50].copy().view("<u2")  # [N, 8]
    dl = _odd_step(d, (qh >> 12) & 7)
    delta = np.where((qh & 0x8000) == 0, gguf_quants.IQ1_S.delta, -gguf_quants.IQ1_S.delta)
    index = b[:, 2:34].astype(np.int64) | (((qh[..., None] >> (3 * np.arange(4, dtype=np.uint16))) & 7)
                                           .astype(np.int64) << 8).reshape(-1, 32)
    grid = _table("IQ1_S")[index].reshape(-1, 8, 4, 8)
    return (dl[..., None, None] * (grid + delta[..., None, None])).reshape(*data.shape[:-1], k)


def dequantize_iq1_m(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(-1, 56)
    words = b[:, 48:56].copy().view("<u2")  # [N, 4]
    half = ((words & 0xF000) >> np.array([12, 8, 4, 0], dtype=np.uint16)).astype(np.uint16)
    d = (half[:, 0] | half[:, 1] | half[:, 2] | half[:, 3]).view(np.float16).astype(_F32)[:, None]
    scales = ((words[..., None] >> (3 * np.arange(4, dtype=np.uint16))) & 7).reshape(-1, 16)
    dl = _odd_step(d, scales)  # [N, 16]
    qh = np.stack([b[:, 32:48] & 15, b[:, 32:48] >> 4], axis=-1)  # [N, 16, 2]
    index = b[:, :32].astype(np.int64).reshape(-1, 16, 2) | (qh & 7).astype(np.int64) << 8
    delta = np.where(qh & 8 == 0, gguf_quants.IQ1_M.delta, -gguf_quants.IQ1_M.delta)
    grid = _table("IQ1_M")[index]  # [N, 16, 2, 8]
    return (dl[..., None, None] * (grid + delta[..., None])).reshape(*data.shape[:-1], k)


# ggml_quantize_requires_imatrix's types: without an importance vector they are refused
REQUIRES_IMPORTANCE = frozenset([*(name for name, kind in _KINDS.items() if kind.plain is None), _IQ1_S.name])
# bytes per 256-weight super-block (ggml-common.h's block_iq*)
BLOCK_BYTES = {"iq3_xxs": 98, "iq3_s": 110, "iq2_xxs": 66, "iq2_xs": 74, "iq2_s": 82, "iq1_s": 50, "iq1_m": 56}
QUANTIZERS = {"iq3_xxs": quantize_iq3_xxs, "iq3_s": quantize_iq3_s, "iq2_xxs": quantize_iq2_xxs,
              "iq2_xs": quantize_iq2_xs, "iq2_s": quantize_iq2_s, "iq1_s": quantize_iq1_s, "iq1_m": quantize_iq1_m}
DEQUANTIZERS = {"iq3_xxs": dequantize_iq3_xxs, "iq3_s": dequantize_iq3_s, "iq2_xxs": dequantize_iq2_xxs,
                "iq2_xs": dequantize_iq2_xs, "iq2_s": dequantize_iq2_s, "iq1_s": dequantize_iq1_s,
                "iq1_m": dequantize_iq1_m}
