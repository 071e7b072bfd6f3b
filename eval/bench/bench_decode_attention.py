"""The runtime's dense attention paths for one decode step, side by side, over a bf16 cache: the fused
one-query CPU operator and the fused block kernel over every block (quantkit/cpu_ops), and SDPA, at the
default model's head shape (9 query / 3 KV heads, d 64) and MiniCPM4.1-8B's (32 / 2, d 128). The
crossover of the first two is where ``FUSED_ATTENTION_MAX_SCORES`` in kernels/model.py comes from, that of
the last two ``DENSE_DECODE_MIN_KEYS`` in kernels/infllm/cpu.py. Medians of repeats.

    python -m quantkit.eval.bench.bench_decode_attention --json out/bench-decode-attention.json
"""
from __future__ import annotations

import click
import torch

from quantkit.eval.bench.common import dense_paths, machine, random_keys_values, report, timing_options
from quantkit.kernels.infllm.cpu import DENSE_DECODE_MIN_KEYS
from quantkit.kernels.model import FUSED_ATTENTION_MAX_SCORES
from quantkit.table import format_table

SHAPES = {"default model": (9, 3, 64), "MiniCPM4.1-8B": (32, 2, 128)}  # query heads, KV heads, head dim


@click.command()
@click.option("--lengths", default="64,128,256,384,512,1024,8192", show_default=True, help="Cached keys.")
@timing_options(repeats=15)
def main(lengths, repeats, threads, json_path):
    torch.set_num_threads(threads)
    rows, records = [], []
    for shape, (q_heads, kv_heads, dim) in SHAPES.items():
        g = torch.Generator().manual_seed(q_heads)
        for length in (int(n) for n in lengths.split(",")):
            k, v = random_keys_values(kv_heads, length, dim, g)
            q = torch.randn(q_heads, 1, dim, generator=g).bfloat16()
            timings = dense_paths(q, k, v, repeats)
            fused, blocks = (timings.get(path, float("nan")) for path in ("fused operator", "block kernel"))
            runtime_uses = ("fused operator" if length * (q_heads // kv_heads) <= FUSED_ATTENTION_MAX_SCORES
                            else "block kernel" if length >= DENSE_DECODE_MIN_KEYS else "SDPA")
            rows.append([shape, length, fused * 1e3, blocks * 1e3, timings["SDPA"] * 1e3, timings["SDPA"] / blocks,
                         runtime_uses])
            records.append({"shape": shape, "keys": length, "fused_ms": fused * 1e3, "blocks_ms": blocks * 1e3,
                            "sdpa_ms": timings["SDPA"] * 1e3, "runtime_uses": runtime_uses})
    setup = f"one decode step's dense attention, bf16 cache; median of {repeats}; machine: {machine()}"
    table = format_table(["shape", "keys", "fused operator ms", "block kernel ms", "SDPA ms", "SDPA / block kernel",
                          "runtime uses"], rows)
    report(setup, table, records, json_path=json_path)


if __name__ == "__main__":
    main()
