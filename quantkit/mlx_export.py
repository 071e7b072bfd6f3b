"""``quantkit export mlx``: an existing quantkit artifact rewritten for mlx-lm, without re-rounding.

An integer-zero record means ``w = (q − zero) · scale``; MLX's affine grid means ``w = scale · q +
bias``. With ``bias = −zero · scale`` the two are the same weights, exactly: zero · scale is a
product of an integer below 2^8 and a float16, which float32 holds exactly, and so does their sum
with q · scale. So the export keeps every code and scale and only computes biases, by default in
float32: mlx dequantizes in the scales' dtype, and only in float32 does it compute exactly these
weights (with float16 scales it rounds each weight to float16, twice). ``--dtype float16`` or
``bfloat16`` halves the scales' size where every scale and bias is exact in it, and is refused
otherwise. Records whose grid MLX cannot hold (act-order, a group of all channels, K not a whole
number of groups, GGUF blocks) are refused before anything is written, naming the tensor. The
embedding and the LM head keep their float weights (mlx-lm loads a module without scales
unquantized).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit import atomic
from quantkit.checkpoint import INDEX_FILE
from quantkit.formats import mlx
from quantkit.fp8 import FP8Tensor
from quantkit.models.remote_code import remote_code_for
from quantkit.quant import QuantConfig, QuantizedTensor
from quantkit.reader import ArtifactReader

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_NOT_COPIED = {"config.json", INDEX_FILE, "quantize_config.json", "quantkit.json", "quantize_report.json",
               mlx.TRANSFORMERS_CONFIG}


@dataclass
class MLXExport:
    path: str
    dtype: str  # of the scales and biases
    linears: int
    bits: int
    group_size: int


def _exact_parameters(qt: QuantizedTensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(scales, biases = −zero · scale) in ``dtype`` if both are exact there, else None."""
    scales = qt.scales.float()
    biases = -qt.zeros.float() * scales  # exact in float32
    stored = scales.to(dtype), biases.to(dtype)
    exact = all(torch.equal(t.float(), value) for t, value in zip(stored, (scales, biases)))
    return stored if exact else None


def as_float_bias(qt: QuantizedTensor | FP8Tensor, dtype: torch.dtype, name: str) -> QuantizedTensor:
    """``qt`` on MLX's grid in ``dtype``: the same codes and scales, bias = −zero · scale (exact or refused)."""
    if not isinstance(qt, QuantizedTensor):
        raise ValueError(f"{name}: its weights are FP8 (E4M3), which MLX's affine groups cannot hold: quantize the "
                         "unquantized model for MLX (`quantkit quantize --recipe mlx-s-gptq-w4g64`)")
    n, k = qt.shape
    if qt.config.float_bias:
        raise ValueError(f"{name}: already on a float-bias grid")
    grid = QuantConfig(qt.config.bits, qt.config.group_size, sym=False, float_bias=True, scale_dtype=dtype)
    mlx.check_mlx(grid, k, n, name=name)
    mlx.require_natural_groups(qt, name)
    if qt.scales.dtype == torch.float32:  # q · scale would need more than float32's 24 significant bits
        raise ValueError(f"{name}: its scales are float32 (a compressed-tensors checkpoint of a float32 model), on "
                         "which MLX's scale · q + bias cannot give (q − zero) · scale exactly")
    stored = _exact_parameters(qt, dtype)
    if stored is None:
        raise ValueError(f"{name}: its scales or biases (−zero · scale) are not exact in {dtype}; "
                         "export with --dtype float32")
    return QuantizedTensor(qt.codes, stored[0], None, qt.g_idx, grid, biases=stored[1])


def _records(reader: ArtifactReader):
    for index in range(reader.num_layers):
        plain, records = reader.layer(index)
        yield index, plain, {key.removesuffix(".weight"): qt for key, qt in records.items()}


def _check_records(reader: ArtifactReader, dtype: torch.dtype) -> None:
    """Refuse what MLX cannot hold (or ``dtype`` cannot store exactly) before anything is written."""
    for _, _, records in _records(reader):
        for module, qt in records.items():
            as_float_bias(qt, dtype, module)


def export_mlx(model_dir: str | Path, out: str | Path, dtype: str = "float32") -> MLXExport:
    """Write the quantized artifact ``model_dir`` as an MLX directory ``out`` (which must not exist)."""
    model_dir, out = Path(model_dir), Path(out)
    atomic.refuse_existing(out)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    reader = ArtifactReader(model_dir)
    fmt = reader.format
    if fmt is None:
        raise ValueError(f"{model_dir} is not quantized: quantize it for MLX with `quantkit quantize --recipe "
                         "mlx-rtn-w4g64` (or mlx-s-gptq-w4g64)")
    if fmt.name == "mlx" or fmt.block_types:
        raise ValueError(f"{model_dir} is format {fmt.name}: "
                         + ("already MLX" if fmt.name == "mlx" else "GGUF blocks are not one affine grid per group"))
    if reader.config.tie_word_embeddings:
        raise ValueError(f"{model_dir} ties its LM head to the embedding, which mlx-lm's MiniCPM cannot load "
                         "(docs/formats.md, MLX)")
    chosen = DTYPES[dtype]
    _check_records(reader, chosen)

    staging = out.with_name(out.name + ".partial")
    atomic.remove_tree(staging)
    staging.mkdir(parents=True)
    total = reader.num_layers + 1
    weight_map: dict[str, str] = {}
    linears = 0
    for index, plain, records in _records(reader):
        tensors = dict(plain)
        for module, qt in records.items():
            tensors |= mlx.mlx_tensors(as_float_bias(qt, chosen, module), module)
        linears += len(records)
        weight_map |= _save(staging, index, total, tensors)
    weight_map |= _save(staging, total - 1, total, reader.other_tensors())
    atomic.write_json(staging / INDEX_FILE, {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))})

    grid = mlx.MLXGrid(reader.qconfig.bits, reader.qconfig.group_size, sym=False, float_bias=True, scale_dtype=chosen)
    source = json.loads((model_dir / "config.json").read_text())
    source.pop("configuration_files", None)
    code = remote_code_for(model_dir, source)
    configs = mlx.config_files(code.config({**source, "quantization_config": mlx.quantization_config(grid)}))
    for name, content in configs.items():
        atomic.write_json(staging / name, content)
    for name, text in code.files.items():
        atomic.write_text(staging / name, text)
    for path in sorted(model_dir.iterdir()):
        if (path.is_file() and path.name not in _NOT_COPIED and path.suffix != ".safetensors"
                and path.name not in code.files):
            shutil.copyfile(path, staging / path.name)
    atomic.publish_dir(staging, out)
    return MLXExport(str(out), str(chosen).removeprefix("torch."), linears, grid.bits, grid.group_size)


def _save(staging: Path, index: int, total: int, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    name = f"model-{index + 1:05d}-of-{total:05d}.safetensors"
    atomic.save_safetensors(staging / name, tensors, metadata={"format": "mlx"})
    return {key: name for key in tensors}
