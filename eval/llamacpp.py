"""llama.cpp through llama-cpp-python, as a model the evaluation harness scores like its own.

``LlamaCppModel(path)(input_ids).logits`` runs one window through llama.cpp and returns its logits
as a [1, T, vocab] tensor, so ``quantkit.eval.ppl`` and ``quantkit.eval.kld`` measure GGUF files
with the same windows and float64 arithmetic they use for quantkit's own models.
"""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from quantkit.gguf.imatrix_file import Imatrix

_REPACKING_DISABLED = False


def disable_weight_repacking() -> None:
    """docs/interop.md, "llama.cpp": llama.cpp's CPU weight repacking (AMX/AVX512 layouts) segfaults on quantized
    files on these CPUs; ``Llama()`` has no argument for it, so every model params default loses it.
    Speeds measured this way are llama.cpp without repacking."""
    global _REPACKING_DISABLED
    if _REPACKING_DISABLED:
        return
    import llama_cpp

    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def without_repacking():
        params = default_params()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = without_repacking
    _REPACKING_DISABLED = True


class LlamaCppModel:
    def __init__(self, path: str | Path, n_ctx: int = 2048, threads: int = 2):
        import llama_cpp

        disable_weight_repacking()
        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, logits_all=True,
                                   verbose=False)

    def __call__(self, input_ids: torch.Tensor) -> SimpleNamespace:
        ids = input_ids[0].tolist()
        self.llm.reset()
        self.llm.eval(ids)
        logits = np.array(self.llm.scores[:len(ids)], dtype=np.float32)
        return SimpleNamespace(logits=torch.from_numpy(logits)[None])

    def close(self) -> None:
        self.llm.close()


def llama_quantize(source: str | Path, out: str | Path, file_type: int, threads: int = 2,
                   imatrix: Imatrix | None = None, requantize: bool = False) -> float:
    """llama.cpp's own quantizer (``llama_model_quantize``) from ``source`` into ``out``, with ``imatrix``'s
    entries as ``llama-quantize --imatrix`` passes them (``requantize``: a quantized ``source`` is dequantized
    first, ``--allow-requantize``); wall seconds."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(file_type)
    params.nthread = threads
    params.allow_requantize = requantize
    if imatrix is not None:
        names = sorted(imatrix.sums)
        values = [np.ascontiguousarray(imatrix.importance(name)) for name in names]  # alive through the call
        entries = (llama_cpp.llama_model_imatrix_data * (len(names) + 1))()  # the last one all zero: the end
        for entry, name, value in zip(entries, names, values):
            entry.name, entry.size = name.encode(), len(value)
            entry.data = value.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        params.imatrix = entries
    started = time.perf_counter()
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {source}")
    return time.perf_counter() - started
