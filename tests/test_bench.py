"""The benchmarks' pure logic (no timing): what `make bench-8b` prints as its targets and floor."""
from __future__ import annotations

import pytest

from quantkit.eval.bench.bench_8b import Measured, between_probes, export_targets, targets


def test_bench_8b_targets():
    # probes of 10 GB/s around each decode; quantkit reads 4 GB a token at 512 (ceiling 2.5 tok/s), 5 GB at
    # 8192 (2.0)
    ours = Measured("quantkit", 0, prefill={512: 30.0}, decode={512: 2.0, 8192: 1.0},
                    bytes_per_token={512: 4_000_000_000, 8192: 5_000_000_000}, probed={512: 10.0, 8192: 10.0})
    q4_0 = Measured("llama.cpp Q4_0", 0, prefill={512: 10.0, 8192: 8.0}, decode={512: 1.6, 8192: 1.25},
                    bytes_per_token={512: 4_500_000_000, 8192: 5_500_000_000}, probed={512: 10.0, 8192: 10.0})
    assert ours.ceiling(512) == 2.5 and ours.share(8192) == 0.5
    # one class held against llama.cpp on this CPU, the other against llama.cpp built for it
    emulated = [{"cpu_class": "AVX2 desktop", "prefill_tok_s": 15.0, "decode_tok_s": 1.7, "llama_cpp": None},
                {"cpu_class": "no AMX", "prefill_tok_s": 16.0, "decode_tok_s": 1.8,
                 "llama_cpp": {"build": "llama.cpp noamx", "prefill_tok_s": 4.0, "decode_tok_s": 2.0}}]
    checked = {row["target"]: (round(row["measured"], 6), row["goal"], row["met"])
               for row in targets(ours, q4_0, emulated)}
    assert checked == {
        "decode at 512: quantkit / llama.cpp Q4_0": (1.25, 1.0, True),
        "decode at 512: share of the bandwidth ceiling": (0.8, 0.6, True),
        "decode at 8192: quantkit / llama.cpp Q4_0": (0.8, 1.0, False),
        "decode at 8192: share of the bandwidth ceiling": (0.5, 0.6, False),
        # only the prompts quantkit prefilled are compared (llama.cpp's 8192 is its decode row's fill)
        "prefill of 512: quantkit / llama.cpp Q4_0": (3.0, 2.0, True),
        "prefill of 512 as AVX2 desktop (emulated): quantkit / llama.cpp Q4_0 (on this CPU)": (1.5, 2.0, False),
        "decode at 512 as AVX2 desktop (emulated): quantkit / llama.cpp Q4_0 (on this CPU)": (1.0625, 1.0, True),
        "prefill of 512 as no AMX (emulated): quantkit / llama.cpp Q4_0 (llama.cpp noamx)": (4.0, 2.0, True),
        "decode at 512 as no AMX (emulated): quantkit / llama.cpp Q4_0 (llama.cpp noamx)": (0.9, 1.0, False),
    }


def test_bench_8b_ceiling_is_its_own_minutes_bandwidth():
    """Each decode's ceiling is the mean of the probes around it, or its own read where that is more (a
    probe can land in a slower moment than the decode it brackets)."""
    ours = Measured("quantkit", 0, decode={512: 2.0, 8192: 1.0}, bytes_per_token={512: 4e9, 8192: 5e9},
                    probed={512: 10.0, 8192: 4.0})
    assert ours.bandwidth(512) == 10.0 and ours.share(512) == 0.8
    assert ours.bandwidth(8192) == 5.0 and ours.share(8192) == 1.0  # read 5 GB/s against probes of 4


def test_between_probes_brackets_the_measurement(monkeypatch):
    from quantkit.eval.bench import bench_8b

    order, probes = [], iter([30.0, 50.0])
    monkeypatch.setattr(bench_8b, "memory_bandwidth_gb_s", lambda: order.append("probe") or next(probes))
    assert between_probes(lambda: order.append("measure") or 7) == (7, 40.0)
    assert order == ["probe", "measure", "probe"]


def test_bench_8b_export_targets_need_the_ratio_and_identical_tensors():
    rows = [{"model": "default", "type": "q4_0", "ratio": 1.07, "target_met": True, "identical": True},
            {"model": "8b-1-layer", "type": "q4_k_m", "ratio": 1.62, "target_met": False, "identical": True},
            {"model": "8b-1-layer", "type": "q8_0", "ratio": 0.9, "target_met": True, "identical": False}]
    checked = [(row["measured"], row["goal"], row["at_most"], row["met"]) for row in export_targets(rows)]
    assert checked == [(1.07, 1.5, True, True), (1.62, 1.5, True, False), (0.9, 1.5, True, False)]
    assert "DIFFERENT" in export_targets(rows)[2]["target"]


def test_bench_8b_emulates_the_cpu_classes_below_this_one():
    from quantkit.eval.bench.bench_8b_emulated import CPU_CLASSES, emulated_classes

    without_amx, avx2 = CPU_CLASSES
    assert emulated_classes(["avx2", "avx512f", "amx_tile"]) == [without_amx, avx2]
    assert emulated_classes(["avx2", "avx512f"]) == [avx2]  # no AMX here: the runtime's own rows are that class
    assert emulated_classes(["avx2"]) == []


def test_bench_8b_runs_the_runtime_as_an_avx2_desktop(tiny_checkpoint, tmp_path):
    """The emulating process holds oneDNN, PyTorch and quantkit's operators to AVX2, and prefill then
    multiplies int8 activations on the AVX2 build of the integer kernel."""
    from quantkit.engine import quantize
    from quantkit.eval.bench.bench_8b_emulated import CPU_CLASSES, measure
    from quantkit.recipe import load_recipe

    artifact = tmp_path / "w4"
    quantize(tiny_checkpoint, load_recipe("rtn-w4g128", {"calibration.n_samples": 2, "calibration.seq_len": 32}),
             artifact, progress=False)
    avx2 = list(CPU_CLASSES)[1]
    run = measure(avx2, artifact, layers=2, prompt_tokens=40, new_tokens=4, repeats=1, threads=1)
    assert (run["prefill_kernel"], run["int8_isa"], run["aten_capability"]) == ("int8", "avx2", "AVX2")
    assert run["prefill_tok_s"] > 0 and run["decode_tok_s"] > 0


def test_bench_8b_emulated_times_llama_bench_in_rounds_with_quantkit(tiny_checkpoint, tmp_path):
    """With a llama-bench, the emulating process alternates: each round a prefill test then a decode test
    of one repetition, and the ratios are the median of the rounds' (here a stand-in llama-bench that
    logs its arguments and answers 10, 20, 30, ... tokens per second)."""
    import json
    import subprocess
    import sys

    from quantkit.engine import quantize
    from quantkit.recipe import load_recipe

    artifact = tmp_path / "w4"
    quantize(tiny_checkpoint, load_recipe("rtn-w4g128", {"calibration.n_samples": 2, "calibration.seq_len": 32}),
             artifact, progress=False)
    calls, gguf = tmp_path / "calls.jsonl", tmp_path / "q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    stand_in = tmp_path / "llama-bench"
    stand_in.write_text(f"#!{sys.executable}\nimport json, sys\nlog = open({str(calls)!r}, 'a+')\n"
                        "log.seek(0); n = len(log.readlines()) + 1\nlog.write(json.dumps(sys.argv[1:]) + '\\n')\n"
                        "print(json.dumps([{'samples_ts': [10.0 * n]}]))\n")
    stand_in.chmod(0o755)
    done = subprocess.run([sys.executable, "-m", "quantkit.eval.bench.bench_8b_emulated", "--artifact", str(artifact),
                           "--layers", "2", "--prompt-tokens", "40", "--new-tokens", "4", "--repeats", "3",
                           "--threads", "1", "--llama-bench", str(stand_in), "--gguf", str(gguf)],
                          capture_output=True, text=True, check=True)
    run = json.loads(done.stdout.strip().splitlines()[-1])
    tests = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [t[t.index("-p") + 1] for t in tests] == ["40", "0"] * 3
    assert all(t[t.index("-r") + 1] == "1" and t[t.index("-m") + 1] == str(gguf) for t in tests)
    assert run["rounds"]["llama_prefill"] == [10.0, 30.0, 50.0] and run["rounds"]["llama_decode"] == [20.0, 40.0, 60.0]
    assert run["llama_cpp"]["prefill_tok_s"] == 30.0 and run["llama_cpp"]["decode_tok_s"] == 40.0
    for step in ("prefill", "decode"):
        ratios = sorted(ours / theirs for ours, theirs in zip(run["rounds"][step], run["rounds"][f"llama_{step}"]))
        assert run["paired_ratios"][step] == ratios[1]


def test_bench_8b_layer_floor_counts_each_phase_of_an_8b_layer():
    from quantkit.eval.bench.bench_8b_layer import floor_multiply_adds
    from quantkit.synthetic import minicpm41_8b_config

    config = minicpm41_8b_config()
    macs = floor_multiply_adds(config, n_samples=2, seq_len=8)
    tokens, hidden, ffn, kv = 16, 4096, 16384, 2 * 128  # 2 KV heads of 128
    linears = 2 * hidden * hidden + 2 * kv * hidden + 3 * ffn * hidden  # q, o; k, v; gate, up, down
    assert macs["forwards"] == tokens * linears + tokens * 2 * hidden * (8 + 1) / 2
    assert macs["Hessians"] == tokens * (3 * hidden * (hidden + 1) + ffn * (ffn + 1)) / 2  # q/k/v, o, gate/up, down
    updates = (2 * hidden + 2 * kv + 2 * ffn) * hidden ** 2 / 2 + hidden * ffn ** 2 / 2
    assert macs["solves"] == updates + 6 * hidden ** 3 / 3 + ffn ** 3 / 3



def test_bench_8b_reconstruct_counts_an_8b_forward_and_times_a_small_layer(tiny_checkpoint, monkeypatch):
    """The floor's count for the 8B layer, and the measurement run end to end on the tiny model's layer."""
    from quantkit.eval.bench import bench_8b_reconstruct
    from quantkit.eval.bench.bench_8b_reconstruct import forward_multiply_adds, measure
    from quantkit.models import MiniCPMConfig
    from quantkit.synthetic import minicpm41_8b_config

    hidden, ffn, kv = 4096, 16384, 2 * 128
    linears = 2 * hidden * hidden + 2 * kv * hidden + 3 * ffn * hidden
    assert forward_multiply_adds(minicpm41_8b_config(), 8, 2) == 2 * (8 * linears + 8 * 2 * hidden * (8 + 1) / 2)
    monkeypatch.setattr(bench_8b_reconstruct, "RATE_SHAPE", (64, 64, 64))  # the 8B shape's matmul takes seconds
    measured = measure(MiniCPMConfig.from_pretrained(tiny_checkpoint), rows=2, seq_len=16, threads=1)
    assert measured["measurement_seconds"] > 0 and measured["float32_rate_macs"] > 0
    assert measured["forward_multiply_adds"] > 0

def test_llamacpp_bench_fills_a_long_cache_once_and_reuses_it_across_ggufs(tiny_checkpoint, tmp_path):
    """bench-8b's 8K rows: llama.cpp's cache is prefilled and saved by the first GGUF, loaded (not
    prefilled) by the next one of the same architecture; another prompt is prefilled again."""
    from quantkit.eval.bench.bench_runtime import bench_llamacpp
    from quantkit.gguf.export import export_gguf

    ggufs = {t: tmp_path / f"{t}.gguf" for t in ("q8_0", "q4_0")}
    for file_type, path in ggufs.items():
        export_gguf(tiny_checkpoint, path, file_type, progress=False)
    cache, prompt = tmp_path / "prompt.session", list(range(5, 69))
    prefill, decode = bench_llamacpp(ggufs["q8_0"], prompt, 4, 1, 1, prefill_repeats=0, cache_file=cache)
    assert prefill > 0 and decode > 0 and cache.is_file()
    prefill, decode = bench_llamacpp(ggufs["q4_0"], prompt, 4, 1, 1, prefill_repeats=0, cache_file=cache)
    assert prefill is None and decode > 0
    assert bench_llamacpp(ggufs["q4_0"], [7, *prompt[1:]], 4, 1, 1, prefill_repeats=0, cache_file=cache)[0] > 0


def test_runtime_bench_times_a_fresh_generate_to_its_first_token_and_its_whole_answer(tiny_checkpoint):
    """bench-runtime's first-answer row: `quantkit generate` in its own process, the first byte of the
    streamed answer before the process ends, the median of the runs after a warm-up, judged against 2 s."""
    from quantkit.eval.bench.bench_runtime import FIRST_TOKEN_TARGET_SECONDS, generate_latency

    latency = generate_latency(str(tiny_checkpoint), repeats=2, threads=1)
    assert len(latency["runs"]) == 2 and latency["command"][-4:-2] == ["--model", str(tiny_checkpoint)]
    assert all(0 < run["first_token_seconds"] <= run["answer_seconds"] for run in latency["runs"])
    assert latency["passed"] == (latency["first_token_seconds"] <= FIRST_TOKEN_TARGET_SECONDS == 2.0)


def _scored(method, seed, path, kls):
    from quantkit.eval.bench.bench_methods import Scored

    return Scored(method, 4, seed, path, 10.0, 100.0,
                  {text: {"mean_kl": kl, "perplexity": 20.0, "top1_agreement": 0.7} for text, kl in kls.items()},
                  4.25)


def test_bits_per_weight_counts_every_stored_tensor_of_the_decoder_linears(tiny_checkpoint, tmp_path):
    """A GPTQ W4 g64 artifact: per linear 4-bit codes, a float16 scale and a packed 4-bit zero point per
    group and row, and an int32 g_idx entry per input column (the float checkpoint's linears: 32)."""
    from quantkit.engine import quantize
    from quantkit.eval.bench.bench_methods import linear_bits_per_weight
    from quantkit.models import MiniCPMConfig
    from quantkit.reader import linear_shapes

    from helpers import small_recipe

    assert linear_bits_per_weight(tiny_checkpoint) == 32.0
    out = tmp_path / "w4"
    quantize(tiny_checkpoint, small_recipe("rtn-w4g128", tmp_path, quant={"group_size": 64, "sym": False}), out,
             progress=False)
    shapes = linear_shapes(MiniCPMConfig.from_pretrained(out)).values()
    stored = sum(4 * n * k + (16 + 4) * (k // 64) * n + 32 * k for n, k in shapes)
    assert linear_bits_per_weight(out) == stored / sum(n * k for n, k in shapes)


def test_methods_bench_wins_only_with_its_whole_range_below_the_peer_on_every_text():
    from quantkit.eval.bench.bench_methods import tables

    texts = ["fiction", "code"]
    variants = [_scored("GPTQ", 0, "bf16", {"fiction": 0.30, "code": 0.20}),
                _scored("GPTQ", 1, "bf16", {"fiction": 0.32, "code": 0.22}),
                _scored("S-P-GPTQ", 0, "bf16", {"fiction": 0.20, "code": 0.10}),
                _scored("S-P-GPTQ", 1, "bf16", {"fiction": 0.22, "code": 0.18}),  # above the peer's code 0.17
                _scored("S-P-GPTQ", 0, "fp32", {"fiction": 0.21, "code": 0.11}),
                _scored("S-P-GPTQ", 1, "fp32", {"fiction": 0.23, "code": 0.19}),
                _scored("GPTQModel", 0, "bf16", {"fiction": 0.34, "code": 0.17}),
                _scored("GPTQModel", 1, "bf16", {"fiction": 0.36, "code": 0.25})]
    summary, per_text, verdicts = tables(variants, texts, "GPTQ", {"GPTQModel": "command"})
    # S-P-GPTQ bf16: mean 0.175 over texts and seeds; GPTQModel's 0.28; ratio 0.625 -> PASS, but its code
    # range (0.10-0.18) overlaps the peer's (0.17-0.25), so it does not win outright
    assert "S-P-GPTQ W4 bf16 vs GPTQModel (bf16): mean KL 0.62x (target <= 0.8: PASS); every seed and text " \
           "below: no" in verdicts
    assert "GPTQ W4 bf16 vs GPTQModel (bf16): mean KL 0.93x (target <= 0.8: FAIL); every seed and text below: no" \
           in verdicts
    # the fp32 path's mean 0.185 against bf16's 0.175: 1.057, outside 5 %
    assert "S-P-GPTQ W4: fp32 path / bf16 path mean KL 1.057 (target within 5%: FAIL)" in verdicts
    assert "0.175 (0.1–0.22)" in summary and "0.625" not in summary  # ratios go against GPTQ of the same path
    assert "0.21 (0.2–0.22)" in per_text and "0.14 (0.1–0.18)" in per_text


def test_beats_needs_every_value_below_on_every_text():
    from quantkit.eval.bench.across_texts import Spread, beats

    assert beats({"a": [0.1, 0.2], "b": [0.3]}, {"a": [0.21], "b": [0.31, 0.5]})
    assert not beats({"a": [0.1, 0.2], "b": [0.3]}, {"a": [0.2], "b": [0.31]})
    assert str(Spread.of([0.1, 0.2, 0.3])) == "0.2 (0.1–0.3)" and str(Spread.of([0.25])) == "0.25"


def test_scores_are_remembered_per_text_and_redone_when_the_tokens_change(tmp_path):
    import torch

    from quantkit.eval.bench.across_texts import remembered_scores
    from quantkit.eval.kld import KLResult

    calls = []

    def score(tokens):
        calls.append(int(tokens.sum()))
        return KLResult(float(tokens.sum()), 0.0, 1.0, 2.0, 2.0, len(tokens), 4)

    path = tmp_path / "a.scores.json"
    first = remembered_scores(path, score, {"x": torch.tensor([1, 2]), "y": torch.tensor([3])}, 4, reuse=True)
    assert first["x"]["mean_kl"] == 3.0 and calls == [3, 3]
    # another run asking for one known text and one new: only the new one is scored, the others are kept
    second = remembered_scores(path, score, {"x": torch.tensor([1, 2]), "z": torch.tensor([5])}, 4, reuse=True)
    assert calls == [3, 3, 5] and set(second) == {"x", "z"}
    # changed tokens (or a run without reuse) are scored again
    remembered_scores(path, score, {"y": torch.tensor([4])}, 4, reuse=True)
    remembered_scores(path, score, {"x": torch.tensor([1, 2])}, 4, reuse=False)
    assert calls == [3, 3, 5, 4, 3]


def test_gguf_target_holds_only_when_every_text_is_within_the_ratio():
    from quantkit.eval.bench.bench_gguf import Row, target_line

    def row(name, kls):
        return Row(name, "", 4.5, 1.0, 20.0, sum(kls.values()) / len(kls), 0.8, 1.0, "", kls)

    anchor = row("q4_k_m-imatrix-llama.cpp.gguf", {"fiction": 0.10, "code": 0.05})
    assert target_line("q4_k_m", row("gguf-q4_k_m.gguf", {"fiction": 0.07, "code": 0.04}), anchor) == (
        "target q4_k_m: gguf-q4_k_m.gguf / llama.cpp+imatrix per text fiction 0.70, code 0.80 (<= 0.8 on every "
        "text: PASS)")
    # a better mean (0.05 against 0.075) does not pass while one text is above the ratio
    assert target_line("q4_k_m", row("gguf-q4_k_m.gguf", {"fiction": 0.05, "code": 0.045}), anchor).endswith(
        "fiction 0.50, code 0.90 (<= 0.8 on every text: FAIL)")


def test_reuse_takes_an_artifact_made_by_another_checkout_but_not_by_another_venv_or_command(tmp_path):
    import json

    import click

    from quantkit.eval.bench.common import Variant, make_variant

    (tmp_path / "a").mkdir()
    made = ["/tmp/other/.venv/bin/python", "-m", "quantkit.cli", "quantize", "--out", "a"]
    (tmp_path / "a.run.json").write_text(json.dumps({"command": made, "seconds": 1.0, "peak_rss_mb": 2}))
    here = ["/work/q/.venv/bin/python", *made[1:]]
    assert make_variant(Variant("a", "a", here), tmp_path, reuse=True)["reused"]
    for other in (["/work/q/.venv-llmc/bin/python", *made[1:]], [here[0], *made[1:-1], "b"]):
        with pytest.raises(click.ClickException, match="was made by"):
            make_variant(Variant("a", "a", other), tmp_path, reuse=True)


def test_bench_gguf_plots_kl_against_size_per_way_of_making_the_file(tmp_path):
    from quantkit.eval.bench.bench_gguf import SERIES, Row, plot_kl_against_size

    made_by = [*SERIES, "quantkit imatrix row (not plotted)"]
    rows = [Row(f"{t}.gguf", f"{by} ...", bits, 1.0, 10.0, kl, 0.9, 1.0, "", {})
            for by in made_by for t, bits, kl in (("q4_0", 4.5, 0.1), ("q2_k", 2.9, 0.4))]
    plot_kl_against_size(rows, tmp_path / "kl.png", "test")
    assert (tmp_path / "kl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gptq_transfer_bench_scores_both_solutions_under_each_sets_inputs(tiny_checkpoint, tmp_path):
    """On the calibration rows' own statistics GPTQ beats llama.cpp + imatrix on every linear (that is what
    it minimises); the held-out text's column is a measurement, only required to be a positive ratio."""
    import json

    from click.testing import CliRunner

    from quantkit.eval.bench.bench_gptq_transfer import main

    out = tmp_path / "transfer.json"
    result = CliRunner().invoke(main, ["--model", str(tiny_checkpoint), "--texts", "austen", "--max-tokens", "256",
                                       "--window", "128", "--n-samples", "4", "--seq-len", "64", "--shrink", "0,1",
                                       "--threads", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())["rows"]
    assert {r["shrink"] for r in records} == {0.0, 1.0} and len(records) == 2 * 7 * 2  # 2 layers x 7 linears
    for record in records:
        assert set(record["ratio"]) == {"calibration", "austen"} and all(v > 0 for v in record["ratio"].values())
        if record["shrink"] == 0:
            assert record["ratio"]["calibration"] < 1


@pytest.mark.parametrize("shrink", ["abc", "0,1.5", ""])
def test_gptq_transfer_bench_refuses_a_shrink_outside_zero_to_one(shrink):
    from click.testing import CliRunner

    from quantkit.eval.bench.bench_gptq_transfer import main

    result = CliRunner().invoke(main, ["--model", "nonexistent", "--shrink", shrink])
    assert result.exit_code == 2 and "--shrink" in result.output and "Traceback" not in result.output


def test_bench_spec_llamacpp_reads_what_llama_speculative_simple_prints(tmp_path):
    """The generated text is what follows the echoed prompt on stdout; the statistics come from stderr's
    timestamped INFO lines (as llama.cpp 0.3.36's common log prints them); τ = committed / target forwards."""
    import click

    from quantkit.eval.bench.bench_spec_llamacpp import run_speculative

    program = tmp_path / "llama-speculative-simple"
    program.write_text("#!/bin/sh\nprintf '\\n\\n\\nOnce upon a time, there was\\n\\n\\n\\n\\n'\n"
                       "printf '0.01.002.003 I decoded   17 tokens in    0.250 seconds, speed:   68.000 t/s\\n"
                       "0.01.002.004 I n_draft   = 3\\n0.01.002.005 I n_predict = 17\\n"
                       "0.01.002.006 I n_drafted = 24\\n0.01.002.007 I n_accept  = 9\\n' >&2\n")
    program.chmod(0o755)
    run = run_speculative(program, tmp_path / "t.gguf", tmp_path / "h.gguf", "\nOnce upon", "\nOnce upon", 16, 3, 2)
    assert (run.text, run.n_predict, run.n_drafted, run.n_accept) == (" a time, there was\n", 17, 24, 9)
    assert (run.rounds, run.tau, run.decode_seconds) == (8, 17 / 8, 0.25)
    with pytest.raises(click.ClickException, match="did not echo the prompt"):
        run_speculative(program, tmp_path / "t.gguf", tmp_path / "h.gguf", "Once upon", "Once upon", 16, 3, 2)
    program.write_text("#!/bin/sh\nprintf 'Once upon'\n")
    with pytest.raises(click.ClickException, match="printed no statistics"):
        run_speculative(program, tmp_path / "t.gguf", tmp_path / "h.gguf", "Once upon", "Once upon", 16, 3, 2)


def test_bench_spec_8b_times_each_part_of_a_round_and_puts_the_caches_back(tiny_checkpoint_factory, tmp_path):
    """On a 4-layer tiny target and a random head: a row per draft shape, the round's cost the sum of its parts
    in plain steps, the chain's speed-up at the official tau; after every part the target's cache is back at
    the context and the head drafts from it again."""
    from quantkit.eval.bench.bench_spec_8b import OFFICIAL_TAU, Round, _shapes, projected, round_costs
    from quantkit.kernels.generate import load_text_generator
    from quantkit.synthetic import write_tiny_eagle3_head

    target = tiny_checkpoint_factory(num_hidden_layers=4)
    generator = load_text_generator(target, draft=write_tiny_eagle3_head(tmp_path / "head", target))
    assert projected(10.0, 2.0, 4) == 2.0 + 8.0 * 32 / 4
    shapes = _shapes(3, "3x2x6")
    rows = round_costs("bf16", generator, 40, shapes, repeats=1, seed=0)
    assert [(row.draft, row.verify_rows) for row in rows] == [("chain 3", 4), ("tree 3x2x6", 7)]
    for row in rows:
        assert min(row.plain_ms, row.propose_ms, row.verify_ms) > 0 and row.observe_ms >= 0
        assert row.round_steps == pytest.approx((row.propose_ms + row.verify_ms + row.observe_ms) / row.plain_ms)
        assert row.tau_for_target == pytest.approx(1.6 * row.round_steps)
    assert rows[0].speedup == pytest.approx(OFFICIAL_TAU / rows[0].round_steps) and rows[1].speedup is None

    measuring = Round(generator, 40, seed=1)
    for shape in shapes.values():
        work, rows, verification = measuring.draft(shape)
        for call in (measuring.drafter_call(work), measuring.target(rows, verification),
                     measuring.drafter_call(measuring.observe(2))):
            assert call() > 0 and measuring.cache.length == 40
    assert len(generator.drafter.propose(3, measuring.sampler)[0]) == 3
