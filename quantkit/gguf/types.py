"""The registry of GGUF tensor types quantkit writes: one entry per type, each a quantizer and its
dequantizer, after gguf-py's layout (one small module per type family, bit-exact tests for each).

A quantizer maps float32 [..., K] to the stored bytes, uint8 [..., K / block · bytes per block]; the
dequantizer is what llama.cpp computes from those bytes. Float types are blocks of one value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as GGML

from quantkit.gguf import iquants, kquants, lattice, legacy, native, ternary
from quantkit.gguf.codec import Codec


@dataclass(frozen=True)
class TensorType:
    name: str
    ggml: GGML
    block_size: int  # weights per block
    block_bytes: int
    quantize: Callable[[np.ndarray], np.ndarray]
    dequantize: Callable[[np.ndarray, int], np.ndarray]  # (bytes [..., n], K) -> float32 [..., K]
    codec: Codec | None = None  # the codes' grid, for scalar types GPTQ can solve on
    # ggml's importance-matrix path: (x, importance [K], the rows' σ² or None) -> bytes; None where ggml
    # ignores the imatrix (Q8_0, the ternary and float types)
    quantize_weighted: Callable[[np.ndarray, np.ndarray, np.ndarray | None], np.ndarray] | None = None
    # ggml_quantize_chunk writes this type's bytes as quantize/quantize_with do (tests/test_gguf_types.py),
    # faster: quantize_fast runs it wherever llama-cpp-python's libggml loads
    ggml_quantizes: bool = False
    # llama.cpp quantizes this type only with an importance matrix (ggml_quantize_requires_imatrix; its
    # quantizer asserts, aborting the process): every path here refuses x without one
    requires_importance: bool = False
    # the lattice types whose grid points GPTQ can choose a unit of 8 columns at a time
    lattice: lattice.LatticeCodec | None = None

    @property
    def solvable(self) -> bool:
        """Whether GPTQ can solve on this type (a scalar codec or a lattice one)."""
        return self.codec is not None or self.lattice is not None

    @property
    def codes_are_levels(self) -> bool:
        """Whether the type is a scalar affine grid (weight = code · scale + offset per sub-block), whose
        rounding block reconstruction trains."""
        return self.codec is not None and self.codec.values is None

    @property
    def quantized_by_ggml(self) -> bool:
        """Whether ``quantize_fast`` runs ggml's quantizer here (which makes no temporaries)."""
        return self.ggml_quantizes and native.load_libggml() is not None

    def quantize_fast(self, x: np.ndarray, importance: np.ndarray | None = None,
                      out: np.ndarray | None = None) -> np.ndarray:
        """``quantize_with(x, importance)``'s bytes for whole rows x, by ggml's own quantizer where this
        type has it and the library loads (native.py), else by the NumPy codec; written into ``out``
        (uint8 [..., row bytes]) if given."""
        # checked before ggml is reached; quantize_with's NumPy quantizers refuse it themselves
        if self.requires_importance and importance is None:
            raise lattice.missing_importance(self.name)
        lib = native.load_libggml() if self.ggml_quantizes else None
        if lib is not None:
            return native.quantize(lib, self.ggml, self.block_size, x, importance, out)
        if out is None:
            return self.quantize_with(x, importance)
        out[...] = self.quantize_with(x, importance)
        return out

    def quantize_with(self, x: np.ndarray, importance: np.ndarray | None = None,
                      row_sigma2: np.ndarray | None = None) -> np.ndarray:
        """``ggml_quantize_chunk(type, x, ..., imatrix)``: with ``importance`` (one non-negative float per
        input channel, llama.cpp's imatrix row) the type's weighted scale search, else the plain one.
        ``row_sigma2`` replaces the legacy types' per-row σ² when x holds only part of each row."""
        if importance is None or self.quantize_weighted is None:
            return self.quantize(x)
        return self.quantize_weighted(x, importance, row_sigma2)

    def row_bytes(self, k: int) -> int:
        return k // self.block_size * self.block_bytes

    def fits(self, k: int) -> bool:
        """Whether a row of ``k`` weights is a whole number of blocks."""
        return k % self.block_size == 0


def _as_bytes(values: np.ndarray) -> np.ndarray:
    return values.view(np.uint8).reshape(*values.shape[:-1], values.shape[-1] * values.itemsize)


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16: round to nearest even; NaN stays a (quiet) NaN."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return _as_bytes(np.where(nan, ((bits >> 16) | 64).astype(np.uint16), rounded).astype("<u2"))


def _from_bf16(data: np.ndarray, k: int) -> np.ndarray:
    halves = data.reshape(*data.shape[:-1], k, 2).copy().view("<u2")[..., 0].astype(np.uint32)
    return (halves << 16).view(np.float32)


def _float_type(name: str, ggml: GGML, dtype: str, ggml_quantizes: bool) -> TensorType:
    size = np.dtype(dtype).itemsize
    return TensorType(
        name, ggml, 1, size,
        lambda x: _as_bytes(np.ascontiguousarray(np.asarray(x, dtype=np.float32).astype(dtype))),
        lambda data, k: data.reshape(*data.shape[:-1], k * size).copy().view(dtype).astype(np.float32),
        ggml_quantizes=ggml_quantizes,
    )


TYPES: dict[str, TensorType] = {
    # F32 is a copy either way; ggml's F16 conversion is as fast as NumPy's, its BF16 one ~50x faster
    "f32": _float_type("f32", GGML.F32, "<f4", ggml_quantizes=False),
    "f16": _float_type("f16", GGML.F16, "<f2", ggml_quantizes=True),
    "bf16": TensorType("bf16", GGML.BF16, 1, 2, _to_bf16, _from_bf16, ggml_quantizes=True),
    **{name: TensorType(name, GGML[name.upper()], legacy.BLOCK, layout.block_bytes, legacy.QUANTIZERS[name],
                        lambda data, k, name=name: legacy.dequantize(data, k, name), legacy.CODECS[name],
                        legacy.WEIGHTED_QUANTIZERS.get(name), ggml_quantizes=True)
       for name, layout in legacy.LAYOUTS.items()},
    "q4_k": TensorType("q4_k", GGML.Q4_K, 256, 144, kquants.quantize_q4_k, kquants.dequantize_q4_k,
                       kquants.CODECS["q4_k"], kquants.quantize_q4_k, ggml_quantizes=True),
    "q5_k": TensorType("q5_k", GGML.Q5_K, 256, 176, kquants.quantize_q5_k, kquants.dequantize_q5_k,
                       kquants.CODECS["q5_k"], kquants.quantize_q5_k, ggml_quantizes=True),
    "q6_k": TensorType("q6_k", GGML.Q6_K, 256, 210, kquants.quantize_q6_k, kquants.dequantize_q6_k,
                       kquants.CODECS["q6_k"], kquants.quantize_q6_k, ggml_quantizes=True),
    "q2_k": TensorType("q2_k", GGML.Q2_K, 256, 84, kquants.quantize_q2_k, kquants.dequantize_q2_k,
                       kquants.CODECS["q2_k"], kquants.quantize_q2_k, ggml_quantizes=True),
    "q3_k": TensorType("q3_k", GGML.Q3_K, 256, 110, kquants.quantize_q3_k, kquants.dequantize_q3_k,
                       kquants.CODECS["q3_k"], kquants.quantize_q3_k, ggml_quantizes=True),
    "tq2_0": TensorType("tq2_0", GGML.TQ2_0, 256, 66, ternary.quantize_tq2_0, ternary.dequantize_tq2_0,
                        ggml_quantizes=True),
    "tq1_0": TensorType("tq1_0", GGML.TQ1_0, 256, 54, ternary.quantize_tq1_0, ternary.dequantize_tq1_0,
                        ggml_quantizes=True),
    "iq4_nl": TensorType("iq4_nl", GGML.IQ4_NL, 32, 18, iquants.quantize_iq4_nl, iquants.dequantize_iq4_nl,
                         iquants.CODECS["iq4_nl"], iquants.quantize_iq4_nl, ggml_quantizes=True),
    "iq4_xs": TensorType("iq4_xs", GGML.IQ4_XS, 256, 136, iquants.quantize_iq4_xs, iquants.dequantize_iq4_xs,
                         iquants.CODECS["iq4_xs"], iquants.quantize_iq4_xs, ggml_quantizes=True),
    **{name: TensorType(name, GGML[name.upper()], lattice.QK_K, block_bytes, lattice.QUANTIZERS[name],
                        lattice.DEQUANTIZERS[name], quantize_weighted=lattice.QUANTIZERS[name], ggml_quantizes=True,
                        requires_importance=name in lattice.REQUIRES_IMPORTANCE,
                        lattice=lattice.LATTICE_CODECS.get(name))
       for name, block_bytes in lattice.BLOCK_BYTES.items()},
}
