"""Block reconstruction on one MiniCPM4.1-8B decoder layer: a training step and a measurement pass against
their floor, and the layer's cost at a recipe's settings projected from them.

A whole 8B layer trained with the recipe defaults (200 steps of 4 x 2048-token rows, the error measured
on all 128 rows 5 times) is days of a 2-core CPU, so this measures the parts and multiplies:

- a step: ``quantkit.algorithms.reconstruct.reconstruct`` run for 1 and for 3 iterations on ``--rows``
  rows, the difference halved (both runs measure the start and the end alike, so those cancel);
- a measurement pass: one forward of the layer over the same rows (the eval of ``reconstruct``).

The floor is the multiply-adds at the rate this CPU multiplies float32 matrices (reconstruction runs in
float32), measured on a matmul of the layer's MLP shape before and after: a forward is every linear once
plus causal attention; a step is three forwards' worth (the forward, and the backward's products for the
input's and the weights' gradients). The layer is random (N(0, 0.02) weights, the rounding RTN W2 g64's),
which costs what a real one does.

    python -m quantkit.eval.bench.bench_8b_reconstruct --out out/bench-8b
"""
from __future__ import annotations

import time
from pathlib import Path

import click
import torch

from quantkit.eval.bench.bench_8b_layer import linear_shapes
from quantkit.eval.bench.common import machine, median_seconds, report
from quantkit.table import format_table

FULL_LAYERS = 32
# the matmul whose rate sets the floor: the MLP's up projection of a 2048-token row
RATE_SHAPE = (2048, 4096, 16384)  # (M, K, N) of [M, K] @ [K, N]
# what a layer's reconstruction does at the recipe defaults (quantkit.algorithms.reconstruct.SETTINGS) on
# the full calibration set of bench-8b's GPTQ layer
DEFAULT_RUN = {"iterations": 200, "batch_size": 4, "eval_every": 50, "rows": 128, "seq_len": 2048}


def float32_rate(threads: int, repeats: int = 3) -> float:
    """Multiply-adds per second of a float32 matmul of ``RATE_SHAPE``, median of ``repeats``."""
    torch.set_num_threads(threads)
    m, k, n = RATE_SHAPE
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
    return m * k * n / median_seconds(lambda: a @ b, repeats)


def forward_multiply_adds(config, tokens_per_row: int, rows: int) -> float:
    """One forward of the layer over ``rows`` rows: every linear once, plus causal q·k and p·v."""
    attention = tokens_per_row * 2 * config.num_attention_heads * config.head_dim * (tokens_per_row + 1) / 2
    return rows * (tokens_per_row * sum(n * k for n, k in linear_shapes(config).values()) + attention)


def _layer(config):
    """Layer 0 of ``config`` with N(0, 0.02) weights and unit norm gains, float32, and its rotary embedding."""
    from quantkit.models import MiniCPMDecoderLayer

    generator = torch.Generator().manual_seed(0)
    layer = MiniCPMDecoderLayer(config, 0).requires_grad_(False).eval()
    with torch.no_grad():
        for name, parameter in layer.named_parameters():
            if name.endswith("layernorm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return layer


def measure(config, rows: int, seq_len: int, threads: int) -> dict:
    """Seconds of a step and of a measurement pass of a ``config`` layer on ``rows`` rows of ``seq_len`` tokens,
    and the rates."""
    from quantkit.algorithms.reconstruct import SETTINGS, reconstruct
    from quantkit.models import MiniCPMRotaryEmbedding
    from quantkit.quant import QuantConfig, rtn_quantize

    torch.set_num_threads(threads)
    layer = _layer(config)
    grid = QuantConfig(2, 64, False)
    weights = {name: layer.get_submodule(name).weight for name in linear_shapes(config)}
    records = {name: rtn_quantize(weight, grid) for name, weight in weights.items()}
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(rows, seq_len, config.hidden_size, generator=generator)
    position_embeddings = MiniCPMRotaryEmbedding(config)(inputs[:1], torch.arange(seq_len).unsqueeze(0))

    def forward(linear_weights, batch):
        parameters = {f"{name}.weight": weight for name, weight in linear_weights.items()}
        return torch.func.functional_call(layer, parameters, (batch,), {"position_embeddings": position_embeddings})

    with torch.no_grad():
        targets = forward(weights, inputs)
    rate_before = float32_rate(threads)
    started = time.perf_counter()
    with torch.no_grad():
        forward({name: record.dequantize() for name, record in records.items()}, inputs)
    measurement = time.perf_counter() - started

    def run(iterations: int) -> float:
        settings = {**{key: field.default for key, field in SETTINGS.items()},
                    "iterations": iterations, "batch_size": rows, "eval_every": iterations}
        started = time.perf_counter()
        reconstruct(forward, weights, records, inputs, targets, settings, eval_batch_size=rows, seed=0)
        return time.perf_counter() - started

    once, thrice = run(1), run(3)
    rate_after = float32_rate(threads)
    return {"step_seconds": (thrice - once) / 2, "measurement_seconds": measurement,
            "float32_rate_macs": (rate_before + rate_after) / 2, "float32_rate_before_after": [rate_before, rate_after],
            "forward_multiply_adds": forward_multiply_adds(config, seq_len, rows)}


@click.command()
@click.option("--out", default="out/bench-8b", show_default=True, type=click.Path(path_type=Path))
@click.option("--rows", default=1, show_default=True, help="Calibration rows per step measured.")
@click.option("--seq-len", default=2048, show_default=True, help="Tokens per row.")
@click.option("--threads", default=2, show_default=True)
def main(out, rows, seq_len, threads):
    """Time a block-reconstruction step of one 8B layer against its floor, and project a layer's run."""
    from quantkit.synthetic import minicpm41_8b_config

    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    measured = measure(minicpm41_8b_config(), rows, seq_len, threads)
    rate, forward = measured["float32_rate_macs"], measured["forward_multiply_adds"]
    step_floor, measurement_floor = 3 * forward / rate, forward / rate
    per_row = {"step": measured["step_seconds"] / rows, "measurement": measured["measurement_seconds"] / rows}
    run = DEFAULT_RUN
    steps_rows = run["iterations"] * run["batch_size"]
    measured_rows = (run["iterations"] // run["eval_every"] + 1) * run["rows"]
    projected = steps_rows * per_row["step"] + measured_rows * per_row["measurement"]
    projected_floor = (steps_rows * step_floor + measured_rows * measurement_floor) / rows
    table = format_table(
        ["part", f"T multiply-adds ({rows} x {seq_len} tokens)", "floor s", "measured s", "x floor"],
        [["a training step", 3 * forward / 1e12, step_floor, measured["step_seconds"],
          measured["step_seconds"] / step_floor],
         ["a measurement pass", forward / 1e12, measurement_floor, measured["measurement_seconds"],
          measured["measurement_seconds"] / measurement_floor],
         [f"one layer at the defaults ({run['iterations']} steps of {run['batch_size']} rows, {measured_rows} rows "
          f"measured; projected)", "", projected_floor, projected, projected / projected_floor]])
    setup = (f"block reconstruction of one MiniCPM4.1-8B decoder layer (random weights, RTN W2 g64 start), "
             f"{rows} x {seq_len} tokens a step; floor at the float32 matmul rate {rate / 1e12:.3f} T "
             f"multiply-adds/s, the mean of before and after ({'x'.join(map(str, RATE_SHAPE))}, {threads} threads); "
             f"machine: {machine()}")
    notes = (f"projected for all {FULL_LAYERS} layers at the defaults: {FULL_LAYERS * projected / 3600:.1f} h on "
             f"this CPU (the floor: {FULL_LAYERS * projected_floor / 3600:.1f} h)")
    report(setup, f"{table}\n\n{notes}", [{**measured, "rows": rows, "seq_len": seq_len,
                                          "projected_layer_seconds": projected,
                                          "projected_layer_floor_seconds": projected_floor}],
           json_path=out / "reconstruct.json", markdown_path=out / "reconstruct.md",
           notes=f"wall time of this benchmark: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
