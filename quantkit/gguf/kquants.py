"""llama.cpp's K-quants: super-blocks of 256 weights whose sub-block scales are themselves quantized.

- Q6_K: 16 sub-blocks of 16, 6-bit codes, int8 scales, one fp16 scale (``make_qx_quants``).
- Q4_K / Q5_K: 8 sub-blocks of 32, 4/5-bit codes with a minimum, 6-bit scales and mins packed in
  12 bytes, fp16 ``d`` and ``dmin`` (``make_qkx2_quants``, weights av|x| + |x|).
- Q3_K: 16 sub-blocks of 16, 3-bit signed codes (two low bits in ``qs``, the third in ``hmask``),
  6-bit signed scales packed in 12 bytes, one fp16 ``d`` (``make_q3_quants``).
- Q2_K: 16 sub-blocks of 16, 2-bit codes with a minimum, one byte per sub-block holding a 4-bit
  scale and a 4-bit min, fp16 ``d`` and ``dmin`` (``make_qkx2_quants``, weights |x|, absolute error).

Each repeats ggml's ``quantize_row_*_ref`` (docs/formats.md, "GGUF blocks") in float32 with sums in the C code's
order, so the bytes equal llama.cpp's (tested against ``ggml_quantize_chunk``). Given an importance
vector (llama.cpp's imatrix row) they repeat ``quantize_row_*_impl`` instead, ggml's weighted search
(docs/gguf.md, "Importance weights").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from quantkit.gguf.codec import Codec

QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)
_F32 = np.float32


def _whole_blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=_F32)
    if x.shape[-1] % QK_K:
        raise ValueError(f"rows of {x.shape[-1]} values are not whole blocks of {QK_K}")
    return x


def importance_vector(importance: np.ndarray, k: int) -> np.ndarray:
    """An importance vector (one float per input channel, llama.cpp's imatrix row) as float32 [k]."""
    importance = np.asarray(importance, dtype=_F32)
    if importance.shape != (k,):
        raise ValueError(f"importance has shape {importance.shape}; rows of {k} values need ({k},)")
    return importance


def importance_like(importance: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The importance vector broadcast to x [..., K]."""
    return np.broadcast_to(importance_vector(importance, x.shape[-1]), x.shape)


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: adding 1.5·2^23 in float32 leaves v rounded half to even in the low mantissa
    bits. Below 2^22 in magnitude that is rint; done ggml's way so that beyond it (ggml's range assert
    is compiled out) and for inf or NaN the result is ggml's wrapped value, not a cast's."""
    shifted = (np.asarray(v, dtype=_F32) + _F32(12582912)).astype(_F32)
    return (shifted.view(np.int32) & 0x7FFFFF) - 0x400000


def ordered_sum(terms: np.ndarray) -> np.ndarray:
    """Σ over the last axis, one float32 addition at a time from the left (the C loop's order)."""
    total = np.zeros(terms.shape[:-1], dtype=_F32)
    for i in range(terms.shape[-1]):
        total = (total + terms[..., i]).astype(_F32)
    return total


def _codes_and_sums(x: np.ndarray, iscale: np.ndarray, nmax: int, w: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Clamped codes l of x·iscale and the weighted sums Σ w·x·l, Σ w·l·l."""
    level = np.clip(_nearest_int((iscale * x).astype(_F32)), -nmax, nmax - 1)
    lf = level.astype(_F32)
    return (level, ordered_sum(((w * x).astype(_F32) * lf).astype(_F32)),
            ordered_sum(((w * lf).astype(_F32) * lf).astype(_F32)))


def _signed_largest(x: np.ndarray) -> np.ndarray:
    """The first value of largest magnitude in each row of x [..., n], with its sign."""
    first_largest = np.abs(x).argmax(axis=-1)[..., None]
    return np.take_along_axis(x, first_largest, axis=-1)[..., 0]


def _improve_levels(x: np.ndarray, weights: np.ndarray, levels: np.ndarray, sumlx: np.ndarray, suml2: np.ndarray,
                    nmax: int, signed: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Up to five passes over each row of x [..., n] that move one code at a time to round(x·Σwl²/Σwxl),
    the best level for that value given the others, while the move raises (Σwxl)²/Σwl² (the error the
    least-squares scale removes). Returns (levels, Σwxl, Σwl²).

    ``signed`` (``make_q3_quants``): levels in −nmax..nmax−1, a move needs Σwxl > 0 without the value
    and Σwl² > 0 with the new one. Else (``make_qp_quants``): levels ≤ nmax held as uint8 as in ggml
    (a negative one wraps, and the comparisons see the wrapped value where ggml's do), and a move needs
    Σwxl and Σwl² both positive without the value."""
    wx = (weights * x).astype(_F32)
    # A pass that changes nothing leaves the state as it was, so the next one changes nothing too:
    # running all five passes equals ggml's early exit.
    for _ in range(5):
        for i in range(x.shape[-1]):
            w, li = weights[..., i], levels[..., i].astype(_F32)
            slx = (sumlx - (wx[..., i] * li).astype(_F32)).astype(_F32)
            sl2 = (suml2 - ((w * li).astype(_F32) * li).astype(_F32)).astype(_F32)
            movable = slx > 0 if signed else (slx > 0) & (sl2 > 0)
            ratio = ((x[..., i] * sl2).astype(_F32) / np.where(movable, slx, _F32(1))).astype(_F32)
            new = _nearest_int(np.where(movable, ratio, _F32(0)))
            new = np.clip(new, -nmax, nmax - 1) if signed else np.minimum(nmax, new)
            nf = new.astype(_F32)
            slx = (slx + (wx[..., i] * nf).astype(_F32)).astype(_F32)
            sl2 = (sl2 + ((w * nf).astype(_F32) * nf).astype(_F32)).astype(_F32)
            take = movable & (new != levels[..., i]) & (
                ((slx * slx).astype(_F32) * suml2).astype(_F32) > ((sumlx * sumlx).astype(_F32) * sl2).astype(_F32))
            if signed:
                take &= sl2 > 0
            levels[..., i] = np.where(take, new if signed else new & 255, levels[..., i])
            sumlx = np.where(take, slx, sumlx).astype(_F32)
            suml2 = np.where(take, sl2, suml2).astype(_F32)
    return levels, sumlx, suml2


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Scale and codes (0..2·nmax−1; all 0 in an all-zero row) of each row of x [..., n]
    (``make_q3_quants`` with rmse): round against −nmax/max, move single codes by
    :func:`_improve_levels` weighted by x², and take the least-squares scale of the final codes."""
    w = (x * x).astype(_F32)
    signed_max = _signed_largest(x)
    dead = np.abs(signed_max) < GROUP_MAX_EPS
    iscale = (_F32(-nmax) / np.where(dead, _F32(1), signed_max)).astype(_F32)
    level, sumlx, suml2 = _codes_and_sums(x, iscale[..., None], nmax, w)
    level, sumlx, suml2 = _improve_levels(x, w, level, sumlx, suml2, nmax, signed=True)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, _F32(1)), _F32(0)).astype(_F32)
    return np.where(dead, _F32(0), scale).astype(_F32), np.where(dead[..., None], 0, level + nmax)


def make_qx_quants(x: np.ndarray, nmax: int, weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Scale and codes (0..2·nmax−1) of each row of x [..., n]: the weighted least-squares scale of
    the best of 19 rounding grids around −nmax/max (``make_qx_quants`` with rmse_type 1: weights x²
    unless the caller gives its own, as the importance-matrix paths do)."""
    w = (x * x).astype(_F32) if weights is None else np.broadcast_to(weights, x.shape).astype(_F32)
    signed_max = _signed_largest(x)
    dead = np.abs(signed_max) < GROUP_MAX_EPS
    safe_max = np.where(dead, _F32(1), signed_max).astype(_F32)

    iscale = (_F32(-nmax) / safe_max).astype(_F32)
    level, sumlx, suml2 = _codes_and_sums(x, iscale[..., None], nmax, w)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, _F32(1)), _F32(0)).astype(_F32)
    best = (scale * sumlx).astype(_F32)
    for step in range(-9, 10):
        if step == 0:
            continue
        trial_iscale = (-(_F32(nmax) + (_F32(0.1) * _F32(step)).astype(_F32)) / safe_max).astype(_F32)
        trial, sumlx, suml2 = _codes_and_sums(x, trial_iscale[..., None], nmax, w)
        better = (suml2 > 0) & ((sumlx * sumlx).astype(_F32) > (best * suml2).astype(_F32))
        level = np.where(better[..., None], trial, level)
        scale = np.where(better, sumlx / np.where(suml2 > 0, suml2, _F32(1)), scale).astype(_F32)
        best = np.where(better, (scale * sumlx).astype(_F32), best).astype(_F32)
    scale = np.where(dead, _F32(0), scale).astype(_F32)
    return scale, np.where(dead[..., None], 0, level + nmax)


def quantize_q6_k(x: np.ndarray, importance: np.ndarray | None = None, row_sigma2: np.ndarray | None = None
                  ) -> np.ndarray:
    """float32 [..., K] (K a multiple of 256) -> Q6_K bytes [..., K/256 · 210]. With ``importance``
    (``quantize_row_q6_K_impl``) each sub-block's scale search weighs x by it instead of by x²; ggml's
    Q6_K has no σ² term, so ``row_sigma2`` is not used."""
    x = _whole_blocks(x)
    lead = x.shape[:-1]
    sub = x.reshape(-1, 16, 16)  # [super-blocks, sub-block, value]
    weights = None if importance is None else importance_like(importance, x).reshape(-1, 16, 16)
    scales, codes = make_qx_quants(sub, 32, weights)

    max_scale = _signed_largest(scales)
    dead = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = (_F32(-128) / np.where(dead, _F32(1), max_scale)).astype(_F32)
    d16 = np.where(dead, _F32(0), (_F32(1) / iscale).astype(_F32)).astype("<f2")
    int_scales = np.minimum(127, _nearest_int((iscale[:, None] * scales).astype(_F32))).astype(np.int8)
    int_scales = np.where(dead[:, None], 0, int_scales).astype(np.int8)

    d = (d16.astype(_F32)[:, None] * int_scales.astype(_F32)).astype(_F32)  # [blocks, 16]
    codes = _requantize(sub, d, codes, -32, 31)
    codes = np.where(dead[:, None, None], 0, codes).astype(np.uint8).reshape(-1, QK_K)
    blocks = np.concatenate([_q6_k_code_bytes(codes), int_scales.view(np.uint8), d16.view(np.uint8).reshape(-1, 2)],
                            axis=-1)
    return blocks.reshape(*lead, -1)


def _q6_k_code_bytes(codes: np.ndarray) -> np.ndarray:
    """Codes [blocks, 256] in 0..63 -> ql[128] (low nibbles) and qh[64] (high 2 bits)."""
    c = codes.reshape(-1, 2, 4, 32)  # [block, half, quarter, l]
    ql = np.concatenate([c[:, :, 0] & 15 | (c[:, :, 2] & 15) << 4,
                         c[:, :, 1] & 15 | (c[:, :, 3] & 15) << 4], axis=-1).reshape(-1, 128)
    qh = (c[:, :, 0] >> 4 | (c[:, :, 1] >> 4) << 2 | (c[:, :, 2] >> 4) << 4 | (c[:, :, 3] >> 4) << 6).reshape(-1, 64)
    return np.concatenate([ql, qh], axis=-1)


def _q6_k_codes(b: np.ndarray) -> np.ndarray:
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    quarters = [ql[:, :, :32] & 15, ql[:, :, 32:] & 15, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4]
    return np.stack([q | ((qh >> (2 * i)) & 3) << 4 for i, q in enumerate(quarters)], axis=2).reshape(-1, QK_K)


def _q6_k_grid(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 16-weight sub-block: scale d·scale₈, offset −32·scale (the solver's view; llama.cpp
    multiplies d·scale₈ by code − 32, which :func:`dequantize_q6_k` repeats exactly)."""
    scale = (b[:, 208:210].copy().view("<f2").astype(_F32) * b[:, 192:208].view(np.int8).astype(_F32)).astype(_F32)
    return scale, (scale * _F32(-32)).astype(_F32)


def _with_q6_k_codes(b: np.ndarray, codes: np.ndarray) -> np.ndarray:
    return np.concatenate([_q6_k_code_bytes(codes), b[:, 192:]], axis=-1)


def dequantize_q6_k(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(-1, 210)
    scales = b[:, 192:208].view(np.int8).astype(_F32)
    d = b[:, 208:210].copy().view("<f2").astype(_F32)
    values = _q6_k_codes(b).reshape(-1, 16, 16).astype(_F32) - 32
    return (values * (d * scales)[..., None]).reshape(*data.shape[:-1], k)


def make_qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float,
                     nstep: int, mad: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scale, −min, codes 0..nmax) of each row of x [..., n]: asymmetric grid whose weighted least-
    squares fit is searched over nstep + 1 rescalings of the range (``make_qkx2_quants``). The
    candidates are compared by weighted squared error, or with ``mad`` (ggml's use_mad, Q2_K's plain
    path) by weighted absolute error; the fit itself stays least squares either way."""
    low = np.minimum(x.min(axis=-1), _F32(0)).astype(_F32)
    high = x.max(axis=-1)
    sum_w = ordered_sum(weights)
    sum_x = ordered_sum(np.concatenate([(weights[..., :1] * x[..., :1]).astype(_F32),
                                  (weights[..., 1:] * x[..., 1:]).astype(_F32)], axis=-1))
    flat = high == low

    def fit(iscale: np.ndarray, minimum: np.ndarray) -> np.ndarray:
        shifted = (x - minimum[..., None]).astype(_F32)
        return np.clip(_nearest_int((iscale[..., None] * shifted).astype(_F32)), 0, nmax)

    def error(scale: np.ndarray, minimum: np.ndarray, codes: np.ndarray) -> np.ndarray:
        fitted = ((scale[..., None] * codes.astype(_F32)).astype(_F32) + minimum[..., None]).astype(_F32)
        diff = (fitted - x).astype(_F32)
        return ordered_sum((weights * (np.abs(diff) if mad else (diff * diff).astype(_F32))).astype(_F32))

    def span(minimum: np.ndarray) -> np.ndarray:
        return np.where(flat, _F32(1), (high - minimum).astype(_F32)).astype(_F32)

    iscale = (_F32(nmax) / span(low)).astype(_F32)
    scale = (_F32(1) / iscale).astype(_F32)
    codes = fit(iscale, low)
    best = error(scale, low, codes)
    minimum = low
    for step in range(nstep + 1):
        # As in ggml, each rescaling is taken from the best fit so far: ``min`` changes as the loop goes.
        shift = ((_F32(rmin) + (_F32(rdelta) * _F32(step)).astype(_F32)).astype(_F32) + _F32(nmax)).astype(_F32)
        trial = fit((shift / span(minimum)).astype(_F32), minimum)
        lf = trial.astype(_F32)
        wl = (weights * lf).astype(_F32)
        sum_l, sum_l2 = ordered_sum(wl), ordered_sum((wl * lf).astype(_F32))
        sum_xl = ordered_sum((wl * x).astype(_F32))
        det = ((sum_w * sum_l2).astype(_F32) - (sum_l * sum_l).astype(_F32)).astype(_F32)
        solvable = det > 0
        safe_det = np.where(solvable, det, _F32(1))
        this_scale = (((sum_w * sum_xl).astype(_F32) - (sum_x * sum_l).astype(_F32)).astype(_F32) / safe_det)
        this_min = (((sum_l2 * sum_x).astype(_F32) - (sum_l * sum_xl).astype(_F32)).astype(_F32) / safe_det)
        positive = this_min > 0
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 != 0, sum_l2, _F32(1)), this_scale).astype(_F32)
        this_min = np.where(positive, _F32(0), this_min).astype(_F32)
        current = error(this_scale, this_min, trial)
        better = solvable & (current < best)
        codes = np.where(better[..., None], trial, codes)
        best = np.where(better, current, best)
        scale = np.where(better, this_scale, scale).astype(_F32)
        minimum = np.where(better, this_min, minimum).astype(_F32)
    scale = np.where(flat, _F32(0), scale).astype(_F32)
    codes = np.where(flat[..., None], 0, codes)
    return scale, (-np.where(flat, low, minimum)).astype(_F32), codes


def make_qp_quants(x: np.ndarray, nmax: int, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale, codes uint8) of each row of non-negative x [..., n] on the grid l·scale, l in 0..nmax
    (``make_qp_quants``): the best of 9 rescalings of nmax/max by weighted squared error, then
    :func:`_improve_levels`. Codes live in uint8 as in ggml, so a negative one wraps, and later sums
    use the wrapped value where ggml's do."""
    top = np.maximum(x.max(axis=-1), _F32(0)).astype(_F32)
    dead = top < GROUP_MAX_EPS
    top = np.where(dead, _F32(1), top).astype(_F32)

    def squared_error(iscale: np.ndarray, levels: np.ndarray) -> np.ndarray:
        diff = (x - ((_F32(1) / iscale).astype(_F32)[..., None] * levels.astype(_F32)).astype(_F32)).astype(_F32)
        return ordered_sum(((weights * diff).astype(_F32) * diff).astype(_F32))

    iscale = (_F32(nmax) / top).astype(_F32)
    best = squared_error(iscale, _nearest_int((iscale[..., None] * x).astype(_F32)) & 255)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        trial = (((_F32(0.1) * _F32(step)).astype(_F32) + _F32(nmax)).astype(_F32) / top).astype(_F32)
        error = squared_error(trial, np.minimum(nmax, _nearest_int((trial[..., None] * x).astype(_F32))))
        better = error < best
        best = np.where(better, error, best).astype(_F32)
        iscale = np.where(better, trial, iscale).astype(_F32)
    level = np.minimum(nmax, _nearest_int((iscale[..., None] * x).astype(_F32)))
    lf = level.astype(_F32)
    sumlx = ordered_sum(((weights * x).astype(_F32) * lf).astype(_F32))
    suml2 = ordered_sum(((weights * lf).astype(_F32) * lf).astype(_F32))
    codes, sumlx, suml2 = _improve_levels(x, weights, (level & 255).astype(np.int32), sumlx, suml2, nmax,
                                          signed=False)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, _F32(1)), _F32(0)).astype(_F32)
    return np.where(dead, _F32(0), scale).astype(_F32), np.where(dead[..., None], 0, codes).astype(np.uint8)


def _pack_scales_mins(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [blocks, 8] -> the 12-byte K-quant layout (docs/formats.md, "GGUF blocks")."""
    packed = np.zeros((ls.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, :4] | (ls[:, 4:] >> 4) << 6
    packed[:, 4:8] = lm[:, :4] | (lm[:, 4:] >> 4) << 6
    packed[:, 8:12] = (ls[:, 4:] & 15) | (lm[:, 4:] & 15) << 4
    return packed


def _unpack_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ls = np.concatenate([packed[:, 0:4] & 63, (packed[:, 8:12] & 15) | (packed[:, 0:4] >> 6) << 4], axis=-1)
    lm = np.concatenate([packed[:, 4:8] & 63, (packed[:, 8:12] >> 4) | (packed[:, 4:8] >> 6) << 4], axis=-1)
    return ls, lm


def _levels_against_largest(values: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """The plain K-quant paths' super-block scale: the largest positive value of each row of values
    [blocks, subs] over ``top``, and each value's level round(top·v/largest) as the uint8 ggml stores
    (unclamped: a negative value wraps, as in ggml). No positive value: scale 0, levels 0."""
    largest = np.maximum(values.max(axis=-1), _F32(0)).astype(_F32)
    inverse = np.where(largest > 0, _F32(top) / np.where(largest > 0, largest, _F32(1)), _F32(0)).astype(_F32)
    levels = _nearest_int((inverse[:, None] * values).astype(_F32)).astype(np.uint8)
    return (largest / _F32(top)).astype(_F32), levels


def _importance_weights(sub: np.ndarray, importance: np.ndarray, sigma_scale: int) -> np.ndarray:
    """The K-quant imatrix paths' weights qw·√(σ² + x²) for super-blocks sub [blocks, subs, n] and
    importance of the same shape: σ² = sigma_scale·Σx²/256 over each super-block (ggml doubles it for
    Q3_K..Q5_K, not for Q2_K), so that small weights in a loud channel still count."""
    sum_x2 = ordered_sum((sub * sub).astype(_F32).reshape(-1, QK_K))
    sigma2 = ((_F32(sigma_scale) * sum_x2).astype(_F32) / _F32(QK_K)).astype(_F32)
    return (importance * np.sqrt((sigma2[:, None, None] + (sub * sub).astype(_F32)).astype(_F32))).astype(_F32)


def _requantize(sub: np.ndarray, d: np.ndarray, codes: np.ndarray, low: int, high: int,
                dm: np.ndarray | None = None) -> np.ndarray:
    """Codes of sub [blocks, subs, n] re-rounded on the stored grid, d [blocks, subs] the fp16-rounded
    sub-block scale and dm its minimum: clamp(round((x + dm)/d), low, high) − low. ggml picks the
    search codes against unrounded scales, so rounding again makes them the nearest on what is
    stored; a sub-block whose stored scale is 0 keeps the search's codes, as in ggml."""
    shifted = sub if dm is None else (sub + dm[..., None]).astype(_F32)
    step = np.where(d == 0, _F32(1), d)[..., None]
    requantized = np.clip(_nearest_int((shifted / step).astype(_F32)), low, high) - low
    return np.where((d == 0)[..., None], codes, requantized)


def _qk_k_scales(sub: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, ...]:
    """``quantize_row_q4_K_ref`` / ``q5_K_ref``'s scale search: weights av|x| + |x| per sub-block, 6-bit
    scales and mins by rounding against the largest. (d, dmin, scales₆, mins₆, search codes)."""
    av_x = np.sqrt((ordered_sum((sub * sub).astype(_F32)) / _F32(32)).astype(_F32)).astype(_F32)
    weights = (av_x[..., None] + np.abs(sub)).astype(_F32)
    scales, mins, codes = make_qkx2_quants(sub, weights, nmax, rmin, 0.1, nstep)
    d, ls = _levels_against_largest(scales, 63)
    dmin, lm = _levels_against_largest(mins, 63)
    return d, dmin, np.minimum(ls, 63), np.minimum(lm, 63), codes


def _qk_k_weighted_scales(sub: np.ndarray, importance: np.ndarray, nmax: int, cap: bool) -> tuple[np.ndarray, ...]:
    """``quantize_row_q4_K_impl`` / ``q5_K_impl`` with quant_weights: weights qw·√(σ² + x²) with
    σ² = 2·Σx²/256 over the super-block, ``make_qkx3_quants`` (which is ``make_qkx2_quants`` with
    its own range steps), then the 6-bit scales and mins fitted by ``make_qp_quants`` weighted by each
    sub-block's total weight. Only Q5_K clamps the 6-bit values to 63 (``cap``)."""
    weights = _importance_weights(sub, importance, 2)
    scales, mins, codes = make_qkx2_quants(sub, weights, nmax, -0.9, 0.05, 36)
    total = ordered_sum(weights)
    d, ls = make_qp_quants(scales, 63, total)
    dmin, lm = make_qp_quants(mins, 63, total)
    if cap:
        ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
    return d, dmin, ls, lm, codes


def _quantize_qk_k(sub: np.ndarray, nmax: int, d: np.ndarray, dmin: np.ndarray, ls: np.ndarray, lm: np.ndarray,
                   codes: np.ndarray) -> tuple[np.ndarray, ...]:
    """Shared Q4_K/Q5_K tail: (d16, dmin16, packed scales, codes [blocks, 256]), the codes re-rounded
    on the stored grid. The 6-bit values are read back from the packed bytes, as ggml's
    ``get_scale_min_k4`` does (it matters only if a value ever exceeded 6 bits)."""
    d16, dmin16 = d.astype("<f2"), dmin.astype("<f2")
    packed = _pack_scales_mins(ls, lm)
    ls, lm = _unpack_scales_mins(packed)
    d = (d16.astype(_F32)[:, None] * ls.astype(_F32)).astype(_F32)
    dm = (dmin16.astype(_F32)[:, None] * lm.astype(_F32)).astype(_F32)
    codes = _requantize(sub, d, codes, 0, nmax, dm).astype(np.uint8).reshape(-1, QK_K)
    return d16, dmin16, packed, codes


def _q4_k_code_bytes(codes: np.ndarray) -> np.ndarray:
    """Codes [blocks, 256] in 0..15 -> qs[128]: each 64-weight chunk's first 32 in the low nibbles."""
    chunks = codes.reshape(-1, 4, 2, 32)  # [block, 64-chunk, half, l]
    return (chunks[:, :, 0] | chunks[:, :, 1] << 4).reshape(-1, 128)


def _q4_k_codes(qs: np.ndarray) -> np.ndarray:
    qs = qs.reshape(-1, 4, 32)
    return np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, QK_K)


def _q5_k_code_bytes(codes: np.ndarray) -> np.ndarray:
    """Codes [blocks, 256] in 0..31 -> qh[32] (fifth bits: bit 2c of chunk c's first half, 2c+1 of its
    second) and qs[128] (the low nibbles, laid out as Q4_K's)."""
    bits = (codes.reshape(-1, 4, 2, 32) >> 4).astype(np.uint8)
    qh = np.zeros((codes.shape[0], 32), dtype=np.uint8)
    for chunk in range(4):
        qh |= bits[:, chunk, 0] << (2 * chunk) | bits[:, chunk, 1] << (2 * chunk + 1)
    return np.concatenate([qh, _q4_k_code_bytes(codes & 15)], axis=-1)


def _q5_k_codes(body: np.ndarray) -> np.ndarray:
    qh = body[:, :32]
    high = np.stack([np.stack([(qh >> (2 * c)) & 1, (qh >> (2 * c + 1)) & 1], axis=1) for c in range(4)], axis=1)
    return _q4_k_codes(body[:, 32:]) | high.reshape(-1, QK_K) << 4


def _qk_k_grid(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-weight sub-block: scale d·scale₆ and offset −dmin·min₆ (both exact in float32)."""
    d = b[:, 0:2].copy().view("<f2").astype(_F32)
    dmin = b[:, 2:4].copy().view("<f2").astype(_F32)
    ls, lm = _unpack_scales_mins(b[:, 4:16])
    return (d * ls).astype(_F32), (-(dmin * lm)).astype(_F32)


def _with_qk_k_codes(b: np.ndarray, codes: np.ndarray, code_bytes) -> np.ndarray:
    return np.concatenate([b[:, :16], code_bytes(codes)], axis=-1)


@dataclass(frozen=True)
class _QKK:
    """What differs between Q4_K and Q5_K: code range, the plain search's range steps, the packing."""

    nmax: int
    rmin: float
    nstep: int
    caps_6bit: bool  # the imatrix path clamps the 6-bit scales to 63 (ggml's Q5_K does, its Q4_K does not)
    code_bytes: Callable[[np.ndarray], np.ndarray]


def _qk_k_blocks(x: np.ndarray, kind: _QKK, importance: np.ndarray | None) -> np.ndarray:
    x = _whole_blocks(x)
    sub = x.reshape(-1, 8, 32)
    if importance is None:
        found = _qk_k_scales(sub, kind.nmax, kind.rmin, kind.nstep)
    else:
        found = _qk_k_weighted_scales(sub, importance_like(importance, x).reshape(-1, 8, 32), kind.nmax,
                                      kind.caps_6bit)
    d16, dmin16, scales, codes = _quantize_qk_k(sub, kind.nmax, *found)
    blocks = np.concatenate([d16.view(np.uint8).reshape(-1, 2), dmin16.view(np.uint8).reshape(-1, 2), scales,
                             kind.code_bytes(codes)], axis=-1)
    return blocks.reshape(*x.shape[:-1], -1)


def quantize_q4_k(x: np.ndarray, importance: np.ndarray | None = None, row_sigma2: np.ndarray | None = None
                  ) -> np.ndarray:
    """float32 [..., K] -> Q4_K bytes [..., K/256 · 144]: d, dmin, scales[12], qs[128]. σ² is the
    super-block's own in ggml, so ``row_sigma2`` is not used."""
    return _qk_k_blocks(x, _Q4_K, importance)


def quantize_q5_k(x: np.ndarray, importance: np.ndarray | None = None, row_sigma2: np.ndarray | None = None
                  ) -> np.ndarray:
    """float32 [..., K] -> Q5_K bytes [..., K/256 · 176]: d, dmin, scales[12], qh[32], qs[128]."""
    return _qk_k_blocks(x, _Q5_K, importance)


def _dequantize_qk_k(data: np.ndarray, k: int, block_bytes: int, codes_of) -> np.ndarray:
    b = data.reshape(-1, block_bytes)
    scale, offset = _qk_k_grid(b)
    values = codes_of(b[:, 16:]).reshape(-1, 8, 32).astype(_F32) * scale[..., None] + offset[..., None]
    return values.reshape(*data.shape[:-1], k)


def dequantize_q4_k(data: np.ndarray, k: int) -> np.ndarray:
    return _dequantize_qk_k(data, k, 144, _q4_k_codes)


def dequantize_q5_k(data: np.ndarray, k: int) -> np.ndarray:
    return _dequantize_qk_k(data, k, 176, _q5_k_codes)


_Q4_K = _QKK(15, -1.0, 20, False, _q4_k_code_bytes)
_Q5_K = _QKK(31, -0.5, 15, True, _q5_k_code_bytes)


def _two_bit_bytes(codes: np.ndarray) -> np.ndarray:
    """Codes [blocks, 256] in 0..3 -> 64 bytes: each 128-weight half's four runs of 32 in bit pairs
    0, 2, 4 and 6 of the half's 32 bytes (Q2_K's qs, and Q3_K's low two bits)."""
    c = codes.reshape(-1, 2, 4, 32).astype(np.uint8)  # [block, half, run, l]
    return (c[:, :, 0] | c[:, :, 1] << 2 | c[:, :, 2] << 4 | c[:, :, 3] << 6).reshape(-1, 64)


def _two_bit_codes(qs: np.ndarray) -> np.ndarray:
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, QK_K)


def _q2_k_blocks(sub: np.ndarray, d: np.ndarray, dmin: np.ndarray, ls: np.ndarray, lm: np.ndarray,
                 codes: np.ndarray) -> np.ndarray:
    """Q2_K blocks from the scale search: each sub-block's byte is scale | min << 4 truncated to 8
    bits as ggml's uint8 store does (a level above 15 spills into the min's nibble there too), and
    the codes are re-rounded on the fp16 d and dmin times the nibbles read back from that byte."""
    packed = ((ls.astype(np.int32) | lm.astype(np.int32) << 4) & 255).astype(np.uint8)
    d16, dmin16 = d.astype("<f2"), dmin.astype("<f2")
    step = (d16.astype(_F32)[:, None] * (packed & 15).astype(_F32)).astype(_F32)
    low = (dmin16.astype(_F32)[:, None] * (packed >> 4).astype(_F32)).astype(_F32)
    codes = _requantize(sub, step, codes, 0, 3, low)
    return np.concatenate([packed, _two_bit_bytes(codes), d16.view(np.uint8).reshape(-1, 2),
                           dmin16.view(np.uint8).reshape(-1, 2)], axis=-1)


def quantize_q2_k(x: np.ndarray, importance: np.ndarray | None = None, row_sigma2: np.ndarray | None = None
                  ) -> np.ndarray:
    """float32 [..., K] -> Q2_K bytes [..., K/256 · 84]: scales[16], qs[64], d, dmin.

    Plain (``quantize_row_q2_K_ref``): each 16-weight sub-block's scale and minimum by
    ``make_qkx2_quants`` with weights |x| compared by absolute error, then both sets as 4-bit levels
    against their largest. With ``importance`` (``quantize_row_q2_K_impl``): weights qw·√(σ² + x²),
    σ² = Σx²/256 of the super-block (not doubled, unlike Q3_K..Q5_K), the finer range steps
    (``make_qkx3_quants``), and the 4-bit levels fitted by ``make_qp_quants`` weighted by each
    sub-block's total weight. σ² is the super-block's own, so ``row_sigma2`` is not used."""
    x = _whole_blocks(x)
    sub = x.reshape(-1, 16, 16)
    if importance is None:
        scales, mins, codes = make_qkx2_quants(sub, np.abs(sub), 3, -0.5, 0.1, 15, mad=True)
        d, ls = _levels_against_largest(scales, 15)
        dmin, lm = _levels_against_largest(mins, 15)
    else:
        weights = _importance_weights(sub, importance_like(importance, x).reshape(sub.shape), 1)
        scales, mins, codes = make_qkx2_quants(sub, weights, 3, -0.9, 0.05, 36)
        total = ordered_sum(weights)
        d, ls = make_qp_quants(scales, 15, total)
        dmin, lm = make_qp_quants(mins, 15, total)
    return _q2_k_blocks(sub, d, dmin, ls, lm, codes).reshape(*x.shape[:-1], -1)


def _q2_k_grid(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 16-weight sub-block: scale d·sc and offset −dmin·m (sc, m the byte's two nibbles; exact
    in float32, so codes · scale + offset is llama.cpp's d·sc·q − dmin·m to the bit)."""
    d = b[:, 80:82].copy().view("<f2").astype(_F32)
    dmin = b[:, 82:84].copy().view("<f2").astype(_F32)
    packed = b[:, :16]
    return (d * (packed & 15).astype(_F32)).astype(_F32), (-(dmin * (packed >> 4).astype(_F32))).astype(_F32)


def _with_q2_k_codes(b: np.ndarray, codes: np.ndarray) -> np.ndarray:
    return np.concatenate([b[:, :16], _two_bit_bytes(codes), b[:, 80:]], axis=-1)


def dequantize_q2_k(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(-1, 84)
    scale, offset = _q2_k_grid(b)
    values = _two_bit_codes(b[:, 16:80]).reshape(-1, 16, 16).astype(_F32) * scale[..., None] + offset[..., None]
    return values.reshape(*data.shape[:-1], k)


def _pack_q3_k_scales(levels: np.ndarray) -> np.ndarray:
    """6-bit levels [blocks, 16] -> 12 bytes: low nibbles of 0..7 and 8..15 in bytes 0..7 (low, high
    nibble), then the top two bits, sub-block j's in byte 8 + j%4 at bit 2·(j//4)."""
    levels = levels.astype(np.uint8)
    top = (levels >> 4).reshape(-1, 4, 4)  # [block, j // 4, j % 4]
    return np.concatenate([(levels[:, :8] & 15) | (levels[:, 8:] & 15) << 4,
                           top[:, 0] | top[:, 1] << 2 | top[:, 2] << 4 | top[:, 3] << 6], axis=-1)


def _unpack_q3_k_scales(packed: np.ndarray) -> np.ndarray:
    low = np.concatenate([packed[:, :8] & 15, packed[:, :8] >> 4], axis=-1)
    top = (packed[:, None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    return low | top.reshape(-1, 16) << 4


def _q3_k_code_bytes(codes: np.ndarray) -> np.ndarray:
    """Codes [blocks, 256] in 0..7 -> hmask[32] (third bits: weight 32·b + m in bit b of byte m) and
    qs[64] (the low two bits, laid out as Q2_K's)."""
    third = (codes.reshape(-1, 8, 32) >> 2).astype(np.uint8)  # [block, b, m]
    hmask = np.zeros((codes.shape[0], 32), dtype=np.uint8)
    for bit in range(8):
        hmask |= third[:, bit] << bit
    return np.concatenate([hmask, _two_bit_bytes(codes & 3)], axis=-1)


def _q3_k_codes(b: np.ndarray) -> np.ndarray:
    third = (b[:, None, :32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return _two_bit_codes(b[:, 32:96]) | third.reshape(-1, QK_K) << 2


def quantize_q3_k(x: np.ndarray, importance: np.ndarray | None = None, row_sigma2: np.ndarray | None = None
                  ) -> np.ndarray:
    """float32 [..., K] -> Q3_K bytes [..., K/256 · 110]: hmask[32], qs[64], scales[12], d.

    Plain (``quantize_row_q3_K_ref``): each 16-weight sub-block's signed scale by ``make_q3_quants``,
    then 6-bit levels against the scale of largest magnitude (d = −largest/32, so that one is level
    0, i.e. −32). With ``importance`` (``quantize_row_q3_K_impl``): weights qw·√(σ² + x²), σ² =
    2·Σx²/256 of the super-block, ``make_qx_quants`` on them, and d and the levels by
    ``make_qx_quants`` again on the 16 scales weighted by each sub-block's total weight. σ² is the
    super-block's own, so ``row_sigma2`` is not used."""
    x = _whole_blocks(x)
    sub = x.reshape(-1, 16, 16)
    if importance is None:
        scales, codes = make_q3_quants(sub, 4)
        largest = _signed_largest(scales)
        live = largest != 0
        iscale = (_F32(-32) / np.where(live, largest, _F32(1))).astype(_F32)
        levels = np.clip(_nearest_int((iscale[:, None] * scales).astype(_F32)), -32, 31) + 32
        levels = np.where(live[:, None], levels, 0)
        d = np.where(live, (_F32(1) / iscale).astype(_F32), _F32(0)).astype(_F32)
    else:
        weights = _importance_weights(sub, importance_like(importance, x).reshape(sub.shape), 2)
        scales, codes = make_qx_quants(sub, 4, weights)
        d, levels = make_qx_quants(scales, 32, ordered_sum(weights))
    d16 = d.astype("<f2")
    step = (d16.astype(_F32)[:, None] * (levels - 32).astype(_F32)).astype(_F32)
    codes = _requantize(sub, step, codes, -4, 3).reshape(-1, QK_K)
    blocks = np.concatenate([_q3_k_code_bytes(codes), _pack_q3_k_scales(levels), d16.view(np.uint8).reshape(-1, 2)],
                            axis=-1)
    return blocks.reshape(*x.shape[:-1], -1)


def _q3_k_grid(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 16-weight sub-block: scale d·(sc − 32), offset −4·scale (llama.cpp computes d·(sc − 32)·(q − 4);
    both are exact in float32). The scale is negative wherever the sub-block's sign is flipped against
    the largest one, and 0 where its level is 32."""
    d = b[:, 108:110].copy().view("<f2").astype(_F32)
    scale = (d * (_unpack_q3_k_scales(b[:, 96:108]).astype(_F32) - _F32(32))).astype(_F32)
    return scale, (scale * _F32(-4)).astype(_F32)


def _with_q3_k_codes(b: np.ndarray, codes: np.ndarray) -> np.ndarray:
    return np.concatenate([_q3_k_code_bytes(codes), b[:, 96:]], axis=-1)


def dequantize_q3_k(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(-1, 110)
    scale, _ = _q3_k_grid(b)
    values = (_q3_k_codes(b).reshape(-1, 16, 16).astype(_F32) - _F32(4)) * scale[..., None]
    return values.reshape(*data.shape[:-1], k)

CODECS = {
    "q4_k": Codec(32, 15, _qk_k_grid, lambda b: _q4_k_codes(b[:, 16:]),
                  lambda b, codes: _with_qk_k_codes(b, codes, _q4_k_code_bytes)),
    "q5_k": Codec(32, 31, _qk_k_grid, lambda b: _q5_k_codes(b[:, 16:]),
                  lambda b, codes: _with_qk_k_codes(b, codes, _q5_k_code_bytes)),
    "q6_k": Codec(16, 63, _q6_k_grid, _q6_k_codes, _with_q6_k_codes),
    "q3_k": Codec(16, 7, _q3_k_grid, _q3_k_codes, _with_q3_k_codes),
    "q2_k": Codec(16, 3, _q2_k_grid, lambda b: _two_bit_codes(b[:, 16:80]), _with_q2_k_codes),
}
