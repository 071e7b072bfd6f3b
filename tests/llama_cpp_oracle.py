"""llama.cpp's own block quantizer (``ggml_quantize_chunk`` in the libggml that llama-cpp-python
ships), as the reference the GGUF block quantizers must match byte for byte."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np


def _libggml():
    import llama_cpp
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
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
