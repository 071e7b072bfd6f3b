"""quantkit's prefill and decode at MiniCPM4.1-8B's shape as a CPU of another class runs them, emulated
on this one.

``make bench-8b`` measures the runtime on the CPU it has. The targets must also hold on CPUs without
AMX, and on desktops without AVX-512, so it runs this command once per class in ``CPU_CLASSES``, each
in a process of its own (the instruction sets every library uses are fixed when it starts), holding
each library to what such a CPU has: oneDNN (``ONEDNN_MAX_CPU_ISA``), PyTorch's vector kernels
(``ATEN_CPU_CAPABILITY``) and quantkit's compiled operators (``QUANTKIT_CPU_MARCH``, a build for that
class). The emulation is of instruction sets only: clock, caches and memory stay this machine's.

Where a class has a llama.cpp build (``CpuClass.llama_cpp``), its llama.cpp figures come from
llama-bench compiled for that class (``llama_build``) on the same Q4_0 file, with llama.cpp's defaults
(weight repacking on, as a user of that CPU gets it), run by the emulating process in alternation with
its own timings: each round times quantkit's prefill, llama.cpp's, quantkit's decode, llama.cpp's, so
that both see the same phase of a shared machine (here a VM's speed moved by 40 % within minutes,
which two runs one after the other turn into a ratio). The ratios are the median of the rounds'.
Without a build, llama.cpp's figures on this CPU stand for the class.

Prints one JSON line: the prompt's tokens per second (prefills from an empty cache) and the decode's
after it (``--new-tokens`` greedy steps), medians of ``--repeats`` rounds after a warm-up, as bench_8b's
own rows; llama.cpp's and the paired ratios when it ran; the prefill kernel the runtime chose, the
instruction set of the compiled integer kernel and PyTorch's.

    python -m quantkit.eval.bench.bench_8b_emulated --artifact out/bench-8b/w4-rtn-w4g128-32-layer --layers 32
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click


@dataclass(frozen=True)
class CpuClass:
    environment: dict[str, str]  # of the emulating process
    above: str  # a flag of this CPU without which the class is this CPU itself or more than it has
    # (build name, cmake GGML_* flags) of llama.cpp compiled for the class, or None: llama.cpp on this CPU
    # stands for it
    llama_cpp: tuple[str, tuple[str, ...]] | None = None


# llama.cpp's build for CPUs with AVX2 but neither AVX-512 nor AVX-VNNI (its portable x86-64-v3 level)
AVX2_LLAMA_CPP = ("avx2", ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_BMI2=ON", "-DGGML_FMA=ON",
                           "-DGGML_F16C=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF"))
CPU_CLASSES = {
    # llama.cpp uses no AMX here: its AMX path is weight repacking, which the in-process runs turn off
    "AVX-512 without AMX": CpuClass({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "amx_tile"),
    "AVX2 desktop (no AVX-512, no VNNI)": CpuClass({"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                                                    "QUANTKIT_CPU_MARCH": "haswell"}, "avx512f", AVX2_LLAMA_CPP),
}


SETTLE_STEPS = 8  # untimed decode steps before each timed run


def emulated_classes(flags: list[str]) -> list[str]:
    return [name for name, cpu_class in CPU_CLASSES.items() if cpu_class.above in flags]


def measure(cpu_class: str, artifact: Path, layers: int, prompt_tokens: int, new_tokens: int, repeats: int,
            threads: int, gguf: Path | None = None) -> dict:
    """This module's command in a process with ``cpu_class``'s environment, alternating with llama-bench built
    for the class on ``gguf`` when the class has a build (compiled here on first use); its result."""
    from quantkit.eval.bench.llama_build import llama_cpp_programs

    emulated = CPU_CLASSES[cpu_class]
    command = [sys.executable, "-m", "quantkit.eval.bench.bench_8b_emulated", "--artifact", str(artifact),
               "--layers", str(layers), "--prompt-tokens", str(prompt_tokens), "--new-tokens", str(new_tokens),
               "--repeats", str(repeats), "--threads", str(threads)]
    if gguf is not None and emulated.llama_cpp is not None:
        name, flags = emulated.llama_cpp
        bench = llama_cpp_programs(name, ("llama-bench",), flags, jobs=threads) / "llama-bench"
        command += ["--llama-bench", str(bench), "--llama-build", f"llama.cpp {name} ({' '.join(flags)})",
                    "--gguf", str(gguf)]
    done = subprocess.run(command, env={**os.environ, **emulated.environment}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the runtime as {cpu_class} failed:\n{done.stderr[-3000:]}")
    return {"cpu_class": cpu_class, "environment": emulated.environment,
            **json.loads(done.stdout.strip().splitlines()[-1])}


def llama_bench_tok_s(bench: Path, gguf: Path, threads: int, *test: str) -> float:
    """Tokens per second of one llama-bench repetition of ``test`` (after its warm-up) on ``gguf``."""
    command = [str(bench), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *test]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)[0]["samples_ts"][0]


@click.command()
@click.option("--artifact", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--layers", required=True, type=int, help="Decoder layers of the artifact (32: the whole model).")
@click.option("--prompt-tokens", default=512, show_default=True)
@click.option("--new-tokens", default=32, show_default=True, help="Decode steps per timed run.")
@click.option("--repeats", default=3, show_default=True, help="Rounds; the medians are kept.")
@click.option("--threads", default=2, show_default=True)
@click.option("--llama-bench", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="llama-bench to alternate with (prefill of the prompt from an empty cache; decode "
                   "--prompt-tokens positions in).")
@click.option("--llama-build", default="", help="How that llama-bench was built, for the report.")
@click.option("--gguf", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The Q4_0 file of the artifact's weights, for --llama-bench.")
def main(artifact, layers, prompt_tokens, new_tokens, repeats, threads, llama_bench, llama_build, gguf):
    """Prefill and decode tok/s of ``artifact`` in this process's instruction sets (and llama-bench's, in
    alternation), as one JSON line."""
    import torch

    from quantkit import cpu_ops
    from quantkit.eval.bench.bench_8b import as_full_model, random_prompt
    from quantkit.eval.bench.bench_runtime import greedy_steps
    from quantkit.kernels.generate import load_text_generator
    from quantkit.kernels.linear.panel import prefill_kernel

    if (llama_bench is None) != (gguf is None):
        raise click.UsageError("--llama-bench and --gguf go together")
    torch.set_num_threads(threads)
    with as_full_model(layers):
        generator = load_text_generator(artifact, sparse="off")
    prompt = random_prompt(prompt_tokens, generator.runtime.config.vocab_size, seed=prompt_tokens)
    cache = generator.new_cache()

    def prefill() -> tuple[float, int]:
        cache.crop(0)
        start = time.perf_counter()
        first = int(generator.prefill(prompt, cache).argmax())
        return prompt_tokens / (time.perf_counter() - start), first

    def decode(first: int) -> float:
        cache.crop(prompt_tokens)
        return new_tokens / greedy_steps(generator.runtime, cache, first, new_tokens)

    def settle() -> None:
        """A few untimed steps before each timed run, as llama-bench warms up before its own: the first
        run after a llama-bench process lost ~1 s (decode 5.1 tok/s, then 6.8-7.0; scratch measurement)."""
        cache.crop(prompt_tokens)
        greedy_steps(generator.runtime, cache, first, SETTLE_STEPS)

    first = prefill()[1]  # warm-up
    decode(first)
    rounds = {"prefill": [], "decode": [], "llama_prefill": [], "llama_decode": []}
    for _ in range(repeats):
        settle()
        rounds["prefill"].append(prefill()[0])
        if llama_bench:
            rounds["llama_prefill"].append(llama_bench_tok_s(llama_bench, gguf, threads, "-p", str(prompt_tokens),
                                                             "-n", "0"))
        settle()
        rounds["decode"].append(decode(first))
        if llama_bench:
            rounds["llama_decode"].append(llama_bench_tok_s(llama_bench, gguf, threads, "-p", "0", "-n",
                                                            str(new_tokens), "-d", str(prompt_tokens)))
    ops = cpu_ops.load()
    result = {"prefill_tok_s": statistics.median(rounds["prefill"]),
              "decode_tok_s": statistics.median(rounds["decode"]), "prefill_kernel": prefill_kernel(),
              "int8_isa": ops.int4_int8_isa() if ops else None,
              "aten_capability": torch.backends.cpu.get_cpu_capability(), "rounds": rounds}
    if llama_bench:
        result["llama_cpp"] = {"build": llama_build, "prefill_tok_s": statistics.median(rounds["llama_prefill"]),
                               "decode_tok_s": statistics.median(rounds["llama_decode"])}
        result["paired_ratios"] = {
            step: statistics.median(ours / theirs for ours, theirs in zip(rounds[step], rounds[f"llama_{step}"]))
            for step in ("prefill", "decode")}
    click.echo(json.dumps(result))


if __name__ == "__main__":
    main()
