"""Build a MiniCPM model from any checkpoint quantkit reads (unquantized, or an artifact it wrote).

``load_model`` is the reference ("what the file means") that evaluation compares against and that
faster runtimes in quantkit.kernels must match: quantized linears are dequantized into ordinary
weights. The runtime builds its own model around quantized linears (``quantkit.kernels.load``); both
fill theirs with ``load_weights``, so which tensors a model needs, what is missing and how the LM head
is tied are decided once.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import Tensor, nn

from quantkit.checkpoint import CheckpointError
from quantkit.models.layers import layer_prefix
from quantkit.reader import ArtifactReader

if TYPE_CHECKING:
    from quantkit.models.minicpm import MiniCPMForCausalLM

# A MiniCPM module tree: the transformers model, or the runtime's skeleton (quantkit.models.decoder)
Model = TypeVar("Model", bound=nn.Module)


def _first(names: list[str]) -> str:
    return f"{names[:5]}{' ...' if len(names) > 5 else ''}"


def load_weights(model: Model, tensors: Mapping[str, Tensor], source: Path,
                 cast: Callable[[Tensor], Tensor] | None = None, strict: bool = False) -> Model:
    """Fill ``model`` from ``tensors`` (name -> tensor, as ``ArtifactReader`` gives them, each ``cast`` if
    given) and return it in eval mode. The model takes every state-dict entry, or, when it is a skeleton
    on the meta device, the entries still there (quantized linears put in place are not); a tied LM head
    is not read but tied to the embedding. Tensors the model takes that ``tensors`` lack are an error
    naming ``source``; with ``strict``, so are tensors the model has no place for."""
    state = model.state_dict()
    skeleton = any(tensor.is_meta for tensor in state.values())
    wanted = {name for name, tensor in state.items() if tensor.is_meta or not skeleton}
    if model.config.tie_word_embeddings:
        wanted.discard("lm_head.weight")
    missing = sorted(wanted - set(tensors))
    unexpected = sorted(set(tensors) - set(state)) if strict else []
    if missing or unexpected:
        raise CheckpointError(f"{source}: missing tensors {_first(missing)}"
                              + (f", unexpected {_first(unexpected)}" if strict else ""))
    model.load_state_dict({name: tensors[name] if cast is None else cast(tensors[name]) for name in sorted(wanted)},
                          strict=False, assign=skeleton)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> MiniCPMForCausalLM:
    """The model the artifact means: its quantized linears dequantized, and, where its format quantizes
    activations too (W8A8), each quantized linear's input quantized as the serving kernel does."""
    from quantkit.models.minicpm import MiniCPMForCausalLM

    artifact = ArtifactReader(model_dir)
    tensors = artifact.dequantized_tensors()
    model = MiniCPMForCausalLM(artifact.model_config()).to(dtype)
    load_weights(model, tensors, artifact.dir, strict=True)
    quantize_activations(model, artifact)
    quantize_kv_cache(model, artifact)
    return model


def quantize_activations(model: torch.nn.Module, artifact: ArtifactReader) -> None:
    """Where the artifact's format quantizes activations too (W8A8), make each quantized linear of ``model``
    quantize its input as the serving kernel does (``activation_quant``), on a static scheme with the
    linear's stored ``input_scale``."""
    grid = artifact.format.activation_grid(artifact.qconfig) if artifact.format is not None else None
    if grid is None:
        return
    for index in range(artifact.num_layers):
        for linear in artifact.shapes:
            name = f"{layer_prefix(index)}{linear}"
            scale = None if grid.dynamic else input_scale(artifact, name)
            model.get_submodule(name).register_forward_pre_hook(
                lambda _, inputs, scale=scale: (grid.fake_quantize(inputs[0], scale),))


def quantize_kv_cache(model: torch.nn.Module, artifact: ArtifactReader) -> None:
    """Where the artifact states a quantized KV cache, make each attention of ``model`` attend to its keys
    (after RoPE) and values as the server stores them: on the cache's grid under the layer's stored
    ``k_scale`` and ``v_scale``."""
    grid = artifact.format.kv_cache_grid(artifact.qconfig) if artifact.format is not None else None
    if grid is None:
        return
    for index in range(artifact.num_layers):
        attention = model.get_submodule(f"{layer_prefix(index)}self_attn")
        scales = [_stored_scale(artifact, f"{layer_prefix(index)}self_attn.{name}", "a quantized KV cache")
                  for name in ("k_scale", "v_scale")]

        def stored(query, key, value, *rest, core=attention.core, scales=scales):
            return core(query, grid.fake_quantize(key, scales[0]), grid.fake_quantize(value, scales[1]), *rest)

        attention.core = stored


def input_scale(artifact: ArtifactReader, linear: str) -> torch.Tensor:
    """A static activation scheme's stored scale of ``linear`` (float32 [1]), checked."""
    return _stored_scale(artifact, f"{linear}.input_scale", "a static activation scheme")


def _stored_scale(artifact: ArtifactReader, name: str, needed_by: str) -> torch.Tensor:
    if name not in artifact.tensors.names:
        raise CheckpointError(f"{artifact.dir}: {name} is missing, which {needed_by} needs")
    scale = artifact.tensors.get(name)
    if scale.numel() != 1 or not scale.dtype.is_floating_point or not (torch.isfinite(scale).all() and scale > 0):
        raise CheckpointError(f"{artifact.dir}: {name} must be one positive finite float, got {scale.dtype} "
                              f"{list(scale.shape)}")
    return scale.float().reshape(1)
