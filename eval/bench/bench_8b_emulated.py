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
(weight repacking on, as a user of that CPU gets it): ``llama_cpp_speed``. Without one, llama.cpp's
figures on this CPU stand for the class.

Prints one JSON line: the prompt's tokens per second (median of ``--repeats`` prefills from an empty
cache) and the decode's after it (``--new-tokens`` greedy steps, median of ``--repeats``), as bench_8b's
own rows; the prefill kernel the runtime chose, the instruction set of the compiled integer kernel and
PyTorch's.

    python -m quantkit.eval.bench.bench_8b_emulated --artifact out/bench-8b/w4-rtn-w4g128-32-layer --layers 32
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
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


def emulated_classes(flags: list[str]) -> list[str]:
    return [name for name, cpu_class in CPU_CLASSES.items() if cpu_class.above in flags]


def measure(cpu_class: str, artifact: Path, layers: int, prompt_tokens: int, new_tokens: int, repeats: int,
            threads: int) -> dict:
    """This module's command in a process with ``cpu_class``'s environment; its result."""
    environment = CPU_CLASSES[cpu_class].environment
    command = [sys.executable, "-m", "quantkit.eval.bench.bench_8b_emulated", "--artifact", str(artifact),
               "--layers", str(layers), "--prompt-tokens", str(prompt_tokens), "--new-tokens", str(new_tokens),
               "--repeats", str(repeats), "--threads", str(threads)]
    done = subprocess.run(command, env={**os.environ, **environment}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the runtime as {cpu_class} failed:\n{done.stderr[-3000:]}")
    return {"cpu_class": cpu_class, "environment": environment, **json.loads(done.stdout.strip().splitlines()[-1])}


def llama_cpp_speed(cpu_class: str, gguf: Path, prompt_tokens: int, new_tokens: int, repeats: int,
                    threads: int) -> dict | None:
    """llama-bench compiled for ``cpu_class`` on ``gguf`` (built on first use), or None if the class has no
    llama.cpp build: prefill tok/s of a ``prompt_tokens`` prompt from an empty cache, and decode tok/s of
    ``new_tokens`` steps ``prompt_tokens`` positions in (llama-bench ``-d``: that prompt is prefilled once),
    each the median of ``repeats`` runs after llama-bench's warm-up."""
    from quantkit.eval.bench.llama_build import llama_cpp_programs

    build = CPU_CLASSES[cpu_class].llama_cpp
    if build is None:
        return None
    name, flags = build
    bench = llama_cpp_programs(name, ("llama-bench",), flags, jobs=threads) / "llama-bench"

    def tokens_per_second(*test: str) -> float:
        command = [str(bench), "-m", str(gguf), "-t", str(threads), "-r", str(repeats), "-o", "json", *test]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return statistics.median(json.loads(done.stdout)[0]["samples_ts"])

    return {"build": f"llama.cpp {name} ({' '.join(flags)})",
            "prefill_tok_s": tokens_per_second("-p", str(prompt_tokens), "-n", "0"),
            "decode_tok_s": tokens_per_second("-p", "0", "-n", str(new_tokens), "-d", str(prompt_tokens))}


@click.command()
@click.option("--artifact", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--layers", required=True, type=int, help="Decoder layers of the artifact (32: the whole model).")
@click.option("--prompt-tokens", default=512, show_default=True)
@click.option("--new-tokens", default=32, show_default=True, help="Decode steps per timed run.")
@click.option("--repeats", default=3, show_default=True)
@click.option("--threads", default=2, show_default=True)
def main(artifact, layers, prompt_tokens, new_tokens, repeats, threads):
    """Prefill and decode tok/s of ``artifact`` in this process's instruction sets, as one JSON line."""
    import torch
    from quantkit.eval.bench.bench_8b import as_full_model, random_prompt
    from quantkit.eval.bench.bench_runtime import bench_quantkit
    from quantkit.kernels import cpu_ops
    from quantkit.kernels.generate import load_engine
    from quantkit.kernels.linear.int4 import prefill_kernel

    torch.set_num_threads(threads)
    with as_full_model(layers):
        engine = load_engine(artifact, sparse="off")
    prompt = random_prompt(prompt_tokens, engine.runtime.config.vocab_size, seed=prompt_tokens)
    _, prefill, decode = bench_quantkit(artifact, prompt, new_tokens, repeats, engine=engine)
    ops = cpu_ops.load()
    click.echo(json.dumps({"prefill_tok_s": prefill, "decode_tok_s": decode, "prefill_kernel": prefill_kernel(),
                           "int8_isa": ops.int4_int8_isa() if ops else None,
                           "aten_capability": torch.backends.cpu.get_cpu_capability()}))


if __name__ == "__main__":
    main()
