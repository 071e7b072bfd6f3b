"""One MiniCPM4.1-8B decoder layer quantized with a full calibration set, against its floor.

``make bench-8b``'s quantization row (also on its own: ``python -m quantkit.eval.bench.bench_8b_layer``).
A one-layer checkpoint of MiniCPM4.1-8B's shapes (random weights, as ``make bench-scale`` writes
them) is quantized by ``quantkit quantize`` with ``--recipe`` (GPTQ W4 g128 by default) on
``--n-samples`` x ``--seq-len`` calibration tokens (128 x 2048: the full set, not a projection).
The engine's report splits the layer's time into statistics (the calibration forwards and the
Hessians) and solves (GPTQ); the rest is per-linear error reports, packing and the shard write.

The floor is what the layer's multiply-adds cost at the rate this CPU multiplies bf16 matrices
(AMX tiles or AVX-512 BF16 where it has them), measured here on a matmul of the Hessian's shape:

- forwards: one pass of every calibration token through the layer, each linear once, plus causal
  attention (q·k and p·v over half the sequence on average), as the engine's true-sequential passes
  compute them: each group's output is kept for the later groups (down_proj's input too, 16,384
  values a token) rather than recomputed.
- Hessians: T x K(K + 1)/2 for each distinct input (q/k/v share one, o_proj, gate/up share one,
  down_proj): H is symmetric, so one triangle is what it takes (a BLAS syrk's count), and what the
  engine's compiled kernel multiplies.
- solves: GPTQ's lazy-batch updates (N x K²/2 a linear) and the Cholesky factor of each linear's
  Hessian (K³/3).

The whole model's time is projected as 32 x the layer's wall time plus what the run spends outside
its layers (reading, the embedding and LM head, writing the configs).

    python -m quantkit.eval.bench.bench_8b_layer --out out/bench-8b
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import click
import torch

from quantkit.eval.bench.bench_gguf_speed import eight_b_slice
from quantkit.eval.bench.common import machine, median_seconds, quantize_command, report, timed
from quantkit.table import format_table

FULL_LAYERS = 32
RECIPE = "gptq-w4g128"
# the matmul whose rate sets the floor: a Hessian update of a 4,096-wide input over 16,384 tokens
RATE_SHAPE = (4096, 16384, 4096)  # (M, K, N) of [M, K] @ [K, N]
TARGET = 1.5  # statistics + solves within this multiple of the floor


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """Each quantized linear of one decoder layer -> (out_features N, in_features K)."""
    from quantkit.models.decoder import weight_shapes
    from quantkit.models.layers import LINEARS, layer_prefix

    shapes = weight_shapes(config)
    return {name: shapes[f"{layer_prefix(0)}{name}.weight"] for name in LINEARS}


def floor_multiply_adds(config, n_samples: int, seq_len: int) -> dict[str, float]:
    """The layer's necessary multiply-adds by phase (see the module's docstring)."""
    from quantkit.models.layers import SEQUENTIAL_GROUPS

    tokens = n_samples * seq_len
    shapes = linear_shapes(config)
    attention_width = config.num_attention_heads * config.head_dim
    # causal attention: a query attends (seq_len + 1) / 2 keys on average, for q·k and for p·v
    attention = tokens * 2 * attention_width * (seq_len + 1) / 2
    forwards = tokens * sum(n * k for n, k in shapes.values()) + attention
    # groups sharing an input share its Hessian (q/k/v, gate/up)
    hessians = tokens * sum(k * (k + 1) / 2 for k in (shapes[group[0]][1] for group in SEQUENTIAL_GROUPS))
    solves = sum(n * k * k / 2 + k ** 3 / 3 for n, k in shapes.values())
    return {"forwards": forwards, "Hessians": hessians, "solves": solves}


def bf16_rate(threads: int, repeats: int = 3) -> float:
    """Multiply-adds per second of a bf16 matmul of ``RATE_SHAPE`` with float32 sums, median of ``repeats``."""
    torch.set_num_threads(threads)
    m, k, n = RATE_SHAPE
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).bfloat16()
    b = torch.randn(k, n, generator=generator).bfloat16()
    return m * k * n / median_seconds(lambda: a @ b, repeats)


def run(out: Path, recipe: str, n_samples: int, seq_len: int, batch_size: int, threads: int,
        activations: str) -> tuple[str, str, dict]:
    """Quantize the one-layer checkpoint -> (setup, table, measurements)."""
    from quantkit.models import MiniCPMConfig

    checkpoint = eight_b_slice(out / "minicpm41-8b-1-layer", 1)
    config = MiniCPMConfig.from_pretrained(checkpoint)
    artifact = out / f"layer-{recipe}-{n_samples}x{seq_len}"
    shutil.rmtree(artifact, ignore_errors=True)
    shutil.rmtree(artifact.with_name(artifact.name + ".partial"), ignore_errors=True)
    rate_before = bf16_rate(threads)
    settings = (f"calibration.n_samples={n_samples}", f"calibration.seq_len={seq_len}",
                f"calibration.batch_size={batch_size}")
    command = quantize_command(recipe, checkpoint, artifact, settings) + ["--activations", activations]
    wall, peak_rss_mb = timed(command, out / f"{artifact.name}.log")
    rate_after = bf16_rate(threads)
    # the rate is measured on both sides of the run: on this VM it has moved by up to 2x between
    # measurements minutes apart (0.29-0.72 T/s on one shape), and the floor takes their mean
    rate = (rate_before + rate_after) / 2
    measured = json.loads((artifact / "quantize_report.json").read_text())
    layer = measured["layers"][0]
    macs = floor_multiply_adds(config, n_samples, seq_len)
    floors = {phase: count / rate for phase, count in macs.items()}
    statistics_floor = floors["forwards"] + floors["Hessians"]
    rows = [
        ["statistics: forwards", macs["forwards"] / 1e12, floors["forwards"], "", ""],
        ["statistics: Hessians", macs["Hessians"] / 1e12, floors["Hessians"], "", ""],
        ["statistics", (macs["forwards"] + macs["Hessians"]) / 1e12, statistics_floor, layer["stats_seconds"],
         layer["stats_seconds"] / statistics_floor],
        ["solves (GPTQ)", macs["solves"] / 1e12, floors["solves"], layer["solve_seconds"],
         layer["solve_seconds"] / floors["solves"]],
    ]
    both_floor = statistics_floor + floors["solves"]
    both = layer["stats_seconds"] + layer["solve_seconds"]
    rows.append(["statistics + solves", sum(macs.values()) / 1e12, both_floor, both, both / both_floor])
    rows.append(["the layer's wall time (+ error reports, packing, shard)", "", "", layer["seconds"], ""])
    table = format_table(["phase", "T multiply-adds", "floor s", "measured s", "x floor"], rows)
    outside = measured["seconds"] - layer["seconds"]
    projected = FULL_LAYERS * layer["seconds"] + outside
    setup = (f"one MiniCPM4.1-8B decoder layer (random weights), recipe {recipe}, {n_samples} x {seq_len} "
             f"calibration tokens in batches of {batch_size}, activations {measured['activations']}; floor at the "
             f"bf16 matmul rate {rate / 1e12:.3f} T multiply-adds/s, the mean of {rate_before / 1e12:.3f} before and "
             f"{rate_after / 1e12:.3f} after the run ({'x'.join(map(str, RATE_SHAPE))}, {threads} threads); "
             f"machine: {machine()}")
    notes = (f"target: statistics + solves <= {TARGET:g}x the floor: {both / both_floor:.2f}x "
             f"{'met' if both / both_floor <= TARGET else 'NOT met'}\n"
             f"quantize wall time {wall:.0f} s (outside the layer {outside:.0f} s), peak RSS "
             f"{peak_rss_mb / 1024:.2f} GB; projected for all {FULL_LAYERS} layers: {projected / 3600:.2f} h")
    results = {"recipe": recipe, "n_samples": n_samples, "seq_len": seq_len, "bf16_rate_macs": rate,
               "bf16_rate_macs_before_after": [rate_before, rate_after],
               "multiply_adds": macs, "floor_seconds": floors, "layer": layer, "wall_seconds": wall,
               "peak_rss_mb": peak_rss_mb, "projected_hours": projected / 3600, "times_floor": both / both_floor,
               "activations": measured["activations"]}
    return setup, f"{table}\n\n{notes}", results


@click.command()
@click.option("--out", default="out/bench-8b", show_default=True, type=click.Path(path_type=Path))
@click.option("--recipe", default=RECIPE, show_default=True)
@click.option("--n-samples", default=128, show_default=True, help="Calibration rows.")
@click.option("--seq-len", default=2048, show_default=True, help="Tokens per calibration row.")
@click.option("--batch-size", default=8, show_default=True, help="Calibration rows per forward.")
@click.option("--activations", type=click.Choice(["auto", "memory", "disk"]), default="auto", show_default=True)
@click.option("--threads", default=2, show_default=True, help="Threads of the rate measurement (the quantize "
                                                                "process takes torch's default).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None)
def main(out, recipe, n_samples, seq_len, batch_size, activations, threads, json_path):
    """Quantize one 8B layer with the full calibration set and print it against its floor."""
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    setup, body, results = run(out, recipe, n_samples, seq_len, batch_size, threads, activations)
    report(setup, body, [results], json_path=json_path or out / "layer.json", markdown_path=out / "layer.md",
           notes=f"wall time of this benchmark: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
