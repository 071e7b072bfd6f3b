"""Training an EAGLE-3 head for a target model (``quantkit draft train``).

The head starts from the target where it can: its LM head is the target's, restricted to the draft
vocabulary (FR-Spec: the training text's most frequent tokens) and divided by the target's μP logit
divisor, its final norm the target's; fc and the midlayer start from PyTorch's default init under
the run's seed. The target runs once per training row (``features``); training then needs only the
head: every step unrolls ``ttt_steps`` draft steps over each row (``ttt``) and matches each step's
draft distribution to the target's over the draft vocabulary (step j weighted ``step_weight``ʲ, as
EAGLE-3 does). AdamW, WSD schedule, gradient clipping; checkpoints, ``--resume`` and the held-out
log as in QAT (``quantkit.training``).

The target, the head, the features of the step's rows and the optimizer's state live on the chosen
device (a CUDA GPU or the CPU, the same torch code on either); the text, the feature cache's files
and the written head stay on the host.

Under torchrun the run is data-parallel, as QAT's (``quantkit.distributed``; docs/distributed.md):
rank r of W takes rows r, r + W, ... of each step's ``batch_rows``; each step's loss is a mean over the
positions of all the step's rows, so each rank divides its positions' sum by the step's count over every
rank, and the ranks' losses and gradients, summed, are the step's, one process's up to the order of float
additions. Each rank computes a share of the target features' chunks (and of the own-text rows). Rank 0
alone owns the run (its lock, staging, checkpoints and the written head); every rank measures the held-out
rows alike, the same head on the same rows. The checkpoint holds the whole state: a run resumes at any world
size.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from quantkit import atomic, calib
from quantkit.cache import cache_root
from quantkit.checkpoint import CheckpointReader
from quantkit.device import resolve_device
from quantkit.distributed import SINGLE, World, joined, throughput
from quantkit.draft.features import build_features, features_key, row_features
from quantkit.draft.head_files import save_quantized_head
from quantkit.draft.settings import DraftSettings
from quantkit.draft.ttt import unrolled_steps
from quantkit.formats import FORMATS
from quantkit.loading import load_model
from quantkit.models.eagle3 import (
    HEAD_LINEAR_GROUPS,
    Eagle3Config,
    Eagle3Head,
    draft_vocabulary,
    save_head,
)
from quantkit.quant import QuantConfig
from quantkit.reader import load_head
from quantkit.run import Run, RunError, begin_on_main, peak_rss_mb
from quantkit.training import state
from quantkit.training.data import training_data
from quantkit.training.distill import distillation_loss
from quantkit.training.fake_quant import FakeQuantLinear, quantized_record, wrap_linears
from quantkit.training.own_text import own_text
from quantkit.training.schedule import wsd_learning_rate
from quantkit.training.sharding import clip_gradients, gather_into, shard, sharded, state_bytes
from quantkit.version import __version__

CHECKPOINT_DIR = "draft_checkpoint"
LOG_FILE = "draft_train.json"  # what was trained: the same bytes for the same inputs, resumed or not
REPORT_FILE = "draft_report.json"  # how this run went: timings, memory, where it resumed
HELDOUT = "austen"
W4_GRID = QuantConfig(bits=4, group_size=128, sym=True)  # the MiniCPM4 report's QAT head: W4A16 g128 (Marlin)


@dataclass
class DraftReport:
    out_dir: str
    device: str = "cpu"
    steps: int = 0
    tokens: int = 0
    resumed_from_step: int = 0
    draft_vocab: int = 0
    heldout_coverage: float = 0.0  # share of held-out tokens in the draft vocabulary
    features_seconds: float = 0.0
    train_seconds: float = 0.0
    tokens_per_second: float = 0.0
    peak_rss_mb: float = 0.0
    threads: int = field(default_factory=torch.get_num_threads)  # per rank
    world_size: int = 1
    backend: str | None = None  # torch.distributed's, None for one process
    sharded: bool = False  # FSDP: each rank held a share of the head, its gradients and optimizer state
    rank_tokens_per_second: list[float] = field(default_factory=list)  # each rank's share of tokens_per_second
    rank_collective_share: list[float] = field(default_factory=list)  # of each rank's loop, in collectives
    log: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def initial_head(target, settings: DraftSettings, token_counts: torch.Tensor) -> Eagle3Head:
    """The head before training (see the module docstring), deterministic under ``settings.seed``."""
    config = target.config
    head_config = Eagle3Config(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, vocab_size=config.vocab_size,
        draft_vocab_size=settings.vocabulary_size(config.vocab_size), target_hidden_size=config.hidden_size,
        rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings, aux_states=settings.aux_states)
    with torch.random.fork_rng():
        torch.manual_seed(settings.seed)
        head = Eagle3Head(head_config, config)
    d2t, t2d = draft_vocabulary(token_counts, head_config.draft_vocab_size)
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        used = torch.nonzero(t2d).flatten().to(target.lm_head.weight.device)
        head.lm_head.weight.copy_(target.lm_head.weight[used].float() / config.logit_divisor)
        head.norm.weight.copy_(target.model.norm.weight.float())
    return head


def step_loss(head: Eagle3Head, embedding, tokens: torch.Tensor, features: dict, settings: DraftSettings,
              world: World = SINGLE):
    """Weighted loss over the unrolled steps of rows ``tokens`` [B, T], and each step's top-1 agreement
    with the target (draft argmax = the target's top token in the draft vocabulary, where the target's
    argmax is in it): the acceptance rate a greedy chain would see at that depth. In a torchrun job
    ``tokens`` are this rank's share of the step's rows: each draft step's mean is over the positions of
    every rank's rows, so the loss is this rank's share of the step's, and the agreement the step's."""
    aux = features["aux"][:, :-1].float()  # positions 0..T-2: the last has no next token in the row
    embeds = head.embed(embedding, tokens[:, 1:])
    teacher_ids, teacher_logits = features["ids"][:, 1:].long(), features["logits"][:, 1:]
    valid = features["in_vocabulary"][:, 1:]
    positions = torch.arange(aux.shape[1], device=aux.device)[None]
    masks = [valid & (positions >= step) for step in range(settings.ttt_steps)]  # no chain reaches before ``step``
    kept = torch.stack([mask.sum() for mask in masks])
    world.sum_([kept])
    total, agreed = 0.0, []
    for step, hidden in enumerate(unrolled_steps(head, aux, embeds, settings.ttt_steps)):
        logits = head.logits(hidden)
        total = total + settings.step_weight ** step * distillation_loss(logits, teacher_ids, teacher_logits, 1.0,
                                                                         masks[step], kept[step])
        agreed.append(((logits.argmax(-1) == teacher_ids[..., 0]) & masks[step]).sum())
    agreed = torch.stack(agreed)
    world.sum_([agreed])
    return total, [float(agree) / max(int(count), 1) for agree, count in zip(agreed, kept)]


def _starting_head(init: Path, target, settings: DraftSettings) -> Eagle3Head:
    """An existing head to continue from (re-alignment: an FP head trained on, for a quantized target),
    with its own vocabulary and aux states, which the settings must not contradict."""
    head = load_head(init, target.config)
    if settings.draft_vocab not in (None, head.config.draft_vocab_size):
        raise RunError(f"--init {init} has a draft vocabulary of {head.config.draft_vocab_size} tokens, "
                       f"not {settings.draft_vocab}")
    if settings.aux_states != head.config.aux_states:
        raise RunError(f"--init {init} reads aux_states {head.config.aux_states!r}, not "
                       f"{settings.aux_states!r}")
    return head.train()


def train_head(target_dir: str | Path, out_dir: str | Path, settings: DraftSettings = DraftSettings(), *,
               init: str | Path | None = None, resume: bool = False, device: str = "auto", shard_state: str = "auto",
               progress: bool = True, stop_after_steps: int | None = None) -> DraftReport | None:
    """Train a head for the checkpoint or artifact ``target_dir`` (from scratch, or from the head ``init``)
    on ``device`` (cpu, cuda, or auto: ``resolve_device``) and write it to ``out_dir`` (official layout,
    plus ``draft_train.json``). ``stop_after_steps`` leaves the run as an interruption would (tests).
    Under torchrun, this process's rank of the job's data-parallel run, the head sharded as ``shard_state``
    says (auto, on or off: ``sharding.sharded``): rank 0 writes and returns the report, the other ranks None."""
    device = resolve_device(device)
    with joined(device) as world:
        report = _train_head(Path(target_dir), Path(out_dir), settings, init=init, resume=resume, device=device,
                             shard_state=shard_state, progress=progress and world.is_main,
                             stop_after_steps=stop_after_steps, world=world)
        return report if world.is_main else None


def _train_head(target_dir: Path, out_dir: Path, settings: DraftSettings, *, init: str | Path | None, resume: bool,
                device: str, shard_state: str, progress: bool, stop_after_steps: int | None,
                world: World) -> DraftReport:
    from quantkit.tokenizer import load_tokenizer

    world.refuse_uneven(settings.batch_rows, f"draft train: a step's {settings.batch_rows} rows (--batch-rows)",
                        "--batch-rows")
    run = world.made_on_main(lambda: Run(out_dir, resume=resume))
    staging = atomic.staging_dir(out_dir)
    target = load_model(target_dir, torch.float32).to(device)
    target.requires_grad_(False)
    settings.check(target.config.vocab_size)
    tokenizer = load_tokenizer(target_dir)
    data = training_data(tokenizer, settings.data, settings.seq_len, settings.seed)
    target_fingerprint = CheckpointReader(target_dir).fingerprint()
    init_fingerprint = None if init is None else CheckpointReader(init).fingerprint()
    continuing = begin_on_main(world, run, {"target": target_fingerprint, "data": data.fingerprint,
                                            "settings": asdict(settings), "init": init_fingerprint,
                                            "quantkit": __version__}, state.progress_file(CHECKPOINT_DIR))
    total_steps = settings.tokens // (settings.batch_rows * settings.seq_len)
    visited = list(dict.fromkeys(data.row_ids(0, total_steps * settings.batch_rows)))
    if settings.own_text_after:
        data = own_text(target, target_fingerprint, data, settings.own_text_after, visited,
                        cache_root() / "draft-own-text", progress, world)

    # made on the host, then moved: the seeded initialisation draws from the CPU's generator on either device
    head = (initial_head(target, settings, torch.bincount(data.rows.flatten(), minlength=target.config.vocab_size))
            if init is None else _starting_head(Path(init), target, settings)).to(device)
    report = DraftReport(out_dir=str(out_dir), device=device, draft_vocab=head.config.draft_vocab_size,
                         **world.described)
    heldout = calib.heldout_tokens(tokenizer, HELDOUT, max_tokens=settings.eval_rows * settings.seq_len).to(device)
    report.heldout_coverage = float(head.t2d[heldout].float().mean())
    heldout_rows = heldout[:heldout.numel() // settings.seq_len * settings.seq_len].view(-1, settings.seq_len)
    started = time.perf_counter()
    key = features_key(target_fingerprint, data.fingerprint, head, settings.top_k)
    features = build_features(target, head, data.rows.to(device), visited, settings.top_k,
                              cache_root() / "draft-features" / key, progress, world)
    with torch.no_grad():
        heldout_features = [row_features(target, head, row, settings.top_k) for row in heldout_rows]
    heldout_features = {name: torch.stack([f[name] for f in heldout_features]) for name in heldout_features[0]}
    report.features_seconds = round(time.perf_counter() - started, 3)

    if settings.w4 is not None:  # quantization-aware: the linears train through W4's grid
        linears = {name: head.get_submodule(name) for group in HEAD_LINEAR_GROUPS for name in group}
        for name, module in linears.items():
            FORMATS[settings.w4].check(W4_GRID, module.in_features, module.out_features, False, name)
        wrap_linears(head, dict.fromkeys(linears, W4_GRID))
    embedding = target.model.embed_tokens
    report.sharded = sharded(shard_state, world, state_bytes(head, dict(head.named_parameters())), device)
    unsharded = None  # what rank 0 writes a sharded head into: a copy made before it was sharded, on the host
    if report.sharded:  # every module holding parameters a unit: the training-time test calls them one by one
        unsharded = copy.deepcopy(head).cpu() if world.is_main else None
        shard([module for module in head.modules() if next(module.parameters(recurse=False), None) is not None])
    trainable = {name: parameter for name, parameter in head.named_parameters()}
    optimizer = torch.optim.AdamW(list(trainable.values()), lr=settings.learning_rate, betas=settings.betas,
                                  weight_decay=settings.weight_decay)
    start_step = 0
    if continuing:
        loop = state.load(staging / CHECKPOINT_DIR, trainable, optimizer, world)
        start_step, report.log = loop["step"], loop["log"]
        report.resumed_from_step = start_step

    def evaluate() -> dict:
        with torch.no_grad():
            loss, agreement = step_loss(head, embedding, heldout_rows, heldout_features, settings)
        return {"heldout_loss": float(loss), "heldout_top1_by_step": agreement}

    if start_step == 0:
        report.log.append({"step": 0, "tokens": 0, **evaluate()})
    last = total_steps if stop_after_steps is None else min(total_steps, stop_after_steps)
    bar = tqdm(range(start_step, last), desc="draft head", unit="step", disable=not progress, initial=start_step,
               total=total_steps)
    started = time.perf_counter()
    collectives_before = world.in_collectives.seconds
    for step in bar:
        lr = wsd_learning_rate(step, total_steps, settings.learning_rate, settings.warmup, settings.decay,
                               settings.final_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        rows = data.row_ids(step * settings.batch_rows, settings.batch_rows)
        rows = [rows[index] for index in world.share(len(rows))]  # this rank's: rows r, r + W, ... of the step's
        batch = {name: tensor.to(device) for name, tensor in features.batch(rows).items()}
        loss, agreement = step_loss(head, embedding, data.rows[rows].to(device), batch, settings, world)
        value = sum(world.per_rank(float(loss.detach())))  # the ranks' shares of the step's loss
        if not math.isfinite(value):
            raise RunError(f"draft train: the loss is not finite at step {step + 1}; the last checkpoint "
                           f"is kept in {staging}. Lower the learning rate and start again")
        loss.backward()
        if not report.sharded:  # (sharded, the backward reduce-scattered them)
            world.sum_([param.grad for param in trainable.values() if param.grad is not None])
        grad_norm = clip_gradients(list(trainable.values()), settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for module in head.modules():
            if isinstance(module, FakeQuantLinear):
                module.refresh()
        entry = {"step": step + 1, "tokens": (step + 1) * settings.batch_rows * settings.seq_len, "loss": value,
                 "top1_by_step": agreement, "lr": lr, "grad_norm": grad_norm}
        if (step + 1) % settings.eval_interval == 0 or step + 1 == total_steps:
            entry.update(evaluate())
        if (step + 1) % settings.checkpoint_interval == 0 or step + 1 == last:
            entry["checkpoint"] = True
        report.log.append(entry)
        if entry.get("checkpoint"):
            state.save(staging / CHECKPOINT_DIR, trainable, optimizer, {"step": step + 1, "log": report.log}, world)
        done = (step + 1 - start_step) * settings.batch_rows * settings.seq_len
        bar.set_postfix(loss=f"{value:.3f}", top1=f"{agreement[0]:.2f}", lr=f"{lr:.2e}",
                        tok_s=f"{done / (time.perf_counter() - started):.0f}")

    report.steps, report.tokens = last, last * settings.batch_rows * settings.seq_len
    report.train_seconds = round(time.perf_counter() - started, 3)
    trained = (last - start_step) * settings.batch_rows * settings.seq_len
    report.tokens_per_second, report.rank_tokens_per_second, report.rank_collective_share = throughput(
        world, trained, report.train_seconds, world.in_collectives.seconds - collectives_before)
    report.peak_rss_mb = peak_rss_mb()
    if report.sharded and last == total_steps:
        gather_into(trainable, None if unsharded is None else dict(unsharded.named_parameters()), world)
        if world.is_main:  # the writer's head: the unsharded copy, now holding the trained weights
            head = unsharded
    if last < total_steps or not world.is_main:  # stopped early (the checkpoint stays), or not the run's owner
        return report
    head.cpu()  # the writer works on the host
    with run.publishing():
        if settings.w4 is None:
            save_head(head, staging)
        else:
            records = {name: quantized_record(head.get_submodule(name).weight, W4_GRID)
                       for group in HEAD_LINEAR_GROUPS for name in group}
            save_quantized_head(head, records, settings.w4, staging)
        atomic.write_json(staging / LOG_FILE, {"settings": asdict(settings), "target": str(target_dir),
                                               "data": data.described, "steps": report.steps,
                                               "tokens": report.tokens, "draft_vocab": report.draft_vocab,
                                               "heldout_coverage": report.heldout_coverage, "log": report.log})
        atomic.write_json(staging / REPORT_FILE, report.to_dict())
    return report
