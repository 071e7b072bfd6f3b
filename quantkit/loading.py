"""Load any checkpoint quantkit reads (unquantized, or an artifact it wrote) as a MiniCPM model.

Quantized linears are dequantized into ordinary weights: this is the reference ("what the file
means") that evaluation compares against and that faster runtimes in quantkit.kernels must match.
"""
from __future__ import annotations

from pathlib import Path

import torch

from quantkit.models import MiniCPMForCausalLM
from quantkit.reader import ArtifactReader


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> MiniCPMForCausalLM:
    artifact = ArtifactReader(model_dir)
    state = artifact.other_tensors()
    for index in range(artifact.num_layers):
        state |= artifact.dequantized_layer(index)
    config = artifact.config
    config.quantization_config = None
    model = MiniCPMForCausalLM(config).to(dtype)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(state), set(state) - set(model.state_dict())
    if missing or unexpected:
        raise ValueError(f"{artifact.dir}: missing tensors {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
