"""The one interface every checkpoint format implements (``Format``), and the per-linear shape most
formats have (``per_linear``). A format module ends with ``FORMATS = (Format(...), ...)``; the
registry in ``quantkit.formats`` is built from the list of modules."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from quantkit.quant import QuantConfig, QuantizedTensor

Shapes = Mapping[str, tuple[int, int]]  # linear name -> (out_features, in_features)


def _recipe_grid(config: QuantConfig, linear: str, layer: int, layers: int, shape: tuple[int, int]) -> QuantConfig:
    return config


def _uniform_grid(quant: Mapping[str, Any], model_dtype: torch.dtype) -> QuantConfig:
    return QuantConfig(**quant)


def _same_grid(config: QuantConfig, recipe: Mapping[str, Any], layers: int) -> QuantConfig:
    return config


def _only_config_json(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {"config.json": config}


@dataclass(frozen=True)
class Format:
    name: str
    summary: str
    check: Callable[[QuantConfig, int, int, bool, str], None]  # (config, K, N, desc_act, linear name); raises
    write_layer: Callable[[Mapping[str, QuantizedTensor], str], dict[str, Tensor]]  # (records, "model.layers.i.")
    read_layer: Callable[[Mapping[str, Tensor], str, QuantConfig, Shapes], dict[str, QuantizedTensor]]
    quantization_config: Callable[..., dict[str, Any]]  # (config, desc_act=, static_groups=, damp_percent=, ...)
    parse_config: Callable[[Mapping[str, Any]], QuantConfig]  # inverse of quantization_config
    suffixes: tuple[str, ...]  # names a quantized linear's tensors end with ("qweight", ...), or their prefix
    # (quant_method, checkpoint_format or None) of checkpoints other tools write that this format reads
    reads: tuple[tuple[str, str | None], ...] = ()
    weights_file: str | None = None  # a single weights file the consumer insists on (else sharded + index)
    # (recipe grid, linear name, layer, layers, (N, K)) -> what the algorithm rounds that linear to
    target: Callable[..., Any] = _recipe_grid
    block_types: bool = False  # linears are solved on GGUF block types, not on the recipe's uniform grid
    # (recipe's quant section, the checkpoint's float dtype) -> the grid of the whole run
    grid: Callable[[Mapping[str, Any], torch.dtype], QuantConfig] = _uniform_grid
    # (run grid, recipe values, decoder layers) -> the run grid with every module's own grid, for formats
    # that store modules on different grids (MLX's mixed precision); ``target`` then reads it per linear
    resolve: Callable[[QuantConfig, Mapping[str, Any], int], QuantConfig] = _same_grid
    # the embedding, final norm and LM head as stored, for formats that quantize some of them too:
    # (tensors, grid) -> what is written, and (stored tensors, grid) -> the float tensors they mean
    write_outside: Callable[[Mapping[str, Tensor], QuantConfig], dict[str, Tensor]] | None = None
    read_outside: Callable[[Mapping[str, Tensor], QuantConfig], dict[str, Tensor]] | None = None
    # the full config.json -> every JSON file the consumers read it from ({"config.json": ...} at least)
    config_files: Callable[[dict[str, Any]], dict[str, dict[str, Any]]] = _only_config_json

    def stores(self, tensor_name: str) -> bool:
        """Whether ``tensor_name`` is part of a quantized linear in this format. A dotted suffix
        ("q_proj.weight") matches the name's tail, a plain one its last component, one ending in "_"
        a prefix of that component."""
        suffix = tensor_name.rsplit(".", 1)[-1]
        return any(tensor_name.endswith("." + s) if "." in s
                   else suffix == s or (s.endswith("_") and suffix.startswith(s)) for s in self.suffixes)


def per_linear(write: Callable[[QuantizedTensor, str], dict[str, Tensor]],
               read: Callable[[Mapping[str, Tensor], str, QuantConfig, tuple[int, int]], QuantizedTensor]):
    """(write_layer, read_layer) of a format that stores each linear on its own, from its per-linear
    ``write(record, module name)`` and ``read(tensors, module name, config, (N, K))``."""
    def write_layer(records: Mapping[str, QuantizedTensor], prefix: str) -> dict[str, Tensor]:
        return {key: t for linear, record in records.items() for key, t in write(record, prefix + linear).items()}

    def read_layer(tensors: Mapping[str, Tensor], prefix: str, config: QuantConfig, shapes: Shapes):
        return {linear: read(tensors, prefix + linear, config, shape) for linear, shape in shapes.items()}

    return write_layer, read_layer
