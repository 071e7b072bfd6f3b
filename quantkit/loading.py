"""Load any checkpoint quantkit reads (unquantized, or an artifact it wrote) as a MiniCPM model.

Quantized linears are dequantized into ordinary weights: this is the reference ("what the file
means") that evaluation compares against and that faster runtimes in quantkit.kernels must match.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from quantkit.checkpoint import CheckpointReader
from quantkit.formats import gptq
from quantkit.models import MiniCPMConfig, MiniCPMForCausalLM
from quantkit.models.layers import LINEARS, layer_prefix


def quantization_method(model_dir: str | Path) -> str | None:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return (config.get("quantization_config") or {}).get("quant_method")


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> MiniCPMForCausalLM:
    model_dir = Path(model_dir)
    reader = CheckpointReader(model_dir)
    config = MiniCPMConfig.from_pretrained(model_dir)
    method = quantization_method(model_dir)
    if method not in (None, "gptq"):
        raise ValueError(f"{model_dir}: quantization method '{method}' is not supported yet")
    state = {name: reader.get(name) for name in reader.names}
    if method == "gptq":
        qconfig, _ = gptq.parse_quantization_config(config.quantization_config)
        for index in range(config.num_hidden_layers):
            for linear in LINEARS:
                prefix = f"{layer_prefix(index)}{linear}"
                qt = gptq.read_gptq_tensors(state, prefix, qconfig)
                for suffix in gptq.TENSOR_NAMES:
                    state.pop(f"{prefix}.{suffix}")
                state[prefix + ".weight"] = qt.dequantize(torch.float32)
        config.quantization_config = None
    model = MiniCPMForCausalLM(config).to(dtype)
    missing = set(model.state_dict()) - set(state)
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"{model_dir}: missing tensors {sorted(missing)[:5]}")
    unexpected = set(state) - set(model.state_dict())
    if unexpected:
        raise ValueError(f"{model_dir}: unexpected tensors {sorted(unexpected)[:5]}")
    model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
