"""ggml's own block quantizer, ``ggml_quantize_chunk`` in the libggml that llama-cpp-python ships, as
the exporter's fast path (docs/gguf.md, "Two quantizer implementations").

The NumPy codecs (legacy.py, kquants.py, ternary.py) write the same bytes, 8–15× slower; they are what
runs where llama-cpp-python is not installed, and what the tests hold against ggml. Rows are
independent in ggml (σ² and the scale search are per row, the importance per column), so splitting
them across threads changes no byte.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from quantkit.gguf.kquants import importance_vector

LIBRARY = "libggml-base.so"
# Below this many weights per thread (about 0.3 ms of Q8_0), handing rows to a second thread costs more
# than it saves.
MIN_WEIGHTS_PER_THREAD = 1 << 16


@functools.cache
def load_libggml() -> ctypes.CDLL | None:
    """llama-cpp-python's libggml-base with ``ggml_quantize_chunk`` declared, or None where it is not
    installed or does not load. Found without importing llama_cpp, which would also load libllama."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        lib = ctypes.CDLL(str(Path(spec.submodule_search_locations[0]) / "lib" / LIBRARY))
    except OSError:
        return None
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return lib


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    """One pool per thread count for the whole process: starting threads for every tensor cost 0.4 s of
    the default model's export on a busy 2-core machine (each new thread waits to be scheduled)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="ggml-quantize")


def _row_spans(rows: int, k: int) -> list[tuple[int, int]]:
    """(first row, row count) of near-equal contiguous spans, one per thread torch may use (the
    project's thread setting), fewer for small work."""
    parts = max(1, min(torch.get_num_threads(), rows, rows * k // MIN_WEIGHTS_PER_THREAD))
    bounds = np.linspace(0, rows, parts + 1).astype(int)
    return [(int(a), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:])]


def quantize(lib: ctypes.CDLL, ggml_type: int, block_size: int, x: np.ndarray,
             importance: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """``ggml_quantize_chunk`` of float32 rows x [..., K]: uint8 [..., row bytes] (into ``out`` if given),
    with ``importance`` (float32 [K]) ggml's weighted search where the type has one. Rows are split
    across threads (ctypes releases the GIL for the call)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    k = x.shape[-1]
    # ggml_quantize_chunk aborts the process on a partial block: refuse it as the NumPy codecs do
    if k % block_size:
        raise ValueError(f"rows of {k} values are not whole blocks of {block_size}")
    weights = None if importance is None else np.ascontiguousarray(importance_vector(importance, k))
    rows = x.size // k
    shape = (*x.shape[:-1], lib.ggml_row_size(int(ggml_type), k))
    if out is None:
        out = np.empty(shape, dtype=np.uint8)
    elif out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out must be contiguous uint8 {shape}, not {out.dtype} {out.shape}")

    def run(span: tuple[int, int]) -> int:
        first, count = span
        return lib.ggml_quantize_chunk(int(ggml_type), x.ctypes.data, out.ctypes.data, first * k, count, k,
                                       None if weights is None else weights.ctypes.data)

    spans = _row_spans(rows, k)
    written = sum(_pool(len(spans)).map(run, spans) if len(spans) > 1 else map(run, spans))
    assert written == out.nbytes, (written, out.nbytes)
    return out
