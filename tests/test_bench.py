"""The benchmarks' pure logic (no timing): what `make bench-8b` prints as its targets."""
from __future__ import annotations

from quantkit.eval.bench.bench_8b import Measured, targets


def test_bench_8b_targets():
    # bandwidth 10 GB/s; quantkit reads 4 GB a token at 512 (ceiling 2.5 tok/s), 5 GB at 8192 (2.0)
    ours = Measured("quantkit", 0, prefill={512: 30.0}, decode={512: 2.0, 8192: 1.0},
                    bytes_per_token={512: 4_000_000_000, 8192: 5_000_000_000})
    q4_0 = Measured("llama.cpp Q4_0", 0, prefill={512: 10.0, 8192: 8.0}, decode={512: 1.6, 8192: 1.25},
                    bytes_per_token={512: 4_500_000_000, 8192: 5_500_000_000})
    assert ours.ceiling(512, 10.0) == 2.5 and ours.share(8192, 10.0) == 0.5
    checked = {row["target"]: (round(row["measured"], 6), row["goal"], row["met"]) for row in targets(ours, q4_0, 10.0)}
    assert checked == {
        "decode at 512: quantkit / llama.cpp Q4_0": (1.25, 1.0, True),
        "decode at 512: share of the bandwidth ceiling": (0.8, 0.6, True),
        "decode at 8192: quantkit / llama.cpp Q4_0": (0.8, 1.0, False),
        "decode at 8192: share of the bandwidth ceiling": (0.5, 0.6, False),
        # only the prompts quantkit prefilled are compared (llama.cpp's 8192 is its decode row's fill)
        "prefill of 512: quantkit / llama.cpp Q4_0": (3.0, 2.0, True),
    }
