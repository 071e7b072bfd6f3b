"""Quantized linear layers for the runtime, built from any artifact quantkit reads.

Every format (GPTQ, AutoAWQ, Marlin, CPM.cu, ternary, GGUF blocks) is first read into its record by
``quantkit.formats`` (the same code that writes it, tested bit-exact), then executed by the module
its grid calls for:

| backend     | 4-bit uniform grid (gptq, awq, marlin, cpmcu)     | anything else (2/3/8-bit, GGUF types) |
|-------------|---------------------------------------------------|---------------------------------------|
| "reference" | float32 dequantized weight (what the file means)   | same                                  |
| "cpu"       | ``Int4Linear``: int8 x int4 dot products [3]       | [1], [4]; others: bf16 dequantized    |
| "triton"    | see [2]                                           | W8A8 [5]; others: bf16 dequantized    |

[1] ternary: ``TernaryLinear`` on the stored bit planes.
[2] the stored tensors of Marlin (``TritonMarlinLinear``) and AWQ artifacts; ``TritonW4A16Linear`` over
    the GPTQ layout for the others.
[3] decode, verification, and prefill without AMX; prefill with AMX multiplies the bf16 weight.
[4] INT8 W8A8: ``W8A8Linear``, int8 x int8 dot products with per-token activation scales (dynamic INT8 W8A8 only).
[5] ``TritonW8A8Linear``: INT8 x INT8 or E4M3 x E4M3 (sm_89 only) tensor-core dots, dynamic or static activations.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from quantkit.activation_quant import ActivationGrid
from quantkit.kernels.linear.int4 import Int4Linear
from quantkit.kernels.linear.ternary import TernaryLinear
from quantkit.kernels.linear.w8a8 import W8A8Linear, runs_on_integer_kernel
from quantkit.loading import input_scale
from quantkit.quant import QuantizedTensor
from quantkit.reader import ArtifactReader, layer_records

BACKENDS = ("reference", "cpu", "triton")
# Dequantized bf16 weights kept for prefill up to this many bytes in total; beyond it (an 8B model)
# each prefill chunk dequantizes its layer's weights again.
KEEP_DEQUANTIZED_BYTES = 4 << 30


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    module.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if bias is not None:
        module.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    module.weight_bytes = weight.numel() * module.weight.element_size()
    return module


def linear_for(record, bias: torch.Tensor | None, backend: str, dtype: torch.dtype,
               keep_dequantized: bool = True, activations: ActivationGrid | None = None,
               input_scale: torch.Tensor | None = None) -> nn.Module:
    """The module that executes one quantized linear's record on ``backend``; ``activations``: how a W8A8
    format quantizes the linear's input, with ``input_scale`` on a static grid. The input arrives already
    quantized (``quantkit.loading.quantize_activations``, for every backend); a W8A8 kernel quantizing it
    again gets the same codes back."""
    if backend not in BACKENDS:
        raise ValueError(f"linear backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return dense_linear(record.dequantize(torch.float32), bias, torch.float32)
    if backend == "triton" and activations is not None:
        from quantkit.kernels.linear.triton_w8a8 import TritonW8A8Linear

        build = TritonW8A8Linear.from_fp8_record if activations.kind == "fp8" else TritonW8A8Linear.from_int8_record
        return build(record, bias, activations, input_scale)
    uniform = isinstance(record, QuantizedTensor)
    if uniform and record.config.ternary and backend == "cpu":
        return TernaryLinear.from_record(record, bias, keep_dequantized)
    # the int4 kernels take integer zero points; a float-bias (MLX) record runs dequantized
    four_bit = uniform and record.config.bits == 4 and not record.config.float_bias
    if four_bit and backend == "cpu":
        return Int4Linear.from_record(record, bias, keep_dequantized)
    if backend == "cpu" and runs_on_integer_kernel(record, activations):
        return W8A8Linear.from_record(record, bias, keep_dequantized)
    if four_bit and backend == "triton":
        from quantkit.kernels.linear.triton_w4a16 import TritonW4A16Linear

        return TritonW4A16Linear.from_record(record, bias)
    return dense_linear(record.dequantize(torch.float32), bias, dtype)


def _triton_marlin(tensors: dict, shape: tuple[int, int], group_size: int, bias, keep: bool) -> nn.Module:
    from quantkit.kernels.linear.triton_marlin import TritonMarlinLinear

    out_features, in_features = shape
    return TritonMarlinLinear.from_marlin_tensors(tensors["qweight"], tensors["scales"], in_features, out_features,
                                                  group_size, bias)


def _triton_awq(tensors: dict, shape: tuple[int, int], group_size: int, bias, keep: bool) -> nn.Module:
    from quantkit.kernels.linear.triton_w4a16 import TritonW4A16Linear

    return TritonW4A16Linear.from_awq_tensors(tensors["qweight"], tensors["qzeros"], tensors["scales"], shape[1],
                                              group_size, bias)


def _cpu_ternary(tensors: dict, shape: tuple[int, int], group_size: int, bias, keep: bool) -> nn.Module:
    return TernaryLinear(tensors["qweight"], tensors["scales"], group_size, bias, keep)


# (backend, a format's ``stored_layout``) -> the kernel that runs a linear's stored tensors (by suffix) as
# they are, with no repacking at load (the format's reader already validated them). ``keep``: whether a
# CPU module may keep a bf16 dequantized copy for prefill (see KEEP_DEQUANTIZED_BYTES).
LAYOUT_KERNELS = {("triton", "marlin"): _triton_marlin, ("triton", "awq"): _triton_awq,
                  ("cpu", "ternary planes"): _cpu_ternary}


def load_linears(model_dir: str | Path, backend: str = "cpu",
                 dtype: torch.dtype = torch.bfloat16) -> dict[str, nn.Module]:
    """Every quantized linear of an artifact as a module, keyed by its name (``model.layers.3.mlp.up_proj``);
    {} for an unquantized checkpoint. CPM.cu's fused tensors come back as their q/k/v and gate/up parts."""
    artifact = ArtifactReader(model_dir)
    if artifact.format is None:
        return {}
    weights = artifact.num_layers * sum(n * k for n, k in artifact.shapes.values())
    keep = weights * 2 <= KEEP_DEQUANTIZED_BYTES
    fmt = artifact.format
    activations = fmt.activation_grid(artifact.qconfig)
    static = activations is not None and not activations.dynamic
    stored = LAYOUT_KERNELS.get((backend, fmt.stored_layout))
    modules: dict[str, nn.Module] = {}
    for index in range(artifact.num_layers):
        tensors = artifact.layer_tensors(index)
        plain, records = layer_records(tensors, index, artifact.config, artifact.qconfig, fmt)
        for key, record in records.items():
            name = key.removesuffix(".weight")
            bias = plain.get(f"{name}.bias")
            if stored is not None:
                modules[name] = stored(fmt.linear_tensors(tensors, name), record.shape, artifact.qconfig.group_size,
                                       bias, keep)
            else:
                modules[name] = linear_for(record, bias, backend, dtype, keep, activations,
                                           input_scale(artifact, name) if static else None)
    return modules

