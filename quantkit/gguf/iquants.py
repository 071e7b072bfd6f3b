"""llama.cpp's 4-bit non-linear types: each code is an index into one fixed codebook of 16 int8 levels,
denser near zero (where most weights are) than a uniform grid, times a scale per 32 weights.

- IQ4_NL: blocks of 32 weights, fp16 d, 16 bytes of nibbles (Q4_0's order); weight = d · level[q].
- IQ4_XS: super-blocks of 256, fp16 d, eight 6-bit sub-block scales (low nibbles in scales_l[4],
  high 2 bits in the uint16 scales_h), 128 bytes of nibbles; weight = d · (scale₆ − 32) · level[q].

Both repeat ggml's ``quantize_row_iq4_nl_impl`` as ``ggml_quantize_chunk`` runs it (ntry 7, for the plain
and the importance-matrix path alike) in float32, with sums in the C code's order, so the bytes equal
llama.cpp's (tested against ``ggml_quantize_chunk``). Each 32-weight sub-block's scale is the weighted
least-squares fit of the best of 16 codebook roundings (weights x², or with an imatrix qw·√(σ² + x²),
σ² = 2·Σx² / the block's size); the codes are then re-rounded against the final scale. IQ4_XS rounds its
eight scales to 6 bits against the largest, which becomes −32.
"""
from __future__ import annotations

import numpy as np

from quantkit.gguf.codec import Codec
from quantkit.gguf.kquants import GROUP_MAX_EPS, QK_K, _nearest_int, importance_like, ordered_sum
from quantkit.gguf.legacy import _unpack_nibbles, half_bytes, pack_nibbles

BLOCK = 32  # weights per IQ4_NL block and per IQ4_XS sub-block: one scale each
# ggml's kvalues_iq4nl: the level each 4-bit code stands for (a format constant)
LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)
NTRY = 7  # the scale search's ±7 trial grids (``quantize_iq4_nl`` / ``quantize_iq4_xs``)
_F32 = np.float32
_CHUNK = 1 << 10  # sub-blocks per slice of the scale search


# The levels are integers, so level ≤ y exactly when level ≤ ⌊y⌋: a table over ⌊y⌋ = −128..113 gives the
# first level above y (1..15, the ends clamped), and both neighbours' values, without a binary search.
_FLOORS = np.arange(-128, int(LEVELS[-1]) + 1)
_UPPER = np.clip(np.searchsorted(LEVELS, _FLOORS, side="right"), 1, len(LEVELS) - 1).astype(np.uint8)
_BELOW, _ABOVE = LEVELS[_UPPER - 1], LEVELS[_UPPER]


def nearest_level(y: np.ndarray) -> np.ndarray:
    """The code whose level is nearest y (float32), as ggml's ``best_index_int8`` finds it: the end code
    beyond either end (NaN: the top one), and between two levels the lower only if it is strictly nearer,
    both distances taken in float32 (so a tie, or a rounding that makes one, goes to the upper level)."""
    y = np.asarray(y, dtype=_F32)
    # fmin first: it maps NaN to the top, where ggml's comparisons (all false) leave it
    at = np.fmax(np.fmin(np.floor(y), LEVELS[-1]), _F32(_FLOORS[0])).astype(np.int32) - _FLOORS[0]
    nearer_below = (y - np.take(_BELOW, at)).astype(_F32) < (np.take(_ABOVE, at) - y).astype(_F32)
    return (np.take(_UPPER, at) - nearer_below).astype(np.uint8)


def _inverse(d: np.ndarray) -> np.ndarray:
    """``d ? 1/d : 0`` in float32."""
    return np.where(d != 0, _F32(1) / np.where(d != 0, d, _F32(1)), _F32(0)).astype(_F32)


def _sums(x: np.ndarray, w: np.ndarray, iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Σ w·q·x and Σ w·q·q over each sub-block, q the levels of the codes nearest iscale·x."""
    q = LEVELS[nearest_level((iscale[..., None] * x).astype(_F32))]
    wq = (w * q).astype(_F32)
    return ordered_sum((wq * x).astype(_F32)), ordered_sum((wq * q).astype(_F32))


def _sub_block_scales(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """:func:`_search` over x, w [n, 32] a slice of sub-blocks at a time: the search's 16 passes then keep
    their temporaries (128 KB each) in cache, which halves its time on a large matrix."""
    return np.concatenate([_search(x[i:i + _CHUNK], w[i:i + _CHUNK]) for i in range(0, max(len(x), 1), _CHUNK)])


def _search(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Each 32-weight sub-block's scale d (x, w [..., 32]): the least-squares fit on the codes nearest
    x/(max/127), then on those of each trial grid x·(−127 + t)/max, t = −7..7, kept where it explains more
    of Σwx² (larger (Σwqx)²/Σwq²); 0 where max|x| < GROUP_MAX_EPS. ``max`` is signed, the first weight
    of largest magnitude: the trials put it on the codebook's longer, negative end."""
    first_largest = np.abs(x).argmax(axis=-1)[..., None]
    signed_max = np.take_along_axis(x, first_largest, axis=-1)[..., 0]
    dead = np.abs(signed_max) < GROUP_MAX_EPS
    safe_max = np.where(dead, _F32(1), signed_max).astype(_F32)

    sumqx, sumq2 = _sums(x, w, _inverse((-safe_max / LEVELS[0]).astype(_F32)))
    d = np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, _F32(1)), _F32(0)).astype(_F32)
    best = (d * sumqx).astype(_F32)
    for step in range(-NTRY, NTRY + 1):
        sumqx, sumq2 = _sums(x, w, (_F32(step + LEVELS[0]) / safe_max).astype(_F32))
        better = (sumq2 > 0) & ((sumqx * sumqx).astype(_F32) > (best * sumq2).astype(_F32))
        d = np.where(better, sumqx / np.where(better, sumq2, _F32(1)), d).astype(_F32)
        best = np.where(better, (d * sumqx).astype(_F32), best).astype(_F32)
    return np.where(dead, _F32(0), d).astype(_F32)


def _weights(blocks: np.ndarray, importance: np.ndarray | None, x: np.ndarray) -> np.ndarray:
    """The scale search's weights for blocks [n, S] (S the block the σ² spans: 32 for IQ4_NL, 256 for
    IQ4_XS): x² without an importance vector, else qw·√(σ² + x²) with σ² = 2·Σx²/S over the block."""
    squares = (blocks * blocks).astype(_F32)
    if importance is None:
        return squares
    sigma2 = (ordered_sum(squares) * _F32(2 / blocks.shape[-1])).astype(_F32)
    qw = importance_like(importance, x).reshape(blocks.shape)
    return (qw * np.sqrt((sigma2[:, None] + squares).astype(_F32))).astype(_F32)


def _rows(x: np.ndarray, block: int) -> np.ndarray:
    x = np.asarray(x, dtype=_F32)
    if x.shape[-1] % block:
        raise ValueError(f"rows of {x.shape[-1]} values are not whole blocks of {block}")
    return x


def _code_bytes(codes: np.ndarray) -> np.ndarray:
    """Codes [n, m·32] -> [n, m·16]: each 32 weights' nibbles as Q4_0 packs them."""
    n, k = codes.shape
    return pack_nibbles(codes.reshape(n, k // BLOCK, BLOCK)).reshape(n, k // 2)


def _codes(qs: np.ndarray) -> np.ndarray:
    n, size = qs.shape
    return _unpack_nibbles(qs.reshape(n, size // (BLOCK // 2), BLOCK // 2)).reshape(n, 2 * size)


def quantize_iq4_nl(x: np.ndarray, importance: np.ndarray | None = None, row_sigma2: np.ndarray | None = None
                    ) -> np.ndarray:
    """float32 [..., K] (K a multiple of 32) -> IQ4_NL bytes [..., K/32 · 18]: d, qs[16]. The codes are
    the nearest to x/d for the unrounded d (ggml rounds d to fp16 only to store it). σ² is the block's
    own, so ``row_sigma2`` is not used."""
    x = _rows(x, BLOCK)
    blocks = x.reshape(-1, BLOCK)
    d = _sub_block_scales(blocks, _weights(blocks, importance, x))
    codes = nearest_level((_inverse(d)[:, None] * blocks).astype(_F32))
    blocks = np.concatenate([half_bytes(d[:, None]), _code_bytes(codes)], axis=-1)
    return blocks.reshape(*x.shape[:-1], x.shape[-1] // BLOCK * 18)


def quantize_iq4_xs(x: np.ndarray, importance: np.ndarray | None = None, row_sigma2: np.ndarray | None = None
                    ) -> np.ndarray:
    """float32 [..., K] (K a multiple of 256) -> IQ4_XS bytes [..., K/256 · 136]: d, scales_h, scales_l[4],
    qs[128]. d = −(the sub-block scale of largest magnitude)/32; each scale becomes
    clamp(round(scale/d), −32, 31) + 32, and the codes are the nearest to x/(d·that) for the unrounded d.
    σ² is the super-block's own, so ``row_sigma2`` is not used."""
    x = _rows(x, QK_K)
    supers = x.reshape(-1, QK_K)
    weights = _weights(supers, importance, x)
    scales = _sub_block_scales(supers.reshape(-1, BLOCK), weights.reshape(-1, BLOCK)).reshape(-1, QK_K // BLOCK)

    first_largest = np.abs(scales).argmax(axis=-1)[:, None]
    max_scale = np.take_along_axis(scales, first_largest, axis=-1)[:, 0]
    max_scale = np.where(max_scale != 0, max_scale, _F32(0))  # ggml starts from +0: never a −0 here
    d = (-max_scale / _F32(32)).astype(_F32)
    ls = np.clip(_nearest_int((_inverse(d)[:, None] * scales).astype(_F32)), -32, 31)
    dl = (d[:, None] * ls.astype(_F32)).astype(_F32)
    codes = nearest_level((_inverse(dl)[..., None] * supers.reshape(-1, QK_K // BLOCK, BLOCK)).astype(_F32))

    ls = (ls + 32).astype(np.uint16)
    scales_h = np.bitwise_or.reduce(ls >> 4 << (2 * np.arange(8, dtype=np.uint16)), axis=-1).astype("<u2")
    scales_l = (ls[:, 0::2] & 15 | (ls[:, 1::2] & 15) << 4).astype(np.uint8)
    blocks = [half_bytes(d[:, None]), scales_h[:, None].view(np.uint8), scales_l, _code_bytes(codes.reshape(-1, QK_K))]
    return np.concatenate(blocks, axis=-1).reshape(*x.shape[:-1], x.shape[-1] // QK_K * 136)


def _half(b: np.ndarray) -> np.ndarray:
    return b[:, 0:2].copy().view("<f2").astype(_F32)


def _iq4_nl_grid(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One sub-block per block: scale d, offset 0."""
    d = _half(b)
    return d, np.zeros_like(d)


def _iq4_xs_grid(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-weight sub-block: scale d·(scale₆ − 32), offset 0. Exact in float32 (11 + 6 significant
    bits), and so is its product with a level (7 more): the solver's weights are llama.cpp's."""
    low = np.stack([b[:, 4:8] & 15, b[:, 4:8] >> 4], axis=-1).reshape(-1, 8)
    high = (b[:, 2:4].copy().view("<u2") >> (2 * np.arange(8, dtype=np.uint16))) & 3
    scale = (_half(b) * ((low | high << 4).astype(_F32) - _F32(32))).astype(_F32)
    return scale, np.zeros_like(scale)


def _dequantize(data: np.ndarray, k: int, block_bytes: int, codec: Codec) -> np.ndarray:
    b = data.reshape(-1, block_bytes)
    scale, _ = codec.grid(b)
    values = codec.level(codec.codes(b)).reshape(*scale.shape, BLOCK) * scale[..., None]
    return values.reshape(*data.shape[:-1], k)


def dequantize_iq4_nl(data: np.ndarray, k: int) -> np.ndarray:
    return _dequantize(data, k, 18, CODECS["iq4_nl"])


def dequantize_iq4_xs(data: np.ndarray, k: int) -> np.ndarray:
    return _dequantize(data, k, 136, CODECS["iq4_xs"])


CODECS = {
    "iq4_nl": Codec(BLOCK, 15, _iq4_nl_grid, lambda b: _codes(b[:, 2:]),
                    lambda b, codes: np.concatenate([b[:, :2], _code_bytes(codes)], axis=-1), LEVELS),
    "iq4_xs": Codec(BLOCK, 15, _iq4_xs_grid, lambda b: _codes(b[:, 8:]),
                    lambda b, codes: np.concatenate([b[:, :8], _code_bytes(codes)], axis=-1), LEVELS),
}
