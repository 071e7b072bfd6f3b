"""The layer-wise engine: quantize a checkpoint one decoder layer at a time.

For each layer: read its tensors from the memory-mapped checkpoint, run the calibration
activations through it group by group in true-sequential order (each group sees the outputs of
the groups already quantized), hand each linear and its input statistics to the recipe's
algorithm, write the layer's shard, and pass the quantized layer's outputs on. Peak memory is one
layer plus the activations, whatever the depth. Finished layers survive an interruption; a resumed
run recomputes the activations through them and continues, producing identical bytes.
"""
from __future__ import annotations

import hashlib
import json
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

import quantkit
from quantkit import calib
from quantkit.algorithms import ALGORITHMS
from quantkit.artifact import ArtifactWriter, staging_dir
from quantkit.checkpoint import CheckpointReader
from quantkit.formats import gptq
from quantkit.models import MiniCPMConfig, MiniCPMDecoderLayer, MiniCPMRotaryEmbedding
from quantkit.models.layers import EMBEDDING, FINAL_NORM, LINEARS, LM_HEAD, SEQUENTIAL_GROUPS, layer_prefix
from quantkit.quant import QuantConfig
from quantkit.recipe import Recipe
from quantkit.stats import InputStats, relative_error


class EngineError(RuntimeError):
    """A run that cannot start or continue as asked."""


@dataclass
class LayerReport:
    index: int
    seconds: float
    errors: dict[str, float]  # linear name -> ‖ΔW X‖²/‖W X‖² on the calibration inputs


@dataclass
class RunReport:
    out_dir: str
    recipe: str
    layers: list[LayerReport] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    resumed_from_layer: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


class _StopForward(Exception):
    """Raised by a hook once the inputs it waits for are captured: the rest of the layer is not needed."""


class LayerRunner:
    """Runs calibration activations through one decoder layer in batches."""

    def __init__(self, layer: torch.nn.Module, position_embeddings, batch_size: int):
        self.layer = layer
        self.position_embeddings = position_embeddings
        self.batch_size = batch_size

    def _batches(self, hidden: torch.Tensor):
        for start in range(0, hidden.shape[0], self.batch_size):
            yield hidden[start:start + self.batch_size]

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(hidden)
        for start, batch in zip(range(0, hidden.shape[0], self.batch_size), self._batches(hidden)):
            out[start:start + batch.shape[0]] = self.layer(batch, position_embeddings=self.position_embeddings)
        return out

    @torch.no_grad()
    def input_stats(self, hidden: torch.Tensor, linear_name: str, skip_prefix: int) -> InputStats:
        """Statistics of the inputs that reach ``linear_name`` (stops each forward right there)."""
        linear = self.layer.get_submodule(linear_name)
        stats = InputStats(linear.in_features, skip_prefix)

        def capture(_module, args):
            stats.add(args[0])
            raise _StopForward

        handle = linear.register_forward_pre_hook(capture)
        try:
            for batch in self._batches(hidden):
                try:
                    self.layer(batch, position_embeddings=self.position_embeddings)
                except _StopForward:
                    pass
        finally:
            handle.remove()
        return stats


def _build_layer(config: MiniCPMConfig, index: int, tensors: dict[str, torch.Tensor], dtype) -> torch.nn.Module:
    with torch.device("meta"):
        layer = MiniCPMDecoderLayer(config, index)
    prefix = layer_prefix(index)
    state = {name[len(prefix):]: t.to(dtype) for name, t in tensors.items()}
    missing = set(layer.state_dict()) - set(state)
    if missing:
        raise EngineError(f"layer {index}: checkpoint lacks {sorted(prefix + m for m in missing)}")
    layer.load_state_dict(state, strict=True, assign=True)
    return layer.eval()


def _layer_tensors(reader: CheckpointReader, index: int) -> dict[str, torch.Tensor]:
    prefix = layer_prefix(index)
    return {n: reader.get(n) for n in reader.names if n.startswith(prefix)}


def expected_shapes(config: MiniCPMConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape, derived from the model code itself."""
    with torch.device("meta"):
        layer = MiniCPMDecoderLayer(config, 0)
    shapes = {EMBEDDING: (config.vocab_size, config.hidden_size), FINAL_NORM: (config.hidden_size,)}
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (config.vocab_size, config.hidden_size)
    for index in range(config.num_hidden_layers):
        for name, t in layer.state_dict().items():
            shapes[layer_prefix(index) + name] = tuple(t.shape)
    return shapes


def validate_checkpoint(reader: CheckpointReader, config: MiniCPMConfig, qconfig: QuantConfig,
                        progress: bool = False) -> None:
    """Refuse a bad checkpoint before any work starts: missing tensors, wrong shapes, NaN/Inf
    values, and shapes the format cannot pack."""
    shapes = expected_shapes(config)
    for name, shape in shapes.items():
        if name not in reader:
            raise EngineError(f"checkpoint {reader.directory} lacks tensor '{name}'")
        if reader.shape(name) != shape:
            raise EngineError(f"tensor '{name}' has shape {list(reader.shape(name))}, "
                              f"the config implies {list(shape)}")
    for linear in LINEARS:
        out_features, in_features = shapes[f"{layer_prefix(0)}{linear}.weight"]
        gptq.check_packable(in_features, out_features, qconfig, linear)
    for name in tqdm(list(shapes), desc="check weights", unit="tensor", disable=not progress, leave=False):
        t = reader.get(name)
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise EngineError(f"tensor '{name}' in {reader.directory} contains NaN or Inf values")


def run_fingerprint(model: str, recipe: Recipe, calibration: str) -> str:
    payload = json.dumps({"model": model, "recipe": recipe.fingerprint(), "calibration": calibration,
                          "quantkit": quantkit.__version__}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def quantize(model_dir: str | Path, recipe: Recipe, out_dir: str | Path, *, resume: bool = False,
             progress: bool = True, stop_after_layers: int | None = None) -> RunReport:
    """Quantize ``model_dir`` with ``recipe`` into ``out_dir``.

    ``stop_after_layers`` ends the run after that many layers without finishing the artifact
    (what an interruption leaves behind); tests use it to prove resumption.
    """
    started = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists():
        raise EngineError(f"output directory {out_dir} already exists; choose another --out or remove it")
    staging = staging_dir(out_dir)
    if staging.exists() and not resume:
        raise EngineError(f"{staging} holds an interrupted run: pass --resume to continue it, or remove it")

    reader = CheckpointReader(model_dir)
    config = MiniCPMConfig.from_pretrained(model_dir)
    qconfig = QuantConfig(**recipe["quant"])
    validate_checkpoint(reader, config, qconfig, progress)
    algorithm = ALGORITHMS[recipe["algorithm"]]
    dtype = getattr(torch, recipe["compute_dtype"])

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cal = recipe["calibration"]
    calibration = calib.calibration_set(tokenizer, source=cal["source"], n_samples=cal["n_samples"],
                                        seq_len=cal["seq_len"], seed=cal["seed"], chat=cal["chat"])
    model_fingerprint = reader.fingerprint()
    fingerprint = run_fingerprint(model_fingerprint, recipe, calibration.fingerprint)

    writer = ArtifactWriter(staging, config.num_hidden_layers)
    layer_errors: list[dict] = []
    state = writer.read_progress()
    if state is not None:
        if state["fingerprint"] != fingerprint:
            raise EngineError(f"{staging} was started with a different model, recipe or calibration set; "
                              "remove it to start over")
        layer_errors = state["layer_errors"]
    else:
        writer.write_shard(config.num_hidden_layers, {n: reader.get(n) for n in (EMBEDDING, FINAL_NORM, LM_HEAD)
                                                      if n in reader})
        writer.write_progress(fingerprint, layer_errors)
    done = len(layer_errors)

    report = RunReport(out_dir=str(out_dir), recipe=recipe.name, resumed_from_layer=done)
    with torch.no_grad():
        hidden = (reader.get(EMBEDDING).to(dtype)[calibration.input_ids] * config.scale_emb)
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        position_embeddings = MiniCPMRotaryEmbedding(config)(hidden, positions)

    layers = range(config.num_hidden_layers if stop_after_layers is None else stop_after_layers)
    bar = tqdm(layers, desc=f"quantize {recipe.name}", unit="layer", disable=not progress)
    for index in bar:
        layer_started = time.perf_counter()
        source = _layer_tensors(reader, index)
        if index < done:  # finished before the interruption: replay it from its shard
            layer = _build_layer(config, index, _dequantized(writer, index, source, qconfig), dtype)
            hidden = LayerRunner(layer, position_embeddings, cal["batch_size"]).forward(hidden)
            continue
        layer = _build_layer(config, index, source, dtype)
        runner = LayerRunner(layer, position_embeddings, cal["batch_size"])
        shard, errors = {n: t for n, t in source.items() if not _is_linear_weight(n, index)}, {}
        for group in SEQUENTIAL_GROUPS:
            stats = runner.input_stats(hidden, group[0], skip_prefix=0)
            for name in group:
                weight = source[f"{layer_prefix(index)}{name}.weight"].float()
                qt = algorithm(weight, stats, qconfig)
                approx = qt.dequantize(torch.float32)
                errors[name] = relative_error(weight, approx, stats.hessian)
                layer.get_submodule(name).weight.data = approx.to(dtype)
                shard.update(gptq.gptq_tensors(qt, f"{layer_prefix(index)}{name}"))
        hidden = runner.forward(hidden)
        writer.write_shard(index, shard)
        layer_errors.append({"layer": index, "errors": errors})
        writer.write_progress(fingerprint, layer_errors)
        seconds = time.perf_counter() - layer_started
        report.layers.append(LayerReport(index, round(seconds, 3), errors))
        bar.set_postfix(err=f"{max(errors.values()):.2e}")

    report.seconds = round(time.perf_counter() - started, 3)
    report.peak_rss_mb = round(_peak_rss_mb(), 1)
    if stop_after_layers is not None and stop_after_layers < config.num_hidden_layers:
        return report

    source_config = json.loads((model_dir / "config.json").read_text())
    quantization_config = gptq.quantization_config(qconfig, quantizer=f"quantkit:{quantkit.__version__}")
    manifest = {
        "quantkit_version": quantkit.__version__,
        "recipe": recipe.values,
        "fingerprints": {"model": model_fingerprint, "recipe": recipe.fingerprint(),
                         "calibration": calibration.fingerprint, "run": fingerprint},
        "calibration": calibration.describe(),
        "layer_errors": layer_errors,
    }
    writer.finish(model_dir, out_dir, {**source_config, "quantization_config": quantization_config},
                  quantization_config, manifest, report.to_dict())
    return report


def _is_linear_weight(name: str, index: int) -> bool:
    return name in {f"{layer_prefix(index)}{linear}.weight" for linear in LINEARS}


def _dequantized(writer: ArtifactWriter, index: int, source: dict, qconfig: QuantConfig) -> dict:
    """The layer as the engine ran it after quantization: fake-quantized linears from its shard."""
    from safetensors.torch import load_file

    shard = load_file(str(writer.shard_path(index)))
    tensors = dict(source)
    for linear in LINEARS:
        prefix = f"{layer_prefix(index)}{linear}"
        tensors[prefix + ".weight"] = gptq.read_gptq_tensors(shard, prefix, qconfig).dequantize(torch.float32)
    return tensors

