"""Runtime speed on this CPU, every contender in one run with the same threads: quantkit's runtime on a
W4 artifact of the default model against transformers (float32 and bf16, eager) on the unquantized
model and llama.cpp on a Q4_0 GGUF of it, plus the memory-bandwidth ceiling of a decode step.

Prefill: one forward over a prompt of held-out text. Decode: greedy tokens after that prompt, one
at a time. Each is the median of ``--repeats`` runs; ratios are against transformers float32 and
llama.cpp Q4_0. A profile of quantkit's decode step says where its time goes.

First, what a user waits for: ``quantkit generate`` on ``--model`` started as a fresh process, wall
seconds to the first byte of its answer and to its exit, against the target of a first token in
``FIRST_TOKEN_TARGET_SECONDS`` (warm caches, idle machine).

    python -m quantkit.eval.bench.bench_runtime --artifact out/runtime-w4 --out out/bench-runtime
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import torch

from quantkit.eval.bench.common import machine, median_rate, median_seconds, report
from quantkit.table import format_table

# A first answer in about two seconds (issue 68): from starting `quantkit generate` to its first token.
FIRST_TOKEN_TARGET_SECONDS = 2.0
GENERATE_PROMPT = "What is the capital of France?"


@dataclass
class Contender:
    name: str
    prefill_tok_s: float
    decode_tok_s: float
    decode_bytes_per_token: float | None = None


def memory_bandwidth_gb_s(repeats: int = 5) -> float:
    """Read bandwidth as a 1 GiB float32 reduction sees it (what a decode step's weight stream gets)."""
    data = torch.ones(2**28)
    return data.numel() * 4 / median_seconds(data.sum, repeats) / 1e9


def greedy_steps(runtime, cache, token: int, steps: int) -> float:
    """Seconds for ``steps`` greedy decode steps of ``runtime`` from ``token`` on ``cache`` (which grows by them)."""
    start = time.perf_counter()
    for _ in range(steps):
        token = int(runtime.forward(torch.tensor([token]), cache).argmax())
    return time.perf_counter() - start


def timed_generate(command: list[str], environment: dict) -> dict:
    """Wall seconds from starting ``command`` to the first byte it writes to stdout and to its exit."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment)
    first_byte = process.stdout.read(1)
    first = time.perf_counter() - start
    _, stderr = process.communicate()
    if process.returncode != 0 or not first_byte:
        raise click.ClickException(f"{' '.join(command)} exited {process.returncode}:\n{stderr.decode()}")
    return {"first_token_seconds": first, "answer_seconds": time.perf_counter() - start}


def generate_latency(model: str, repeats: int, threads: int) -> dict:
    """Median wall seconds from starting ``quantkit generate --model MODEL`` (a fresh process, ``threads``
    threads) to the first byte of its streamed answer, and to its exit with the whole answer, over
    ``repeats`` runs after one that warms the caches (page cache, compiled CPU operators)."""
    command = [sys.executable, "-m", "quantkit.cli", "generate", "--model", model, "--prompt", GENERATE_PROMPT]
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    runs = [timed_generate(command, environment) for _ in range(repeats + 1)][1:]
    first, answer = (statistics.median(run[key] for run in runs) for key in ("first_token_seconds", "answer_seconds"))
    return {"command": command, "runs": runs, "first_token_seconds": first, "answer_seconds": answer,
            "target_seconds": FIRST_TOKEN_TARGET_SECONDS, "passed": first <= FIRST_TOKEN_TARGET_SECONDS}


def bench_quantkit(artifact: Path, prompt: list[int], new_tokens: int, repeats: int, generator=None,
                   prefill_repeats: int | None = None):
    """(generator, prefill tok/s, decode tok/s) of quantkit's runtime on ``artifact`` with dense attention, or
    on a ``generator`` already loaded. Prefill: the prompt from an empty cache in the generator's chunks, median
    of ``prefill_repeats`` runs (default ``repeats``), or with 0 the one run that fills the cache for
    decode. Decode: greedy steps after the prompt, prefilled once; each run drops the previous one's."""
    from quantkit.kernels.generate import load_text_generator

    generator = generator if generator is not None else load_text_generator(artifact, sparse="off")
    cache, last = generator.new_cache(), {}

    def prefill() -> float:
        cache.crop(0)
        start = time.perf_counter()
        last["logits"] = generator.prefill(prompt, cache)
        return time.perf_counter() - start

    prefill_repeats = repeats if prefill_repeats is None else prefill_repeats
    prefill_rate = median_rate(prefill, len(prompt), prefill_repeats) if prefill_repeats else len(prompt) / prefill()
    first = int(last["logits"].argmax())

    def decode() -> float:
        cache.crop(len(prompt))
        return greedy_steps(generator.runtime, cache, first, new_tokens)

    return generator, prefill_rate, median_rate(decode, new_tokens, repeats)


def bench_transformers(model_dir: Path, dtype: torch.dtype, prompt: list[int], new_tokens: int, repeats: int):
    from transformers import DynamicCache

    from quantkit.loading import load_model

    model = load_model(model_dir, dtype)
    ids = torch.tensor([prompt])

    @torch.inference_mode()
    def prefill() -> float:
        start = time.perf_counter()
        model(ids, logits_to_keep=1)
        return time.perf_counter() - start

    @torch.inference_mode()
    def decode() -> float:
        cache = DynamicCache(config=model.config)
        token = model(ids, cache=cache, logits_to_keep=1).logits[0, -1].argmax()
        start = time.perf_counter()
        for _ in range(new_tokens):
            token = model(token.view(1, 1), cache=cache).logits[0, -1].argmax()
        return time.perf_counter() - start

    return median_rate(prefill, len(prompt), repeats), median_rate(decode, new_tokens, repeats)


def bench_llamacpp(gguf: Path, prompt: list[int], new_tokens: int, repeats: int, threads: int,
                   prefill_repeats: int | None = None, cache_file: Path | None = None):
    """(prefill tok/s, decode tok/s) of llama.cpp on ``gguf``, as ``bench_quantkit`` measures them: prefill
    median of ``prefill_repeats`` runs (default ``repeats``; 0: the one run that fills the cache), decode
    after the prompt prefilled once, each run dropping the previous one's tokens from the KV cache.

    With ``prefill_repeats=0`` and a ``cache_file`` (llama.cpp's own session file: its KV cache, logits
    and the prompt's tokens), the cache is loaded from that file when it holds ``prompt`` instead of
    prefilled (prefill tok/s is then None), and saved there after a prefill. A decode step reads every
    cached key and value whatever they hold, so a file written by another GGUF of the same architecture
    serves: an 8K prompt costs llama.cpp half an hour of prefill on 2 cores, once per machine instead of
    once per type and run."""
    import ctypes

    import llama_cpp

    from quantkit.atomic import atomic_path
    from quantkit.eval.llamacpp import disable_weight_repacking

    disable_weight_repacking()
    llm = llama_cpp.Llama(str(gguf), n_ctx=len(prompt) + new_tokens + 8, n_batch=len(prompt), n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))

    def prefill() -> float:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        return time.perf_counter() - start

    def loaded() -> bool:
        """The prompt's cache from ``cache_file``, if that file holds exactly this prompt."""
        if cache_file is None or not cache_file.is_file():
            return False
        tokens, count = (llama_cpp.llama_token * len(prompt))(), ctypes.c_size_t(0)
        if not llama_cpp.llama_state_load_file(llm._ctx.ctx, str(cache_file).encode(), tokens, len(prompt),
                                               ctypes.byref(count)) or list(tokens[:count.value]) != prompt:
            llm.reset()
            return False
        last = llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(llm._ctx.ctx), 0)
        if last != len(prompt) - 1:
            raise click.ClickException(f"{cache_file}: llama.cpp restored {last + 1} cached positions, not "
                                       f"{len(prompt)}; remove the file")
        llm.input_ids[:len(prompt)] = prompt
        llm.n_tokens = len(prompt)
        return True

    def save() -> None:
        with atomic_path(cache_file) as tmp:
            tokens = (llama_cpp.llama_token * len(prompt))(*prompt)
            if not llama_cpp.llama_state_save_file(llm._ctx.ctx, str(tmp).encode(), tokens, len(prompt)):
                raise click.ClickException(f"llama.cpp could not write its session file {cache_file}")

    def decode() -> float:
        llm.n_tokens = len(prompt)  # eval removes the cache's positions from n_tokens on
        token = first
        start = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([token])
            token = int(last_logits().argmax())
        return time.perf_counter() - start

    try:
        prefill_repeats = repeats if prefill_repeats is None else prefill_repeats
        if prefill_repeats:
            prefill_rate = median_rate(prefill, len(prompt), prefill_repeats)
        elif loaded():
            prefill_rate = None
        else:
            prefill_rate = len(prompt) / prefill()
            if cache_file is not None:
                save()
        first = int(last_logits().argmax())
        return prefill_rate, median_rate(decode, new_tokens, repeats)
    finally:
        llm.close()


def decode_bytes(generator, context: int) -> int:
    """Bytes a decode step of quantkit's runtime reads: each quantized module's ``weight_bytes``, every
    other parameter except the embedding table (one row is read), and the KV cache at ``context``."""
    model = generator.runtime.model
    total, counted = 0, set()
    for module in model.modules():
        if hasattr(module, "weight_bytes"):
            total += module.weight_bytes
            counted.update(id(t) for t in module.parameters())
    embedding = model.model.embed_tokens.weight
    total += sum(p.numel() * p.element_size() for p in model.parameters()
                 if p is not embedding and id(p) not in counted)
    config = model.config
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * context
    return total + kv * generator.runtime.kv_dtype.itemsize


def profile_decode(generator, prompt: list[int], steps: int = 16, rows: int = 10) -> list[dict]:
    """Where a decode step's time goes: the PyTorch operators with the most self CPU time, and the
    rest of the wall time (the fused C++ operators of quantkit/cpu_ops, which the profiler does not
    see, and Python)."""
    from torch.profiler import profile

    # Kineto, the profiler's backend, prints a line at each start and stop at its default level; 6 is
    # above every level it has, read when the profiler first starts
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    runtime = generator.runtime
    cache = runtime.new_cache()
    token = int(runtime.forward(torch.tensor(prompt), cache).argmax())
    with profile() as trace:
        start = time.perf_counter()
        for _ in range(steps):
            token = int(runtime.forward(torch.tensor([token]), cache).argmax())
        wall_us = (time.perf_counter() - start) * 1e6
    events = sorted(trace.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    listed = [{"op": e.key, "calls_per_token": e.count / steps, "us_per_token": e.self_cpu_time_total / steps}
              for e in events[:rows]]
    outside = wall_us - sum(e.self_cpu_time_total for e in events)
    listed.append({"op": "outside PyTorch operators (fused C++ ops, Python)", "calls_per_token": 0,
                   "us_per_token": outside / steps})
    for row in listed:
        row["share"] = row["us_per_token"] * steps / wall_us
    return listed


@click.command()
@click.option("--model", default="default", show_default=True, help="The unquantized model.")
@click.option("--artifact", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A W4 artifact of --model, run by quantkit's runtime.")
@click.option("--gguf", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="llama.cpp's file (default: --model exported as Q4_0 by llama.cpp's quantizer).")
@click.option("--prompt-tokens", default=512, show_default=True)
@click.option("--new-tokens", default=128, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--out", default="out/bench-runtime", show_default=True, type=click.Path(path_type=Path))
def main(model, artifact, gguf, prompt_tokens, new_tokens, repeats, threads, out):
    from transformers import AutoTokenizer

    from quantkit import calib
    from quantkit.zoo import resolve_model

    torch.set_num_threads(threads)
    model_dir = resolve_model(model)
    out.mkdir(parents=True, exist_ok=True)
    latency = generate_latency(model, repeats, threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = calib.heldout_tokens(tokenizer, max_tokens=prompt_tokens)[:prompt_tokens].tolist()
    with tempfile.TemporaryDirectory() as scratch:
        if gguf is None:
            from quantkit.gguf.export import export_gguf

            gguf = Path(scratch) / "q4_0.gguf"
            export_gguf(model_dir, gguf, "q4_0", progress=False)
        llama_prefill, llama_decode = bench_llamacpp(gguf, prompt, new_tokens, repeats, threads)
    generator, ours_prefill, ours_decode = bench_quantkit(artifact, prompt, new_tokens, repeats)
    fp32 = bench_transformers(model_dir, torch.float32, prompt, new_tokens, repeats)
    bf16 = bench_transformers(model_dir, torch.bfloat16, prompt, new_tokens, repeats)
    bandwidth = memory_bandwidth_gb_s()
    context = prompt_tokens + new_tokens // 2
    ours_bytes = decode_bytes(generator, context)
    contenders = [
        Contender(f"quantkit runtime, {artifact.name}", ours_prefill, ours_decode, ours_bytes),
        Contender("transformers fp32 eager", *fp32),
        Contender("transformers bf16 eager", *bf16),
        Contender("llama.cpp Q4_0 (no repacking)", llama_prefill, llama_decode),
    ]
    rows = [[c.name, c.prefill_tok_s, c.prefill_tok_s / fp32[0], c.prefill_tok_s / llama_prefill,
             c.decode_tok_s, c.decode_tok_s / fp32[1], c.decode_tok_s / llama_decode] for c in contenders]
    table = format_table(["runtime", "prefill tok/s", "x fp32", "x llama.cpp", "decode tok/s", "x fp32",
                          "x llama.cpp"], rows)
    ceiling = bandwidth * 1e9 / ours_bytes
    profile = profile_decode(generator, prompt)
    profile_table = format_table(["op", "share", "calls/token", "us/token"],
                                 [[p["op"], f"{100 * p['share']:.1f}%", p["calls_per_token"], p["us_per_token"]]
                                  for p in profile])
    header = (f"prompt {prompt_tokens} held-out tokens, {new_tokens} greedy decode steps, median of {repeats}; "
              f"machine: {machine()}; measured read bandwidth {bandwidth:.1f} GB/s")
    latency_table = format_table(
        ["command", "first token s", "whole answer s", "target s", "first token"],
        [[f"quantkit generate --model {model}", latency["first_token_seconds"], latency["answer_seconds"],
          FIRST_TOKEN_TARGET_SECONDS, "PASS" if latency["passed"] else "FAIL"]])
    summary = (f"quantkit decode reads {ours_bytes / 1e6:.1f} MB per token (context {context}): ceiling "
               f"{ceiling:.0f} tok/s at {bandwidth:.1f} GB/s; measured {ours_decode:.1f} tok/s = "
               f"{ours_decode / ceiling:.0%} of the ceiling")
    report(header, table, contenders, json_path=out / "bench.json", markdown_path=out / "bench.md",
           notes=(f"{summary}\n\nquantkit decode profile (top ops by self CPU time):\n{profile_table}\n\n"
                  f"a fresh `quantkit generate`, prompt {GENERATE_PROMPT!r}, wall seconds, median of {repeats} "
                  f"after a warm-up run:\n{latency_table}"),
           extra={"bandwidth_gb_s": bandwidth, "ceiling_tok_s": ceiling, "decode_profile": profile,
                  "generate_latency": latency})


if __name__ == "__main__":
    main()
