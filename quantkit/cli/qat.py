"""`quantkit qat ternary|dwq`: quantization-aware training, a model toward a low-bit grid or the scales of
fixed codes."""
from __future__ import annotations

from pathlib import Path

import click

from quantkit.cli import (
    device_option,
    emit,
    friendly_errors,
    json_option,
    out_dir_option,
    progress_option,
    ranks_text,
    revision_option,
    shard_option,
    stack,
)
from quantkit.table import format_table


@click.group("qat")
def qat_group():
    """Quantization-aware training: train a model toward a low-bit grid (BitCPM4's ternary QAT), or train the
    scales and biases of fixed codes (mlx-lm's DWQ)."""


def _run_qat(model, revision, out, recipe, overrides, tokens, init, fake_quant, resume, device, shard_state, progress,
             as_json, refuse):
    """What every `quantkit qat` command does: load the recipe, refuse it if ``refuse(recipe)`` says why,
    train, and report the measured points."""
    from quantkit.eval.ppl import perplexity
    from quantkit.qat import run_qat
    from quantkit.recipe import load_recipe, parse_override
    from quantkit.zoo import resolve_model

    settings = dict(parse_override(text) for text in overrides)
    loaded = load_recipe(recipe, settings)
    refusal = refuse(loaded)
    if refusal:
        raise click.ClickException(f"recipe {loaded.name} {refusal}")
    report = run_qat(resolve_model(model, revision=revision), loaded, out, perplexity=perplexity, tokens=tokens,
                     init=init, resume=resume, fake_quant=fake_quant, device=device, shard_state=shard_state,
                     progress=progress)
    if report is None:  # another rank of a torchrun job: rank 0 reports the run
        return
    measured = [e for e in report.log if "heldout_ppl" in e]
    rows = [[e["step"], e["tokens"], e.get("loss"), e.get("heldout_kl"), e["heldout_ppl"],
             "kept" if e["step"] == report.kept_step else ""] for e in measured]
    text = format_table(["step", "tokens", "loss", "held-out KL", "held-out ppl", ""], rows)
    start = report.log[0]
    if "heldout_kl" in start:
        text += (f"\n\npeak learning rate x{start['rate_factor']:.3g}: the start's held-out KL to the FP model is "
                 f"{start['heldout_kl']:.4g} (qat.full_rate_excess)")
    text += (f"\n\nwrote {out}: {report.steps} steps, {report.tokens} tokens at {report.tokens_per_second:.0f} tok/s "
             f"(teacher {report.teacher_seconds:.0f} s, training {report.train_seconds:.0f} s), "
             f"peak RSS {report.peak_rss_mb:.0f} MB" + (f" (resumed at step {report.resumed_from_step})"
                                                       if report.resumed_from_step else ""))
    emit(as_json, report.to_dict(), text + ranks_text(report, report.sharded))


def _qat_command(name, recipe_default, recipe_help, set_example, init_help):
    """A `quantkit qat` command with the options every one takes; each command adds its own after these."""
    return stack(
        qat_group.command(name),
        click.option("--model", default="default", show_default=True,
                     help="Checkpoint directory, or 'default' (the teacher)."),
        revision_option("--model"),
        out_dir_option,
        click.option("--recipe", default=recipe_default, show_default=True, help=recipe_help),
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                     help=f"Override a recipe setting, e.g. {set_example}."),
        click.option("--tokens", type=click.IntRange(min=1), default=None,
                     help="Training tokens (default: the recipe's)."),
        click.option("--init", "init", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
                     help=init_help),
        click.option("--resume", is_flag=True, help="Continue an interrupted run from its last checkpoint."),
        device_option,
        shard_option,
        progress_option,
        json_option,
        friendly_errors,
    )


@_qat_command("ternary", "qat-ternary-g32",
              "QAT recipe: qat-ternary-g32, qat-ternary-g256, or a YAML file with a 'qat' section.",
              "--set qat.distill_weight=0 --set qat.learning_rate=1e-4",
              "Start from this artifact's weights (e.g. a gptq-ternary-g32 one) instead of the model's.")
@click.option("--format", "out_format", type=click.Choice(["artifact", "fake-quant"]), default="artifact",
              show_default=True, help="artifact: the recipe's packed format (runtime, eval, GGUF export); "
                                      "fake-quant: a plain checkpoint whose linears hold t·s, as BitCPM4 ships.")
def qat_ternary(model, revision, out, recipe, overrides, tokens, init, resume, device, shard_state, progress, as_json,
                out_format):
    """Train MODEL to ternary weights (BitCPM4): straight-through estimator, WSD schedule, distillation from
    MODEL itself; writes the ternary artifact, a loss/perplexity curve and a JSON log."""
    def refuse(loaded):
        if not loaded["quant"]["ternary"]:
            return "does not train a ternary grid (quant.ternary is false)"
        return None

    _run_qat(model, revision, out, recipe, overrides, tokens, init, out_format == "fake-quant", resume, device,
             shard_state, progress, as_json, refuse)


@_qat_command("dwq", "mlx-dwq-w4g64",
              "DWQ recipe: mlx-dwq-w4g64, or a YAML file whose 'qat' section sets trains: scales.",
              "--set qat.learning_rate=3e-5 --set qat.top_k=64",
              "Keep this MLX artifact's codes (e.g. an mlx-s-gptq-w4g64 one) instead of RTN's.")
def qat_dwq(model, revision, out, recipe, overrides, tokens, init, resume, device, shard_state, progress, as_json):
    """Distilled scales and biases (mlx-lm's DWQ): keep every decoder linear's codes (RTN's, or --init's) and
    train only each group's scale and bias toward MODEL's own output distribution; writes the MLX artifact,
    a loss/perplexity curve and a JSON log."""
    def refuse(loaded):
        trains = loaded.values.get("qat", {}).get("trains")
        if trains != "scales":
            return (f"does not train scales and biases (qat.trains is {trains!r}, DWQ needs 'scales'): "
                    "use mlx-dwq-w4g64, or `quantkit qat ternary` for weight QAT")
        return None

    _run_qat(model, revision, out, recipe, overrides, tokens, init, False, resume, device, shard_state, progress,
             as_json, refuse)
