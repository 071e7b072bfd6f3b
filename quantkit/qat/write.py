"""What a QAT run writes: the packed artifact in the recipe's format (the runtime, `quantkit eval` and
the GGUF exporter read it like any other), or a fake-quantized checkpoint; plus the training log and
its curve.

Each trained linear gives its own record (``record()`` of its ``fake_quant`` module): latent weights
rounded onto the grid by RTN's rule, or, where only scales and biases trained, the fixed codes with
them, never re-rounded. The embedding and LM head are written as the format writes them
(``write_outside``: MLX rounds them to nearest too), as the student computed with them.

The fake-quantized checkpoint is a plain MiniCPM checkpoint whose linears hold the grid values
(t·s for ternary), as OpenBMB ships BitCPM4: transformers loads it with no quantization code. Each
linear is stored in the first of the source dtype, float16 and float32 that holds it exactly (t·s
with an fp16 s is exact in float16, not in bfloat16).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from quantkit import atomic
from quantkit.artifact import MANIFEST_FILE, ArtifactWriter
from quantkit.checkpoint import SINGLE_FILE, CheckpointReader
from quantkit.formats import FORMATS
from quantkit.models.layers import EMBEDDING, FINAL_NORM, LM_HEAD, layer_prefix
from quantkit.models.remote_code import remote_code_for
from quantkit.qat.trainer import LOG_FILE, TrainedModel
from quantkit.recipe import Recipe
from quantkit.version import __version__

FAKE_QUANT = "fake-quant"
CURVE_FILE = "qat_curve.png"
FAKE_QUANT_MANIFEST = "qat.json"


def _exact_dtype(weight: torch.Tensor, source_dtype: torch.dtype) -> torch.dtype:
    for dtype in (source_dtype, torch.float16):
        if torch.equal(weight.to(dtype).to(torch.float32), weight):
            return dtype
    return torch.float32


def _manifest(trained: TrainedModel, recipe: Recipe, fmt_name: str, model_fingerprint: str,
              init: str | None) -> dict:
    return {"quantkit_version": __version__, "format": fmt_name, "recipe": recipe.values,
            "fingerprints": {"model": model_fingerprint, "recipe": recipe.fingerprint(),
                             "run": trained.run.fingerprint},
            "qat": {"data": trained.data, "tokens": trained.report.tokens, "steps": trained.report.steps,
                    "init": init, "threads": trained.report.threads, "sharded": trained.report.sharded,
                    **trained.world.described},
            "layer_errors": []}


def _layer_tensors(trained: TrainedModel, params: dict, reader: CheckpointReader, index: int) -> tuple[dict, dict]:
    """Layer ``index``: its linears' records and its other parameters (norms, any output biases) in the
    source dtype."""
    prefix = layer_prefix(index)
    records = {name.removeprefix(prefix): trained.model.get_submodule(name).record()
               for name in trained.grids if name.startswith(prefix)}
    tensors = {name: param.detach().to(reader.dtype(name)) for name, param in params.items()
               if name.startswith(prefix) and (name.rpartition(".")[0] not in trained.grids or name.endswith(".bias"))}
    return tensors, records


def _plot_curve(log: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = [e for e in log if "loss" in e]
    measured = [e for e in log if "heldout_ppl" in e]
    figure, (loss_axes, ppl_axes) = plt.subplots(1, 2, figsize=(10, 4))
    loss_axes.plot([e["tokens"] for e in trained], [e["loss"] for e in trained])
    loss_axes.set(xlabel="training tokens", ylabel="training loss", title="loss")
    ppl_axes.plot([e["tokens"] for e in measured], [e["heldout_ppl"] for e in measured], marker="o")
    ppl_axes.set(xlabel="training tokens", ylabel="held-out perplexity", yscale="log", title="held-out perplexity")
    figure.tight_layout()
    with atomic.atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=100)
    plt.close(figure)


def write_outputs(trained: TrainedModel, model_dir: Path, recipe: Recipe, *, fake_quant: bool = False,
                  init: str | None = None) -> None:
    """Write the run's result to its output (published only when complete) and drop its checkpoint."""
    staging = trained.run.staging
    reader = CheckpointReader(model_dir)
    config = trained.model.config
    fmt = FORMATS[recipe["format"]]
    atomic.write_json(staging / LOG_FILE, trained.report.log)
    _plot_curve(trained.report.log, staging / CURVE_FILE)
    report = {**trained.report.to_dict(), "seconds": trained.report.teacher_seconds + trained.report.train_seconds}
    source_config = json.loads((model_dir / "config.json").read_text())
    source_config.pop("quantization_config", None)
    code = remote_code_for(model_dir, source_config)
    source_config = code.config(source_config)
    qconfig = trained.qconfig
    outside = {n: reader.get(n) for n in (EMBEDDING, LM_HEAD) if n in reader}
    outside[FINAL_NORM] = trained.model.model.norm.weight.detach().to(reader.dtype(FINAL_NORM))
    if fmt.write_outside is not None:
        outside = fmt.write_outside(outside, qconfig)
        if fake_quant:  # a plain checkpoint: the weights the format's rounded ones mean, exact
            outside = {n: t.to(_exact_dtype(t.to(torch.float32), reader.dtype(n)))
                       for n, t in fmt.read_outside(outside, qconfig).items()}

    writer = ArtifactWriter(staging, config.num_hidden_layers)
    params = dict(trained.model.named_parameters())
    for index in range(config.num_hidden_layers):
        tensors, records = _layer_tensors(trained, params, reader, index)
        prefix = layer_prefix(index)
        if fake_quant:
            for linear, record in records.items():
                name, weight = f"{prefix}{linear}.weight", record.dequantize(torch.float32)
                tensors[name] = weight.to(_exact_dtype(weight, reader.dtype(name)))
        else:
            tensors.update(fmt.write_layer(records, prefix))
        writer.write_shard(index, tensors)
    writer.write_shard(config.num_hidden_layers, outside)
    manifest = _manifest(trained, recipe, FAKE_QUANT if fake_quant else fmt.name, reader.fingerprint(), init)
    manifest["remote_code"] = code.record
    if fake_quant:
        writer.finish(model_dir, source_config, None, report, weights_file=SINGLE_FILE, code_files=code.files)
    else:
        quantization_config = fmt.quantization_config(qconfig, quantizer=f"quantkit:{__version__}")
        configs = fmt.config_files({**source_config, "quantization_config": quantization_config})
        writer.finish(model_dir, configs.pop("config.json"), quantization_config, report,
                      weights_file=fmt.weights_file, extra_configs=configs, code_files=code.files)
    with trained.run.publishing():
        writer.write_manifest(manifest, FAKE_QUANT_MANIFEST if fake_quant else MANIFEST_FILE)
