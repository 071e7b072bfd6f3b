"""llama.cpp's original block formats, Q8_0, Q5_0, Q5_1, Q4_0 and Q4_1: 32 weights per block, one
fp16 scale (and for the _1 types an fp16 minimum); the 5-bit types keep each code's fifth bit in a
32-bit mask.

Each quantizer repeats the float32 arithmetic of ggml's reference C code
(``quantize_row_*_ref``; layouts in docs/formats.md, "GGUF blocks"), so the bytes are identical to
llama.cpp's own quantizer; ``WEIGHTED_QUANTIZERS`` repeat ggml's importance-matrix path
(``quantize_row_*_impl`` with quant_weights; Q8_0 has none).
The tests compare them against ``ggml_quantize_chunk`` from the llama.cpp library that
llama-cpp-python ships. Inputs are float32 arrays [..., K] with K a multiple of 32. Outputs are uint8
arrays [..., K/32 · block bytes].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from quantkit.gguf.codec import Codec
from quantkit.gguf.kquants import importance_like, make_qkx2_quants, make_qx_quants, ordered_sum

# (x [..., K], importance [K], the rows' σ² or None) -> bytes [..., row bytes]
Quantizer = Callable[[np.ndarray, np.ndarray, "np.ndarray | None"], np.ndarray]

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


def _eight_bit_codes(qs: np.ndarray) -> np.ndarray:
    """Q8_0's int8 values as codes 0..255 (zero point 128), so that every type's codes are unsigned."""
    return (qs.view(np.int8).astype(np.int16) + 128).astype(np.uint8)


def _eight_bit_bytes(codes: np.ndarray) -> np.ndarray:
    return (codes.astype(np.int16) - 128).astype(np.int8).view(np.uint8)


def _five_bit_bytes(codes: np.ndarray) -> np.ndarray:
    return np.concatenate(_five_bit_parts(codes), axis=-1)


def _five_bit_unpacked(body: np.ndarray) -> np.ndarray:
    return _five_bit_codes(body[..., :4], body[..., 4:])


@dataclass(frozen=True)
class Layout:
    """One legacy type's block: fp16 d, then (the _1 types) an fp16 minimum, then the packed codes."""

    block_bytes: int
    bits: int
    zero: int | None  # the symmetric types' zero point; None: the block stores its minimum

    @property
    def header(self) -> int:
        return 2 if self.zero is not None else 4


LAYOUTS = {
    "q8_0": Layout(34, 8, 128),
    "q5_0": Layout(22, 5, 16),
    "q5_1": Layout(24, 5, None),
    "q4_0": Layout(18, 4, 8),
    "q4_1": Layout(20, 4, None),
}
# code bits -> (packed body -> codes [..., 32], codes -> packed body)
_PACKING = {
    4: (_unpack_nibbles, pack_nibbles),
    5: (_five_bit_unpacked, _five_bit_bytes),
    8: (_eight_bit_codes, _eight_bit_bytes),
}


def _half(b: np.ndarray, at: int) -> np.ndarray:
    return b[..., at:at + 2].copy().view("<f2").astype(_F32)


def block_grid(blocks: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(scale, offset) [..., 1] of blocks [..., B]: weight = code · scale + offset."""
    layout = LAYOUTS[type_name]
    d = _half(blocks, 0)
    offset = _half(blocks, 2) if layout.zero is None else (d * _F32(-layout.zero)).astype(_F32)
    return d, offset


def block_codes(blocks: np.ndarray, type_name: str) -> np.ndarray:
    layout = LAYOUTS[type_name]
    return _PACKING[layout.bits][0](blocks[..., layout.header:])


def with_block_codes(blocks: np.ndarray, codes: np.ndarray, type_name: str) -> np.ndarray:
    layout = LAYOUTS[type_name]
    return np.concatenate([blocks[..., :layout.header], _PACKING[layout.bits][1](codes)], axis=-1)


def dequantize(data: np.ndarray, k: int, type_name: str) -> np.ndarray:
    """What llama.cpp computes: code · d + offset is exact in float32 for these types (at most 19
    significant bits), so it equals ggml's ``(q − zero) · d`` and ``q · d + m`` bit for bit."""
    blocks = data.reshape(*data.shape[:-1], k // BLOCK, LAYOUTS[type_name].block_bytes)
    scale, offset = block_grid(blocks, type_name)
    values = (block_codes(blocks, type_name).astype(_F32) * scale).astype(_F32) + offset
    return values.reshape(*data.shape[:-1], k)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """d = max|x| / 127, q = roundf(x · (1/d)) as int8."""
    b = _blocks(x)
    d = (np.abs(b).max(axis=-1, keepdims=True) / _F32(127)).astype(_F32)
    q = round_half_away((b * inverse(d)).astype(_F32)).astype(np.int8)
    return _flatten(np.concatenate([half_bytes(d), q.view(np.uint8)], axis=-1))


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


def quantize_q4_1(x: np.ndarray) -> np.ndarray:
    d, low, q = _min_max_codes(_blocks(x), 15)
    return _flatten(np.concatenate([half_bytes(d), half_bytes(low), pack_nibbles(q)], axis=-1))


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
    return _flatten(np.concatenate([half_bytes(d), _five_bit_bytes(q)], axis=-1))


def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    d, low, q = _min_max_codes(_blocks(x), 31)
    return _flatten(np.concatenate([half_bytes(d), half_bytes(low), _five_bit_bytes(q)], axis=-1))


# ggml's legacy imatrix path (``quantize_row_q4_0_impl`` ... ``q5_1_impl``) weighs each weight by
# qw·√(σ² + x²), σ² = Σx²/K over the whole row: a block's scale then fits the weights whose inputs are
# loud, large weights more than small ones, and σ² keeps small weights from counting for nothing.
def row_sigma2(x: np.ndarray) -> np.ndarray:
    """σ² of each row of x [..., K] as ggml sums it: Σx² in order, divided by K."""
    x = np.asarray(x, dtype=_F32)
    return (ordered_sum((x * x).astype(_F32)) / _F32(x.shape[-1])).astype(_F32)


def _weighted_blocks(x: np.ndarray, importance: np.ndarray, sigma2: np.ndarray | None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(blocks [..., K/32, 32], their weights qw·√(σ² + x²)). ``sigma2`` [...] stands in for the rows'
    own when x is only part of each row (the GPTQ solver quantizes one block at a time)."""
    b = _blocks(x)
    sigma2 = row_sigma2(x) if sigma2 is None else np.asarray(sigma2, dtype=_F32)
    qw = importance_like(importance, np.asarray(x, dtype=_F32)).reshape(b.shape)
    return b, (qw * np.sqrt((sigma2[..., None, None] + (b * b).astype(_F32)).astype(_F32))).astype(_F32)


def _weighted_signed(half: int, code_bytes: Callable[[np.ndarray], np.ndarray]) -> Quantizer:
    """Q4_0 (half 8) and Q5_0 (16) with an imatrix: ``make_qx_quants`` on the weights, whose codes
    (0..2·half − 1, all 0 in an all-zero block) are kept as found, d unrounded until stored."""
    def quantize(x: np.ndarray, importance: np.ndarray, sigma2: np.ndarray | None = None) -> np.ndarray:
        b, weights = _weighted_blocks(x, importance, sigma2)
        d, q = make_qx_quants(b, half, weights)
        return _flatten(np.concatenate([half_bytes(d[..., None]), code_bytes(q)], axis=-1))
    return quantize


def _weighted_min_max(levels: int, code_bytes: Callable[[np.ndarray], np.ndarray]) -> Quantizer:
    """Q4_1 (levels 15) and Q5_1 (31) with an imatrix: ``make_qkx3_quants`` (range steps −0.9 + 0.05·i,
    i = 0..36), storing d and the minimum; codes as found."""
    def quantize(x: np.ndarray, importance: np.ndarray, sigma2: np.ndarray | None = None) -> np.ndarray:
        b, weights = _weighted_blocks(x, importance, sigma2)
        d, negated_min, q = make_qkx2_quants(b, weights, levels, -0.9, 0.05, 36)
        low = (-negated_min).astype(_F32)
        return _flatten(np.concatenate([half_bytes(d[..., None]), half_bytes(low[..., None]), code_bytes(q)],
                                       axis=-1))
    return quantize


QUANTIZERS = {"q8_0": quantize_q8_0, "q5_0": quantize_q5_0, "q5_1": quantize_q5_1, "q4_0": quantize_q4_0,
              "q4_1": quantize_q4_1}
# Q8_0 has no imatrix path: ggml's quantize_q8_0 ignores the weights.
WEIGHTED_QUANTIZERS = {"q5_0": _weighted_signed(16, _five_bit_bytes), "q5_1": _weighted_min_max(31, _five_bit_bytes),
                       "q4_0": _weighted_signed(8, pack_nibbles), "q4_1": _weighted_min_max(15, pack_nibbles)}
CODECS = {
    name: Codec(BLOCK, 2**layout.bits - 1,
                lambda b, name=name: block_grid(b, name),
                lambda b, name=name: block_codes(b, name),
                lambda b, codes, name=name: with_block_codes(b, codes, name))
    for name, layout in LAYOUTS.items()
}
