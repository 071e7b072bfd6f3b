"""The runtime's CPU linears side by side at MiniCPM4.1-8B's shapes, for decode (1 row) and prefill
(256 rows): bf16 dense (the baseline), the packed int4 kernel (``Int4Linear``, W4 g128) and the
ternary bit-plane kernel (``TernaryLinear``, g32). Ratios are dense time over each path's time, so
above 1 is faster than bf16; medians of repeats. ``DECODE_ROWS`` in kernels/linear/packed.py comes
from where the packed kernels stop beating the bf16 matmul.

    python -m quantkit.eval.bench.bench_linear --json out/bench-linear.json
"""
from __future__ import annotations

import click
import torch
from quantkit.eval.bench.common import machine, median_seconds, report, timing_options
from quantkit.kernels.linear import dense_linear
from quantkit.kernels.linear.int4 import Int4Linear
from quantkit.kernels.linear.ternary import TernaryLinear

from quantkit.algorithms.rtn import rtn_quantize
from quantkit.quant import QuantConfig
from quantkit.table import format_table

SHAPES = {"q_proj / o_proj": (4096, 4096), "gate_proj / up_proj": (16384, 4096), "down_proj": (4096, 16384)}
PATHS = {
    "int4 g128": lambda w: Int4Linear.from_record(rtn_quantize(w, QuantConfig(4, 128, sym=True))),
    "ternary g32": lambda w: TernaryLinear.from_record(rtn_quantize(w, QuantConfig(2, 32, False, ternary=True))),
}


@click.command()
@click.option("--rows", default="1,4,16,256", show_default=True, help="Activation rows (tokens) per call.")
@timing_options(repeats=9)
def main(rows, repeats, threads, json_path):
    torch.set_num_threads(threads)
    table, records = [], []
    for shape, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.02
        modules = {"bf16 dense": dense_linear(weight, None, torch.bfloat16)}
        modules.update({name: build(weight) for name, build in PATHS.items()})
        bytes_read = {name: m.weight_bytes for name, m in modules.items()}
        for count in (int(r) for r in rows.split(",")):
            x = torch.randn(count, k).bfloat16()
            with torch.no_grad():
                seconds = {name: median_seconds(lambda m=m: m(x), repeats) for name, m in modules.items()}
            base = seconds["bf16 dense"]
            table.append([shape, f"{n}x{k}", count, base * 1e3,
                          *(base / seconds[name] for name in PATHS)])
            records.append({"shape": shape, "out_features": n, "in_features": k, "rows": count,
                            "milliseconds": {name: s * 1e3 for name, s in seconds.items()},
                            "weight_bytes": bytes_read})
    setup = (f"one linear, bf16 activations; ratio = bf16 dense time / path time; median of {repeats}; "
             f"{threads} threads; machine: {machine()}")
    headers = ["linear", "N x K", "rows", "bf16 dense ms", *(f"{name} speed-up" for name in PATHS)]
    report(setup, format_table(headers, table), records, json_path=json_path)


if __name__ == "__main__":
    main()
