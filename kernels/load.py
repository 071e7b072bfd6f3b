"""Build the runtime's model from a checkpoint directory without ever materialising float weights for
quantized linears: the model's skeleton (``quantkit.models.decoder.MiniCPMSkeleton``: the module tree
without transformers, whose modeling code takes seconds to import) is created on the meta device,
quantized linears come from ``quantkit.kernels.linear`` in their stored layout, and only the remaining
tensors (embeddings, norms, lm_head, unquantized linears) are read and cast to the activation dtype. The
reader (``quantkit.reader``) gives those tensors and ``quantkit.loading.load_weights`` fills the
skeleton, as for the reference model.
"""
from __future__ import annotations

from pathlib import Path

import torch

from quantkit.loading import load_weights, quantize_activations
from quantkit.models.decoder import MiniCPMSkeleton
from quantkit.reader import ArtifactReader

LM_HEADS = ("auto", "int8", "float")


def load_runtime_model(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16, linear_backend: str = "cpu",
                       device: str = "cpu", lm_head: str = "auto") -> MiniCPMSkeleton:
    """``lm_head``: "int8" quantizes the LM head to int8 codes per group of 128 columns (``Int8Linear``),
    "float" keeps it in ``dtype``; "auto" is int8 for quantized artifacts run in bf16 on the CPU, float
    otherwise."""
    from quantkit.kernels.linear import load_linears
    from quantkit.kernels.linear.int8 import Int8Linear

    if lm_head not in LM_HEADS:
        raise ValueError(f"lm_head must be one of {LM_HEADS}, got {lm_head!r}")

    artifact = ArtifactReader(model_dir)
    quantized = artifact.format is not None
    activations = artifact.format.activation_grid(artifact.qconfig) if quantized else None
    if activations is not None and activations.kind == "fp8" and device == "cuda":
        # refused before any weight is read: an Orin (sm_87) has no FP8 tensor cores
        from quantkit.kernels.linear.triton_w8a8 import require_fp8

        require_fp8(torch.device(device))
    linears = load_linears(artifact.dir, linear_backend, dtype) if quantized else {}
    with torch.device("meta"):
        model = MiniCPMSkeleton(artifact.config)
    for name, module in linears.items():
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).register_module(child, module.to(device))
    # outside the layers as the format means them (MLX quantizes the embedding and LM head: dequantized)
    load_weights(model, artifact.stored_tensors(), artifact.dir, cast=lambda t: t.to(device=device, dtype=dtype))
    # W8A8: each quantized linear's input quantized as the serving kernel does, then the linear as stored
    # (dynamic INT8 on the CPU's integer dot products, which quantize it to the same codes; FP8 and
    # static INT8 on the dequantized weight)
    quantize_activations(model, artifact)
    if lm_head == "auto":
        lm_head = "int8" if quantized and dtype == torch.bfloat16 and device == "cpu" else "float"
    if lm_head == "int8":
        model.lm_head = Int8Linear(model.lm_head.weight)
    return model.eval()
