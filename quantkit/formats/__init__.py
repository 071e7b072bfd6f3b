"""Checkpoint formats: each converts ``QuantizedTensor`` records to tensors and back.

A format is a subclass of ``quantkit.formats.base.Format`` (a constraint check run before
quantization starts, a layer writer, a layer reader that is its exact inverse, the
``quantization_config`` its consumers read and its parser, the names of its tensors, and what else
the rest of quantkit asks of a format: who reads it, the kernel layout of its tensors, whether it
holds a draft head, its own recipe section). Defining the subclass registers it; every module of
this package is imported here, so adding a format is adding one module.
"""
from __future__ import annotations

import importlib
import pkgutil

from quantkit.formats.base import Format, Shapes, registered

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

FORMATS: dict[str, Format] = {fmt.name: fmt for fmt in sorted(registered(), key=lambda fmt: fmt.list_order)}

__all__ = ["FORMATS", "Format", "Shapes"]
