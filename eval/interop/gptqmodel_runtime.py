"""What both GPTQModel scripts need before and after importing it (they run in the interop venv)."""
from __future__ import annotations

import os

# GPTQModel 7.7 gives its "cpu" pool (cores + 1) // 2 workers but always carves a 2-worker
# "model_loader:cpu" pool out of it, so on 2 cores it raises "requests 2 workers but parent 'cpu'
# only has 1" before doing anything. An explicit setting from the caller wins.
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

import gptqmodel  # noqa: E402
from gptqmodel import BACKEND, GPTQConfig, GPTQModel  # noqa: E402
from gptqmodel.nn_modules.qlinear import BaseQuantLinear  # noqa: E402

import quantkit  # noqa: E402,F401  (registers model_type "minicpm" with transformers' Auto classes)

__all__ = ["BACKEND", "DTYPES", "GPTQConfig", "GPTQModel", "BaseQuantLinear", "kernel_names", "versions"]

DTYPES = ("float32", "bfloat16", "float16")


def kernel_names(model) -> list[str]:
    """The quantized-linear classes GPTQModel chose for ``model`` (its backend selection, made visible)."""
    return sorted({type(m).__name__ for m in model.modules() if isinstance(m, BaseQuantLinear)})


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {"gptqmodel": gptqmodel.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__}
