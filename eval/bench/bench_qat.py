"""`make bench-qat`: ternary quantization-aware training against the post-training ways to the same
size, in one run on the same held-out tokens.

Rows: the FP model; RTN and GPTQ onto the ternary g32 grid; GPTQ W2 g32 (about the bits per weight of
the ternary g32 packing); QAT on cross-entropy alone and QAT distilled from the FP model, each for
``--tokens`` training tokens; with ``--with-init`` distilled QAT started from the GPTQ ternary
artifact; GPTQ W4 g128 for scale. Every variant is made in its own process under `/usr/bin/time -v`
(wall time, peak RSS) and scored by `quantkit eval kld` (FP: `quantkit eval ppl`) on the same tokens.

Beside them: the training throughput of a naive full fine-tune of the same model (every parameter,
fp32, AdamW, no fake quantization, no teacher) timed in this process, the decode speed of the QAT
artifact and the W4 one in quantkit's runtime, the held-out perplexity curves of the QAT runs (a PNG,
with the post-training levels as horizontal lines), the issue's targets as pass/fail lines and a
power-law projection of the tokens QAT would need to reach GPTQ W2 g32.

The curves come from each run's ``qat_log.json``: perplexity on ``qat.eval_tokens`` held-out tokens
in windows of ``qat.seq_len``. That is not the table's setup (``--max-tokens`` tokens, window 2048), so
the horizontal lines and the projection's target are measured again the way the curve is ("curve ppl").

    python -m quantkit.eval.bench.bench_qat --out out/bench-qat
"""
from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import click

from quantkit.eval.bench.common import (
    Variant,
    log_tail,
    machine,
    make_variant,
    median_seconds,
    pyplot,
    quantize_command,
    report,
    save_figure,
)
from quantkit.table import format_table

QAT_RECIPE = "qat-ternary-g32"
# the post-training ternary artifacts --with-init can start QAT from
INIT_RECIPES = ("gptq-ternary-g32", "block-recon-ternary-g32")
W2 = ("gptq-w4g128", ("quant.bits=2", "quant.group_size=32"))
REPORT_QAT_TOKENS = 350e9  # BitCPM4's QAT budget in the MiniCPM4 technical report


@dataclass
class Row:
    name: str
    perplexity: float
    mean_kl: float
    top1: float
    curve_ppl: float  # held-out perplexity measured the way qat_log.json measures it
    seconds: float | None = None
    tokens_per_second: float | None = None
    peak_rss_mb: float | None = None
    size_mb: float = 0.0
    reused: bool = False
    command: str = ""
    log: list[dict] = field(default_factory=list)  # QAT rows: the measured points of qat_log.json


def _run_json(command: list[str]) -> dict:
    """Run a `quantkit ... --json` command and return what it printed."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise click.ClickException(f"exit {done.returncode}: {shlex.join(command)}\n{log_tail(done.stderr)}")
    return json.loads(done.stdout)


def _weights_mb(directory: Path) -> float:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors")) / 1e6


def _qat_command(model_dir: Path, out: Path, tokens: int, settings: tuple[str, ...],
                 init: Path | None = None) -> list[str]:
    command = [sys.executable, "-m", "quantkit.cli", "qat", "ternary", "--model", str(model_dir), "--out", str(out),
               "--recipe", QAT_RECIPE, "--tokens", str(tokens), "--no-progress",
               *(arg for setting in settings for arg in ("--set", setting))]
    return command + (["--init", str(init)] if init is not None else [])


def _curve_ppl(model_dir: Path, tokens, window: int) -> float:
    """Held-out perplexity of ``model_dir`` as the QAT loop measures it (its tokens, its window)."""
    from quantkit.eval.ppl import perplexity
    from quantkit.loading import load_model

    return perplexity(load_model(model_dir), tokens, window=window).perplexity


def naive_finetune_tokens_per_second(model_dir: Path, batch: int, seq_len: int, steps: int) -> float:
    """Tokens per second of a plain full fine-tune: every parameter trainable (embeddings and LM head
    included) in fp32, AdamW, ``batch`` rows of ``seq_len`` calibration tokens a step, no fake
    quantization, no teacher; median step time of ``steps`` steps after one warm-up step."""
    import torch
    from transformers import AutoTokenizer

    from quantkit import calib
    from quantkit.loading import load_model

    model = load_model(model_dir, torch.float32)
    model.train()
    model.requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95))
    ids = calib.calibration_set(AutoTokenizer.from_pretrained(model_dir), n_samples=batch, seq_len=seq_len).input_ids

    def step() -> None:
        logits = model(ids[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return batch * seq_len / median_seconds(step, steps)


def log_slope(log: list[dict]) -> tuple[float, float, int] | None:
    """Least-squares d log ppl / d log tokens over the last half of the measured points after step 0:
    (slope, intercept, points), or None with fewer than two points."""
    points = [(e["tokens"], e["heldout_ppl"]) for e in log if e["tokens"] > 0]
    last = points[len(points) // 2:]
    if len(last) < 2:
        return None
    slope, intercept = statistics.linear_regression([math.log(t) for t, _ in last], [math.log(p) for _, p in last])
    return slope, intercept, len(last)


def projection(log: list[dict], target: float) -> str:
    """The slope of the curve's last half and the tokens its power law reaches ``target`` at."""
    fit = log_slope(log)
    if fit is None:
        return "too few measured points for a slope"
    slope, intercept, points = fit
    text = f"slope d log ppl / d log tokens = {slope:.3f} over the last {points} measured points"
    if log[-1]["heldout_ppl"] <= target:
        return f"{text}; already at or below {target:.4g}"
    if slope >= 0:
        return f"{text}; not falling, no projection"
    tokens = math.exp((math.log(target) - intercept) / slope)
    at_report = math.exp(intercept + slope * math.log(REPORT_QAT_TOKENS))
    return (f"{text}; projection (power law, not measured): ppl {target:.4g} at {tokens:.3g} training tokens, "
            f"ppl {at_report:.3g} at the MiniCPM4 report's {REPORT_QAT_TOKENS:.3g} QAT tokens")


def tokens_to_reach(log: list[dict], level: float) -> int | None:
    return next((e["tokens"] for e in log if e["heldout_ppl"] <= level), None)


def plot_curves(rows: list[Row], levels: dict[str, float], path: Path, setup: str) -> None:
    figure, axes = pyplot().subplots(figsize=(8, 5))
    for row in rows:
        axes.plot([e["tokens"] for e in row.log], [e["heldout_ppl"] for e in row.log], marker="o", markersize=3,
                  label=row.name)
    for (name, ppl), style in zip(levels.items(), ("--", "-.", ":", "-")):
        axes.axhline(ppl, linestyle=style, color="gray", linewidth=1)
        axes.annotate(f"{name} {ppl:.4g}", (0, ppl), xycoords=("axes fraction", "data"), fontsize=8,
                      xytext=(4, 2), textcoords="offset points", color="dimgray")
    axes.set(xlabel="training tokens", ylabel="held-out perplexity", yscale="log", title=setup)
    save_figure(figure, axes, path)


def _verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


@click.command()
@click.option("--model", default="default", show_default=True, help="The FP model (and the QAT teacher).")
@click.option("--out", default="out/bench-qat", show_default=True, type=click.Path(path_type=Path))
@click.option("--tokens", default=400_000, show_default=True, type=click.IntRange(min=1),
              help="Training tokens of each QAT run.")
@click.option("--max-tokens", default=8192, show_default=True, help="Held-out tokens for ppl/KL.")
@click.option("--with-init", is_flag=True, help="Also QAT (distilled) from a post-training ternary artifact.")
@click.option("--init-recipe", type=click.Choice(INIT_RECIPES), default=INIT_RECIPES[0], show_default=True,
              help="The post-training recipe --with-init starts from.")
@click.option("--data", default="test-fiction", show_default=True,
              help="Held-out text the table scores (a test text: the runs keep the weights closest to the FP "
                   "model on the validation text austen, which the curve shows).")
@click.option("--reuse", is_flag=True, help="Reuse the artifacts a previous run left in --out (same commands), "
              "and continue interrupted ones, instead of making them again.")
@click.option("--qat-set", "qat_settings", multiple=True, metavar="KEY=VALUE",
              help="Passed to every `quantkit qat ternary` as --set (e.g. qat.eval_interval=10).")
@click.option("--naive-batch", default=4, show_default=True, help="Rows per step of the naive fine-tune.")
@click.option("--naive-seq-len", default=512, show_default=True, help="Tokens per row of the naive fine-tune.")
@click.option("--naive-steps", default=5, show_default=True, help="Timed naive steps (after one warm-up).")
@click.option("--prompt-tokens", default=512, show_default=True, help="Prompt before the decode timing.")
@click.option("--new-tokens", default=128, show_default=True, help="Greedy decode steps timed.")
@click.option("--repeats", default=3, show_default=True, help="Decode timings; the median is kept.")
@click.option("--threads", default=2, show_default=True,
              help="torch threads here and in every subprocess (OMP_NUM_THREADS).")
def main(model, out, tokens, max_tokens, with_init, init_recipe, data, reuse, qat_settings, naive_batch,
         naive_seq_len, naive_steps, prompt_tokens, new_tokens, repeats, threads):
    """Ternary QAT against RTN/GPTQ ternary, GPTQ W2 g32 and W4, with its curve, cost and targets."""
    import torch
    from transformers import AutoTokenizer

    from quantkit import calib
    from quantkit.eval.bench.bench_runtime import bench_quantkit
    from quantkit.qat.trainer import CHECKPOINT_DIR, HELDOUT, LOG_FILE
    from quantkit.recipe import load_recipe, parse_override
    from quantkit.training.state import progress_file
    from quantkit.zoo import resolve_model

    checkpoint = progress_file(CHECKPOINT_DIR)  # what a training run leaves to --resume from
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    model_dir = resolve_model(model)
    out.mkdir(parents=True, exist_ok=True)
    qat_recipe = load_recipe(QAT_RECIPE, dict(parse_override(text) for text in qat_settings))["qat"]
    commands: list[dict] = []

    variants = [
        Variant("rtn-ternary-g32", "RTN ternary g32", quantize_command("rtn-ternary-g32", model_dir,
                                                                        out / "rtn-ternary-g32")),
        Variant("gptq-ternary-g32", "GPTQ ternary g32", quantize_command("gptq-ternary-g32", model_dir,
                                                                          out / "gptq-ternary-g32")),
        Variant("gptq-w2g32", "GPTQ W2 g32", quantize_command(W2[0], model_dir, out / "gptq-w2g32", W2[1])),
        Variant("qat-ce", "QAT ternary g32, CE only",
                _qat_command(model_dir, out / "qat-ce", tokens, (*qat_settings, "qat.distill_weight=0.0")),
                checkpoint=checkpoint),
        Variant("qat-distill", "QAT ternary g32, distilled",
                _qat_command(model_dir, out / "qat-distill", tokens, qat_settings), checkpoint=checkpoint),
    ]
    if with_init:
        if init_recipe not in {variant.key for variant in variants}:
            start = quantize_command(init_recipe, model_dir, out / init_recipe)
            variants.append(Variant(init_recipe, init_recipe, start))
        variants.append(Variant("qat-distill-init", f"QAT ternary g32, distilled, from {init_recipe}",
                                _qat_command(model_dir, out / "qat-distill-init", tokens, qat_settings,
                                             init=out / init_recipe), checkpoint=checkpoint))
    variants.append(Variant("gptq-w4g128", "GPTQ W4 g128", quantize_command("gptq-w4g128", model_dir,
                                                                             out / "gptq-w4g128")))
    made = {}
    for variant in variants:
        made[variant.key] = make_variant(variant, out, reuse)
        commands.append({"step": f"make {variant.key}", "command": shlex.join(variant.command),
                         "resumed": made[variant.key]["resumed"], "reused": made[variant.key]["reused"]})

    # Scores: the table's (eval ppl / eval kld on --max-tokens) and the curve's (qat_log's tokens and window).
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    curve_tokens = calib.heldout_tokens(tokenizer, HELDOUT, max_tokens=qat_recipe["eval_tokens"])
    curve_window = qat_recipe["seq_len"]
    cli = [sys.executable, "-m", "quantkit.cli", "eval"]
    fp_command = [*cli, "ppl", "--model", str(model_dir), "--data", data, "--max-tokens", str(max_tokens), "--json"]
    click.echo(f"[FP] {shlex.join(fp_command)}", err=True)
    fp = _run_json(fp_command)
    commands.append({"step": "eval FP", "command": shlex.join(fp_command)})
    rows = [Row("FP", fp["perplexity"], 0.0, 1.0, _curve_ppl(model_dir, curve_tokens, curve_window),
                size_mb=_weights_mb(model_dir))]
    by_key = {}
    for variant in variants:
        artifact, record = out / variant.key, made[variant.key]
        kld_command = [*cli, "kld", "--model", str(artifact), "--ref", str(model_dir), "--data", data, "--max-tokens",
                       str(max_tokens), "--json"]
        click.echo(f"[{variant.label}] {shlex.join(kld_command)}", err=True)
        kl = _run_json(kld_command)
        commands.append({"step": f"eval {variant.key}", "command": shlex.join(kld_command)})
        row = Row(variant.label, kl["perplexity"], kl["mean_kl"], kl["top1_agreement"],
                  _curve_ppl(artifact, curve_tokens, curve_window), record["seconds"], None, record["peak_rss_mb"],
                  _weights_mb(artifact), record["reused"], shlex.join(variant.command))
        if variant.checkpoint:
            trained = json.loads((artifact / "quantize_report.json").read_text())
            row.tokens_per_second = trained["tokens_per_second"]
            row.log = [{"tokens": e["tokens"], "heldout_ppl": e["heldout_ppl"]}
                       for e in json.loads((artifact / LOG_FILE).read_text()) if "heldout_ppl" in e]
        rows.append(row)
        by_key[variant.key] = row

    click.echo(f"[naive full fine-tune] {naive_batch} x {naive_seq_len} tokens a step, {naive_steps} steps", err=True)
    naive = naive_finetune_tokens_per_second(model_dir, naive_batch, naive_seq_len, naive_steps)
    prompt = calib.heldout_tokens(tokenizer, max_tokens=prompt_tokens)[:prompt_tokens].tolist()
    decode = {}
    for key in ("qat-distill", "gptq-w4g128"):
        click.echo(f"[decode {key}] {len(prompt)} prompt tokens, {new_tokens} new, median of {repeats}", err=True)
        _, prefill_rate, decode_rate = bench_quantkit(out / key, prompt, new_tokens, repeats)
        decode[key] = {"prefill_tok_s": prefill_rate, "decode_tok_s": decode_rate}

    qat_rows = [row for row in rows if row.log]
    levels = {"FP": rows[0].curve_ppl, "RTN ternary": by_key["rtn-ternary-g32"].curve_ppl,
              "GPTQ ternary": by_key["gptq-ternary-g32"].curve_ppl, "GPTQ W2 g32": by_key["gptq-w2g32"].curve_ppl}
    curve_setup = (f"held-out {HELDOUT}, {curve_tokens.numel()} tokens, window {curve_window} "
                   f"(qat.eval_tokens, qat.seq_len)")
    plot_curves(qat_rows, levels, out / "qat_curves.png", f"{model_dir.name}: {curve_setup}")

    table = format_table(
        ["variant", "ppl", "mean KL", "top-1", "curve ppl", "wall s", "train tok/s", "peak RSS MB", "size MB"],
        [[r.name, r.perplexity, r.mean_kl, r.top1, r.curve_ppl, "" if r.seconds is None else r.seconds,
          "" if r.tokens_per_second is None else r.tokens_per_second,
          "" if r.peak_rss_mb is None else r.peak_rss_mb, round(r.size_mb, 1)] for r in rows])

    best_ptq = min((by_key["rtn-ternary-g32"], by_key["gptq-ternary-g32"]), key=lambda r: r.perplexity)
    best_qat = min(qat_rows, key=lambda r: r.perplexity)
    w2, ce, distill = by_key["gptq-w2g32"], by_key["qat-ce"], by_key["qat-distill"]
    targets = [
        f"{_verdict(best_qat.perplexity <= best_ptq.perplexity / 10)}  QAT ppl <= 1/10 of the best ternary "
        f"post-training ppl: {best_qat.name} {best_qat.perplexity:.4g} vs {best_ptq.name} "
        f"{best_ptq.perplexity:.4g} / 10 = {best_ptq.perplexity / 10:.4g}",
        f"{_verdict(best_qat.perplexity <= w2.perplexity)}  (stretch) QAT ppl <= GPTQ W2 g32 ppl: "
        f"{best_qat.perplexity:.4g} vs {w2.perplexity:.4g}",
        f"{_verdict(distill.perplexity < ce.perplexity)}  distillation beats CE only at {tokens} tokens: "
        f"{distill.perplexity:.4g} vs {ce.perplexity:.4g}",
    ]
    curves = [f"{r.name}: {projection(r.log, w2.curve_ppl)}" for r in qat_rows]
    if with_init:
        started = by_key["qat-distill-init"]
        level = max(distill.log[-1]["heldout_ppl"], started.log[-1]["heldout_ppl"])
        reach = {r.name: tokens_to_reach(r.log, level) for r in (distill, started)}
        curves.append(f"which start converges faster: tokens to curve ppl <= {level:.4g} (the higher final): "
                      + "; ".join(f"{name} {t}" for name, t in reach.items()))
        half = tokens_to_reach(started.log, distill.log[-1]["heldout_ppl"])
        targets.append(
            f"{_verdict(half is not None and half <= tokens / 2 and started.perplexity < distill.perplexity)}  from "
            f"{init_recipe}: the FP start's final curve ppl {distill.log[-1]['heldout_ppl']:.4g} reached in <= half "
            f"the tokens ({half} of {tokens}), and a lower final ppl ({started.perplexity:.4g} vs "
            f"{distill.perplexity:.4g})")
    qat_rate = {r.name: r.tokens_per_second for r in qat_rows}
    throughput = (f"naive full fine-tune (all parameters, fp32, AdamW, {naive_batch} x {naive_seq_len} tokens a "
                  f"step, median of {naive_steps} steps after a warm-up): {naive:.4g} tok/s; QAT: "
                  + "; ".join(f"{name} {rate:.4g} tok/s = {rate / naive:.2f}x naive" for name, rate in qat_rate.items())
                  + " (QAT's rate counts its held-out evaluations and checkpoints)")
    decode_table = format_table(["quantkit runtime", "prefill tok/s", "decode tok/s", "decode x W4"],
                                [[key, d["prefill_tok_s"], d["decode_tok_s"],
                                  d["decode_tok_s"] / decode["gptq-w4g128"]["decode_tok_s"]]
                                 for key, d in decode.items()])
    reused = [r.name for r in rows if r.reused]
    if reused:
        throughput += (f"\n\nreused from an earlier run in {out} (--reuse; wall s and peak RSS as then): "
                       f"{', '.join(reused)}")
    notes = "\n".join(["targets (printed, not asserted):", *targets, "", "held-out perplexity curves "
                       f"({curve_setup}; plot {out / 'qat_curves.png'}):", *curves, "", throughput, "",
                       f"decode, {len(prompt)} prompt tokens, {new_tokens} greedy steps, median of {repeats}:",
                       decode_table])
    header = (f"model {model_dir.name}; QAT {QAT_RECIPE}, {tokens} tokens"
              + (f", --set {' '.join(qat_settings)}" if qat_settings else "")
              + f"; ppl/KL/top-1: held-out {data}, {fp['tokens']} scored tokens, window 2048; curve ppl: "
              f"{curve_setup}; machine: {machine()}")
    report(header, table, rows, json_path=out / "bench.json", markdown_path=out / "bench.md", notes=notes,
           extra={"commands": commands, "naive_finetune_tok_s": naive, "decode": decode, "targets": targets,
                  "curves": curves, "threads": threads, "curve_levels": levels})


if __name__ == "__main__":
    main()
