"""llama.cpp's own block quantizer (``ggml_quantize_chunk`` in the libggml that llama-cpp-python
ships), as the reference the GGUF block quantizers must match byte for byte."""
from __future__ import annotations

import numpy as np

from quantkit.gguf.native import load_libggml


def _libggml():
    """The library quantkit's fast path loads (only the loading is shared: the call below is this
    oracle's own, one ggml_quantize_chunk over all rows)."""
    lib = load_libggml()
    assert lib is not None, "llama-cpp-python's libggml-base did not load"
    return lib


def ggml_quantize(x: np.ndarray, ggml_type: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """llama.cpp's bytes for float32 rows ``x`` [rows, K]: uint8 [rows, row bytes]. ``imatrix`` is an
    importance vector of K float32 values (what ``llama-quantize --imatrix`` passes per tensor)."""
    lib = _libggml()
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, k = x.shape
    row_bytes = lib.ggml_row_size(int(ggml_type), k)
    out = np.zeros((rows, row_bytes), dtype=np.uint8)
    weights = None
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        assert imatrix.shape == (k,), imatrix.shape
        weights = imatrix.ctypes.data
    written = lib.ggml_quantize_chunk(int(ggml_type), x.ctypes.data, out.ctypes.data, 0, rows, k, weights)
    assert written == out.nbytes
    return out
