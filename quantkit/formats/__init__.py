"""Checkpoint formats: each converts ``QuantizedTensor`` records to tensors and back.

Every format module implements the one interface of ``quantkit.formats.base.Format`` (a constraint
check run before quantization starts, a layer writer, a layer reader that is its exact inverse, the
``quantization_config`` its consumers read and its parser, the names of its tensors) and ends with
``FORMATS = (Format(...), ...)``. The registry below is built from the list of modules: adding a
format is one module plus one entry in ``MODULES``.
"""
from __future__ import annotations

from quantkit.formats import awq, cpmcu, gguf, gptq, marlin, mlx, ternary
from quantkit.formats.base import Format, Shapes

MODULES = (gptq, awq, marlin, cpmcu, ternary, gguf, mlx)
FORMATS: dict[str, Format] = {fmt.name: fmt for module in MODULES for fmt in module.FORMATS}

__all__ = ["FORMATS", "Format", "MODULES", "Shapes"]
