"""The runtime's CPU linears side by side at MiniCPM4.1-8B's shapes, for decode (1 row) and prefill
(256 rows): bf16 dense (the baseline), the packed int4 kernel (``Int4Linear``, W4 g128) and the
ternary bit-plane kernel (``TernaryLinear``, g32). Ratios are dense time over each path's time, so
above 1 is faster than bf16; medians of repeats. ``DECODE_ROWS`` in kernels/linear/packed.py comes
from where the packed kernels stop beating the bf16 matmul. Then the LM head's decode row (73448 x
4096): quantkit's int8 head (``Int8Linear``) against PyTorch's int8 weight-only kernel on the same
bytes per weight (one scale per row), the kernel the runtime used before.

    python -m quantkit.eval.bench.bench_linear --json out/bench-linear.json
"""
from __future__ import annotations

import click
import torch

from quantkit.eval.bench.common import machine, median_seconds, report, timing_options
from quantkit.kernels.linear import dense_linear
from quantkit.kernels.linear.int4 import Int4Linear
from quantkit.kernels.linear.int8 import Int8Linear
from quantkit.kernels.linear.ternary import TernaryLinear
from quantkit.quant import QuantConfig, rtn_quantize
from quantkit.table import format_table

SHAPES = {"q_proj / o_proj": (4096, 4096), "gate_proj / up_proj": (16384, 4096), "down_proj": (4096, 16384)}
PATHS = {
    "int4 g128": lambda w: Int4Linear.from_record(rtn_quantize(w, QuantConfig(4, 128, sym=True))),
    "ternary g32": lambda w: TernaryLinear.from_record(rtn_quantize(w, QuantConfig(2, 32, False, ternary=True))),
}
LM_HEAD = (73448, 4096)


class TorchInt8RowHead(torch.nn.Module):
    """PyTorch's int8 weight-only kernel (one scale per row, bf16 activations converted per product)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        scales = weight.abs().amax(dim=1) / 127
        self.codes = torch.round(weight / scales[:, None]).to(torch.int8)
        self.scales = scales.bfloat16()
        self.weight_bytes = self.codes.numel() + self.scales.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)


def lm_head_rows(repeats: int) -> tuple[list[list], list[dict]]:
    """One decode row through the LM head: ms and GB/s of codes and scales read, per path."""
    n, k = LM_HEAD
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.02
    modules = {"quantkit int8 g128": Int8Linear(weight), "PyTorch int8 per row": TorchInt8RowHead(weight)}
    x = torch.randn(1, k).bfloat16()
    with torch.no_grad():
        seconds = {name: median_seconds(lambda m=m: m(x), repeats) for name, m in modules.items()}
    base = seconds["PyTorch int8 per row"]
    table = [[name, f"{n}x{k}", seconds[name] * 1e3, modules[name].weight_bytes / seconds[name] / 1e9,
              base / seconds[name]] for name in modules]
    records = [{"shape": "lm_head", "out_features": n, "in_features": k, "rows": 1, "path": name,
                "milliseconds": seconds[name] * 1e3, "weight_bytes": modules[name].weight_bytes} for name in modules]
    return table, records


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
    head_table, head_records = lm_head_rows(repeats)
    setup = (f"one linear, bf16 activations; ratio = bf16 dense time / path time (LM head: PyTorch int8 time / "
             f"path time); median of {repeats}; {threads} threads; machine: {machine()}")
    headers = ["linear", "N x K", "rows", "bf16 dense ms", *(f"{name} speed-up" for name in PATHS)]
    tables = (format_table(headers, table) + "\n\nLM head, one decode row:\n"
              + format_table(["path", "N x K", "ms", "GB/s read", "speed-up"], head_table))
    report(setup, tables, records + head_records, json_path=json_path)


if __name__ == "__main__":
    main()
