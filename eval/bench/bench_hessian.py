"""The Hessian update of bf16 activations, H <- H/2 + XᵀX, by each path the statistics can take, side by side
at MiniCPM4.1-8B's widths: the compiled kernel on AMX tiles and on AVX-512 BF16 vectors (one triangle,
quantkit/cpu_ops/gram_ops.cpp), and PyTorch's float32 product with oneDNN's bf16 flag (the kernel's
specification, and what runs without bf16 hardware). Rates count one triangle, T·K(K + 1)/2 multiply-adds,
for every path. Medians of repeats after a warm-up; the machine line lists the CPU's flags, since AMX decides
the first row of each shape. ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` holds PyTorch's product off AMX.

    python -m quantkit.eval.bench.bench_hessian --json out/bench-hessian.json
"""
from __future__ import annotations

import click
import torch

from quantkit.eval.bench.common import machine, median_seconds, report, timing_options
from quantkit.table import format_table

SHAPES = [(16384, 4096), (8192, 16384)]  # calibration rows x features: q/k/v, o_proj, gate/up; down_proj


@click.command()
@timing_options(repeats=3)
def main(repeats, threads, json_path):
    from quantkit import cpu_ops
    from quantkit.stats import BF16_IN_HARDWARE, gram_by_torch

    torch.set_num_threads(threads)
    ops = cpu_ops.load()
    if ops is None:
        raise click.ClickException("the compiled CPU operators did not build (no compiler?)")
    rows_out, records = [], []
    for tokens, features in SHAPES:
        rows = torch.randn(tokens, features, generator=torch.Generator().manual_seed(features)).bfloat16()
        hessian = torch.zeros(features, features)
        paths = {"PyTorch, oneDNN bf16 flag": lambda: gram_by_torch(hessian, rows, 0.5, 1.0)}
        if BF16_IN_HARDWARE:  # elsewhere the kernel declines
            paths = {"kernel, AMX tiles": lambda: ops.bf16_gram_accumulate(hessian, rows, 0.5, 1.0, True),
                     "kernel, AVX-512 BF16 vectors": lambda: ops.bf16_gram_accumulate(hessian, rows, 0.5, 1.0, False),
                     **paths}
        macs = tokens * features * (features + 1) / 2
        seconds = {name: median_seconds(path, repeats) for name, path in paths.items()}
        baseline = seconds["PyTorch, oneDNN bf16 flag"]
        for name, spent in seconds.items():
            rows_out.append([f"{tokens} x {features}", name, spent, macs / spent / 1e12, baseline / spent])
            records.append({"tokens": tokens, "features": features, "path": name, "seconds": spent,
                            "triangle_tmacs_per_s": macs / spent / 1e12})
    setup = (f"H <- H/2 + XᵀX, X bf16 [T, K], H float32; {threads} threads, median of {repeats} after a warm-up; "
             f"machine: {machine()}")
    table = format_table(["T x K", "path", "seconds", "T multiply-adds/s (triangle)", "x PyTorch"], rows_out)
    report(setup, table, records, json_path=json_path)


if __name__ == "__main__":
    main()
