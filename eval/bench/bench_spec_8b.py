"""`make bench-spec-8b`: what a speculative round costs at MiniCPM4.1-8B's shape, in plain decode steps of
the same target, and the speed-up that gives with the official head's acceptance.

The target is MiniCPM4.1-8B's shape with ``--layers`` decoder layers of random weights (``make bench-8b``'s
slice, written once under ``--out``), unquantized (bf16) and W4 (``rtn-w4g128``: a step's speed does not
depend on the values); the draft is an EAGLE-3 head of the official layout with random weights (one decoder
layer of the target's shape reading three of its states, CPM.cu's FR-Spec draft vocabulary of 32,768
tokens), in the target's dtype. W4 linears run as in the whole model (``bench_8b.as_full_model``): no
dequantized bf16 copies.

At each of ``--contexts`` the target's cache holds that many positions of random keys and values
(``bench_8b.fill_cache``; InfLLM v2's compressed keys pooled from them, sparse above its dense_len), the
head's as many positions it has observed (random states, in chunks). Each part of a round is timed alone, the
caches put back after every call, in passes that time every part once (a warm-up pass, then ``--repeats``),
the median kept:

- ``plain``: a decode step, one row.
- ``verify``: the target's forward over the committed token and the drafts (a chain of k: k + 1 rows
  under ``chain_verification``; a tree: its nodes and the root under its own mask), capturing the states
  the head reads, as ``speculative_tokens`` runs it.
- ``propose``: the head drafting the chain or growing the tree (``propose`` / ``propose_tree``, greedy).
- ``observe``: the head reading the verified rows of a round that commits the official mean (2 of a
  chain's rows at τ 2.45; a tree's as many).

Projection to the whole model (arithmetic from measured costs, labelled so): every target forward is
timed whole and its LM head alone on the same rows; a 32-layer forward is the LM head plus 32 / L times
the rest. The head's own parts do not depend on the target's depth. A round's cost is
(propose + verify + observe) / plain. With OpenBMB's mean acceptance length for MiniCPM4.1-8B's EAGLE-3
head (2.44–2.47, a chain of 3) the chain's speed-up is τ / round; a tree's τ is not published, so its
columns give the τ it needs to break even and to reach the issue's 1.6x.

Targets (printed, not asserted): on the W4 target, verifying a chain of 3 at most 1.3 plain steps and a
13-row tree at most 2.0; the chain's projected speed-up at least 1.6x plain W4 decode.

    python -m quantkit.eval.bench.bench_spec_8b --out out/bench-spec-8b
    python -m quantkit.eval.bench.bench_spec_8b --layers 4 --contexts 512 --repeats 3
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import click

from quantkit.eval.bench.common import Variant, cpu_flags, machine, make_variant, quantize_command, report
from quantkit.table import format_table

FULL_LAYERS = 32
# OpenBMB's mean acceptance length of MiniCPM4.1-8B's EAGLE-3 head, a chain of 3 (2.44-2.47)
OFFICIAL_TAU = 2.45
OFFICIAL_CHAIN = 3
DRAFT_VOCAB = 32_768  # CPM.cu's FR-Spec default
TARGET_SPEEDUP = 1.6
VERIFY_TARGETS = {"chain 3": 1.3, "tree 3x4x12": 2.0}  # verification in plain steps, on the W4 target
OBSERVE_CHUNK = 1024  # rows of random states the head observes at once while its cache fills


@dataclass
class RoundCost:
    target: str
    context: int
    draft: str
    verify_rows: int
    plain_ms: float  # a whole-model decode step (projected)
    propose_ms: float
    verify_ms: float  # projected
    observe_ms: float
    verify_steps: float  # verify / plain
    round_steps: float  # (propose + verify + observe) / plain: also the tau at which drafting breaks even
    speedup: float | None  # at the official tau (the chain of 3 only)
    tau_for_target: float


def projected(total: float, lm_head: float, layers: int) -> float:
    """A forward of the whole model from one of ``layers`` layers: its LM head, plus the rest scaled."""
    return lm_head + (total - lm_head) * FULL_LAYERS / layers


def interleaved(calls: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each of ``calls`` (name -> a call that returns its own seconds) over ``repeats`` passes
    that each make every call once, after a warm-up pass: a slow minute of a shared VM then lands on every part
    of one pass rather than on all of one part's timings (timed one part after another, a chain's verification
    of 4 rows once came out slower than a tree's of 7)."""
    for call in calls.values():
        call()
    samples = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            samples[name].append(call())
    return {name: statistics.median(values) for name, values in samples.items()}


class Round:
    """One target and head at one context: calls that each time one part of a round and put the caches back."""

    def __init__(self, generator, context: int, seed: int):
        import torch

        from quantkit.eval.bench.bench_8b import fill_cache
        from quantkit.kernels.sampling import Sampler, Sampling

        self.runtime, self.drafter, self.context = generator.runtime, generator.drafter, context
        self.layers = self.runtime.config.num_hidden_layers
        self.random = torch.Generator().manual_seed(seed)
        self.sampler = Sampler(Sampling())
        self.cache = fill_cache(generator, context, context + 64, seed)
        self._fill_drafter()

    def _tokens(self, count: int):
        import torch

        return torch.randint(0, self.runtime.config.vocab_size, (count,), generator=self.random)

    def _states(self, rows: int) -> dict:
        import torch

        hidden = self.runtime.config.hidden_size
        return {layer: torch.randn(rows, hidden, generator=self.random) for layer in self.drafter.aux_layers}

    def _fill_drafter(self) -> None:
        self.drafter.crop(0)
        for start in range(0, self.context, OBSERVE_CHUNK):
            rows = min(OBSERVE_CHUNK, self.context - start)
            self.drafter.observe(self._tokens(rows), self._states(rows), self._tokens(rows))

    def _restore_drafter(self) -> None:
        """Back to ``context`` observed positions, the last one observed again (cropping forgets its output)."""
        self.drafter.crop(self.context - 1)
        self.drafter.observe(self._tokens(1), self._states(1), self._tokens(1))

    def target(self, rows: int, verification=None):
        """A call timing the target's forward over ``rows`` rows (``verification``: their positions and mask,
        capturing the head's states as verification does; None: a plain decode step), its cache put back."""
        tokens = self._tokens(rows)

        def call() -> float:
            started = time.perf_counter()
            if verification is None:
                self.runtime.forward(tokens, self.cache)
            else:
                self.runtime.forward_capturing(tokens, self.cache, self.drafter.aux_layers, verification)
            seconds = time.perf_counter() - started
            self.cache.crop(self.context)
            return seconds
        return call

    def lm_head(self, rows: int):
        """A call timing the target's LM head alone on ``rows`` rows."""
        import torch

        hidden = torch.randn(rows, self.runtime.config.hidden_size, generator=self.random)

        def call() -> float:
            with torch.inference_mode():
                started = time.perf_counter()
                self.runtime._logits(hidden)
                return time.perf_counter() - started
        return call

    def drafter_call(self, work):
        """A call timing ``work`` of the head's, then putting the head back (drafting extends its cache,
        observing its context)."""
        def call() -> float:
            started = time.perf_counter()
            work()
            seconds = time.perf_counter() - started
            self._restore_drafter()
            return seconds
        return call

    def draft(self, shape) -> tuple:
        """(the head's drafting of ``shape``, an int chain length or a TreeShape, as a work; verification's rows
        and (positions, mask)): a tree's from one the head grows here."""
        from quantkit.kernels.speculative import chain_verification

        if isinstance(shape, int):
            return (lambda: self.drafter.propose(shape, self.sampler)), shape + 1, chain_verification(self.context,
                                                                                                      shape)
        tree = self.drafter.propose_tree(shape, self.sampler)
        self._restore_drafter()
        return (lambda: self.drafter.propose_tree(shape, self.sampler)), len(tree.tokens) + 1, tree.verification(
            self.context)

    def observe(self, rows: int):
        return lambda: self.drafter.observe(self._tokens(rows), self._states(rows), self._tokens(rows))


def round_costs(label: str, generator, context: int, drafts: dict, repeats: int, seed: int) -> list[RoundCost]:
    """A row per draft shape (``drafts``: label -> an int chain length or a TreeShape) at ``context``."""
    measuring = Round(generator, context, seed)
    calls = {"plain": measuring.target(1), "plain lm_head": measuring.lm_head(1),
             "observe": measuring.drafter_call(measuring.observe(round(OFFICIAL_TAU)))}
    verify_rows = {}
    for draft, shape in drafts.items():
        propose, rows, verification = measuring.draft(shape)
        verify_rows[draft] = rows
        calls.update({f"{draft} propose": measuring.drafter_call(propose),
                      f"{draft} verify": measuring.target(rows, verification),
                      f"{draft} verify lm_head": measuring.lm_head(rows)})
    seconds = interleaved(calls, repeats)
    layers = measuring.layers
    plain = projected(seconds["plain"], seconds["plain lm_head"], layers)
    observed = seconds["observe"]
    costs = []
    for draft, shape in drafts.items():
        propose = seconds[f"{draft} propose"]
        verify = projected(seconds[f"{draft} verify"], seconds[f"{draft} verify lm_head"], layers)
        round_steps = (propose + verify + observed) / plain
        official = isinstance(shape, int) and shape == OFFICIAL_CHAIN
        costs.append(RoundCost(label, context, draft, verify_rows[draft], 1000 * plain, 1000 * propose,
                               1000 * verify, 1000 * observed, verify / plain, round_steps,
                               OFFICIAL_TAU / round_steps if official else None, TARGET_SPEEDUP * round_steps))
    return costs


def prepare(out: Path, layers: int, reuse: bool) -> tuple[Path, Path, Path]:
    """The random slice (as bench-8b writes it), its W4 artifact and a random EAGLE-3 head for it."""
    from quantkit.eval.bench.bench_8b import CALIBRATION, RECIPE, progress
    from quantkit.eval.bench.bench_gguf_speed import eight_b_slice
    from quantkit.synthetic import write_tiny_eagle3_head

    checkpoint = eight_b_slice(out / f"minicpm41-8b-{layers}-layer", layers)
    w4 = Variant(f"w4-{RECIPE}-{layers}-layer", f"quantkit {RECIPE}",
                 quantize_command(RECIPE, checkpoint, out / f"w4-{RECIPE}-{layers}-layer", CALIBRATION))
    make_variant(w4, out, reuse)
    head = out / f"eagle3-head-{layers}-layer"
    if not (head / "config.json").is_file():
        import torch

        progress(f"random EAGLE-3 head {head}")
        write_tiny_eagle3_head(head, checkpoint, draft_vocab_size=DRAFT_VOCAB, dtype=torch.bfloat16)
    return checkpoint, out / w4.key, head


def _shapes(chain: int, trees: str) -> dict:
    from quantkit.kernels.speculative import TreeShape

    return {f"chain {chain}": chain, **{f"tree {text}": TreeShape.parse(text) for text in trees.split(",") if text}}


def _table(rows: list[RoundCost]) -> str:
    return format_table(
        ["target", "context", "draft", "rows", "plain ms", "propose ms", "verify ms", "observe ms", "verify (steps)",
         "round (steps)", f"speed-up at tau {OFFICIAL_TAU}", "tau to break even", f"tau for {TARGET_SPEEDUP}x"],
        [[r.target, r.context, r.draft, r.verify_rows, r.plain_ms, r.propose_ms, r.verify_ms, r.observe_ms,
          r.verify_steps, r.round_steps, "" if r.speedup is None else r.speedup, r.round_steps, r.tau_for_target]
         for r in rows])


def _target_notes(rows: list[RoundCost]) -> str:
    lines = []
    for row in rows:
        if row.target != "W4":
            continue
        if row.draft in VERIFY_TARGETS:
            bound = VERIFY_TARGETS[row.draft]
            lines.append(f"W4 at {row.context}: verifying {row.draft} costs {row.verify_steps:.2f} plain steps "
                         f"(target <= {bound}: {'met' if row.verify_steps <= bound else 'NOT met'})")
        if row.speedup is not None:
            lines.append(f"W4 at {row.context}: projected {row.draft} speed-up {row.speedup:.2f}x at tau "
                         f"{OFFICIAL_TAU} "
                         f"(target >= {TARGET_SPEEDUP}: {'met' if row.speedup >= TARGET_SPEEDUP else 'NOT met'})")
    return "\n".join(lines)


@click.command()
@click.option("--layers", default=4, show_default=True, type=click.IntRange(min=4),
              help="Decoder layers of the random slice (4 or more: the head reads the states entering layers 2, "
                   "L/2 and L-3); a whole-model step is projected from it.")
@click.option("--contexts", default="512,8192", show_default=True,
              help="Cached positions a round runs after (InfLLM v2 sparse above 8,192).")
@click.option("--chain", default=OFFICIAL_CHAIN, show_default=True, help="Drafts of the chain.")
@click.option("--trees", default="3x2x6,3x4x12", show_default=True,
              help="Draft trees (DEPTHxTOPKxSIZE, comma-separated).")
@click.option("--repeats", default=5, show_default=True, help="Timed calls of each part; the median is kept.")
@click.option("--threads", default=2, show_default=True)
@click.option("--reuse/--no-reuse", default=True, show_default=True,
              help="Reuse the slice, artifact and head in --out.")
@click.option("--out", default="out/bench-spec-8b", show_default=True, type=click.Path(path_type=Path))
def main(layers, contexts, chain, trees, repeats, threads, reuse, out):
    """A speculative round's cost at MiniCPM4.1-8B's shape on W4 and bf16 targets."""
    import torch

    from quantkit.eval.bench.bench_8b import amx_note, as_full_model, progress
    from quantkit.kernels.generate import load_text_generator

    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint, w4, head = prepare(out, layers, reuse)
    drafts = _shapes(chain, trees)
    rows = []
    for label, target in (("W4", w4), ("bf16", checkpoint)):
        with as_full_model(layers):
            generator = load_text_generator(target, draft=head)
        for context in (int(c) for c in contexts.split(",")):
            progress(f"{label} target at {context}")
            rows.extend(round_costs(label, generator, context, drafts, repeats, seed=context))
        del generator
        gc.collect()
    setup = (f"bench-spec-8b: MiniCPM4.1-8B's shape, {layers} random layers projected to {FULL_LAYERS} (arithmetic "
             f"from measured costs), random EAGLE-3 head (draft vocabulary {DRAFT_VOCAB}), greedy; median of "
             f"{repeats}; {machine()}; {amx_note(cpu_flags())}")
    report(setup, _table(rows), rows, json_path=out / "results.json", markdown_path=out / "results.md",
           notes=_target_notes(rows))


if __name__ == "__main__":
    main()
