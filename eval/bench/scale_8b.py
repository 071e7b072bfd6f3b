"""`make bench-scale`: the marlin recipe on an 8B-shaped MiniCPM4.1 checkpoint (random weights).

Proves that a full-size model quantizes on this machine within a memory budget, and projects the
wall time for a real calibration set: per layer, the statistics time (forward passes and Hessian
accumulation) grows with the number of calibration tokens, the solve time (smoothing search and
GPTQ) does not.

    python -m quantkit.eval.bench.scale_8b --work out/scale-8b
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import click

from quantkit.eval.bench.common import quantize_command, timed
from quantkit.table import format_table


@click.command()
@click.option("--work", default="out/scale-8b", show_default=True, type=click.Path(path_type=Path))
@click.option("--n-samples", default=8, show_default=True)
@click.option("--seq-len", default=256, show_default=True)
@click.option("--layers", default=None, type=int, help="Stop after this many layers (default: all 32).")
@click.option("--target-samples", default=128, show_default=True, help="Projection: calibration rows.")
@click.option("--target-seq-len", default=2048, show_default=True, help="Projection: tokens per row.")
def main(work, n_samples, seq_len, layers, target_samples, target_seq_len):
    """Write the checkpoint (once), quantize it with the marlin recipe, report time and memory."""
    from quantkit.synthetic import minicpm41_8b_config, write_sharded_checkpoint

    model = work / "minicpm41-8b-random"
    if not (model / "config.json").is_file():
        shutil.rmtree(model, ignore_errors=True)
        config = minicpm41_8b_config()
        if layers:
            config.num_hidden_layers = layers
        write_sharded_checkpoint(model, config, progress=True)
    out = work / "marlin"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.with_name(out.name + ".partial"), ignore_errors=True)
    seconds, rss = timed(quantize_command("marlin", model, out, (f"calibration.n_samples={n_samples}",
                                                                  f"calibration.seq_len={seq_len}",
                                                                  f"calibration.batch_size={n_samples}")),
                         work / "quantize.log")
    report = json.loads((out / "quantize_report.json").read_text())
    growth = (target_samples * target_seq_len) / (n_samples * seq_len)
    rows, total_projected = [], 0.0
    for layer in report["layers"]:
        projected = layer["solve_seconds"] + layer["stats_seconds"] * growth
        total_projected += projected
        rows.append([layer["index"], layer["seconds"], layer["stats_seconds"], layer["solve_seconds"], projected])
    click.echo(format_table(["layer", "seconds", "stats s", "solve s", f"projected s ({target_samples}x"
                                                                         f"{target_seq_len})"], rows))
    click.echo(f"\nwall {seconds:.0f} s, peak RSS {rss / 1024:.2f} GB (/usr/bin/time -v); projected for "
               f"{target_samples} x {target_seq_len} calibration tokens: {total_projected / 3600:.1f} h "
               "(statistics time scaled linearly with tokens, solve time unchanged)")


if __name__ == "__main__":
    main()
