"""InfLLM v2 against dense attention on this CPU, on MiniCPM4.1-8B's attention shape (32 query
heads, 2 KV heads, head dim 128) and its sparse_config, with random q/k/v: one decode step and one
prefill chunk at the end of 8K, 32K and 64K tokens of context. The compressed keys are already in
the cache, as they are in decode (the runtime extends them incrementally). Dense is the faster of
the runtime's two dense paths (SDPA, and the fused one-query operator for decode). Medians of repeats.

    python -m quantkit.eval.bench_sparse --json out/bench-sparse.json
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import torch

from quantkit.eval.bench_methods import machine
from quantkit.kernels import cpu_ops
from quantkit.kernels.infllm import CompressedKeyCache, SparseAttentionConfig, dense_attention, sparse_attention
from quantkit.table import format_table

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 2, 128


def median_seconds(run, repeats: int) -> float:
    run()  # warm-up (and the cache's one-time pooling of the history)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def dense_paths(q, k, v, repeats: int) -> dict[str, float]:
    """Median seconds of dense attention of the last T positions by each of the runtime's dense paths:
    SDPA, and for one query (T = 1) over a bf16 cache the fused CPU operator, when it builds."""
    timings = {"SDPA": median_seconds(lambda: dense_attention(q, k, v), repeats)}
    ops = cpu_ops.load()
    if q.shape[1] == 1 and ops is not None:
        query = q.float().contiguous()
        timings["fused operator"] = median_seconds(
            lambda: ops.decode_attention(query, k, v, k.shape[1], q.shape[-1] ** -0.5), repeats)
    return timings


def fastest_dense(q, k, v, repeats: int) -> tuple[str, float]:
    """The faster of the runtime's dense paths -> (name, median seconds)."""
    timings = dense_paths(q, k, v, repeats)
    name = min(timings, key=timings.get)
    return name, timings[name]


@click.command()
@click.option("--contexts", default="8192,32768,65536", show_default=True)
@click.option("--chunk", default=512, show_default=True, help="Queries in the prefill chunk.")
@click.option("--repeats", default=5, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None)
def main(contexts, chunk, repeats, threads, json_path):
    torch.set_num_threads(threads)
    config = SparseAttentionConfig()  # MiniCPM4.1-8B: kernel 32/16, block 64, top-64, window 2048, dense below 8192
    rows, records = [], []
    for context in (int(c) for c in contexts.split(",")):
        g = torch.Generator().manual_seed(context)
        k, v = torch.randn(2, KV_HEADS, context, HEAD_DIM, generator=g).bfloat16()
        for name, queries in (("decode step", 1), (f"prefill chunk of {chunk}", chunk)):
            q = torch.randn(Q_HEADS, queries, HEAD_DIM, generator=g).bfloat16()
            cache = CompressedKeyCache(config)
            cache.update(k[:, :context - queries])
            dense_path, dense = fastest_dense(q, k, v, repeats)
            sparse = median_seconds(lambda: sparse_attention(q, k, v, config, cache), repeats)
            rows.append([context, name, dense_path, dense * 1e3, sparse * 1e3, dense / sparse])
            records.append({"context": context, "queries": queries, "dense_path": dense_path, "dense_ms": dense * 1e3,
                            "sparse_ms": sparse * 1e3, "speedup": dense / sparse})
    setup = (f"attention only, {Q_HEADS} q heads / {KV_HEADS} KV heads / d {HEAD_DIM}, bf16, MiniCPM4.1 "
             f"sparse_config; median of {repeats}; machine: {machine()}")
    report(setup, ["context", "work", "fastest dense path", "dense ms", "InfLLM v2 ms", "dense / sparse"], rows,
           records, json_path)


def report(setup: str, headers: list[str], rows: list[list], records: list[dict], json_path: Path | None) -> None:
    """Print the setup line and the table; write both as JSON when asked."""
    click.echo(f"{setup}\n\n{format_table(headers, rows)}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"setup": setup, "rows": records}, indent=2))


if __name__ == "__main__":
    main()
