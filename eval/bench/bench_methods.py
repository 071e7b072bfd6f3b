"""`make bench-gptq`, `make bench-awq`: quantization methods side by side, in one run, on the same
calibration tokens.

Each variant is quantized in its own process under `/usr/bin/time -v` (wall time and peak RSS of
that process alone, not inherited from this one), then evaluated against the unquantized model
on the same held-out tokens: perplexity, KL divergence and top-1 agreement. Peers that run in
their own environment (GPTQModel, llm-compressor) join through `--peer NAME=COMMAND` lines that
write a checkpoint quantkit loads into the directory given as `{out}`.

    python -m quantkit.eval.bench.bench_methods --out out/bench-gptq
"""
from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import click

from quantkit.eval.bench.common import machine, quantize_command, report, timed
from quantkit.table import format_table

# method -> (recipe, overrides). Every variant is written as a GPTQ checkpoint: the weights do not
# depend on the format (tests read AWQ/Marlin artifacts back equal to the GPTQ ones), and the GPTQ
# format also holds W3 and the default model's ragged g128 groups, which AWQ's GEMM layout cannot.
METHODS = {
    "RTN": ("rtn-w4g128", ()),
    "AWQ": ("awq-w4g128", ("format=gptq",)),
    "GPTQ": ("gptq-w4g128", ()),
    "P-GPTQ": ("p-gptq-w4g128", ()),
    "S-GPTQ": ("s-gptq-w4g128", ()),
    "S-P-GPTQ": ("s-p-gptq-w4g128", ()),
}


@dataclass
class Row:
    method: str
    bits: int
    perplexity: float
    delta_ppl_pct: float
    mean_kl: float
    top1: float
    seconds: float
    peak_rss_mb: float


@click.command()
@click.option("--model", default="default", show_default=True)
@click.option("--bits", "bit_widths", multiple=True, type=int, default=(4, 3), show_default=True)
@click.option("--group-size", default=128, show_default=True)
@click.option("--n-samples", default=128, show_default=True)
@click.option("--seq-len", default=512, show_default=True)
@click.option("--max-tokens", default=8192, show_default=True, help="Held-out tokens for ppl/KL.")
@click.option("--methods", default="RTN,GPTQ,P-GPTQ,S-GPTQ,S-P-GPTQ", show_default=True,
              help=f"Comma-separated, from {', '.join(METHODS)}.")
@click.option("--baseline", default="GPTQ", show_default=True, help="The method KL ratios are taken against.")
@click.option("--out", default="out/bench-gptq", show_default=True, type=click.Path(path_type=Path))
@click.option("--peer", "peers", multiple=True, help="NAME=COMMAND producing a checkpoint quantkit loads in {out} "
              "(run with {model}, {bits}, {group_size}, {n_samples}, {seq_len} substituted).")
def main(model, bit_widths, group_size, n_samples, seq_len, max_tokens, methods, baseline, out, peers):
    """Quantize the model with every method at each bit width and compare them in one table."""
    from transformers import AutoTokenizer

    from quantkit import calib
    from quantkit.eval.kld import kl_divergence
    from quantkit.eval.ppl import perplexity
    from quantkit.loading import load_model
    from quantkit.zoo import resolve_model

    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(METHODS))
    if unknown:
        raise click.BadParameter(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}",
                                 param_hint="--methods")
    model_dir = resolve_model(model)
    out.mkdir(parents=True, exist_ok=True)
    tokens = calib.heldout_tokens(AutoTokenizer.from_pretrained(model_dir), name="austen", max_tokens=max_tokens)
    reference = load_model(model_dir)
    fp = perplexity(reference, tokens, window=2048)
    rows = [Row("FP", 32, fp.perplexity, 0.0, 0.0, 1.0, 0.0, 0.0)]
    for bits in bit_widths:
        jobs = {method: None for method in chosen}
        jobs.update(dict(peer.split("=", 1) for peer in peers))
        for method, peer_command in jobs.items():
            artifact = out / f"{method.lower()}-w{bits}g{group_size}"
            shutil.rmtree(artifact, ignore_errors=True)
            if peer_command is None:
                recipe, overrides = METHODS[method]
                command = quantize_command(recipe, model_dir, artifact, (
                    f"quant.bits={bits}", f"quant.group_size={group_size}", f"calibration.n_samples={n_samples}",
                    f"calibration.seq_len={seq_len}", *overrides))
            else:
                command = shlex.split(peer_command.format(model=model_dir, bits=bits, group_size=group_size,
                                                          n_samples=n_samples, seq_len=seq_len, out=artifact))
            click.echo(f"[{method} W{bits}] {' '.join(command)}", err=True)
            seconds, rss = timed(command, out / f"{method.lower()}-w{bits}.log")
            kl = kl_divergence(load_model(artifact), reference, tokens, window=2048)
            rows.append(Row(method, bits, kl.perplexity, 100 * (kl.perplexity / fp.perplexity - 1), kl.mean_kl,
                            kl.top1_agreement, round(seconds, 1), round(rss, 0)))
    baseline_kl = {r.bits: r.mean_kl for r in rows if r.method == baseline}
    table = format_table(
        ["method", "bits", "ppl", "Δppl %", "mean KL", f"KL / {baseline}", "top-1", "quantize s", "peak RSS MB"],
        [[r.method, r.bits, r.perplexity, r.delta_ppl_pct, r.mean_kl,
          r.mean_kl / baseline_kl[r.bits] if r.bits in baseline_kl else "", r.top1, r.seconds, r.peak_rss_mb]
         for r in rows])
    header = (f"model {model_dir.name}; group size {group_size} (AWQ asymmetric as AutoAWQ, the others as their "
              f"recipes); calibration {n_samples} x {seq_len} tokens (default mix, seed 0); "
              f"held-out Austen, {fp.tokens} scored tokens, window 2048; machine: {machine()}")
    report(header, table, rows, json_path=out / "bench.json", markdown_path=out / "bench.md")


if __name__ == "__main__":
    main()
