"""InfLLM v2 against dense attention on this CPU, on MiniCPM4.1-8B's attention shape (32 query
heads, 2 KV heads, head dim 128) and its sparse_config, with random q/k/v: one decode step and one
prefill chunk at the end of 8K, 32K and 64K tokens of context. The compressed keys are already in
the cache, as they are in decode (the runtime extends them incrementally). Dense is the faster of
the runtime's two dense paths (SDPA, and the fused one-query operator for decode). Medians of repeats.

    python -m quantkit.eval.bench.bench_sparse --json out/bench-sparse.json
"""
from __future__ import annotations

import click
import torch

from quantkit.eval.bench.common import dense_paths, machine, median_seconds, random_keys_values, report, timing_options
from quantkit.kernels.infllm import CompressedKeyCache, SparseAttentionConfig, sparse_attention
from quantkit.table import format_table

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 2, 128


def fastest_dense(q, k, v, repeats: int) -> tuple[str, float]:
    """The faster of the runtime's dense paths -> (name, median seconds)."""
    timings = dense_paths(q, k, v, repeats)
    name = min(timings, key=timings.get)
    return name, timings[name]


@click.command()
@click.option("--contexts", default="8192,32768,65536", show_default=True)
@click.option("--chunk", default=512, show_default=True, help="Queries in the prefill chunk.")
@timing_options(repeats=5)
def main(contexts, chunk, repeats, threads, json_path):
    torch.set_num_threads(threads)
    config = SparseAttentionConfig()  # MiniCPM4.1-8B: kernel 32/16, block 64, top-64, window 2048, dense below 8192
    rows, records = [], []
    for context in (int(c) for c in contexts.split(",")):
        g = torch.Generator().manual_seed(context)
        k, v = random_keys_values(KV_HEADS, context, HEAD_DIM, g)
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
    table = format_table(["context", "work", "fastest dense path", "dense ms", "InfLLM v2 ms", "dense / sparse"], rows)
    report(setup, table, records, json_path=json_path)


if __name__ == "__main__":
    main()
