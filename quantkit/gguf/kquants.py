"""llama.cpp's K-quants: super-blocks of 256 weights whose sub-block scales are themselves quantized.

Q6_K (16 sub-blocks of 16, 6-bit codes, int8 scales, one fp16 scale per super-block) repeats
``quantize_row_q6_K_ref`` and its ``make_qx_quants`` search (formats.md §4.5) in float32, sums in
the C code's order, so the bytes equal llama.cpp's (tested against ``ggml_quantize_chunk``).
"""
from __future__ import annotations

import numpy as np

QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)
_F32 = np.float32


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int (the 1.5·2^23 trick): round half to even in float32."""
    return np.rint(v.astype(_F32)).astype(np.int32)


def _fsum(terms: np.ndarray) -> np.ndarray:
    """Σ over the last axis, one float32 addition at a time from the left (the C loop's order)."""
    total = np.zeros(terms.shape[:-1], dtype=_F32)
    for i in range(terms.shape[-1]):
        total = (total + terms[..., i]).astype(_F32)
    return total


def _codes_and_sums(x: np.ndarray, iscale: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Clamped codes l of x·iscale and the weighted sums Σ w·x·l, Σ w·l·l with w = x² (rmse_type 1)."""
    level = np.clip(_nearest_int((iscale * x).astype(_F32)), -nmax, nmax - 1)
    lf = level.astype(_F32)
    w = (x * x).astype(_F32)
    return level, _fsum(((w * x).astype(_F32) * lf).astype(_F32)), _fsum(((w * lf).astype(_F32) * lf).astype(_F32))


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Scale and codes (0..2·nmax−1) of each row of x [..., n]: the weighted least-squares scale of
    the best of 19 rounding grids around −nmax/max (``make_qx_quants`` with rmse_type 1)."""
    first_largest = np.abs(x).argmax(axis=-1)[..., None]
    signed_max = np.take_along_axis(x, first_largest, axis=-1)[..., 0]
    dead = np.abs(signed_max) < GROUP_MAX_EPS
    safe_max = np.where(dead, _F32(1), signed_max).astype(_F32)

    iscale = (_F32(-nmax) / safe_max).astype(_F32)
    level, sumlx, suml2 = _codes_and_sums(x, iscale[..., None], nmax)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, _F32(1)), _F32(0)).astype(_F32)
    best = (scale * sumlx).astype(_F32)
    for step in range(-9, 10):
        if step == 0:
            continue
        trial_iscale = (-(_F32(nmax) + (_F32(0.1) * _F32(step)).astype(_F32)) / safe_max).astype(_F32)
        trial, sumlx, suml2 = _codes_and_sums(x, trial_iscale[..., None], nmax)
        better = (suml2 > 0) & ((sumlx * sumlx).astype(_F32) > (best * suml2).astype(_F32))
        level = np.where(better[..., None], trial, level)
        scale = np.where(better, sumlx / np.where(suml2 > 0, suml2, _F32(1)), scale).astype(_F32)
        best = np.where(better, (scale * sumlx).astype(_F32), best).astype(_F32)
    scale = np.where(dead, _F32(0), scale).astype(_F32)
    return scale, np.where(dead[..., None], 0, level + nmax)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [..., K] (K a multiple of 256) -> Q6_K bytes [..., K/256 · 210]."""
    x = np.asarray(x, dtype=_F32)
    if x.shape[-1] % QK_K:
        raise ValueError(f"rows of {x.shape[-1]} values are not whole blocks of {QK_K}")
    lead = x.shape[:-1]
    sub = x.reshape(-1, 16, 16)  # [super-blocks, sub-block, value]
    scales, codes = make_qx_quants(sub, 32)

    first_largest = np.abs(scales).argmax(axis=-1)[:, None]
    max_scale = np.take_along_axis(scales, first_largest, axis=-1)[:, 0]
    dead = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = (_F32(-128) / np.where(dead, _F32(1), max_scale)).astype(_F32)
    d16 = np.where(dead, _F32(0), (_F32(1) / iscale).astype(_F32)).astype("<f2")
    int_scales = np.minimum(127, _nearest_int((iscale[:, None] * scales).astype(_F32))).astype(np.int8)
    int_scales = np.where(dead[:, None], 0, int_scales).astype(np.int8)

    d = (d16.astype(_F32)[:, None] * int_scales.astype(_F32)).astype(_F32)  # [blocks, 16]
    requantized = np.clip(_nearest_int((sub / np.where(d == 0, _F32(1), d)[..., None]).astype(_F32)), -32, 31) + 32
    codes = np.where((d == 0)[..., None], codes, requantized)  # a zero sub-scale keeps the search's codes
    codes = np.where(dead[:, None, None], 0, codes).astype(np.uint8).reshape(-1, 2, 4, 32)  # [blk, half, quarter, l]

    ql = np.concatenate([codes[:, :, 0] & 15 | (codes[:, :, 2] & 15) << 4,
                         codes[:, :, 1] & 15 | (codes[:, :, 3] & 15) << 4], axis=-1).reshape(-1, 128)
    qh = (codes[:, :, 0] >> 4 | (codes[:, :, 1] >> 4) << 2 | (codes[:, :, 2] >> 4) << 4
          | (codes[:, :, 3] >> 4) << 6).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, int_scales.view(np.uint8), d16.view(np.uint8).reshape(-1, 2)], axis=-1)
    return blocks.reshape(*lead, -1)


def dequantize_q6_k(data: np.ndarray, k: int) -> np.ndarray:
    lead = data.shape[:-1]
    b = data.reshape(-1, 210)
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    scales = b[:, 192:208].view(np.int8).astype(_F32)
    d = b[:, 208:210].copy().view("<f2").astype(_F32)
    quarters = [ql[:, :, :32] & 15, ql[:, :, 32:] & 15, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4]
    codes = np.stack([q | ((qh >> (2 * i)) & 3) << 4 for i, q in enumerate(quarters)], axis=2)  # [blk, 2, 4, 32]
    values = codes.reshape(-1, 16, 16).astype(_F32) - 32
    return (values * (d * scales)[..., None]).reshape(*lead, k)
