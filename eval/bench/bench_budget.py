"""`make bench-budget`: quantkit's size budgets against llama.cpp's fixed mixes at the same sizes.

llama.cpp's files are ``llama-quantize --imatrix`` of the F32 export, the importance matrix from
``llama-imatrix`` on the calibration text quantkit's GPTQ sees, for every mix in ``--llama-types`` and for
the hand overrides users set (``--tensor-type``, ``HAND_OVERRIDES``). quantkit's files are ``quantkit quantize
--recipe gguf-q4_k_m --target-size S`` for S each budget file's exact size, exported unchanged. Every file
is scored in llama.cpp against the F32 file on the same held-out tokens; each quantkit file is compared
with the best llama.cpp file of equal or larger size (target: KL at most ``TARGET_RATIO`` of it).

The estimate is checked too: for ``--check-pairs`` (linear, type) pairs drawn at random, the KL the
rounding alone causes, measured in PyTorch on a validation text, against the plan's estimate (Spearman).

    python -m quantkit.eval.bench.bench_budget --out out/bench-budget
"""
from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path
from statistics import fmean

import click

from quantkit.eval.bench.across_texts import names, text_tokens, texts_option
from quantkit.eval.bench.bench_gguf import Row, calibration_text, llama_tools, plot_kl_against_size
from quantkit.eval.bench.common import machine, report, timed
from quantkit.table import format_table

RECIPE = "gguf-q4_k_m"  # the base mix: its embedding and output types; every linear's type is planned
LLAMA_TYPES = ("q4_k_m", "q4_k_s", "iq4_xs", "q3_k_m", "iq3_m", "q2_k", "iq2_m", "iq1_m")
# what users set by hand: ffn_down (and attn_v) a type up from the mix's own
HAND_OVERRIDES = {"q3_k_m+down": ("q3_k_m", ("ffn_down=q5_k", "attn_v=q5_k")),
                  "iq2_m+down": ("iq2_m", ("ffn_down=iq3_s", "attn_v=q4_k"))}
BUDGETS = ("q4_k_m", "q3_k_m", "iq2_m")  # quantkit's budgets: these llama.cpp files' sizes
TARGET_RATIO = 0.75


def check_estimate(model_dir: Path, pairs: int, seed: int) -> dict:
    """Spearman correlation of the plan's estimate with the KL each sampled rounding alone causes on the
    validation text ``austen`` (4 rows of 512 tokens), measured in PyTorch."""
    import numpy as np
    import torch

    from quantkit.budget.formats import budget_format, rounding
    from quantkit.budget.plan import measure_options, plan_rows
    from quantkit.calib import heldout_tokens
    from quantkit.gguf.names import minicpm_name
    from quantkit.gguf.types import TYPES
    from quantkit.imatrix import collect
    from quantkit.loading import load_model
    from quantkit.recipe import load_recipe
    from quantkit.tokenizer import load_tokenizer

    recipe = load_recipe(RECIPE)
    options = measure_options(model_dir, recipe, budget_format(recipe))
    # the mean x² on the plan's rows, which weighted the estimate's rounding
    importance = collect(model_dir, plan_rows(model_dir, recipe).input_ids, [])
    rng = random.Random(seed)
    sample = [(name, rng.choice(opts)) for name, opts in rng.sample(sorted(options.items()), pairs)]
    model = load_model(model_dir).eval()
    ids = heldout_tokens(load_tokenizer(model_dir), "austen")[:4 * 512].reshape(4, 512)
    with torch.no_grad():
        reference = torch.log_softmax(model(ids).logits.double(), -1)
    measured = []
    for name, option in sample:
        module = model.get_submodule(minicpm_name(name).removesuffix(".weight"))
        original = module.weight.data.clone()
        rounded = rounding(TYPES[option.name])(original.numpy(), importance.importance(name))
        module.weight.data = torch.from_numpy(rounded)
        with torch.no_grad():
            log_q = torch.log_softmax(model(ids).logits.double(), -1)
        measured.append(float((reference.exp() * (reference - log_q)).sum(-1).mean()))
        module.weight.data = original
    estimates = [option.loss for _, option in sample]
    ranks = [np.argsort(np.argsort(values)) for values in (estimates, measured)]
    return {"pairs": [{"tensor": n, "type": o.name, "estimated_kl": o.loss, "measured_kl": m}
                      for (n, o), m in zip(sample, measured)],
            "spearman": float(np.corrcoef(*ranks)[0, 1]),
            # over the roundings that change the model: an exact one (Q4_1 on some weights) is 0 / 0
            "median_ratio": float(np.median([e / m for e, m in zip(estimates, measured) if m > 0]))}


@click.command()
@click.option("--model", default="default", show_default=True)
@texts_option("test-fiction,test-manual,test-code,test-zh")
@click.option("--max-tokens", default=2048, show_default=True, help="Tokens scored per text.")
@click.option("--window", default=512, show_default=True)
@click.option("--llama-types", default=",".join(LLAMA_TYPES), show_default=True,
              help="llama.cpp mixes quantized with llama-imatrix's importance matrix.")
@click.option("--budgets", default=",".join(BUDGETS), show_default=True,
              help="quantkit's budgets: the sizes of these llama.cpp files (each also in --llama-types).")
@click.option("--check-pairs", default=24, show_default=True, help="(linear, type) pairs the estimate is checked on.")
@click.option("--n-samples", default=128, show_default=True)
@click.option("--seq-len", default=512, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--out", default="out/bench-budget", show_default=True, type=click.Path(path_type=Path))
def main(model, texts, max_tokens, window, llama_types, budgets, check_pairs, n_samples, seq_len, threads, out):
    """Score llama.cpp's mixes and quantkit's budgets at their sizes in llama.cpp; print one table."""
    from transformers import AutoTokenizer

    from quantkit.eval.kld import kl_divergence
    from quantkit.eval.llamacpp import LlamaCppModel
    from quantkit.gguf.export import export_gguf
    from quantkit.zoo import resolve_model

    model_dir = resolve_model(model)
    out.mkdir(parents=True, exist_ok=True)
    tokens = text_tokens(AutoTokenizer.from_pretrained(model_dir), names(texts), max_tokens)
    f32 = out / "f32.gguf"
    f32.unlink(missing_ok=True)
    weights = export_gguf(model_dir, f32, "f32", progress=False).weights
    reference = LlamaCppModel(f32, n_ctx=window)

    def score(path: Path, made_by: str, seconds: float) -> Row:
        candidate = LlamaCppModel(path, n_ctx=window)
        try:
            kls = {name: kl_divergence(candidate, reference, text, window=window) for name, text in tokens.items()}
        finally:
            candidate.close()
        size = path.stat().st_size
        row = Row(path.name, made_by, 8 * size / weights, size / 2**20, fmean(k.perplexity for k in kls.values()),
                  fmean(k.mean_kl for k in kls.values()), fmean(k.top1_agreement for k in kls.values()),
                  round(seconds, 1), "", {name: k.mean_kl for name, k in kls.items()})
        click.echo(f"[{row.file}] {size:,} bytes, KL {row.mean_kl:.4f}", err=True)
        return row

    bin_dir = llama_tools()
    calibration = out / "calibration.txt"
    calibration.write_text(calibration_text(model_dir, n_samples, seq_len))
    imatrix = out / "imatrix-llama.cpp.gguf"
    imatrix.unlink(missing_ok=True)
    imatrix_seconds, _ = timed([str(bin_dir / "llama-imatrix"), "-m", str(f32), "-f", str(calibration), "-o",
                                str(imatrix), "-c", str(seq_len), "-b", str(seq_len), "--chunks", str(n_samples),
                                "-t", str(threads), "--no-ppl"], out / "llama-imatrix.log")
    llama_rows: dict[str, Row] = {}
    wanted = {name: (name, ()) for name in names(llama_types)} | HAND_OVERRIDES
    for label, (file_type, overrides) in wanted.items():
        path = out / f"{label}-llama.cpp.gguf"
        path.unlink(missing_ok=True)
        command = [str(bin_dir / "llama-quantize"), "--imatrix", str(imatrix),
                   *(arg for o in overrides for arg in ("--tensor-type", o)), str(f32), str(path), file_type.upper(),
                   str(threads)]
        seconds, _ = timed(command, out / f"{path.stem}.log")
        how = f" --tensor-type {' '.join(overrides)}" if overrides else ""
        llama_rows[label] = score(path, f"llama.cpp quantize --imatrix (llama-imatrix){how}", imatrix_seconds + seconds)

    rows, targets = list(llama_rows.values()), []
    for budget in names(budgets):
        size = (out / f"{budget}-llama.cpp.gguf").stat().st_size
        artifact = out / f"budget-{budget}"
        shutil.rmtree(artifact, ignore_errors=True)
        command = [sys.executable, "-m", "quantkit.cli", "quantize", "--recipe", RECIPE, "--model", str(model_dir),
                   "--out", str(artifact), "--target-size", str(size), "--no-progress",
                   "--set", f"calibration.n_samples={n_samples}", "--set", f"calibration.seq_len={seq_len}"]
        seconds, _ = timed(command, out / f"budget-{budget}.log")
        path = out / f"budget-{budget}.gguf"
        path.unlink(missing_ok=True)
        export_gguf(artifact, path, RECIPE.removeprefix("gguf-"), progress=False)
        ours = score(path, f"quantkit --target-size {size} (the size of llama.cpp's {budget})", seconds)
        rows.append(ours)
        rivals = [r for r in llama_rows.values() if r.size_mb >= ours.size_mb]
        best = min(rivals, key=lambda r: r.mean_kl)
        ratio = ours.mean_kl / best.mean_kl
        passed = ratio <= TARGET_RATIO and path.stat().st_size <= size
        targets.append(f"target at {ours.size_mb:.2f} MiB ({budget}'s size): KL {ours.mean_kl:.4f} / best llama.cpp "
                       f"file of equal or larger size ({best.file}, {best.mean_kl:.4f}) = {ratio:.2f} (<= "
                       f"{TARGET_RATIO}: {'PASS' if passed else 'FAIL'})")
    reference.close()
    estimate = check_estimate(model_dir, check_pairs, seed=0) if check_pairs else None
    table = format_table(["file", "made by", "bits/weight", "MiB", "ppl", "mean KL", *tokens, "top-1", "seconds"],
                         [[r.file, r.made_by, r.bits_per_weight, r.size_mb, r.perplexity, r.mean_kl,
                           *r.kl_per_text.values(), r.top1, r.seconds] for r in rows])
    notes = list(targets)
    if estimate:
        notes.append(f"estimate vs measured KL of {check_pairs} single-tensor roundings (austen, PyTorch): Spearman "
                     f"{estimate['spearman']:.2f}, median estimate/measured {estimate['median_ratio']:.2f}")
    header = (f"model {model_dir.name}; {', '.join(tokens)}, {max_tokens} tokens each, llama.cpp windows of {window}, "
              f"reference f32.gguf; calibration {n_samples} x {seq_len} tokens (both); machine: {machine()}")
    report(header, table, rows, json_path=out / "bench.json", markdown_path=out / "bench.md", notes="\n".join(notes),
           extra={"targets": targets, "estimate_check": estimate})
    plot_kl_against_size(rows, out / "kl-vs-size.png", f"{model_dir.name}: size budgets and llama.cpp's mixes")
    (out / "estimate-check.json").write_text(json.dumps(estimate, indent=2))
    click.echo(f"plot: {out / 'kl-vs-size.png'}")


if __name__ == "__main__":
    main()
