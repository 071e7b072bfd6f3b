"""`make bench-spec`: speculative decoding with EAGLE-3 heads on the default model, in one run.

Made, each in its own process under `/usr/bin/time -v` (``--reuse`` takes what an earlier run left
with the same command, and continues an interrupted training): the FP head (`quantkit draft train`
on the FP target), its GPTQ W4 g128 (`quantkit draft quantize`) and its W4 QAT (`draft train --init
--w4`, as the MiniCPM4 report makes its head); the W4 targets GPTQ W4 g128 and
AWQ W4 (g64 where K is not a whole number of 128-groups), plus ``--qat-artifact`` (e.g. bench-qat's
ternary QAT artifact) as one more target; for
each quantized target the FP head re-aligned to it (`quantkit draft train --init`).

τ (`quantkit.eval.accept`: the runtime in float32) for every target × {FP head, GPTQ W4 head, QAT W4
head, that target's re-aligned head}: a chain of ``--k`` and a ``--tree``, each greedy and sampled at
``--temperature`` (sampled trees verified by recursive rejection sampling), on held-out prompts.
Speed: the runtime as `quantkit generate` runs it, FP and GPTQ W4 targets, greedy, plain and with the
FP head drafting chains and trees (decode tok/s, median of repeats), beside llama.cpp Q4_0's plain
decode. The issue's targets are printed, not asserted.

    python -m quantkit.eval.bench.bench_spec --out out/bench-spec
"""
from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import click
from quantkit.eval.bench.common import Variant, machine, make_variant, median_rate, quantize_command, report

from quantkit.table import format_table

# (artifact, recipe, its settings, label). AutoAWQ's GEMM layout needs K in whole groups: the default
# model's hidden size 576 is 4.5 groups of 128, so its AWQ target uses groups of 64.
QUANTIZED_TARGETS = (("gptq-w4g128", "gptq-w4g128", (), "GPTQ W4 g128"),
                     ("awq-w4g64", "awq-w4g128", ("quant.group_size=64",), "AWQ W4 g64"))


@dataclass
class Pairing:
    target: str
    head: str
    shape: str
    temperature: float
    tau: float
    position_rates: list[float]
    rounds: int


def _draft_command(target: Path, out: Path, tokens: int, text: tuple[str, ...], init: Path | None = None,
                   *options: str) -> list[str]:
    """``quantkit draft train`` of a head for ``target`` on ``text`` (its --data and --own-text-after options):
    each target, quantized ones included, writes its own text for its head."""
    command = [sys.executable, "-m", "quantkit.cli", "draft", "train", "--target", str(target), "--out", str(out),
               "--tokens", str(tokens), *text, "--no-progress", *options]
    return command + (["--init", str(init)] if init is not None else [])


def decode_rates(engine, prompt: list[int], new_tokens: int, repeats: int) -> tuple[float, float | None]:
    """Greedy decode tok/s of ``engine`` after ``prompt`` (median of ``repeats``, stop tokens ignored so
    that every run is ``new_tokens`` long), and τ of its last run when it drafts."""
    engine.stop_tokens = set()
    last = {}

    def run() -> float:
        last["result"] = engine.generate(prompt, max_new_tokens=new_tokens)
        return last["result"].decode_seconds

    rate = median_rate(run, new_tokens - 1, repeats)  # the first token comes out of the prefill
    acceptance = last["result"].acceptance
    return rate, None if acceptance is None else acceptance["tau"]


@click.command()
@click.option("--model", default="default", show_default=True, help="The FP target.")
@click.option("--out", default="out/bench-spec", show_default=True, type=click.Path(path_type=Path))
@click.option("--head-tokens", default=262_144, show_default=True, help="Training tokens of the FP head.")
@click.option("--realign-tokens", default=65_536, show_default=True, help="Training tokens of each re-alignment.")
@click.option("--head-data", default="default", show_default=True,
              help="Training text of every head (`draft train --data`).")
@click.option("--own-text-after", default=0, show_default=True,
              help="`draft train --own-text-after` of every head: each target writes its own head's text after "
                   "this many tokens of it (0: the text itself).")
@click.option("--qat-artifact", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A ternary QAT artifact of --model to add as a target (e.g. out/bench-qat/qat-distill).")
@click.option("--k", default=3, show_default=True, help="Draft tokens a round.")
@click.option("--tree", default="3x4x12", show_default=True, help="The greedy draft tree (DEPTHxTOPKxSIZE).")
@click.option("--temperature", default=0.8, show_default=True, help="The sampled τ's temperature.")
@click.option("--prompts", default=8, show_default=True)
@click.option("--prompt-tokens", default=128, show_default=True)
@click.option("--max-new-tokens", default=64, show_default=True, help="New tokens per prompt for τ.")
@click.option("--speed-prompt-tokens", default=512, show_default=True)
@click.option("--speed-new-tokens", default=128, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--reuse", is_flag=True, help="Reuse the heads and targets an earlier run left in --out.")
def main(model, out, head_tokens, realign_tokens, head_data, own_text_after, qat_artifact, k, tree, temperature,
         prompts, prompt_tokens, max_new_tokens, speed_prompt_tokens, speed_new_tokens, repeats, threads, reuse):
    """EAGLE-3 heads: τ over targets × heads, and decode speed with and without the head."""
    import tempfile

    import torch
    from quantkit.eval.accept import acceptance, prompt_rows
    from quantkit.eval.bench.bench_runtime import bench_llamacpp
    from quantkit.kernels.generate import load_engine
    from quantkit.kernels.speculative import TreeShape
    from transformers import AutoTokenizer

    from quantkit import calib
    from quantkit.draft.trainer import CHECKPOINT_FILE
    from quantkit.models.zoo import resolve_model

    torch.set_num_threads(threads)
    tree_shape = TreeShape.parse(tree)
    model_dir = resolve_model(model)
    out.mkdir(parents=True, exist_ok=True)
    commands = []

    def made(variant: Variant) -> Path:
        record = make_variant(variant, out, reuse)
        commands.append({"step": f"make {variant.key}", "command": shlex.join(variant.command),
                         "seconds": record["seconds"], "reused": record["reused"]})
        return out / variant.key

    text = ("--data", head_data, "--own-text-after", str(own_text_after))
    head = made(Variant("head-fp", "FP head", _draft_command(model_dir, out / "head-fp", head_tokens, text),
                        CHECKPOINT_FILE))
    w4_head = made(Variant("head-gptq-w4g128", "GPTQ W4 head", [
        sys.executable, "-m", "quantkit.cli", "draft", "quantize", "--head", str(head), "--target", str(model_dir),
        "--recipe", "gptq-w4g128", "--out", str(out / "head-gptq-w4g128"), "--no-progress"]))
    qat_head = made(Variant("head-qat-w4", "QAT W4 head", _draft_command(model_dir, out / "head-qat-w4",
                                                                         realign_tokens, text, head, "--w4", "gptq"),
                            CHECKPOINT_FILE))
    targets = {"FP": model_dir}
    for key, recipe, settings, label in QUANTIZED_TARGETS:
        targets[label] = made(Variant(key, label, quantize_command(recipe, model_dir, out / key, settings)))
    if qat_artifact is not None:
        targets["ternary QAT"] = qat_artifact
    realigned = {}
    for label, target in list(targets.items())[1:]:
        key = f"head-realigned-{target.name}"
        realigned[label] = made(Variant(key, f"head re-aligned to {label}",
                                        _draft_command(target, out / key, realign_tokens, text, head),
                                        CHECKPOINT_FILE))

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    heldout = calib.heldout_tokens(tokenizer, max_tokens=prompts * prompt_tokens + speed_prompt_tokens)
    batch = prompt_rows(heldout, prompts, prompt_tokens)
    pairings = []
    for label, target in targets.items():
        engine = load_engine(target, dtype=torch.float32)
        heads = {"FP head": head, "GPTQ W4 head": w4_head, "QAT W4 head": qat_head,
                 **({"re-aligned head": realigned[label]} if label in realigned else {})}
        for head_label, head_dir in heads.items():
            for shape, t, shape_tree in ((f"chain {k}", 0.0, None), (f"tree {tree}", 0.0, tree_shape),
                                         (f"chain {k}", temperature, None), (f"tree {tree}", temperature, tree_shape)):
                click.echo(f"[tau] {label} <- {head_label}, {shape}, T={t}", err=True)
                stats = acceptance(engine, head_dir, batch, k, max_new_tokens, t, tree=shape_tree)
                pairings.append(Pairing(label, head_label, shape, t, stats.tau, stats.position_rates, stats.rounds))
    depth = max(k, tree_shape.depth)
    tau_table = format_table(["target", "head", "draft", "T", "tau", *[f"accept@{i + 1}" for i in range(depth)]],
                             [[p.target, p.head, p.shape, p.temperature, p.tau, *p.position_rates,
                               *[""] * (depth - len(p.position_rates))] for p in pairings])

    speed_prompt = heldout[-speed_prompt_tokens:].tolist()
    speeds = []
    for label in ("FP", "GPTQ W4 g128"):
        plain, _ = decode_rates(load_engine(targets[label]), speed_prompt, speed_new_tokens, repeats)
        for shape, options in ((f"chain {k}", {"draft_tokens": k}), (f"tree {tree}", {"draft_tree": tree_shape})):
            drafted, tau = decode_rates(load_engine(targets[label], draft=head, **options), speed_prompt,
                                        speed_new_tokens, repeats)
            speeds.append({"target": label, "draft": shape, "plain_tok_s": plain, "speculative_tok_s": drafted,
                           "speedup": drafted / plain, "tau": tau})
    with tempfile.TemporaryDirectory() as scratch:
        from quantkit.gguf.export import export_gguf

        gguf = Path(scratch) / "q4_0.gguf"
        export_gguf(model_dir, gguf, "q4_0", progress=False)
        _, llama_decode = bench_llamacpp(gguf, speed_prompt, speed_new_tokens, repeats, threads)
    speed_table = format_table(["quantkit runtime", "FP head drafts", "plain tok/s", "with head tok/s", "speed-up",
                                "tau", "x llama.cpp Q4_0"],
                               [[s["target"], s["draft"], s["plain_tok_s"], s["speculative_tok_s"], s["speedup"],
                                 s["tau"], s["speculative_tok_s"] / llama_decode] for s in speeds])

    def tau_of(target, head_label):
        return next(p.tau for p in pairings if (p.target, p.head, p.shape, p.temperature) == (target, head_label,
                                                                                             f"chain {k}", 0.0))

    verdict = {True: "PASS", False: "FAIL"}
    fp_tau = tau_of("FP", "FP head")
    targets_text = [
        f"{verdict[fp_tau >= 2.0]}  greedy chain tau with the FP head >= 2.0: {fp_tau:.3f}",
        *[f"{verdict[s['speedup'] >= 1.5]}  {s['target']}, {s['draft']}: decode with the head >= 1.5x plain: "
          f"{s['speedup']:.2f}x" for s in speeds],
        *[f"{verdict[tau_of(label, 're-aligned head') >= tau_of(label, 'FP head')]}  {label}: re-aligned head's tau "
          f">= the FP head's: {tau_of(label, 're-aligned head'):.3f} vs {tau_of(label, 'FP head'):.3f}"
          for label in realigned],
        *[f"{verdict[tau_of('FP', name) >= 0.97 * fp_tau]}  the {name} keeps >= 0.97x the FP head's tau: "
          f"{tau_of('FP', name):.3f} vs {fp_tau:.3f}" for name in ("GPTQ W4 head", "QAT W4 head")],
    ]
    trained = {**json.loads((head / "draft_train.json").read_text()),
               **json.loads((head / "draft_report.json").read_text())}
    notes = "\n".join([
        f"llama.cpp Q4_0 plain decode: {llama_decode:.1f} tok/s", "", speed_table, "",
        f"FP head: draft vocabulary {trained['draft_vocab']} tokens covering {100 * trained['heldout_coverage']:.1f} "
        f"% of held-out tokens; trained on {trained['tokens']} tokens at {trained['tokens_per_second']:.0f} tok/s",
        "", "targets (printed, not asserted):", *targets_text])
    header = (f"model {model_dir.name}; tau: {prompts} held-out prompts of {prompt_tokens} tokens, {max_new_tokens} "
              f"new tokens each, runtime float32; speed: {speed_prompt_tokens}-token prompt, "
              f"{speed_new_tokens} greedy tokens, runtime defaults, median of {repeats}; machine: {machine()}")
    report(header, tau_table, pairings, json_path=out / "bench.json", markdown_path=out / "bench.md", notes=notes,
           extra={"commands": commands, "speed": speeds, "llamacpp_q4_0_decode_tok_s": llama_decode,
                  "targets": targets_text})


if __name__ == "__main__":
    main()
