"""``make bench-mlx``: MLX artifacts of one model, every row scored by mlx-lm itself.

Rows: ``mlx_lm.convert -q`` (4 bits, group 64), mlx-lm's own learned quantizers (GPTQ, AWQ, DWQ, fed
quantkit's calibration rows: ``quantkit.eval.interop.mlx_lm_quantize``), quantkit's MLX recipes, and
quantkit's DWQ (``quantkit qat dwq``) started from this run's ``mlx-s-gptq-w4g64`` artifact, beside
mlx-lm's DWQ; and at each ``--budgets`` bits per weight, ``mlx_lm.dynamic_quant`` (its bits from gradient
sensitivities, between the two widths around the budget) beside ``mlx-s-gptq-w4g64 --target-bpw`` (quantkit's
size budget, a little under the budget so that its count, which leaves the norms out, stays below mlx-lm's).
Each artifact is loaded with ``mlx_lm.utils.load_model`` and run by mlx on held-out text beside the
unquantized model, also run by mlx: KL divergence to it, perplexity and top-1 agreement, on the same
windows of each test text (their mean over the texts is the row's figure). Bits per weight are
mlx-lm's own count (``compute_bits_per_weight``); size is the weight files on disk; time is the wall
time of the command that made the artifact. A row whose quantizer fails here keeps the reason as its
note. The targets are printed under the table.
"""
from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean

import click

from quantkit.eval.bench.across_texts import names, text_tokens, texts_option
from quantkit.eval.bench.common import Variant, log_tail, machine, make_variant, quantize_command, report

# The targets, at 4 bits, group 64
CONVERT_KL_RATIO = 0.7  # quantkit's best at most this times mlx_lm.convert's KL
BPW_SLACK = 0.01  # "equal bits per weight": within this many bits
# at a size budget: quantkit's planned artifact at most this times mlx_lm.dynamic_quant's KL at the same bits
DYNAMIC_KL_RATIO = 0.75
BUDGET_RECIPE = "mlx-s-gptq-w4g64"
_AT_BUDGET = re.compile(r" at ([0-9.]+) bits/w")  # in the labels of the rows made at a size budget


DWQ_RECIPE, DWQ_INIT = "mlx-dwq-w4g64", "mlx-s-gptq-w4g64"  # quantkit's DWQ keeps this artifact's codes


# mlx_lm.convert's command line, in a process that has imported quantkit: on a LongRoPE checkpoint the
# plain command crashes loading the tokenizer (docs/formats.md, "MLX"); quantkit registers MiniCPM with
# transformers, which changes nothing mlx-lm computes
CONVERT = [sys.executable, "-c", "import sys, quantkit; from mlx_lm.convert import main; "
           "sys.argv[0] = 'mlx_lm.convert'; main()"]


def _failure(message: str) -> str:
    """The line of a failed command's log that says why (its exception), else its last line."""
    lines = log_tail(message).splitlines()
    return next((line for line in reversed(lines) if "Error" in line), lines[-1]).strip()[:200]


def _variants(model: Path, out: Path, bits: int, group_size: int, n_samples: int, seq_len: int,
              budgets: list[float], scale_bits: int) -> list[Variant]:
    from quantkit.qat.trainer import CHECKPOINT_DIR
    from quantkit.training.state import progress_file

    checkpoint = progress_file(CHECKPOINT_DIR)  # what a training run leaves to --resume from
    peer = [sys.executable, "-m", "quantkit.eval.interop.mlx_lm_quantize", str(model)]
    sizes = ["--bits", str(bits), "--group-size", str(group_size), "--nsamples", str(n_samples),
             "--seqlen", str(seq_len)]
    grid = [f"quant.bits={bits}", f"quant.group_size={group_size}", f"calibration.n_samples={n_samples}",
            f"calibration.seq_len={seq_len}"]
    return [
        Variant("mlx-lm-convert", "mlx_lm.convert -q", [*CONVERT, "--hf-path", str(model), "--mlx-path",
                str(out / "mlx-lm-convert"), "-q", "--q-bits", str(bits), "--q-group-size", str(group_size)]),
        *(Variant(f"mlx-lm-{method}", f"mlx-lm {method.upper()}",
                  [*peer, str(out / f"mlx-lm-{method}"), "--method", method, *sizes])
          for method in ("gptq", "awq", "dwq")),
        *(Variant(recipe, f"quantkit {recipe}", quantize_command(recipe, model, out / recipe, grid))
          for recipe in ("mlx-rtn-w4g64", DWQ_INIT)),
        # after its --init artifact, made just above
        Variant(DWQ_RECIPE, f"quantkit {DWQ_RECIPE} (from {DWQ_INIT})",
                [sys.executable, "-m", "quantkit.cli", "qat", "dwq", "--model", str(model), "--out",
                 str(out / DWQ_RECIPE), "--recipe", DWQ_RECIPE, "--init", str(out / DWQ_INIT), "--no-progress",
                 *(arg for setting in grid[:2] for arg in ("--set", setting))], checkpoint=checkpoint),
        *(variant for budget in budgets for variant in _budget_variants(model, out, budget, group_size, n_samples,
                                                                         seq_len, grid[2:], scale_bits)),
    ]


def _budget_variants(model: Path, out: Path, budget: float, group_size: int, n_samples: int, seq_len: int,
                     calibration: list[str], scale_bits: int) -> list[Variant]:
    """mlx_lm.dynamic_quant between the widths around ``budget`` (a group's scale and bias, each of
    ``scale_bits``, the model dtype's, add 2 · scale_bits / group_size bits per weight), and quantkit's plan
    at the same bits."""
    low = math.floor(budget - 2 * scale_bits / group_size)
    dynamic, planned = f"mlx-lm-dynamic-{budget:g}", f"quantkit-budget-{budget:g}"
    return [
        Variant(dynamic, f"mlx-lm dynamic_quant at {budget:g} bits/w ({low}/{low + 1} bits)",
                [sys.executable, "-m", "quantkit.eval.interop.mlx_lm_quantize", str(model), str(out / dynamic),
                 "--method", "dynamic", "--bits", str(low), "--high-bits", str(low + 1), "--group-size",
                 str(group_size), "--nsamples", str(n_samples), "--seqlen", str(seq_len), "--target-bpw",
                 f"{budget:g}"]),
        Variant(planned, f"quantkit {BUDGET_RECIPE} at {budget:g} bits/w (--target-bpw {budget - BPW_SLACK:g})",
                [*quantize_command(BUDGET_RECIPE, model, out / planned, calibration), "--target-bpw",
                 f"{budget - BPW_SLACK:g}"]),
    ]


@dataclass
class Row:
    method: str
    kl: float | None = None  # the mean over the texts of each text's mean KL
    ppl: float | None = None  # the mean over the texts of each text's perplexity
    top1: float | None = None
    bits_per_weight: float | None = None
    size_mb: float | None = None
    seconds: float | None = None
    note: str = ""
    kl_per_text: dict[str, float] = field(default_factory=dict)

    @classmethod
    def across(cls, method: str, per_text: dict[str, "Row"]) -> "Row":
        rows = per_text.values()
        return cls(method, fmean(r.kl for r in rows), fmean(r.ppl for r in rows), fmean(r.top1 for r in rows),
                   kl_per_text={text: r.kl for text, r in per_text.items()})


class _Scores:
    """Sums over scored positions of KL(P_fp ‖ P_q), the quantized model's NLL and top-1 agreement."""

    def __init__(self):
        self.kl = self.nll = self.agree = 0.0
        self.positions = 0

    def add(self, fp_logprobs, logprobs, targets) -> None:
        import mlx.core as mx

        self.kl += float((mx.exp(fp_logprobs) * (fp_logprobs - logprobs)).sum())
        self.nll -= float(mx.take_along_axis(logprobs, targets[:, None], axis=-1).sum())
        self.agree += float((fp_logprobs.argmax(-1) == logprobs.argmax(-1)).sum())
        self.positions += targets.size

    def row(self, method: str) -> Row:
        n = self.positions
        return Row(method, self.kl / n, math.exp(self.nll / n), self.agree / n)


def _logprobs(model, window):
    import mlx.core as mx

    logits = model(window[None])[0, :-1].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def score(model_dir: Path, artifacts: dict[str, Path], texts: dict[str, list[int]],
          window: int) -> tuple[Row, dict[str, Row]]:
    """mlx-lm's FP model and each artifact on the same non-overlapping windows of every text."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    reference, _ = load_model(model_dir)
    models = {key: load_model(path)[0] for key, path in artifacts.items()}
    fp, scores = {}, {key: {} for key in models}
    for text, tokens in texts.items():
        fp_text, on_text = _Scores(), {key: _Scores() for key in models}
        for start in range(0, len(tokens) - window + 1, window):
            chunk = mx.array(tokens[start:start + window])
            fp_logprobs = _logprobs(reference, chunk)
            fp_text.add(fp_logprobs, fp_logprobs, chunk[1:])
            for key, model in models.items():
                on_text[key].add(fp_logprobs, _logprobs(model, chunk), chunk[1:])
        fp[text] = fp_text.row(text)
        for key, text_scores in on_text.items():
            scores[key][text] = text_scores.row(text)
    return Row.across("unquantized (mlx)", fp), {key: Row.across(key, rows) for key, rows in scores.items()}


def _size_mb(directory: Path) -> float:
    return sum(p.stat().st_size for p in directory.glob("model*.safetensors")) / 2**20


def targets(rows: list[Row]) -> list[str]:
    """The issue's targets, each with the numbers it was decided on."""
    scored = [r for r in rows if r.kl is not None]
    convert = next((r for r in scored if r.method == "mlx_lm.convert -q"), None)
    at_budget = {r.method: float(match[1]) for r in scored if (match := _AT_BUDGET.search(r.method))}
    ours = [r for r in scored if r.method.startswith("quantkit") and r.method not in at_budget]
    peers = [r for r in scored if r.method.startswith("mlx-lm ") and r.method not in at_budget]
    if not ours:
        return ["targets: not decided (every quantkit row failed)"]
    best = min(ours, key=lambda r: r.kl)
    # each target on its own: a run without mlx_lm.convert (e.g. --only) still decides target 2
    if convert is None:
        lines = ["target 1: not decided (no mlx_lm.convert row)"]
    else:
        bound = CONVERT_KL_RATIO * convert.kl
        lines = [f"target 1: {best.method} KL {best.kl:.4f} <= {CONVERT_KL_RATIO} x mlx_lm.convert's "
                 f"{convert.kl:.4f} = {bound:.4f}: {'MET' if best.kl <= bound else 'MISSED'}"]
    equal = [r for r in peers if abs(r.bits_per_weight - best.bits_per_weight) <= BPW_SLACK]
    if equal:
        peer = min(equal, key=lambda r: r.kl)
        lines.append(f"target 2: {best.method} KL {best.kl:.4f} <= best mlx-lm quantizer at {best.bits_per_weight:.3f} "
                     f"bits/weight ({peer.method}, {peer.kl:.4f}): {'MET' if best.kl <= peer.kl else 'MISSED'}")
    else:
        lines.append("target 2: not decided (no mlx-lm quantizer ran at the same bits per weight)")
    for dynamic in (r for r in scored if r.method.startswith("mlx-lm") and r.method in at_budget):
        budget = at_budget[dynamic.method]
        planned = next((r for r in scored if r.method.startswith("quantkit") and at_budget.get(r.method) == budget),
                       None)
        if planned is None:
            lines.append(f"budget {budget:g}: not decided (no quantkit row)")
            continue
        bound = DYNAMIC_KL_RATIO * dynamic.kl
        met = planned.kl <= bound and planned.bits_per_weight <= dynamic.bits_per_weight
        lines.append(f"budget {budget:g} bits/w: quantkit KL {planned.kl:.4f} at {planned.bits_per_weight:.3f} bits/w "
                     f"<= {DYNAMIC_KL_RATIO} x mlx_lm.dynamic_quant's {dynamic.kl:.4f} at "
                     f"{dynamic.bits_per_weight:.3f} = {bound:.4f}: {'MET' if met else 'MISSED'}")
    return lines


@click.command()
@click.option("--model", default="default", show_default=True, help="Unquantized checkpoint, or a built-in name.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/bench-mlx"), show_default=True)
@click.option("--bits", default=4, show_default=True)
@click.option("--group-size", default=64, show_default=True)
# mlx's CPU backend makes mlx-lm's own quantizers slow here (its GPTQ: ~20 min at 8 x 256 on the default
# model), so the defaults are a calibration every row can afford, the same for every learned quantizer
@click.option("--n-samples", default=8, show_default=True, help="Calibration rows for every learned quantizer.")
@click.option("--seq-len", default=256, show_default=True)
@texts_option("test-fiction,test-manual,test-code,test-zh")
@click.option("--max-tokens", default=2048, show_default=True, help="Tokens scored per text.")
@click.option("--window", default=512, show_default=True)
@click.option("--only", default=None, help="Comma-separated variant keys to make and score (default: all).")
@click.option("--reuse", is_flag=True, help="Keep artifacts an earlier run made with the same command.")
@click.option("--variant-timeout", default=2400.0, show_default=True, type=float,
              help="Stop a quantizer still running after this many seconds; its row says so.")
@click.option("--budgets", default="3.5,4.5", show_default=True,
              help="Comma-separated bits per weight at which mlx_lm.dynamic_quant and quantkit's size budget are "
                   "compared (empty: none).")
def main(model, out, bits, group_size, n_samples, seq_len, texts, max_tokens, window, only, reuse,
         variant_timeout, budgets):
    from transformers import AutoTokenizer

    from quantkit.zoo import resolve_model

    model_dir = Path(resolve_model(model))
    out.mkdir(parents=True, exist_ok=True)
    from quantkit.checkpoint import CheckpointReader
    from quantkit.models.layers import EMBEDDING

    scale_bits = 8 * CheckpointReader(model_dir).dtype(EMBEDDING).itemsize  # MLX stores scales in the model dtype
    variants = _variants(model_dir, out, bits, group_size, n_samples, seq_len, [float(b) for b in names(budgets)],
                         scale_bits)
    if only:
        variants = [v for v in variants if v.key in only.split(",")]
    rows, made = [], {}
    for variant in variants:
        try:
            record = make_variant(variant, out, reuse, variant_timeout)
        except click.ClickException as e:
            rows.append(Row(variant.label, note=_failure(e.message)))
            continue
        made[variant.key] = (variant, record)

    tokens = {name: text.tolist() for name, text in
              text_tokens(AutoTokenizer.from_pretrained(model_dir), names(texts), max_tokens).items()}
    fp, scores = score(model_dir, {key: out / key for key in made}, tokens, window)
    from mlx_lm.utils import compute_bits_per_weight, load_model

    for key, (variant, record) in made.items():
        row = scores[key]
        row.method, row.seconds, row.size_mb = variant.label, record["seconds"], round(_size_mb(out / key), 2)
        row.bits_per_weight = round(compute_bits_per_weight(load_model(out / key)[0]), 3)
        rows.append(row)
    rows.insert(0, Row(fp.method, 0.0, fp.ppl, 1.0, 32.0, round(_size_mb(model_dir), 2),
                       kl_per_text=dict.fromkeys(tokens, 0.0)))

    header = ["method", "mean KL", *tokens, "PPL", "top-1", "bits/w", "MB", "seconds", "note"]
    table = [[r.method, r.kl, *(r.kl_per_text.get(text) for text in tokens), r.ppl, r.top1, r.bits_per_weight,
              r.size_mb, r.seconds, r.note] for r in rows]
    from quantkit.table import format_table

    setup = (f"bench-mlx: {model_dir.name}, W{bits} g{group_size}, {n_samples} x {seq_len} calibration tokens; "
             f"scored by mlx-lm on {', '.join(tokens)}, {fp_positions(tokens, window)} positions each in windows "
             f"of {window} (PPL: the mean of the texts'); "
             f"machine: {machine()}")
    report(setup, format_table(header, table), rows, json_path=out / "bench-mlx.json",
           markdown_path=out / "bench-mlx.md", notes="\n".join(targets(rows)),
           extra={"targets": targets(rows), "commands": {k: v.command for k, (v, _) in made.items()}})


def fp_positions(tokens: dict[str, list[int]], window: int) -> int:
    """Positions scored per text (the shortest text's, if one is shorter than ``--max-tokens``)."""
    return min(len(text) // window for text in tokens.values()) * (window - 1)


if __name__ == "__main__":
    main()
