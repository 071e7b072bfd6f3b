"""One report for many variants of a model: every variant scored the same way, in one run.

For each variant (the FP model, and artifacts in any format quantkit reads): its size on disk and
bits per parameter, perplexity and its change, KL divergence and top-1 agreement against the
reference (from the on-disk reference cache, ``refcache``), the per-layer reconstruction error
its quantization run recorded, and on request task scores (``quantkit.eval.tasks``) and the
speculative acceptance length τ of the variant as target with a given draft (``accept``).
Written as ``report.json`` (with seeds, data hash and package
versions), ``report.md``, and two PNG plots: KL against bits per parameter, and error per layer.

Under torchrun the variants are spread over the ranks (``quantkit.distributed``): rank 0 computes the
reference cache while the others wait, then rank r scores variants r, r + W, ... (the reference counted
first) against it, whole, and every rank receives every result in the order one process lists them; the
caller's rank 0 writes the report. A variant's numbers are those one process computes for it.
"""
from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

import torch

from quantkit.distributed import SINGLE, World
from quantkit.table import format_table

PACKAGES = ("quantkit", "torch", "transformers", "numpy", "safetensors", "gguf")
ACCEPT_PROMPT_TOKENS = 64  # tokens per τ prompt


@dataclass
class VariantResult:
    name: str
    path: str
    size_mb: float
    bits_per_parameter: float
    perplexity: float
    delta_ppl_pct: float
    mean_kl: float
    top1: float
    layer_errors: list[float] = field(default_factory=list)  # mean relative error of each layer's linears
    tasks: dict[str, float] = field(default_factory=dict)  # task name -> headline score
    tau: float | None = None  # speculative acceptance length with the report's draft


@dataclass(frozen=True)
class Extras:
    """What a report measures beyond perplexity and KL (each costs generation time)."""

    tasks: tuple[str, ...] = ()
    task_limit: int | None = None  # samples per task (default: each task's own subset)
    draft: Path | None = None  # τ of every variant as the target of this draft
    accept_k: int = 4
    accept_prompts: int = 4
    accept_new_tokens: int = 64


def weight_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def layer_errors(model_dir: Path) -> list[float]:
    """Mean ‖ΔW X‖²/‖W X‖² over each layer's linears, from the artifact's manifest (empty for FP)."""
    from quantkit.artifact import MANIFEST_FILE

    manifest = model_dir / MANIFEST_FILE
    if not manifest.is_file():
        return []
    layers = json.loads(manifest.read_text())["layer_errors"]
    return [sum(entry["errors"].values()) / len(entry["errors"]) for entry in layers]


def _task_scores(path: Path, extras: Extras, progress: bool, device: str = "cpu") -> dict[str, float]:
    from quantkit.eval.tasks.model import TaskModel
    from quantkit.eval.tasks.registry import evaluate_tasks

    results = evaluate_tasks(TaskModel.load(path, device), list(extras.tasks), extras.task_limit, progress)
    return {r.task: r.score for r in results}


def evaluate(reference_dir: Path, variants: list[Path], tokens: torch.Tensor, window: int, stride: int | None,
             top_k: int, cache_dir: Path, progress: bool = False, extras: Extras = Extras(),
             device: str = "cpu", world: World = SINGLE) -> tuple[list[VariantResult], Path]:
    """Every variant's result (the reference first) and the reference cache's path. The models run on
    ``device`` (task scores too); ``tokens`` stay on the host for the cache key. In a torchrun job
    (``world``), each rank scores its share of the variants and every rank returns them all."""
    from quantkit.eval.accept import acceptance, prompt_rows
    from quantkit.eval.refcache import cached_reference, kl_against_reference
    from quantkit.kernels.generate import load_text_generator
    from quantkit.loading import load_model

    if not world.is_main:  # rank 0 computes the cache; the others read it once it is written
        world.barrier("waiting for rank 0's reference cache")
    reference, cache_path = cached_reference(reference_dir, tokens, window, stride, top_k, cache_dir, progress,
                                             device=device)
    if world.is_main:
        world.barrier("waiting for the ranks to start scoring")
    paths = [reference_dir, *variants]
    results = []
    for path in (paths[index] for index in world.share(len(paths))):
        model = load_model(path).to(device)
        parameters = sum(t.numel() for t in model.state_dict().values()) - (
            model.lm_head.weight.numel() if model.config.tie_word_embeddings else 0)
        kl = kl_against_reference(model, reference, tokens.to(device), progress)
        tau = None
        if extras.draft is not None:
            prompts = prompt_rows(tokens, extras.accept_prompts, ACCEPT_PROMPT_TOKENS)
            generator = load_text_generator(path, dtype=torch.float32, device=device)
            tau = acceptance(generator, extras.draft, prompts, extras.accept_k, extras.accept_new_tokens).tau
        del model
        size = weight_bytes(path)
        results.append(VariantResult(
            path.name if path != reference_dir else f"{path.name} (reference)", str(path), size / 2**20,
            8 * size / parameters, kl.perplexity, 100 * (kl.perplexity / kl.reference_perplexity - 1), kl.mean_kl,
            kl.top1_agreement, layer_errors(path),
            _task_scores(path, extras, progress, device) if extras.tasks else {}, tau))
    return [VariantResult(**record) for record in world.unshared_records([asdict(r) for r in results])], cache_path


def setup_record(reference_dir: Path, data: str, tokens: torch.Tensor, window: int, stride: int | None,
                 top_k: int, extras: Extras = Extras()) -> dict:
    """Everything the numbers depend on, so that two reports can be told apart (or shown equal)."""
    return {
        "reference": str(reference_dir), "data": data, "tokens": len(tokens),
        "extras": {**asdict(extras), "draft": str(extras.draft) if extras.draft else None},
        "tokens_sha256": hashlib.sha256(tokens.to(torch.int64).numpy().tobytes()).hexdigest(),
        "window": window, "stride": stride or window, "kl_top_k": top_k, "machine": platform.processor() or
        platform.machine(), "threads": torch.get_num_threads(),
        "packages": {name: version(name) for name in PACKAGES},
    }


def markdown(results: list[VariantResult], setup: dict) -> str:
    reference = results[0]
    tasks = list(reference.tasks)
    headers = ["variant", "MB", "bits/param", "ppl", "Δppl %", "mean KL", "top-1",
               *[column for task in tasks for column in (task, f"Δ {task}")],
               *(["τ"] if reference.tau is not None else [])]
    rows = [[r.name, r.size_mb, r.bits_per_parameter, r.perplexity, r.delta_ppl_pct, r.mean_kl, r.top1,
             *[value for task in tasks for value in (r.tasks[task], r.tasks[task] - reference.tasks[task])],
             *([r.tau] if r.tau is not None else [])] for r in results]
    table = format_table(headers, rows)
    return (f"# quantkit report\n\nreference `{setup['reference']}`; data {setup['data']}, {setup['tokens']} tokens "
            f"(sha256 {setup['tokens_sha256'][:12]}), window {setup['window']}, stride {setup['stride']}; KL over "
            f"the reference's top {setup['kl_top_k']} tokens + the rest\n\n```\n{table}\n```\n\n"
            "![KL against bits per parameter](kl_vs_bits.png)\n\n![error per layer](layer_error.png)\n")


def plot(results: list[VariantResult], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    colors = {r.name: f"C{i}" for i, r in enumerate(results)}  # one colour per variant in both plots
    figure, axes = plt.subplots(figsize=(6, 4))
    for r in results:
        if r.mean_kl > 0:  # the reference (KL 0) has no place on a log axis: it is named in the title
            axes.scatter(r.bits_per_parameter, r.mean_kl, color=colors[r.name])
            axes.annotate(r.name, (r.bits_per_parameter, r.mean_kl), fontsize=7, xytext=(4, 4),
                          textcoords="offset points")
    axes.set(xlabel="bits per parameter (weight files)", ylabel="mean KL to the reference (nats)", yscale="log",
             title=f"accuracy against size (reference: {results[0].bits_per_parameter:.1f} bits/param)")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out / "kl_vs_bits.png", dpi=120)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(6, 4))
    for r in results:
        if r.layer_errors:
            axes.plot(range(len(r.layer_errors)), r.layer_errors, marker=".", label=r.name, color=colors[r.name])
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set(xlabel="decoder layer", ylabel="mean relative output error of its linears", yscale="log",
             title="quantization error per layer")
    if axes.lines:
        axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out / "layer_error.png", dpi=120)
    plt.close(figure)


def write(out: Path, results: list[VariantResult], setup: dict) -> None:
    """The report folder, built beside ``out`` and renamed into place when complete."""
    from quantkit.atomic import publish_dir, remove_tree

    staging = out.with_name(out.name + ".partial")
    remove_tree(staging)
    staging.mkdir(parents=True)
    (staging / "report.json").write_text(json.dumps({"setup": setup, "variants": [asdict(r) for r in results]},
                                                    indent=2))
    (staging / "report.md").write_text(markdown(results, setup))
    plot(results, staging)
    publish_dir(staging, out)
