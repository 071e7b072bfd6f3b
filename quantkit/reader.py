"""Reading any checkpoint directory quantkit opens: an unquantized MiniCPM checkpoint, an artifact
quantkit wrote, or a GPTQ/AWQ checkpoint another tool wrote.

``ArtifactReader`` knows the directory's format, config and quantization settings, and gives each
decoder layer's stored tensors, its plain (unquantized) tensors and its quantized linears as
``QuantizedTensor`` records. The engine writes artifacts; everything that reads them (the loader,
the runtime, the GGUF exporter, the conformance check) goes through this module and never imports
the engine.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from quantkit.artifact import MANIFEST_FILE
from quantkit.checkpoint import CheckpointReader
from quantkit.formats import FORMATS, Format
from quantkit.models import MiniCPMConfig
from quantkit.models.layers import LINEARS, layer_prefix
from quantkit.models.minicpm import weight_shapes
from quantkit.quant import QuantConfig, QuantizedTensor

# (quant_method, checkpoint_format) of checkpoints other tools wrote -> the format that reads them
_FOREIGN_METHODS = {key: fmt.name for fmt in FORMATS.values() for key in fmt.reads}


def artifact_format(model_dir: Path, config: MiniCPMConfig) -> Format | None:
    """The format of a quantized checkpoint: from quantkit's manifest, else from its quant_method."""
    manifest = Path(model_dir) / MANIFEST_FILE
    if manifest.is_file():
        return FORMATS[json.loads(manifest.read_text())["format"]]
    quantization = getattr(config, "quantization_config", None) or {}
    if not quantization:
        return None
    key = (quantization.get("quant_method"), quantization.get("checkpoint_format"))  # mlx-lm writes neither
    if key not in _FOREIGN_METHODS:
        readable = ", ".join(f"{m or 'none (mlx-lm)'}" + (f" with checkpoint_format {f}" if f else "")
                             for m, f in _FOREIGN_METHODS)
        raise ValueError(f"{model_dir}: quantization method '{key[0]}' with checkpoint_format "
                         f"{key[1]!r} is not supported (readable: {readable})")
    return FORMATS[_FOREIGN_METHODS[key]]


def linear_shapes(config: MiniCPMConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each linear of a decoder layer."""
    shapes = weight_shapes(config)
    return {linear: shapes[f"{layer_prefix(0)}{linear}.weight"] for linear in LINEARS}


def layer_records(tensors: dict, index: int, config: MiniCPMConfig, qconfig: QuantConfig,
                  fmt: Format) -> tuple[dict, dict[str, QuantizedTensor]]:
    """Layer ``index``'s unquantized tensors, and its linears' records keyed by weight name."""
    prefix = layer_prefix(index)
    shapes = linear_shapes(config)
    records = fmt.read_layer(tensors, prefix, qconfig, shapes)
    # a linear the checkpoint leaves unquantized (an MLX entry `false`) has no record: its weight stays plain
    unquantized = {f"{prefix}{linear}.weight" for linear in shapes if linear not in records}
    plain = {n: t for n, t in tensors.items() if n.startswith(prefix) and (n in unquantized or not fmt.stores(n))}
    return plain, {f"{prefix}{name}.weight": qt for name, qt in records.items()}


def dequantize_layer(tensors: dict, index: int, config: MiniCPMConfig, qconfig: QuantConfig, fmt: Format) -> dict:
    """Layer ``index``'s tensors with its quantized linears replaced by dequantized weights."""
    plain, records = layer_records(tensors, index, config, qconfig, fmt)
    return plain | {key: qt.dequantize(torch.float32) for key, qt in records.items()}


class ArtifactReader:
    """One checkpoint directory, read layer by layer (never the whole checkpoint at once)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.tensors = CheckpointReader(self.dir)
        self.config = MiniCPMConfig.from_pretrained(self.dir)
        self.format = artifact_format(self.dir, self.config)
        self.quantization_config: dict = dict(self.config.quantization_config or {}) if self.format else {}
        self.qconfig = self.format.parse_config(self.quantization_config) if self.format else None
        self.shapes = linear_shapes(self.config)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def layer_tensors(self, index: int) -> dict[str, Tensor]:
        """The tensors stored under layer ``index``'s prefix, as stored."""
        prefix = layer_prefix(index)
        return {name: self.tensors.get(name) for name in self.tensors.names if name.startswith(prefix)}

    def other_tensors(self) -> dict[str, Tensor]:
        """Everything outside the decoder layers (embedding, final norm, LM head), quantized ones dequantized."""
        tensors = {name: self.tensors.get(name) for name in self.tensors.names if not name.startswith("model.layers.")}
        if self.format is not None and self.format.read_outside is not None:
            return self.format.read_outside(tensors, self.qconfig)
        return tensors

    def layer(self, index: int) -> tuple[dict[str, Tensor], dict[str, QuantizedTensor]]:
        """Layer ``index``'s plain tensors and its quantized linears' records (none if unquantized)."""
        tensors = self.layer_tensors(index)
        if self.format is None:
            return tensors, {}
        return layer_records(tensors, index, self.config, self.qconfig, self.format)

    def dequantized_layer(self, index: int) -> dict[str, Tensor]:
        """Layer ``index`` with every quantized linear replaced by its float32 weight."""
        tensors = self.layer_tensors(index)
        if self.format is None:
            return tensors
        return dequantize_layer(tensors, index, self.config, self.qconfig, self.format)
