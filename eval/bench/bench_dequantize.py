"""How long a W4 linear takes to rebuild its bf16 weight (``Int4Linear._rebuilt``, what each prefill
chunk of a model beyond ``KEEP_DEQUANTIZED_BYTES`` pays per linear) at MiniCPM4.1-8B's shapes, against
a 512-row bf16 matmul on the result: random codes, group 128, median of ``--repeats``. Both ways it
can be built: the compiled operator (``int4_dequantize_t``) and PyTorch's operators.

    OMP_NUM_THREADS=1 python -m quantkit.eval.bench.bench_dequantize
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def shapes() -> dict[str, tuple[int, int]]:
    from quantkit.synthetic import minicpm41_8b_config

    config = minicpm41_8b_config()
    hidden, heads = config.hidden_size, config.num_attention_heads * config.head_dim
    qkv = heads + 2 * config.num_key_value_heads * config.head_dim
    return {"qkv": (qkv, hidden), "o": (hidden, heads), "gate_up": (2 * config.intermediate_size, hidden),
            "down": (hidden, config.intermediate_size)}


def main(repeats: int, rows: int) -> None:
    from quantkit import cpu_ops
    from quantkit.kernels.linear.int4 import Int4Linear

    compiled = cpu_ops.load
    if compiled() is None:
        raise SystemExit("the compiled CPU operators are unavailable here (no C++ compiler?)")
    generator = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for name, (n, k) in shapes().items():
        codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
        scales = torch.rand(k // 128, n, generator=generator) * 0.01 + 1e-3
        offsets = (torch.rand(k // 128, n, generator=generator) - 0.5) * 0.05
        module = Int4Linear(codes, scales, offsets, 128, k, keep_dequantized=False)
        del codes
        seconds = {}
        for way, load in (("compiled", compiled), ("PyTorch", lambda: None)):
            cpu_ops.load = load
            times = []
            for _ in range(repeats + 1):  # the first call pays for the buffer
                started = time.perf_counter()
                weight = module._rebuilt(torch.bfloat16)
                times.append(time.perf_counter() - started)
            seconds[way] = statistics.median(times[1:])
        cpu_ops.load = compiled
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        started = time.perf_counter()
        x @ weight.T
        matmul = time.perf_counter() - started
        print(f"{name:8s} [{n}, {k}]: rebuild {seconds['compiled']:.3f} s compiled, {seconds['PyTorch']:.3f} s "
              f"PyTorch ({seconds['PyTorch'] / seconds['compiled']:.1f}x); {rows}-row bf16 matmul {matmul:.3f} s",
              flush=True)
        del module, weight


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=512)
    args = parser.parse_args()
    main(args.repeats, args.rows)
