"""The layer-wise engine: quantize a checkpoint one decoder layer at a time.

For each layer: read its tensors from the memory-mapped checkpoint, run the calibration
activations through it group by group in true-sequential order (each group sees the outputs of
the groups already quantized), hand each linear and its input statistics to the recipe's
algorithm, write the layer's shard, and pass the quantized layer's outputs on. Peak memory is one
layer plus the activations, whatever the depth. Finished layers survive an interruption; a resumed
run recomputes the activations through them and continues, producing identical bytes.

A layer's work (its weights, the activations, the statistics and the solves) runs on the chosen
device, a CUDA GPU or the CPU, with the same torch code; the checkpoint reader and the shard writer
stay on the host, so only one layer's weights and the activations ever occupy the device.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

import torch
from tqdm.auto import tqdm

from quantkit import calib
from quantkit.activations import Activations
from quantkit.algorithms import ALGORITHMS
from quantkit.algorithms.reconstruct import reconstruct
from quantkit.algorithms.smooth import search_scale, smooth_layer
from quantkit.algorithms.smoothquant import SAMPLE_ROWS, search_migration
from quantkit.artifact import PROGRESS_FILE, ArtifactWriter
from quantkit.checkpoint import CheckpointReader
from quantkit.formats import FORMATS, Format
from quantkit.models import MiniCPMConfig, MiniCPMDecoderLayer, MiniCPMRotaryEmbedding
from quantkit.models.decoder import weight_shapes
from quantkit.models.layers import (
    ATTENTION_PROJECTIONS,
    EMBEDDING,
    FINAL_NORM,
    GATE,
    LINEARS,
    LM_HEAD,
    O_PROJ,
    SEQUENTIAL_GROUPS,
    UP,
    layer_prefix,
    scaling_groups_for,
)
from quantkit.models.remote_code import remote_code_for
from quantkit.quant import QuantConfig
from quantkit.reader import dequantize_layer
from quantkit.recipe import Recipe
from quantkit.run import Run, RunError, peak_rss_mb
from quantkit.run.checks import validate_checkpoint
from quantkit.stats import InputCapture, InputStats, compute_dtype, fast_relative_error
from quantkit.version import __version__


@dataclass
class LayerReport:
    index: int
    seconds: float
    errors: dict[str, float]  # linear name -> ‖ΔW X‖²/‖W X‖² on the calibration inputs
    stats_seconds: float = 0.0  # forward passes and statistics: grows with calibration tokens
    solve_seconds: float = 0.0  # smoothing search and the algorithm: independent of them


@dataclass
class RunReport:
    out_dir: str
    recipe: str
    layers: list[LayerReport] = field(default_factory=list)
    device: str = "cpu"
    activations: str = "memory"  # or "disk": spilled beside the output (engine.plan_activations)
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    resumed_from_layer: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class LayerRunner:
    """Runs calibration activations through one decoder layer in batches.

    Once q/k/v are final, ``fix_attention`` keeps o_proj's input for every sample, and later passes
    start from it (``after_attention``) instead of recomputing the attention; once o_proj is final,
    ``fix_attended`` keeps the residual stream after attention in its place, and the MLP's passes
    start there (``feed_forward``) instead of recomputing o_proj; once gate/up are final, ``fix_gated``
    keeps down_proj's input too, and down_proj's statistics and the layer's output start from it
    (``finished``) instead of computing gate/up a second time. Results are bit-identical. Measured
    on the default model (GPTQ W4, 128 x 512 tokens), reusing the attention: statistics time 122 s ->
    110 s; reusing o_proj saves two of its three passes (4.4 T multiply-adds each for an 8B layer at
    128 x 2048 tokens), reusing gate/up one of their two (35 T multiply-adds there, a third of the
    layer's forwards, for 16,384 values a token kept).
    """

    def __init__(self, layer: torch.nn.Module, position_embeddings, batch_size: int, activations: Activations):
        self.layer = layer
        self.position_embeddings = position_embeddings
        self.batch_size = batch_size
        self.activations = activations
        self.device = position_embeddings[0].device
        self.mixed: torch.Tensor | None = None  # o_proj's input, once q/k/v are final
        self.attended: torch.Tensor | None = None  # the residual stream after attention, once o_proj is final
        self.gated: torch.Tensor | None = None  # down_proj's input, once gate/up are final
        # max |K| (after RoPE) and max |V| the attention saw while o_proj's input was kept: the KV cache's
        # calibration (a quantized cache's scales)
        self.key_value_abs_max: tuple[torch.Tensor, torch.Tensor] | None = None

    def _batches(self, hidden: torch.Tensor):
        """(start, batch on the layer's device): spilled activations stay on the host, a batch at a time moves."""
        for start in range(0, hidden.shape[0], self.batch_size):
            yield start, hidden[start:start + self.batch_size].to(self.device)

    def _run(self, start: int, batch: torch.Tensor) -> torch.Tensor:
        rows = slice(start, start + batch.shape[0])
        if self.gated is not None:
            return self.layer.finished(self.attended[rows].to(self.device), self.gated[rows].to(self.device))
        if self.attended is not None:
            return self.layer.feed_forward(self.attended[rows].to(self.device))
        if self.mixed is not None:
            return self.layer.after_attention(batch, self.mixed[rows].to(self.device))
        return self.layer(batch, position_embeddings=self.position_embeddings)

    @torch.no_grad()
    def fix_attention(self, hidden: torch.Tensor) -> None:
        """Compute and keep o_proj's input (the attended heads) for all of ``hidden``."""
        self.mixed = self.attended = self.gated = None
        attention = self.layer.self_attn
        core = attention.core
        seen = [torch.zeros((), device=self.device), torch.zeros((), device=self.device)]

        def observed(query, key, value, *rest):
            for index, states in enumerate((key, value)):
                seen[index] = torch.maximum(seen[index], states.detach().abs().amax().float())
            return core(query, key, value, *rest)

        attention.core = observed
        try:
            for start, batch in self._batches(hidden):
                mixed = attention.mix(self.layer.input_layernorm(batch), self.position_embeddings)
                if self.mixed is None:
                    self.mixed = self.activations.empty((hidden.shape[0], *mixed.shape[1:]), mixed.dtype)
                self.mixed[start:start + batch.shape[0]] = mixed
        finally:
            attention.core = core
        self.key_value_abs_max = (seen[0], seen[1])

    @torch.no_grad()
    def fix_attended(self, hidden: torch.Tensor) -> None:
        """Compute and keep the residual stream after attention for all of ``hidden`` (after ``fix_attention``),
        in place of o_proj's input."""
        attended = self.activations.empty_like(hidden)
        for start, batch in self._batches(hidden):
            rows = slice(start, start + batch.shape[0])
            attended[rows] = self.layer.attended(batch, self.mixed[rows].to(self.device))
        self.mixed, self.attended = None, attended

    @torch.no_grad()
    def fix_gated(self, hidden: torch.Tensor) -> None:
        """Compute and keep down_proj's input for all of ``hidden`` (after ``fix_attended``)."""
        for start, batch in self._batches(hidden):
            rows = slice(start, start + batch.shape[0])
            gated = self.layer.gated(self.attended[rows].to(self.device))
            if self.gated is None:
                self.gated = self.activations.empty((hidden.shape[0], *gated.shape[1:]), gated.dtype)
            self.gated[rows] = gated

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output for all of ``hidden``. After ``fix_gated`` it is written over the residual
        stream after attention (each batch's rows are read before they are written), so the run's peak
        holds the input, that stream and down_proj's input, not a fourth tensor; the runner is spent."""
        in_place = self.gated is not None
        out = self.attended if in_place else self.activations.empty_like(hidden)
        for start, batch in self._batches(hidden):
            out[start:start + batch.shape[0]] = self._run(start, batch)
        if in_place:
            self.attended = self.gated = None
        return out

    @torch.no_grad()
    def input_stats(self, hidden: torch.Tensor, linear_names: tuple[str, ...],
                    skip_prefix: Mapping[str, int], sample_every: int = 0) -> dict[str, InputStats]:
        """Statistics of the inputs reaching each linear (named in forward order), leaving out the
        first ``skip_prefix[name]`` positions of each sequence (and keeping every ``sample_every``-th
        row); each forward stops as soon as the last of them has been reached."""
        with InputCapture(self.layer, linear_names, skip_prefix, stop_after_last=True,
                          sample_every=sample_every) as capture:
            for start, batch in self._batches(hidden):
                capture.run(self._run, start, batch)
        return capture.stats


# Once a group is final, what the runner keeps so that later passes start there instead of recomputing it
KEPT_AFTER = {ATTENTION_PROJECTIONS: LayerRunner.fix_attention, (O_PROJ,): LayerRunner.fix_attended,
              (GATE, UP): LayerRunner.fix_gated}


def _build_layer(config: MiniCPMConfig, index: int, tensors: dict[str, torch.Tensor], dtype,
                 device: torch.device) -> torch.nn.Module:
    with torch.device("meta"):
        layer = MiniCPMDecoderLayer(config, index)
    prefix = layer_prefix(index)
    state = {name[len(prefix):]: t.to(device, dtype) for name, t in tensors.items()}
    missing = set(layer.state_dict()) - set(state)
    if missing:
        raise RunError(f"layer {index}: checkpoint lacks {sorted(prefix + m for m in missing)}")
    layer.load_state_dict(state, strict=True, assign=True)
    return layer.eval()


def _layer_tensors(reader: CheckpointReader, index: int) -> dict[str, torch.Tensor]:
    prefix = layer_prefix(index)
    return {n: reader.get(n) for n in reader.names if n.startswith(prefix)}


# What the estimate leaves out (the interpreter, torch, the tokenizer, allocator slack) is covered by this
# factor rather than itemised.
MEMORY_MARGIN = 1.25


def calibration_memory(config: MiniCPMConfig, n_samples: int, seq_len: int, dtype: torch.dtype,
                       reconstructs: bool = False) -> dict[str, int]:
    """Bytes a run holds at its peak, by what holds them: the activations (the layer's input and the
    residual stream after attention, with o_proj's input or, later, down_proj's input: kept so that later
    groups skip the attention, o_proj and gate/up; the output overwrites the residual stream; with block
    reconstruction, the unquantized model's stream and the layer's unquantized output too), one layer's
    weights (at the compute dtype, a float32 copy for smoothing and the solve, and the solver's work
    matrices; with reconstruction, float32 offsets and their gradients) and the largest Hessian (float32,
    and its factor)."""
    shapes = {name: shape for name, shape in weight_shapes(config).items() if name.startswith(layer_prefix(0))}
    layer_parameters = sum(math.prod(shape) for shape in shapes.values())
    widest = max(shape[1] for name, shape in shapes.items() if len(shape) == 2)
    largest = max(math.prod(shape) for shape in shapes.values())
    tokens = n_samples * seq_len
    attention_width = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    streams = 4 if reconstructs else 2
    return {
        "activations": tokens * (streams * config.hidden_size + max(attention_width, config.intermediate_size))
        * dtype.itemsize,
        "layer weights": layer_parameters * (dtype.itemsize + 4 + (16 if reconstructs else 0)) + 4 * largest * 4,
        "Hessian": 2 * widest * widest * 4,
    }


ACTIVATION_PLACES = ("auto", "memory", "disk")


def plan_activations(config: MiniCPMConfig, calibration: Mapping, dtype: torch.dtype, device: torch.device,
                     place: str, spill_dir: Path, reconstructs: bool = False) -> Activations:
    """Where the run keeps its calibration activations (``place``: memory, disk, or auto: memory where the
    whole run fits, else disk). Refuses before any work a run that cannot fit even with its activations
    on disk, or whose spill would not fit on the disk, with the estimate and the limit."""
    from quantkit.memory import address_space_available, device_available_bytes

    if place not in ACTIVATION_PLACES:
        raise RunError(f"activations must be one of {', '.join(ACTIVATION_PLACES)}, not {place!r}")
    n_samples, seq_len = calibration["n_samples"], calibration["seq_len"]
    parts = calibration_memory(config, n_samples, seq_len, dtype, reconstructs)
    available = device_available_bytes(device)
    room = math.inf if available is None else available[0]
    needed = MEMORY_MARGIN * sum(parts.values())
    if place != "disk" and needed <= room:
        return Activations(device)
    if place != "memory":  # on disk, one batch of them at a time on the device
        spilled = parts.pop("activations")
        batch_share = min(calibration["batch_size"], n_samples) / n_samples
        parts = {"activations (one batch; the rest on disk)": int(spilled * batch_share), **parts}
        needed = MEMORY_MARGIN * sum(parts.values())
        spill_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(spill_dir).free
        if spilled > free:
            raise RunError(f"calibration does not fit: the activations of {n_samples} x {seq_len} tokens "
                           f"({spilled / 2**30:.2f} GiB) fit neither in memory nor on the disk of {spill_dir} "
                           f"({free / 2**30:.2f} GiB free). Lower calibration.n_samples or calibration.seq_len "
                           "(--set calibration.n_samples=N), or free disk space")
        # mapped files still take address space: under ulimit -v, spilling does not make room
        address_space = address_space_available()
        if address_space is not None and device.type == "cpu":
            room = min(room, address_space[0] - spilled)
        if needed <= room:
            return Activations(torch.device("cpu"), spill_dir)
    gib = 2 ** 30
    itemised = ", ".join(f"{name} {size / gib:.2f} GiB" for name, size in parts.items())
    raise RunError(
        f"calibration does not fit: {n_samples} x {seq_len} tokens at hidden size {config.hidden_size} in "
        f"{str(dtype).removeprefix('torch.')} need about {needed / gib:.2f} GiB on {device.type} ({itemised}, plus "
        f"{MEMORY_MARGIN - 1:.0%}), and {available[1]} leaves {max(available[0], 0) / gib:.2f} GiB. Lower "
        "calibration.n_samples or calibration.seq_len (--set calibration.n_samples=N), or free memory")


def quantize(model_dir: str | Path, recipe: Recipe, out_dir: str | Path, *, resume: bool = False,
             progress: bool = True, device: str = "auto", activations: str = "auto",
             stop_after_layers: int | None = None, notes: dict | None = None) -> RunReport:
    """Quantize ``model_dir`` with ``recipe`` into ``out_dir``, each layer's work on ``device`` (cpu, cuda,
    or auto: ``resolve_device``), the calibration activations in memory or spilled to files beside
    ``out_dir`` (``activations``: auto, memory or disk; ``plan_activations``).

    ``notes`` are added to the artifact's manifest as they are (a size budget's plan: what each tensor got
    and why). ``stop_after_layers`` ends the run after that many layers without finishing the artifact
    (what an interruption leaves behind); tests use it to prove resumption.
    """
    from quantkit.device import resolve_device

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    device = torch.device(resolve_device(device))
    if "qat" in recipe.values:
        from quantkit.training.fake_quant import TRAINS

        command = TRAINS[recipe["qat"]["trains"]].command
        raise RunError(f"recipe {recipe.name} trains (it has a 'qat' section): run it with `{command} "
                       f"--recipe {recipe.name}`")
    run = Run(out_dir, resume=resume)

    reader = CheckpointReader(model_dir)
    config = MiniCPMConfig.from_pretrained(model_dir)
    fmt = FORMATS[recipe["format"]]
    qconfig = fmt.resolve(fmt.grid(recipe["quant"], reader.dtype(EMBEDDING)), recipe.values, config.num_hidden_layers)
    validate_checkpoint(reader, config, qconfig, fmt, ALGORITHMS[recipe["algorithm"]].act_order(recipe.values),
                        progress)
    dtype = compute_dtype(recipe["compute_dtype"])
    reconstructs = "reconstruct" in recipe.values
    store = plan_activations(config, recipe["calibration"], dtype, device, activations, out_dir.absolute().parent,
                             reconstructs)

    from quantkit.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    cal = recipe["calibration"]
    calibration = calib.calibration_set(tokenizer, source=cal["source"], n_samples=cal["n_samples"],
                                        seq_len=cal["seq_len"], seed=cal["seed"], chat=cal["chat"])
    model_fingerprint = reader.fingerprint()
    continuing = run.begin({"model": model_fingerprint, "recipe": recipe.fingerprint(),
                            "calibration": calibration.fingerprint, "compute_dtype": str(dtype),
                            "quantkit": __version__}, PROGRESS_FILE)

    writer = ArtifactWriter(run.staging, config.num_hidden_layers)
    layer_errors: list[dict] = []
    if continuing:
        layer_errors = writer.read_progress()
    else:
        outside = {n: reader.get(n) for n in (EMBEDDING, FINAL_NORM, LM_HEAD) if n in reader}
        if fmt.write_outside is not None:  # formats that quantize the embedding or LM head as well
            outside = fmt.write_outside(outside, qconfig)
        writer.write_shard(config.num_hidden_layers, outside)
        writer.write_progress(layer_errors)
    done = len(layer_errors)

    report = RunReport(out_dir=str(out_dir), recipe=recipe.name, device=device.type, resumed_from_layer=done,
                       activations="disk" if store.spilled else "memory")
    with torch.no_grad():
        hidden = _embed(reader.get(EMBEDDING).to(dtype), calibration.input_ids, config.scale_emb, store,
                        cal["batch_size"])
        positions = torch.arange(hidden.shape[1], device=device).unsqueeze(0)
        position_embeddings = MiniCPMRotaryEmbedding(config)(hidden[:1].to(device), positions)
    # block reconstruction matches each layer's output to the unquantized model's: that model's own stream
    unquantized = hidden if reconstructs else None

    layers = range(config.num_hidden_layers if stop_after_layers is None else stop_after_layers)
    bar = tqdm(layers, desc=f"quantize {recipe.name}", unit="layer", disable=not progress)
    for index in bar:
        layer_started = time.perf_counter()
        if index < done:  # finished before the interruption: replay it from its shard
            layer = _build_layer(config, index, _replayed(writer, index, config, qconfig, fmt), dtype, device)
            hidden = LayerRunner(layer, position_embeddings, cal["batch_size"], store).forward(hidden)
            if unquantized is not None:
                layer = _build_layer(config, index, _layer_tensors(reader, index), dtype, device)
                unquantized = LayerRunner(layer, position_embeddings, cal["batch_size"], store).forward(unquantized)
            continue
        job = _LayerJob(config, index, recipe, qconfig, dtype, device, position_embeddings, store)
        shard, errors, alphas, hidden, unquantized, reconstruction = job.run(_layer_tensors(reader, index), hidden,
                                                                            fmt, unquantized)
        writer.write_shard(index, shard)
        layer_errors.append({"layer": index, "errors": errors, "smoothing_alpha": alphas,
                             **({"reconstruction": reconstruction} if reconstruction else {})})
        writer.write_progress(layer_errors)
        report.layers.append(LayerReport(index, round(time.perf_counter() - layer_started, 3), errors,
                                         round(job.stats_seconds, 3), round(job.solve_seconds, 3)))
        bar.set_postfix(err=f"{max(errors.values()):.2e}")

    report.seconds = round(run.elapsed(), 3)
    report.peak_rss_mb = peak_rss_mb()
    if stop_after_layers is not None and stop_after_layers < config.num_hidden_layers:
        return report

    source_config = json.loads((model_dir / "config.json").read_text())
    code = remote_code_for(model_dir, source_config)
    recorded = ALGORITHMS[recipe["algorithm"]].recorded_settings(recipe.values)
    quantization_config = fmt.quantization_config(qconfig, **recorded, quantizer=f"quantkit:{__version__}")
    manifest = {
        "quantkit_version": __version__,
        "format": fmt.name,
        "recipe": recipe.values,
        "compute_dtype": str(dtype).removeprefix("torch."),
        "fingerprints": {"model": model_fingerprint, "recipe": recipe.fingerprint(),
                         "calibration": calibration.fingerprint, "run": run.fingerprint},
        "calibration": calibration.describe(),
        "layer_errors": layer_errors,
        "remote_code": code.record,
        **(notes or {}),
    }
    configs = fmt.config_files(code.config({**source_config, "quantization_config": quantization_config}))
    writer.finish(model_dir, configs.pop("config.json"), quantization_config, report.to_dict(),
                  weights_file=fmt.weights_file, extra_configs=configs, code_files=code.files)
    with run.publishing():
        writer.write_manifest(manifest)
    return report


class _LayerJob:
    """Quantize one decoder layer: optional smoothing, then the sequential groups in order."""

    def __init__(self, config: MiniCPMConfig, index: int, recipe: Recipe, qconfig: QuantConfig, dtype,
                 device: torch.device, position_embeddings, activations: Activations):
        self.config, self.index, self.recipe, self.qconfig, self.dtype = config, index, recipe, qconfig, dtype
        self.device = device
        self.activations = activations
        self.prefix = layer_prefix(index)
        self.position_embeddings = position_embeddings
        self.skip_prefix = {name: recipe["prefix_tokens"] if name in recipe["prefix_linears"] else 0
                            for name in LINEARS}
        self.stats_seconds = self.solve_seconds = 0.0

    def _stats(self, runner: "LayerRunner", hidden: torch.Tensor, names: tuple[str, ...],
               sample_every: int = 0) -> dict[str, InputStats]:
        started = time.perf_counter()
        stats = runner.input_stats(hidden, names, self.skip_prefix, sample_every)
        self.stats_seconds += time.perf_counter() - started
        return stats

    def _runner(self, source: dict) -> LayerRunner:
        layer = _build_layer(self.config, self.index, source, self.dtype, self.device)
        return LayerRunner(layer, self.position_embeddings, self.recipe["calibration"]["batch_size"], self.activations)

    def smooth(self, source: dict, hidden: torch.Tensor, fmt: Format) -> tuple[dict, dict[str, float]]:
        """Fold AWQ's (or, for W8A8, SmoothQuant's) scales into an fp32 copy of the layer; the unquantized
        function is unchanged."""
        groups = scaling_groups_for(self.config.num_attention_heads, self.config.num_key_value_heads)
        search, sample_every = search_scale, 0
        if self.recipe["smooth"]["method"] == "smoothquant":  # scored on the activations themselves
            def search(weights, stats, config, grid):
                return search_migration(weights, stats, config, fmt.activation_grid(self.qconfig), grid)
            sample_every = max(1, hidden.shape[0] * hidden.shape[1] // SAMPLE_ROWS)
        stats = self._stats(self._runner(source), hidden, tuple(g.linears[0] for g in groups), sample_every)
        started = time.perf_counter()
        layer = _build_layer(self.config, self.index, source, torch.float32, self.device)
        searches = smooth_layer(layer, stats, self.qconfig, self.config.num_attention_heads,
                                self.config.num_key_value_heads, self.recipe["smooth"]["grid"], search)
        self.solve_seconds += time.perf_counter() - started
        smoothed = {self.prefix + name: t.to("cpu", source[self.prefix + name].dtype)
                    for name, t in layer.state_dict().items()}
        return smoothed, {name: search.alpha for name, search in searches.items()}

    def run(self, source: dict, hidden: torch.Tensor, fmt: Format, unquantized: torch.Tensor | None = None):
        """Quantize the layer; with block reconstruction, ``unquantized`` is the unquantized model's input to it,
        and its output is returned in its place."""
        alphas, checkpoint_layer = {}, source
        if self.recipe["smooth"]["enabled"]:
            source, alphas = self.smooth(source, hidden, fmt)
        runner = self._runner(source)
        algorithm = ALGORITHMS[self.recipe["algorithm"]]
        records, errors, input_abs_max, rounding_points = {}, {}, {}, {}
        for group in SEQUENTIAL_GROUPS:
            stats = self._stats(runner, hidden, (group[0],))[group[0]]
            for name in group:
                input_abs_max[name] = stats.abs_max
                weight = source[f"{self.prefix}{name}.weight"].to(self.device, torch.float32)
                target = fmt.target(self.qconfig, name, self.index, self.config, tuple(weight.shape))
                started = time.perf_counter()
                if unquantized is None:
                    records[name] = algorithm(weight, stats, target, self.recipe.values)
                else:  # block reconstruction starts from what the solver rounded
                    records[name], rounding_points[name] = algorithm.solve(weight, stats, target, self.recipe.values)
                self.solve_seconds += time.perf_counter() - started
                approx = records[name].dequantize(torch.float32).to(self.device)  # GGUF blocks decode on the host
                errors[name] = fast_relative_error(weight, approx, stats.hessian)
                runner.layer.get_submodule(name).weight.data = approx.to(self.dtype)
            keep = KEPT_AFTER.get(group)
            if keep is not None:
                started = time.perf_counter()
                keep(runner, hidden)
                self.stats_seconds += time.perf_counter() - started
        summary = None
        if unquantized is not None:
            started = time.perf_counter()
            # the unquantized input stays alive through the training (fp_input_fraction feeds it): the peak
            # is the unquantized forward's, which holds it beside its output anyway
            unquantized_inputs, unquantized = unquantized, self._runner(checkpoint_layer).forward(unquantized)
            result = self.reconstruct(source, records, rounding_points, hidden, unquantized, unquantized_inputs)
            self.solve_seconds += time.perf_counter() - started
            records, summary = result.records, result.summary()
            runner = self._runner(source)
            for name, record in records.items():
                runner.layer.get_submodule(name).weight.data = record.dequantize(self.dtype).to(self.device)
        shard = {n: t for n, t in source.items() if not _is_linear_weight(n, self.index)}
        shard.update({n: t.cpu() for n, t in fmt.write_layer(records, self.prefix).items()})
        shard.update({n: t.cpu() for n, t in fmt.activation_tensors(self.qconfig, input_abs_max, self.prefix).items()})
        if runner.key_value_abs_max is not None:
            shard.update({n: t.cpu() for n, t in
                          fmt.kv_cache_tensors(self.qconfig, *runner.key_value_abs_max, self.prefix).items()})
        started = time.perf_counter()
        hidden = runner.forward(hidden)
        self.stats_seconds += time.perf_counter() - started
        return shard, errors, alphas, hidden, unquantized, summary

    def reconstruct(self, source: dict, records: dict, rounding_points: dict, inputs: torch.Tensor,
                    targets: torch.Tensor, unquantized_inputs: torch.Tensor):
        """Block reconstruction of the layer's records against ``targets``, in float32 (the recipe's
        ``reconstruct`` section; ``quantkit.algorithms.reconstruct``)."""
        layer = _build_layer(self.config, self.index, source, torch.float32, self.device).requires_grad_(False)
        position_embeddings = tuple(t.to(torch.float32) for t in self.position_embeddings)

        def forward(linear_weights, batch):
            parameters = {f"{name}.weight": weight for name, weight in linear_weights.items()}
            return torch.func.functional_call(layer, parameters, (batch,),
                                              {"position_embeddings": position_embeddings})

        settings = self.recipe["reconstruct"]
        return reconstruct(forward, rounding_points, records, inputs, targets, settings,
                           eval_batch_size=self.recipe["calibration"]["batch_size"],
                           seed=settings["seed"] * 1_000_003 + self.index, fp_inputs=unquantized_inputs)


def _embed(embedding: torch.Tensor, input_ids: torch.Tensor, scale: float, store: Activations,
           batch_size: int) -> torch.Tensor:
    """The first layer's input, ``embedding[input_ids] * scale``, written into ``store`` a batch at a time."""
    hidden = store.empty((*input_ids.shape, embedding.shape[1]), embedding.dtype)
    for start in range(0, input_ids.shape[0], batch_size):
        rows = input_ids[start:start + batch_size]
        hidden[start:start + rows.shape[0]] = (embedding[rows] * scale).to(hidden.device)
    return hidden


def _is_linear_weight(name: str, index: int) -> bool:
    return name in {f"{layer_prefix(index)}{linear}.weight" for linear in LINEARS}


def _replayed(writer: ArtifactWriter, index: int, config: MiniCPMConfig, qconfig: QuantConfig, fmt: Format) -> dict:
    """A finished layer as the run used it: its shard's tensors with the linears dequantized."""
    from safetensors.torch import load_file

    shard = load_file(str(writer.shard_path(index)))
    return dequantize_layer(shard, index, config, qconfig, fmt)
