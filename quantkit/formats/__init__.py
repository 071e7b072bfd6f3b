"""Checkpoint formats: each converts ``QuantizedTensor`` records to tensors and back.

The registry below is what the engine, the loader and the CLI see: one entry per format, each a
constraint check (run before quantization starts), a layer writer, a layer reader that is its exact
inverse, and the ``quantization_config`` the format's consumers read. Adding a format is a module
plus one entry here.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from quantkit.formats import awq, cpmcu, gguf, gptq, marlin, ternary
from quantkit.gguf.types import TensorType
from quantkit.quant import QuantConfig, QuantizedTensor, default_g_idx

Shapes = Mapping[str, tuple[int, int]]  # linear name -> (out_features, in_features)


@dataclass(frozen=True)
class Format:
    name: str
    summary: str
    check: Callable[[QuantConfig, int, int, bool, str], None]  # (config, K, N, desc_act, linear name)
    write_layer: Callable[[Mapping[str, QuantizedTensor], str], dict[str, Tensor]]  # (records, "model.layers.i.")
    read_layer: Callable[[Mapping[str, Tensor], str, QuantConfig, Shapes], dict[str, QuantizedTensor]]
    quantization_config: Callable[..., dict[str, Any]]
    parse_config: Callable[[Mapping[str, Any]], QuantConfig]  # inverse of quantization_config
    weights_file: str | None = None  # a single weights file the consumer insists on (else sharded + index)
    # (recipe grid, linear name, layer, layers, (N, K)) -> what the algorithm rounds that linear to
    target: Callable[[QuantConfig, str, int, int, tuple[int, int]], QuantConfig | TensorType] = (
        lambda config, linear, layer, layers, shape: config)
    block_types: bool = False  # linears are solved on GGUF block types, not on the recipe's uniform grid


def _gptq_check(config: QuantConfig, k: int, n: int, desc_act: bool, name: str) -> None:
    gptq.check_packable(k, n, config, name)


def _gptq_write(records: Mapping[str, QuantizedTensor], prefix: str) -> dict[str, Tensor]:
    return {key: t for name, qt in records.items() for key, t in gptq.gptq_tensors(qt, prefix + name).items()}


def _gptq_read(tensors: Mapping[str, Tensor], prefix: str, config: QuantConfig, shapes: Shapes):
    return {name: gptq.read_gptq_tensors(tensors, prefix + name, config) for name in shapes}


def _gptq_parse(d: Mapping[str, Any]) -> QuantConfig:
    return gptq.parse_quantization_config(d)[0]


def _awq_check(config: QuantConfig, k: int, n: int, desc_act: bool, name: str) -> None:
    awq.check_awq(config, k, n, desc_act, name)


def _awq_write(records: Mapping[str, QuantizedTensor], prefix: str) -> dict[str, Tensor]:
    return {key: t for name, qt in records.items() for key, t in awq.awq_tensors(qt, prefix + name).items()}


def _awq_read(tensors: Mapping[str, Tensor], prefix: str, config: QuantConfig, shapes: Shapes):
    return {name: awq.read_awq_tensors(tensors, prefix + name, config, k, n) for name, (n, k) in shapes.items()}


def _symmetric_record(codes: Tensor, scales: Tensor, config: QuantConfig) -> QuantizedTensor:
    """Marlin stores neither zero points (always 8) nor g_idx (natural order): restore them."""
    zeros = torch.full_like(scales, marlin.ZERO_POINT, dtype=torch.uint8)
    return QuantizedTensor(codes, scales, zeros, default_g_idx(codes.shape[1], config.group_size), config)


def _marlin_check(config: QuantConfig, k: int, n: int, desc_act: bool, name: str) -> None:
    marlin.check_marlin(config, k, n, desc_act, name=name)


def _marlin_write(records: Mapping[str, QuantizedTensor], prefix: str) -> dict[str, Tensor]:
    return {key: t for name, qt in records.items() for key, t in marlin.marlin_tensors(qt, prefix + name).items()}


def _marlin_read(tensors: Mapping[str, Tensor], prefix: str, config: QuantConfig, shapes: Shapes):
    return {name: _symmetric_record(*marlin.read_marlin_tensors(tensors, prefix + name, k, n, config.group_size),
                                    config)
            for name, (n, k) in shapes.items()}


def _ternary_check(config: QuantConfig, k: int, n: int, desc_act: bool, name: str) -> None:
    ternary.check_ternary(config, k, n, desc_act, name)


def _ternary_write(records: Mapping[str, QuantizedTensor], prefix: str) -> dict[str, Tensor]:
    return {key: t for name, qt in records.items() for key, t in ternary.ternary_tensors(qt, prefix + name).items()}


def _ternary_read(tensors: Mapping[str, Tensor], prefix: str, config: QuantConfig, shapes: Shapes):
    return {name: ternary.read_ternary_tensors(tensors, prefix + name, config, k, n)
            for name, (n, k) in shapes.items()}


def _cpmcu_read(tensors: Mapping[str, Tensor], prefix: str, config: QuantConfig, shapes: Shapes):
    parts = cpmcu.read_cpmcu_layer(tensors, prefix, shapes, config.group_size)
    return {name: _symmetric_record(codes, scales, config) for name, (codes, scales) in parts.items()}


def _gguf_format(file_type: str) -> Format:
    return Format(
        f"gguf-{file_type}", f"GGUF {file_type.upper()} blocks per linear, copied unchanged by `export gguf`",
        gguf.check, gguf.write_layer,
        lambda tensors, prefix, config, shapes: gguf.read_layer(tensors, prefix, shapes),
        partial(gguf.quantization_config, file_type), gguf.parse_config,
        target=lambda config, linear, layer, layers, shape: gguf.target(file_type, linear, layer, layers, shape),
        block_types=True)


FORMATS: dict[str, Format] = {
    "gptq": Format("gptq", "AutoGPTQ/GPTQModel checkpoint_format 'gptq' (vLLM, transformers, GPTQModel)",
                   _gptq_check, _gptq_write, _gptq_read, gptq.quantization_config, _gptq_parse),
    "awq": Format("awq", "AutoAWQ GEMM checkpoint (vLLM awq/awq_marlin, transformers)",
                  _awq_check, _awq_write, _awq_read, awq.quantization_config, awq.parse_quantization_config),
    "marlin": Format("marlin", "Marlin W4A16 tile layout (vLLM gptq_marlin after repack, IST-DASLab kernels)",
                     _marlin_check, _marlin_write, _marlin_read, marlin.quantization_config, _gptq_parse),
    "cpmcu": Format("cpmcu", "CPM.cu model_gptq.safetensors: fused qkv/gate_up Marlin tensors",
                    _marlin_check, cpmcu.cpmcu_layer_tensors, _cpmcu_read, marlin.quantization_config, _gptq_parse,
                    weights_file="model_gptq.safetensors"),
    "ternary": Format("ternary", "BitCPM4 ternary weights as +1/-1 bit planes with per-group scales (quantkit runtime)",
                      _ternary_check, _ternary_write, _ternary_read, ternary.quantization_config,
                      ternary.parse_quantization_config),
}
FORMATS.update({f"gguf-{file_type}": _gguf_format(file_type) for file_type in gguf.FILE_TYPES})
