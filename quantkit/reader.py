"""Reading anything quantkit loads: an unquantized MiniCPM checkpoint, an artifact quantkit wrote, a
GPTQ/AWQ/MLX checkpoint another tool wrote, and an EAGLE-3 draft head, FP or quantized.

``ArtifactReader`` knows the directory's format, config and quantization settings, and gives each
decoder layer's stored tensors, its plain (unquantized) tensors and its quantized linears as
``QuantizedTensor`` records. For the two model builders (``quantkit.loading``) it gives every tensor
the model takes: dequantized (the reference) or as stored (the runtime, whose quantized linears
come from the records). ``load_head`` reads a draft head, its quantized linears dequantized. The
engine writes artifacts; everything that reads them (the loader, the runtime, the GGUF exporter,
the conformance check) goes through this module and never imports the engine.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

from quantkit.artifact import MANIFEST_FILE
from quantkit.checkpoint import CheckpointReader, check_files
from quantkit.file_hashes import remembered_sha256s
from quantkit.formats import FORMATS, Format
from quantkit.models import MiniCPMSettings
from quantkit.models.decoder import weight_shapes
from quantkit.models.eagle3 import (
    CONFIG_FILE,
    MIDLAYER,
    WEIGHTS_FILE,
    DraftHeadError,
    Eagle3Config,
    Eagle3Head,
    head_linear_shapes,
)
from quantkit.models.layers import LINEARS, layer_prefix
from quantkit.models.settings import checked_values
from quantkit.quant import QuantConfig, QuantizedTensor

# (quant_method, checkpoint_format) of checkpoints other tools wrote -> the format that reads them
_FOREIGN_METHODS = {key: fmt.name for fmt in FORMATS.values() for key in fmt.reads}


def artifact_format(model_dir: Path, quantization: dict | None) -> Format | None:
    """The format of a quantized checkpoint: from quantkit's manifest, else from its ``quantization``
    settings' quant_method (config.json's ``quantization_config``)."""
    manifest = Path(model_dir) / MANIFEST_FILE
    if manifest.is_file():
        return FORMATS[json.loads(manifest.read_text())["format"]]
    if not quantization:
        return None
    key = (quantization.get("quant_method"), quantization.get("checkpoint_format"))  # mlx-lm writes neither
    if key not in _FOREIGN_METHODS:
        readable = ", ".join(f"{m or 'none (mlx-lm)'}" + (f" with checkpoint_format {f}" if f else "")
                             for m, f in _FOREIGN_METHODS)
        raise ValueError(f"{model_dir}: quantization method '{key[0]}' with checkpoint_format "
                         f"{key[1]!r} is not supported (readable: {readable})")
    return FORMATS[_FOREIGN_METHODS[key]]


def linear_shapes(config: MiniCPMSettings) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each linear of a decoder layer."""
    shapes = weight_shapes(config)
    return {linear: shapes[f"{layer_prefix(0)}{linear}.weight"] for linear in LINEARS}


def layer_records(tensors: dict, index: int, config: MiniCPMSettings, qconfig: QuantConfig,
                  fmt: Format) -> tuple[dict, dict[str, QuantizedTensor]]:
    """Layer ``index``'s unquantized tensors, and its linears' records keyed by weight name."""
    prefix = layer_prefix(index)
    shapes = linear_shapes(config)
    records = fmt.read_layer(tensors, prefix, qconfig, shapes)
    # a linear the checkpoint leaves unquantized (an MLX entry `false`) has no record: its weight stays plain
    unquantized = {f"{prefix}{linear}.weight" for linear in shapes if linear not in records}
    plain = {n: t for n, t in tensors.items() if n.startswith(prefix) and (n in unquantized or not fmt.stores(n))}
    return plain, {f"{prefix}{name}.weight": qt for name, qt in records.items()}


def dequantize_layer(tensors: dict, index: int, config: MiniCPMSettings, qconfig: QuantConfig, fmt: Format) -> dict:
    """Layer ``index``'s tensors with its quantized linears replaced by dequantized weights."""
    plain, records = layer_records(tensors, index, config, qconfig, fmt)
    return plain | {key: qt.dequantize(torch.float32) for key, qt in records.items()}


class _ReadOnAccess(Mapping[str, Tensor]):
    """A checkpoint's tensors by name, each read only when asked for; ``overrides`` (name -> tensor) take
    the place of stored tensors of their name or add to them."""

    def __init__(self, checkpoint: CheckpointReader, overrides: dict[str, Tensor]):
        self._checkpoint, self._overrides = checkpoint, overrides
        self._names = set(checkpoint.names) | set(overrides)

    def __getitem__(self, name: str) -> Tensor:
        if name in self._overrides:
            return self._overrides[name]
        if name not in self._checkpoint:
            raise KeyError(name)
        return self._checkpoint.get(name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor to find out
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._names))

    def __len__(self) -> int:
        return len(self._names)


class ArtifactReader:
    """One checkpoint directory, read layer by layer (never the whole checkpoint at once)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.tensors = CheckpointReader(self.dir)
        # and to their SHA-256: a file changed in place after quantkit wrote it (hashed once a version)
        check_files(self.dir, self.tensors.weight_records(), digests=remembered_sha256s)
        values = checked_values(self.dir / "config.json")
        self.config = MiniCPMSettings.from_values(values)  # what the runtime builds from, without transformers
        self.format = artifact_format(self.dir, values.get("quantization_config"))
        self.quantization_config: dict = dict(values.get("quantization_config") or {}) if self.format else {}
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

    def model_config(self):
        """The transformers config a model of these weights is built from: without ``quantization_config``,
        because the model's linears are plain modules (dequantized), put in place."""
        from quantkit.models.configuration_minicpm import MiniCPMConfig

        config = MiniCPMConfig.from_pretrained(self.dir)
        config.quantization_config = None
        return config

    def dequantized_tensors(self) -> dict[str, Tensor]:
        """Every tensor, the quantized linears as float32 weights: what the reference model loads."""
        tensors = self.other_tensors()
        for index in range(self.num_layers):
            tensors |= self.dequantized_layer(index)
        return tensors

    def stored_tensors(self) -> Mapping[str, Tensor]:
        """Every tensor as stored, read when asked for, except that those outside the layers are as the
        format means them: what the runtime's model loads around its quantized linears."""
        return _ReadOnAccess(self.tensors, self.other_tensors())


def _head_format(names: set[str]) -> str:
    """Which format a quantized head's tensors are in, from their names."""
    if f"{MIDLAYER}self_attn.qkv_proj.qweight" in names:
        return "cpmcu"
    return "gptq" if "fc.qzeros" in names else "marlin"


def read_head_records(directory: str | Path, config: Eagle3Config) -> dict[str, QuantizedTensor]:
    """The record of every quantized linear of the head at ``directory`` (gptq, marlin or cpmcu layout) by
    linear name (``fc``, ``midlayer.self_attn.q_proj``, ...); none for an FP head."""
    quantization_config = json.loads((Path(directory) / CONFIG_FILE).read_text()).get("quantization_config")
    if quantization_config is None:
        return {}
    tensors = _ReadOnAccess(CheckpointReader(directory), {})
    shapes = head_linear_shapes(config)
    fmt = _head_format(set(tensors))
    grid = FORMATS[fmt].parse_config(quantization_config)
    midlayer = FORMATS[fmt].read_layer(tensors, MIDLAYER, grid, {name.removeprefix(MIDLAYER): shape
                                                                   for name, shape in shapes.items()
                                                                   if name.startswith(MIDLAYER)})
    fc = FORMATS[FORMATS[fmt].draft_head_fc].read_layer(tensors, "", grid, {"fc": shapes["fc"]})
    return {**{MIDLAYER + name: record for name, record in midlayer.items()}, **fc}


def load_head(directory: str | Path, target: MiniCPMSettings, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """An EAGLE-3 head in the official layout, FP or quantized (gptq, marlin, cpmcu: its linears
    dequantized), checked against ``target`` before any weight is read."""
    directory = Path(directory)
    config = Eagle3Config.from_pretrained(directory)
    with torch.device("meta"):
        head = Eagle3Head(config, target)
    expected = {name: tuple(tensor.shape) for name, tensor in head.state_dict().items()}
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise DraftHeadError(f"{directory} has no {WEIGHTS_FILE}")
    stored = _ReadOnAccess(CheckpointReader(directory), {})
    linears = {f"{name}.weight": record.dequantize() for name, record in read_head_records(directory, config).items()}
    missing = sorted(set(expected) - set(stored) - set(linears) - {"t2d"})
    if missing:
        raise DraftHeadError(f"{path} lacks {', '.join(missing)}"
                             + (" (d2t maps draft ids to target ids; a head without it cannot be used)"
                                if "d2t" in missing else ""))
    tensors = {**{name: stored[name] for name in expected if name in stored}, **linears}
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise DraftHeadError(f"{path}: {name} has shape {tuple(tensor.shape)}, the config says {expected[name]}")
    if "t2d" not in tensors:  # optional in the official layout: it follows from d2t
        tensors["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
        tensors["t2d"][torch.arange(config.draft_vocab_size) + tensors["d2t"].long()] = True
    tensors = {name: t.long() if name == "d2t" else t if name == "t2d" else t.to(dtype) for name, t in tensors.items()}
    head = Eagle3Head(config, target).to(dtype)
    head.load_state_dict(tensors)
    return head.eval()
