"""`make bench-distributed`: training on the CPU under torchrun, 2 gloo ranks of one thread (data-parallel,
and sharded with FSDP2) against one process of one thread and one process of two, for `quantkit qat ternary`
and `quantkit draft train` on the same model, steps and rows.

Each run is the command a user types (under ``torchrun --standalone --nproc-per-node 2`` for the ranks),
with ``OMP_NUM_THREADS`` setting the threads, in a fresh output each time; its ``--json`` report gives the
training loop's tokens/s (the teacher's or the target's per-row cache is built before the loop, by the
first run, and read by every later one, whatever its world size) and the share of each rank's loop spent
in collectives (moving the gradients and waiting for the other rank). The scaling efficiency is the
2-rank tokens/s over twice the 1-rank, 1-thread tokens/s; 2 ranks of one thread against one process of
two threads says which way of using the same two cores trains faster. Every configuration's step losses are
compared with the one-process, one-thread run's (the largest relative difference over the steps), and QAT's
held-out KL at the last step, which the written artifact has: the ranks train the same steps, up to the order
of float additions. Median of ``--repeats`` runs.

    python -m quantkit.eval.bench.bench_distributed --out out/bench-distributed
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from quantkit.eval.bench.common import machine, report
from quantkit.table import format_table

TARGET_EFFICIENCY = 0.85  # of linear, for 2 ranks

# configuration -> (ranks, threads per rank, its options)
CONFIGURATIONS = {"1 rank x 1 thread": (1, 1, ()), "1 rank x 2 threads": (1, 2, ()),
                  "2 ranks x 1 thread": (2, 1, ("--shard", "off")),
                  "2 ranks x 1 thread, sharded": (2, 1, ("--shard", "on"))}
SINGLE, RANKS = "1 rank x 1 thread", "2 ranks x 1 thread"


def workloads(model: str, steps: int) -> dict[str, list[str]]:
    """workload -> its command line after `quantkit`, for ``steps`` optimizer steps: QAT at its recipe's
    step (2,048 tokens, 4 micro-batches) with a short held-out measurement (it runs at the start and the
    last step, inside the loop's time), and a head's training at 4 rows of 512 tokens a step."""
    return {
        "qat ternary": ["qat", "ternary", "--model", model, "--tokens", str(steps * 2048), "--set",
                        "qat.eval_tokens=512"],
        "draft train": ["draft", "train", "--target", model, "--tokens", str(steps * 4 * 512), "--batch-rows", "4"],
    }


@dataclass
class Row:
    workload: str
    configuration: str
    tokens_per_second: float  # median of the repeats
    collective_share: float  # rank 0's loop, median of the repeats (0 for one process)
    runs: list[float]  # tokens/s of each repeat
    losses: list[float]  # each step's loss (the first repeat's)
    heldout_kl: float | None  # QAT: the held-out KL to the FP model at the last step (the first repeat's)


def run_once(command: list[str], ranks: int, threads: int, out: Path) -> dict:
    """One run of ``command`` into a fresh ``out``: its --json report."""
    shutil.rmtree(out, ignore_errors=True)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                if ranks > 1 else [sys.executable])
    done = subprocess.run([*launcher, "-m", "quantkit.cli", *command, "--out", str(out), "--device", "cpu",
                           "--no-progress", "--json"], env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise click.ClickException(f"{' '.join(command)} ({ranks} ranks x {threads} threads) failed:\n"
                                   + done.stderr[-3000:])
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(done.stdout)


def measure(workload: str, command: list[str], configuration: str, repeats: int, out: Path) -> Row:
    ranks, threads, options = CONFIGURATIONS[configuration]
    reports = [run_once([*command, *options], ranks, threads, out / "run") for _ in range(repeats)]
    return Row(workload, configuration, statistics.median(r["tokens_per_second"] for r in reports),
               statistics.median(r["rank_collective_share"][0] for r in reports),
               [r["tokens_per_second"] for r in reports],
               [entry["loss"] for entry in reports[0]["log"] if "loss" in entry],
               reports[0]["log"][-1].get("heldout_kl"))


def loss_difference(row: Row, reference: Row) -> float:
    """The largest relative difference of a step's loss from the reference run's."""
    return max(abs(ours - theirs) / abs(theirs) for ours, theirs in zip(row.losses, reference.losses, strict=True))


@click.command()
@click.option("--model", default="default", show_default=True)
@click.option("--steps", default=3, show_default=True, help="Optimizer steps per run.")
@click.option("--repeats", default=3, show_default=True, help="Runs of each configuration; the median is kept.")
@click.option("--workloads", "chosen", default="qat ternary,draft train", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/bench-distributed"), show_default=True)
def main(model, steps, repeats, chosen, out):
    """2 gloo ranks of one thread against one process of one and of two threads, for QAT and head training."""
    commands = workloads(model, steps)
    names = [name.strip() for name in chosen.split(",")]
    unknown = set(names) - set(commands)
    if unknown:
        raise click.BadParameter(f"unknown workloads {sorted(unknown)}; choose from {sorted(commands)}")
    out.mkdir(parents=True, exist_ok=True)
    # the first run of each workload builds its per-row cache outside the timed loop; this one keeps it
    # from landing in any configuration's first repeat's start-up
    for name in names:
        run_once(commands[name], 1, 2, out / "warm-up")
    rows = [measure(name, commands[name], configuration, repeats, out)
            for name in names for configuration in CONFIGURATIONS]
    table, notes = [], []
    for name in names:
        by = {row.configuration: row for row in rows if row.workload == name}
        single, two_threads = by[SINGLE], by["1 rank x 2 threads"]
        for row in by.values():
            # a sharded step's gathers and reduce-scatters run inside FSDP's forward and backward, untimed
            share = "not timed" if row.configuration.endswith("sharded") else f"{row.collective_share:.1%}"
            table.append([name, row.configuration, f"{row.tokens_per_second:.1f}",
                          f"{row.tokens_per_second / single.tokens_per_second:.2f}x", share,
                          f"{loss_difference(row, single):.1e}",
                          "" if row.heldout_kl is None else f"{row.heldout_kl - single.heldout_kl:+.1e}",
                          " ".join(f"{rate:.1f}" for rate in row.runs)])
        for configuration in (RANKS, f"{RANKS}, sharded"):
            ranks = by[configuration]
            efficiency = ranks.tokens_per_second / (2 * single.tokens_per_second)
            notes.append(f"{name}, {configuration}: {efficiency:.2f} of linear (target >= {TARGET_EFFICIENCY}: "
                         f"{'met' if efficiency >= TARGET_EFFICIENCY else 'missed'}); against one process of 2 "
                         f"threads {ranks.tokens_per_second / two_threads.tokens_per_second:.2f}x")
    setup = (f"{model}, {steps} steps a run, median of {repeats}; {machine()}; gloo, torchrun --standalone; "
             "the per-row caches built before the timed loops")
    columns = ["workload", "configuration", "tok/s", "vs 1x1", "in collectives (rank 0)", "step loss vs 1x1 (rel.)",
               "held-out KL vs 1x1", "runs tok/s"]
    report(setup, format_table(columns, table), rows, json_path=out / "bench.json",
           markdown_path=out / "bench.md", notes="\n".join(notes),
           extra={"efficiency_target": TARGET_EFFICIENCY})


if __name__ == "__main__":
    main()
