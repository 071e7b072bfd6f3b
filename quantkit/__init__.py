"""quantkit: quantization toolkit for MiniCPM4.1-8B. Importing it registers MiniCPM with transformers.

The Python API is four verbs, each what a command runs (``model`` is a directory or a built-in name
such as "default"; recipes are built-in names or YAML files)::

    report = quantkit.quantize("default", "gptq-w4g128", "out/gptq", quant={"bits": 3})
    model = quantkit.load("out/gptq")                   # a transformers model, weights dequantized
    quantkit.export_gguf("out/gptq", "out/gptq.gguf", "q4_0")
    scores = quantkit.evaluate("out/gptq", ref="default")  # perplexity, KL, top-1 on held-out text

The registration (``quantkit.models.auto``) happens at once for the Auto classes transformers has already
imported, and for the others the moment they are: it needs transformers and torch, which take seconds
to import, and what never touches them (``quantkit --help``) should not wait for them.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

from quantkit.version import __version__  # noqa: F401


def _flatten(settings: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in settings.items():
        flat.update(_flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def quantize(model, recipe, out, *, resume: bool = False, progress: bool = True, **overrides):
    """Quantize ``model`` with ``recipe`` into the artifact directory ``out``; ``overrides`` are recipe
    settings, nested as dicts (``format="gptq-v2"``, ``quant={"bits": 3}``). Returns the run report."""
    from pathlib import Path

    from quantkit.engine import quantize as run
    from quantkit.recipe import load_recipe
    from quantkit.zoo import resolve_model

    return run(resolve_model(model, progress=progress), load_recipe(str(recipe), _flatten(overrides)), Path(out),
               resume=resume, progress=progress)


def load(model, dtype=None):
    """``model`` (a checkpoint, or any artifact quantkit reads) as a MiniCPM transformers model with its
    quantized linears dequantized (float32 unless ``dtype`` is given): what the files mean."""
    import torch

    from quantkit.loading import load_model
    from quantkit.zoo import resolve_model

    return load_model(resolve_model(model), dtype or torch.float32)


def export_gguf(model, out, file_type: str = "q4_k_m", *, progress: bool = True):
    """Write ``model`` (a checkpoint or artifact) as a GGUF file of ``file_type`` for llama.cpp."""
    from quantkit.gguf.export import export_gguf as export
    from quantkit.zoo import resolve_model

    return export(resolve_model(model), out, file_type, progress=progress)


def evaluate(model, ref="default", *, data: str = "austen", max_tokens: int = 8192, window: int = 2048,
             progress: bool = False) -> dict:
    """Perplexity of ``model`` and its KL divergence and top-1 agreement against ``ref`` on held-out text."""
    from dataclasses import asdict

    from quantkit import calib
    from quantkit.eval.kld import kl_divergence
    from quantkit.loading import load_model
    from quantkit.tokenizer import load_tokenizer
    from quantkit.zoo import resolve_model

    model_dir, ref_dir = resolve_model(model), resolve_model(ref)
    tokens = calib.heldout_tokens(load_tokenizer(model_dir), name=data, max_tokens=max_tokens)
    result = kl_divergence(load_model(model_dir), load_model(ref_dir), tokens, window, progress=progress)
    return {"model": str(model_dir), "ref": str(ref_dir), "data": data, **asdict(result)}


# transformers module -> the function of quantkit.models.auto that registers MiniCPM with the Auto classes
# it defines, once it has been imported: opening a tokenizer must not import the model classes' modeling code.
_REGISTRATIONS = {
    "transformers.models.auto.configuration_auto": "register_config",
    "transformers.models.auto.tokenization_auto": "register_tokenizer",
    "transformers.models.auto.modeling_auto": "register_models",
}


def _register(module_name: str) -> None:
    from quantkit.models import auto

    getattr(auto, _REGISTRATIONS[module_name])()


class _RegisterWithTransformers(importlib.abc.MetaPathFinder):
    """Finds no module itself: when one of ``_REGISTRATIONS``' modules is first imported, the other finders
    find it, and its registration runs as soon as the module has (before the import statement returns)."""

    def __init__(self, pending: set[str]) -> None:
        self._pending = pending
        self._finding = False

    def find_spec(self, name, path=None, target=None):
        if name not in self._pending or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register(name)

        spec.loader.exec_module = exec_module
        self._pending.discard(name)
        if not self._pending:
            sys.meta_path.remove(self)  # the import system stops at the spec returned: safe mid-iteration
        return spec


# A source checkout's kernels/ folder is installed as quantkit.kernels, but wherever the checkout's root is on
# sys.path (``python -m`` run there puts the working directory first, as the Makefile's tests and benchmarks
# are run) it would also be found as the top-level package ``kernels``, hiding the Hugging Face package of that
# name which transformers imports when it is installed (transformers >= 5.25 requires it).
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


class _InstalledKernels(importlib.abc.MetaPathFinder):
    """Finds the top-level ``kernels`` on sys.path without the checkout's root (None if it is only there)."""

    def find_spec(self, name, path=None, target=None):
        if name != "kernels":
            return None
        elsewhere = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != _CHECKOUT]
        return importlib.machinery.PathFinder.find_spec(name, elsewhere)


def _install() -> None:
    if os.path.isdir(os.path.join(_CHECKOUT, "kernels")) and not any(
            type(finder).__name__ == "_InstalledKernels" for finder in sys.meta_path):
        sys.meta_path.insert(0, _InstalledKernels())
    if any(type(finder).__name__ == "_RegisterWithTransformers" for finder in sys.meta_path):
        return
    pending = set()
    for module_name in _REGISTRATIONS:
        if module_name in sys.modules:
            _register(module_name)
        else:
            pending.add(module_name)
    if pending:
        sys.meta_path.insert(0, _RegisterWithTransformers(pending))


_install()
