"""Load any checkpoint quantkit reads (unquantized, or an artifact it wrote) as a MiniCPM model.

Quantized linears are dequantized into ordinary weights: this is the reference ("what the file
means") that evaluation compares against and that faster runtimes in quantkit.kernels must match.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from quantkit.artifact import MANIFEST_FILE
from quantkit.checkpoint import CheckpointReader
from quantkit.engine import dequantize_layer
from quantkit.formats import FORMATS, Format
from quantkit.models import MiniCPMConfig, MiniCPMForCausalLM

# quant_method of checkpoints other tools wrote -> the format that reads them
_FOREIGN_METHODS = {"gptq": "gptq", "awq": "awq", "quantkit_ternary": "ternary"}


def artifact_format(model_dir: Path, config: MiniCPMConfig) -> Format | None:
    """The format of a quantized checkpoint: from quantkit's manifest, else from its quant_method."""
    manifest = model_dir / MANIFEST_FILE
    if manifest.is_file():
        return FORMATS[json.loads(manifest.read_text())["format"]]
    method = (getattr(config, "quantization_config", None) or {}).get("quant_method")
    if method is None:
        return None
    if method not in _FOREIGN_METHODS:
        raise ValueError(f"{model_dir}: quantization method '{method}' is not supported "
                         f"(readable: {', '.join(_FOREIGN_METHODS)})")
    return FORMATS[_FOREIGN_METHODS[method]]


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> MiniCPMForCausalLM:
    model_dir = Path(model_dir)
    reader = CheckpointReader(model_dir)
    config = MiniCPMConfig.from_pretrained(model_dir)
    fmt = artifact_format(model_dir, config)
    state = {name: reader.get(name) for name in reader.names}
    if fmt is not None:
        qconfig = fmt.parse_config(config.quantization_config)
        for index in range(config.num_hidden_layers):
            layer = dequantize_layer(state, index, config, qconfig, fmt)
            prefix = f"model.layers.{index}."
            state = {n: t for n, t in state.items() if not n.startswith(prefix)} | layer
        config.quantization_config = None
    model = MiniCPMForCausalLM(config).to(dtype)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(state), set(state) - set(model.state_dict())
    if missing or unexpected:
        raise ValueError(f"{model_dir}: missing tensors {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
