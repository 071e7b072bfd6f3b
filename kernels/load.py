"""Build the runtime's model from a checkpoint directory without ever materialising float weights for
quantized linears: the model skeleton is created on the meta device, quantized linears come from
``quantkit.kernels.linear`` in their stored layout, and only the remaining tensors (embeddings,
norms, lm_head, unquantized linears) are read and cast to the activation dtype.
"""
from __future__ import annotations

from pathlib import Path

import torch

from quantkit.checkpoint import CheckpointReader
from quantkit.models import MiniCPMConfig, MiniCPMForCausalLM
from quantkit.reader import ArtifactReader, artifact_format

LM_HEADS = ("auto", "int8", "float")


def load_runtime_model(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16, linear_backend: str = "cpu",
                       device: str = "cpu", lm_head: str = "auto") -> MiniCPMForCausalLM:
    """``lm_head``: "int8" quantizes the LM head to int8 codes per group of 128 columns (``Int8Linear``),
    "float" keeps it in ``dtype``; "auto" is int8 for quantized artifacts run in bf16 on the CPU, float
    otherwise."""
    from quantkit.kernels.linear import load_linears
    from quantkit.kernels.linear.int8 import Int8Linear

    if lm_head not in LM_HEADS:
        raise ValueError(f"lm_head must be one of {LM_HEADS}, got {lm_head!r}")

    model_dir = Path(model_dir)
    config = MiniCPMConfig.from_pretrained(model_dir)
    quantized = artifact_format(model_dir, config) is not None
    linears = load_linears(model_dir, linear_backend, dtype) if quantized else {}
    config.quantization_config = None
    with torch.device("meta"):
        model = MiniCPMForCausalLM(config)
    for name, module in linears.items():
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).register_module(child, module.to(device))
    reader = CheckpointReader(model_dir)
    # outside the layers, as the format means them (MLX quantizes the embedding and LM head: dequantized)
    outside = ArtifactReader(model_dir).other_tensors() if quantized else {}
    available = set(reader.names) | set(outside)
    wanted = {name for name, tensor in model.state_dict().items() if tensor.is_meta}
    if config.tie_word_embeddings:
        wanted.discard("lm_head.weight")
    missing = sorted(wanted - available)
    if missing:
        raise ValueError(f"{model_dir}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    state = {name: (outside[name] if name in outside else reader.get(name)).to(device=device, dtype=dtype)
             for name in sorted(wanted)}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    if lm_head == "auto":
        lm_head = "int8" if quantized and dtype == torch.bfloat16 and device == "cpu" else "float"
    if lm_head == "int8":
        model.lm_head = Int8Linear(model.lm_head.weight)
    return model.eval()
