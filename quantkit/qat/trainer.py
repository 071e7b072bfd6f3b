"""Quantization-aware training: the loop.

Only what QAT needs is trained, as the recipe's ``qat.trains`` says (``fake_quant.TRAINS``): with
``weights``, the latent weights of the quantized linears (q/k/v/o/gate/up/down, seen through their grid
by ``fake_quant``) and the RMSNorm gains; with ``scales`` (mlx-lm's DWQ), only each group's scale and
float bias, the codes fixed. Embeddings and the LM head stay frozen, as the format stores them (in high
precision, or rounded to nearest where the format quantizes them too). AdamW keeps fp32 master
weights; calibration-style forwards run in bf16 where the CPU multiplies it in hardware. The loss
mixes cross-entropy with distillation from the FP model's cached top-k logits (``teacher``). The
learning rate follows ``schedule.wsd_learning_rate``.

Everything a run needs to continue lives in ``<out>.partial`` (``quantkit.run``): its fingerprint,
the last checkpoint (``state``) and the log. The same inputs, seed and thread count give the same
losses and bytes, and a resumed run ends with the weights of an uninterrupted one.

On a validation text the KL to the FP model (``teacher.heldout_kl``) and the perplexity are measured at
the start and every ``eval_interval`` steps. The KL chooses what is written (``qat.keep: best``: the
weights where it was lowest, the start's included, kept in the run's own folder as they are measured, so
that a run can only end at least as close to the FP model on that text as it started) and scales the
learning rate (``qat.full_rate_excess``: a start close to the FP model, such as a GPTQ, block-reconstructed
or int4 one, takes proportionally smaller steps; ``schedule.start_rate_factor``).

Under torchrun the run is data-parallel (``quantkit.distributed``; docs/distributed.md): each
step's micro-batches are dealt to the ranks (rank r takes micro-batches r, r + W, ...) and their
gradients summed over the ranks, so that a step, its learning rate and its batch mean what they mean in
one process, and the update is one process's up to the order of float additions. Each rank computes a
share of the teacher cache's chunks. Where the training state does not fit a device, or ``--shard on``
says so, the run is fully sharded instead (``quantkit.training.sharding``: FSDP2, each rank holding its
share of the weights, gradients and AdamW's moments). Rank 0 alone owns the run (its lock, staging, log and
output) and measures the held-out text (every rank does, sharded: a sharded forward is a collective),
sending the numbers to the others so that every rank takes the same decisions. Every rank writes its part of
the checkpoints and of the best weights (``state``: torch.distributed.checkpoint), which a run reads at any
world size, sharded or not.

The held-out perplexity comes from the caller (``perplexity``: ``quantkit.eval.ppl.perplexity``, which
the entry points pass in): a pipeline does not import the scoring layer.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from quantkit import atomic, calib
from quantkit.cache import cache_root
from quantkit.checkpoint import CheckpointReader
from quantkit.device import resolve_device
from quantkit.distributed import World, joined, throughput
from quantkit.formats import FORMATS
from quantkit.loading import load_model
from quantkit.models import MiniCPMConfig
from quantkit.models.layers import EMBEDDING, LM_HEAD, layer_prefix
from quantkit.qat.teacher import build_cache, cache_key, heldout_kl, heldout_targets
from quantkit.quant import QuantConfig
from quantkit.reader import ArtifactReader, linear_shapes
from quantkit.recipe import Recipe
from quantkit.run import RUN_DIR, Run, RunError, begin_on_main, peak_rss_mb
from quantkit.run.checks import validate_checkpoint
from quantkit.stats import compute_dtype
from quantkit.training import state
from quantkit.training.data import training_data
from quantkit.training.distill import distillation_loss
from quantkit.training.fake_quant import TRAINS, FakeQuantLinear, Trains, check_groups, wrap_linears
from quantkit.training.schedule import start_rate_factor, wsd_learning_rate
from quantkit.training.sharding import clip_gradients, gather_into, shard, sharded, state_bytes, syncing_gradients
from quantkit.version import __version__

CHECKPOINT_DIR = "qat_checkpoint"
BEST_DIR = "qat_best"  # the trainable weights of the lowest held-out KL measured so far (in the run's own folder)
LOG_FILE = "qat_log.json"
HELDOUT = "austen"
NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclass
class QATReport:
    out_dir: str
    recipe: str
    steps: int = 0
    tokens: int = 0
    resumed_from_step: int = 0
    teacher_seconds: float = 0.0
    train_seconds: float = 0.0
    tokens_per_second: float = 0.0
    peak_rss_mb: float = 0.0
    threads: int = field(default_factory=torch.get_num_threads)  # per rank
    world_size: int = 1
    backend: str | None = None  # torch.distributed's, None for one process
    sharded: bool = False  # FSDP: each rank held a share of the weights, gradients and optimizer state
    rank_tokens_per_second: list[float] = field(default_factory=list)  # each rank's share of tokens_per_second
    rank_collective_share: list[float] = field(default_factory=list)  # of each rank's loop, in collectives
    kept_step: int = 0  # the step whose weights are written (qat.keep)
    kept_heldout_ppl: float = 0.0
    log: list[dict] = field(default_factory=list)  # one entry per step; "heldout_kl"/"heldout_ppl" where measured

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainedModel:
    """What ``train`` hands the writer: the student, whose wrapped linears give their records, the grid of
    each linear, the run's grid, the run, which the writer publishes (rank 0's: the other ranks of a torchrun
    job have none, and write nothing), and the world the run trained in."""

    model: torch.nn.Module
    grids: dict[str, QuantConfig]  # "model.layers.{i}.{linear}" -> grid
    report: QATReport
    run: Run | None
    data: dict
    qconfig: QuantConfig
    world: World


def _student(source: Path, config: MiniCPMConfig, grids: dict[str, QuantConfig], trains: Trains,
             outside: dict[str, torch.Tensor]):
    """The FP (or initial) model with every decoder linear wrapped as ``trains`` says, its embedding and
    LM head as the format stores them (``outside``), and the parameters that train. An artifact's
    quantized linears start from its own records."""
    model = load_model(source, torch.float32)
    model.requires_grad_(False)
    with torch.no_grad():
        for name, tensor in outside.items():
            model.get_parameter(name).copy_(tensor)
    artifact = ArtifactReader(source)
    starts = {} if artifact.format is None else {
        name.removesuffix(".weight"): record
        for index in range(config.num_hidden_layers) for name, record in artifact.layer(index)[1].items()}
    wrap_linears(model, grids, trains.linear, starts)
    trainable = {f"{name}.{param}": model.get_parameter(f"{name}.{param}")
                 for name in grids for param in trains.parameters}
    if trains.norms:
        for index in range(config.num_hidden_layers):
            for norm in NORMS:
                name = f"{layer_prefix(index)}{norm}"
                trainable[f"{name}.weight"] = model.get_submodule(name).weight
        trainable["model.norm.weight"] = model.model.norm.weight
    for param in trainable.values():
        param.requires_grad_(True)
    return model, trainable


def outside_as_stored(reader: CheckpointReader, fmt, qconfig: QuantConfig) -> dict[str, torch.Tensor]:
    """The embedding and LM head as float32 weights of what ``fmt`` stores, for a format that quantizes
    them too (MLX); nothing for the others, which store them as they are."""
    if fmt.write_outside is None:
        return {}
    stored = fmt.write_outside({name: reader.get(name) for name in (EMBEDDING, LM_HEAD) if name in reader}, qconfig)
    return {name: tensor.to(torch.float32) for name, tensor in fmt.read_outside(stored, qconfig).items()}


def _refresh(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FakeQuantLinear):
            module.refresh()


def _best_measured(log: list[dict]) -> dict:
    """The log's entry of the lowest held-out KL, the earliest of equals."""
    return min((entry for entry in log if "heldout_kl" in entry), key=lambda entry: entry["heldout_kl"])


def _restore_best(folder: Path, trainable: dict[str, torch.nn.Parameter], step: int, world: World) -> None:
    """Put the weights saved at ``step`` back into ``trainable``."""
    saved = state.record(folder)["step"]
    if saved != step:
        raise RunError(f"{folder} holds the weights of step {saved}, the log's lowest held-out KL is "
                       f"step {step}'s: the run's files disagree; start it again without --resume")
    state.load(folder, trainable, None, world)


def train(model_dir: str | Path, recipe: Recipe, out_dir: str | Path, *, perplexity: Callable,
          tokens: int | None = None, init: str | Path | None = None, resume: bool = False, device: str = "auto",
          shard_state: str = "auto", progress: bool = True, stop_after_steps: int | None = None) -> TrainedModel | None:
    """Train ``model_dir`` (or the artifact ``init``, e.g. a GPTQ ternary one, as the starting weights)
    toward ``recipe``'s grid, logging the held-out ``perplexity`` (``quantkit.eval.ppl.perplexity``).
    ``stop_after_steps`` ends the run early, leaving its checkpoint as an interruption would (tests use
    it to prove resumption). Under torchrun, this process's rank of the job's data-parallel run, sharded as
    ``shard_state`` says (auto, on or off: ``sharding.sharded``): rank 0 gets what it writes, the other ranks
    None (their student, sharded, holds the process group, which must go with the block)."""
    device = resolve_device(device)
    with joined(device) as world:
        return _train(Path(model_dir), recipe, Path(out_dir), perplexity=perplexity, tokens=tokens, init=init,
                      resume=resume, device=device, shard_state=shard_state, progress=progress and world.is_main,
                      stop_after_steps=stop_after_steps, world=world)


def _train(model_dir: Path, recipe: Recipe, out_dir: Path, *, perplexity: Callable, tokens: int | None,
           init: str | Path | None, resume: bool, device: str, shard_state: str, progress: bool,
           stop_after_steps: int | None, world: World) -> TrainedModel | None:
    run = world.made_on_main(lambda: Run(out_dir, resume=resume))
    staging = atomic.staging_dir(out_dir)
    if "qat" not in recipe.values:
        raise RunError(f"recipe {recipe.name} has no 'qat' section: it is a post-training recipe "
                       "(`quantkit quantize`); QAT recipes are qat-ternary-g32, qat-ternary-g256 and mlx-dwq-w4g64")
    settings = recipe["qat"]
    total_tokens = tokens or settings["tokens"]
    rows_per_step = settings["batch_tokens"] // settings["seq_len"]
    total_steps = total_tokens // settings["batch_tokens"]
    if total_steps < 1:
        raise RunError(f"--tokens {total_tokens} is less than one step of {settings['batch_tokens']} tokens")
    micro_batches = rows_per_step // settings["micro_batch"]
    world.refuse_uneven(micro_batches, f"qat: a step's {micro_batches} micro-batches (qat.batch_tokens / "
                        "(qat.seq_len x qat.micro_batch))", "qat.batch_tokens or qat.micro_batch")

    config = MiniCPMConfig.from_pretrained(model_dir)
    reader = CheckpointReader(model_dir)
    fmt = FORMATS[recipe["format"]]
    qconfig = fmt.grid(recipe["quant"], reader.dtype(EMBEDDING))
    trains = TRAINS[settings["trains"]]
    check_groups(qconfig, linear_shapes(config))
    validate_checkpoint(reader, config, qconfig, fmt, desc_act=False, progress=progress)
    outside = outside_as_stored(reader, fmt, qconfig)
    init_fingerprint = None
    if init is not None:
        if linear_shapes(MiniCPMConfig.from_pretrained(init)) != linear_shapes(config):
            raise RunError(f"--init {init} is not a variant of {model_dir}: its linears have other shapes")
        try:
            trains.linear.check_start(ArtifactReader(init).qconfig, qconfig)
        except ValueError as e:
            raise RunError(str(e)) from e
        init_fingerprint = CheckpointReader(init).fingerprint()

    from quantkit.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    data = training_data(tokenizer, settings["data"], settings["seq_len"], settings["seed"])
    heldout = calib.heldout_tokens(tokenizer, HELDOUT, max_tokens=settings["eval_tokens"])
    model_fingerprint = reader.fingerprint()
    inputs = {"model": model_fingerprint, "init": init_fingerprint, "recipe": recipe.fingerprint(),
              "data": data.fingerprint, "tokens": total_tokens, "quantkit": __version__}
    continuing = begin_on_main(world, run, inputs, state.progress_file(CHECKPOINT_DIR))

    report = QATReport(out_dir=str(out_dir), recipe=recipe.name, **world.described)
    heldout = heldout.to(device)
    weight, temperature = settings["distill_weight"], settings["temperature"]
    # the teacher's distribution on the held-out rows, for the KL measured there (by rank 0)
    measures_kl = weight > 0 or settings["keep"] == "best" or settings["full_rate_excess"] > 0
    grids = {f"{layer_prefix(index)}{linear}": fmt.target(qconfig, linear, index, config, shape)
             for index in range(config.num_hidden_layers) for linear, shape in linear_shapes(config).items()}
    # built on the host, and moved to the device once the teacher has gone: whole, or sharded unit by unit
    model, trainable = _student(Path(init) if init is not None else model_dir, config, grids, trains, outside)
    report.sharded = sharded(shard_state, world, state_bytes(model, trainable), device)
    measures_here = measures_kl and (world.is_main or report.sharded)  # a sharded forward needs every rank
    cache, targets = None, None
    if weight > 0 or measures_here:
        started = time.perf_counter()
        dtype = compute_dtype(recipe["compute_dtype"])
        teacher = load_model(model_dir, torch.float32).to(device)  # in float32, as the student is measured
        if measures_here:
            targets = heldout_targets(teacher, heldout, settings["seq_len"])
        if weight > 0:
            key = cache_key(model_fingerprint, data.fingerprint, settings["top_k"], dtype)
            visited = list(dict.fromkeys(data.row_ids(0, total_steps * rows_per_step)))
            cache = build_cache(teacher.to(dtype), data.rows.to(device), visited, settings["top_k"],
                                cache_root() / "qat-teacher" / key, progress, world)
        del teacher
        report.teacher_seconds = round(time.perf_counter() - started, 3)
    if report.sharded:  # each unit moved to the device as it is sharded: the whole model is never there
        shard([*model.model.layers, model])
        trainable = {name: model.get_parameter(name) for name in trainable}  # now the ranks' shards
    else:
        model.to(device)

    optimizer = torch.optim.AdamW(list(trainable.values()), lr=settings["learning_rate"],
                                  betas=tuple(settings["betas"]), eps=settings["eps"],
                                  weight_decay=settings["weight_decay"])
    best_dir = staging / RUN_DIR / BEST_DIR
    start_step = 0
    if continuing:
        loop = state.load(staging / CHECKPOINT_DIR, trainable, optimizer, world)
        start_step, report.log = loop["step"], loop["log"]
        report.resumed_from_step = start_step
    _refresh(model)

    @torch.no_grad()
    def on_heldout() -> dict:
        """The held-out perplexity, and the KL to the teacher there when its targets are known."""
        result = {"heldout_ppl": perplexity(model, heldout, window=settings["seq_len"]).perplexity}
        if targets is not None:
            result["heldout_kl"] = heldout_kl(model, targets)
        return result

    def measured() -> dict:
        """``on_heldout`` as rank 0 (which alone holds the targets) measures it, on every rank."""
        return world.from_main(on_heldout, ("heldout_ppl", "heldout_kl") if measures_kl else ("heldout_ppl",),
                               computed_by_all=report.sharded)

    if start_step == 0:
        start = {"step": 0, "tokens": 0, **measured(), "rate_factor": 1.0}
        if measures_kl:
            start["rate_factor"] = start_rate_factor(start["heldout_kl"], settings["full_rate_excess"])
        report.log.append(start)
        if settings["keep"] == "best":
            state.save(best_dir, trainable, None, {"step": 0}, world)
    rate_factor = report.log[0]["rate_factor"]

    autocast = compute_dtype(recipe["compute_dtype"]) == torch.bfloat16
    best = min((entry["loss"] for entry in report.log if "loss" in entry), default=math.inf)
    last = total_steps if stop_after_steps is None else min(total_steps, stop_after_steps)
    bar = tqdm(range(start_step, last), desc=f"qat {recipe.name}", unit="step", disable=not progress,
               initial=start_step, total=total_steps)
    started = time.perf_counter()
    collectives_before = world.in_collectives.seconds
    for step in bar:
        lr = wsd_learning_rate(step, total_steps, settings["learning_rate"] * rate_factor, settings["warmup"],
                               settings["decay"], settings["final_lr"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        losses, mine = [], world.share(micro_batches)
        for micro in mine:
            if report.sharded:  # reduce-scatter once, after this rank's last micro-batch of the step
                syncing_gradients(model, micro == mine[-1])
            rows = data.micro_batch(step, micro, rows_per_step, settings["micro_batch"])
            ids = data.rows[rows].to(device)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                logits = model(ids[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            if cache is not None:
                teacher = cache.batch(rows)
                teacher_ids, teacher_logits = teacher["ids"].long().to(device), teacher["logits"].to(device)
                distill = distillation_loss(logits, teacher_ids[:, :-1], teacher_logits[:, :-1], temperature)
                loss = (1 - weight) * loss + weight * distill
            (loss / micro_batches).backward()  # a share of the step's mean over every rank's micro-batches
            losses.append(loss.item())
        if not report.sharded:  # (sharded, the backward of the last micro-batch summed them)
            world.sum_([param.grad for param in trainable.values() if param.grad is not None])
        losses = world.unshared(losses)  # every micro-batch's, in order: the step loss one process computes
        step_loss = sum(losses) / len(losses)
        if not math.isfinite(step_loss) or step_loss > settings["max_loss_growth"] * best:
            saved = max((entry["step"] for entry in report.log if entry.get("checkpoint")), default=0)
            raise RunError(f"qat: the loss {'is not finite' if not math.isfinite(step_loss) else 'exploded'} "
                           f"({step_loss:.4g}, best {best:.4g}) at step {step + 1}; the last good checkpoint "
                           f"(step {saved}) is kept in {staging}. Lower qat.learning_rate or raise qat.warmup "
                           "and start again")
        best = min(best, step_loss)
        grad_norm = clip_gradients(list(trainable.values()), settings["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _refresh(model)
        entry = {"step": step + 1, "tokens": (step + 1) * settings["batch_tokens"], "loss": step_loss,
                 "lr": lr, "grad_norm": grad_norm}
        if (step + 1) % settings["eval_interval"] == 0 or step + 1 == total_steps:
            entry.update(measured())
            if settings["keep"] == "best" and entry["heldout_kl"] < _best_measured(report.log)["heldout_kl"]:
                state.save(best_dir, trainable, None, {"step": step + 1}, world)
        if (step + 1) % settings["checkpoint_interval"] == 0 or step + 1 == last:
            entry["checkpoint"] = True
        report.log.append(entry)
        if entry.get("checkpoint"):
            state.save(staging / CHECKPOINT_DIR, trainable, optimizer, {"step": step + 1, "log": report.log}, world)
            if world.is_main:
                atomic.write_json(staging / LOG_FILE, report.log)
        elapsed = time.perf_counter() - started
        done = (step + 1 - start_step) * settings["batch_tokens"]
        bar.set_postfix(loss=f"{step_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{done / elapsed:.0f}")

    kept = _best_measured(report.log) if settings["keep"] == "best" else report.log[-1]
    if last == total_steps and kept["step"] != last:
        _restore_best(best_dir, trainable, kept["step"], world)
        _refresh(model)
    if report.sharded:  # rank 0's writer gets the student unsharded: built again, its trained weights put back
        unsharded = None
        if world.is_main:
            model, unsharded = _student(Path(init) if init is not None else model_dir, config, grids, trains, outside)
        gather_into(trainable, unsharded, world)
        _refresh(model)
    report.kept_step, report.kept_heldout_ppl = kept["step"], kept.get("heldout_ppl", 0.0)
    report.steps = last
    report.tokens = last * settings["batch_tokens"]
    report.train_seconds = round(time.perf_counter() - started, 3)
    trained = (last - start_step) * settings["batch_tokens"]
    report.tokens_per_second, report.rank_tokens_per_second, report.rank_collective_share = throughput(
        world, trained, report.train_seconds, world.in_collectives.seconds - collectives_before)
    report.peak_rss_mb = peak_rss_mb()
    return TrainedModel(model, grids, report, run, data.described, qconfig, world) if world.is_main else None
