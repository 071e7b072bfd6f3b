"""llama.cpp's ternary block formats for BitNet-style {-1, 0, +1} weights, 256 per block, one fp16
scale d = max|x| per block:

- TQ2_0: 2 bits per weight, code t + 1 in 0..2; byte 32c + l holds the weights 128c + 32i + l (i = 0..3).
- TQ1_0: 1.6875 bits per weight, five trits per byte as a base-3 number stored as the fixed-point
  fraction ⌈v · 256 / 243⌉; the last 16 weights go four to a byte in qh.

The quantizers repeat ggml's ``quantize_row_tq*_0_ref`` (round half away from zero), so the bytes
equal llama.cpp's (tested against ``ggml_quantize_chunk``). A weight that is already ternary times one
scale per block comes back exactly.
"""
from __future__ import annotations

import numpy as np

from quantkit.gguf.legacy import half_bytes, inverse, round_half_away

BLOCK = 256
_F32 = np.float32


def _trits(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d [blocks, 1] float32, codes t + 1 in 0..2 [blocks, 256]) for rows x [..., K]."""
    x = np.asarray(x, dtype=_F32)
    if x.shape[-1] % BLOCK:
        raise ValueError(f"rows of {x.shape[-1]} values are not whole blocks of {BLOCK}")
    b = x.reshape(-1, BLOCK)
    d = np.abs(b).max(axis=-1, keepdims=True).astype(_F32)
    return d, (round_half_away((b * inverse(d)).astype(_F32)) + 1).astype(np.uint8)


def _base3_bytes(groups: np.ndarray) -> np.ndarray:
    """Trit groups [..., n] (most significant first, n ≤ 5) -> ⌈v · 256 / 243⌉ per group, v padded to 5 trits."""
    value = np.zeros(groups.shape[:-1], dtype=np.uint16)
    for i in range(groups.shape[-1]):
        value = value * 3 + groups[..., i]
    value = value * 3 ** (5 - groups.shape[-1])
    return ((value * 256 + 242) // 243).astype(np.uint8)


def quantize_tq2_0(x: np.ndarray) -> np.ndarray:
    lead = np.shape(x)[:-1]
    d, codes = _trits(x)
    chunks = codes.reshape(-1, 2, 4, 32)  # [blocks, c, i, l]
    qs = np.zeros((codes.shape[0], 2, 32), dtype=np.uint8)
    for i in range(4):
        qs |= chunks[:, :, i] << (2 * i)
    return np.concatenate([qs.reshape(-1, 64), half_bytes(d)], axis=-1).reshape(*lead, -1)


def dequantize_tq2_0(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(-1, 66)
    qs = b[:, :64].reshape(-1, 2, 1, 32)
    codes = (qs >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3  # [blocks, c, i, l]
    d = b[:, 64:66].copy().view("<f2").astype(_F32)
    return ((codes.reshape(-1, BLOCK).astype(_F32) - 1) * d).reshape(*data.shape[:-1], k)


def quantize_tq1_0(x: np.ndarray) -> np.ndarray:
    lead = np.shape(x)[:-1]
    d, codes = _trits(x)
    first = codes[:, :160].reshape(-1, 5, 32).transpose(0, 2, 1)  # byte l: weights l + 32n
    second = codes[:, 160:240].reshape(-1, 5, 16).transpose(0, 2, 1)  # byte l: weights 160 + l + 16n
    tail = codes[:, 240:].reshape(-1, 4, 4).transpose(0, 2, 1)  # qh byte l: weights 240 + l + 4n
    blocks = [_base3_bytes(first), _base3_bytes(second), _base3_bytes(tail), half_bytes(d)]
    return np.concatenate(blocks, axis=-1).reshape(*lead, -1)


def _trits_of(bytes_: np.ndarray, count: int) -> np.ndarray:
    """Inverse of ``_base3_bytes``: [..., bytes] -> trits [..., bytes, count], most significant first."""
    value = bytes_.astype(np.uint16)
    return np.stack([((value * 3 ** n) & 255) * 3 >> 8 for n in range(count)], axis=-1).astype(np.uint8)


def dequantize_tq1_0(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(-1, 54)
    first = _trits_of(b[:, :32], 5).transpose(0, 2, 1).reshape(-1, 160)
    second = _trits_of(b[:, 32:48], 5).transpose(0, 2, 1).reshape(-1, 80)
    tail = _trits_of(b[:, 48:52], 4).transpose(0, 2, 1).reshape(-1, 16)
    d = b[:, 52:54].copy().view("<f2").astype(_F32)
    codes = np.concatenate([first, second, tail], axis=-1).astype(_F32) - 1
    return (codes * d).reshape(*data.shape[:-1], k)
