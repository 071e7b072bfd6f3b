"""llama.cpp's original block formats, Q8_0, Q5_0, Q5_1, Q4_0 and Q4_1: 32 weights per block, one
fp16 scale (and for the _1 types an fp16 minimum); the 5-bit types keep each code's fifth bit in a
32-bit mask.

Each quantizer repeats the float32 arithmetic of ggml's reference C code
(``quantize_row_*_ref``, formats.md §4.5), so the bytes are identical to llama.cpp's own quantizer.
The tests compare them against ``ggml_quantize_chunk`` from the llama.cpp library that
llama-cpp-python ships. Inputs are float32 arrays [..., K] with K a multiple of 32. Outputs are uint8
arrays [..., K/32 · block bytes].
"""
from __future__ import annotations

import numpy as np

BLOCK = 32
_F32 = np.float32


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=_F32)
    if x.shape[-1] % BLOCK:
        raise ValueError(f"rows of {x.shape[-1]} values are not whole blocks of {BLOCK}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def inverse(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f`` in float32."""
    safe = np.where(d == 0, _F32(1), d)
    return np.where(d == 0, _F32(0), _F32(1) / safe).astype(_F32)


def round_half_away(v: np.ndarray) -> np.ndarray:
    """C's roundf, exactly: in float64, floor(|v| + 0.5) cannot round up the way float32 can."""
    v64 = v.astype(np.float64)
    return np.sign(v64) * np.floor(np.abs(v64) + 0.5)


def half_bytes(values: np.ndarray) -> np.ndarray:
    """float32 [..., n] -> the little-endian fp16 bytes [..., 2n] (round to nearest even, like F16C)."""
    halves = values.astype("<f2")
    return halves.view(np.uint8).reshape(*values.shape[:-1], 2 * values.shape[-1])


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes [..., 32] in 0..15 -> 16 bytes: byte j holds code j (low nibble) and code j + 16 (high)."""
    q = q.astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _flatten(blocks: np.ndarray) -> np.ndarray:
    return blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1])


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """d = max|x| / 127, q = roundf(x · (1/d)) as int8."""
    b = _blocks(x)
    d = (np.abs(b).max(axis=-1, keepdims=True) / _F32(127)).astype(_F32)
    q = round_half_away((b * inverse(d)).astype(_F32)).astype(np.int8)
    return _flatten(np.concatenate([half_bytes(d), q.view(np.uint8)], axis=-1))


def dequantize_q8_0(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(*data.shape[:-1], k // BLOCK, 34)
    d = b[..., :2].copy().view("<f2").astype(_F32)
    return (b[..., 2:].view(np.int8).astype(_F32) * d).reshape(*data.shape[:-1], k)


def _signed_max_codes(b: np.ndarray, half: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 (half 8) and Q5_0 (half 16): d = (the value of largest magnitude) / −half,
    q = min(2·half − 1, trunc(x · (1/d) + half + 0.5))."""
    first_largest = np.abs(b).argmax(axis=-1)[..., None]  # ggml keeps the first on ties
    d = (np.take_along_axis(b, first_largest, axis=-1) / _F32(-half)).astype(_F32)
    shifted = ((b * inverse(d)).astype(_F32) + _F32(half + 0.5)).astype(_F32)
    return d, np.minimum(2 * half - 1, np.trunc(shifted).astype(np.int8)).astype(np.uint8)


def _min_max_codes(b: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 (levels 15) and Q5_1 (31): d = (max − min) / levels, m = min,
    q = min(levels, trunc((x − min) · (1/d) + 0.5))."""
    low = b.min(axis=-1, keepdims=True)
    d = ((b.max(axis=-1, keepdims=True) - low) / _F32(levels)).astype(_F32)
    shifted = (((b - low).astype(_F32) * inverse(d)).astype(_F32) + _F32(0.5)).astype(_F32)
    return d, low, np.minimum(levels, np.trunc(shifted).astype(np.int8)).astype(np.uint8)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    d, q = _signed_max_codes(_blocks(x), 8)
    return _flatten(np.concatenate([half_bytes(d), pack_nibbles(q)], axis=-1))


def dequantize_q4_0(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(*data.shape[:-1], k // BLOCK, 18)
    d = b[..., :2].copy().view("<f2").astype(_F32)
    q = _unpack_nibbles(b[..., 2:]).astype(_F32)
    return ((q - 8) * d).reshape(*data.shape[:-1], k)


def quantize_q4_1(x: np.ndarray) -> np.ndarray:
    d, low, q = _min_max_codes(_blocks(x), 15)
    return _flatten(np.concatenate([half_bytes(d), half_bytes(low), pack_nibbles(q)], axis=-1))


def dequantize_q4_1(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(*data.shape[:-1], k // BLOCK, 20)
    d = b[..., :2].copy().view("<f2").astype(_F32)
    m = b[..., 2:4].copy().view("<f2").astype(_F32)
    q = _unpack_nibbles(b[..., 4:]).astype(_F32)
    return (q * d + m).reshape(*data.shape[:-1], k)


def _five_bit_parts(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes [..., 32] in 0..31 -> (qh: bit 4 of code j at bit j, as 4 little-endian bytes; the nibbles)."""
    high = ((q.astype(np.uint32) >> 4) & 1) << np.arange(32, dtype=np.uint32)
    qh = np.bitwise_or.reduce(high, axis=-1).astype("<u4")[..., None]
    return qh.view(np.uint8), pack_nibbles(q & 15)


def _five_bit_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    mask = qh.copy().view("<u4").astype(np.uint32)  # [..., 1]
    high = ((mask >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _unpack_nibbles(qs) | (high << 4)


def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    d, q = _signed_max_codes(_blocks(x), 16)
    qh, qs = _five_bit_parts(q)
    return _flatten(np.concatenate([half_bytes(d), qh, qs], axis=-1))


def dequantize_q5_0(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(*data.shape[:-1], k // BLOCK, 22)
    d = b[..., :2].copy().view("<f2").astype(_F32)
    q = _five_bit_codes(b[..., 2:6], b[..., 6:]).astype(_F32)
    return ((q - 16) * d).reshape(*data.shape[:-1], k)


def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    d, low, q = _min_max_codes(_blocks(x), 31)
    qh, qs = _five_bit_parts(q)
    return _flatten(np.concatenate([half_bytes(d), half_bytes(low), qh, qs], axis=-1))


def dequantize_q5_1(data: np.ndarray, k: int) -> np.ndarray:
    b = data.reshape(*data.shape[:-1], k // BLOCK, 24)
    d = b[..., :2].copy().view("<f2").astype(_F32)
    m = b[..., 2:4].copy().view("<f2").astype(_F32)
    q = _five_bit_codes(b[..., 4:8], b[..., 8:]).astype(_F32)
    return (q * d + m).reshape(*data.shape[:-1], k)
