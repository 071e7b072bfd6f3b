"""quantkit's prefill and decode at MiniCPM4.1-8B's shape as a CPU of another class runs them, emulated
on this one.

``make bench-8b`` measures the runtime on the CPU it has. The targets must also hold on CPUs without
AMX, and on desktops without AVX-512, so it runs this command once per class in ``CPU_CLASSES``, each
in a process of its own (the instruction sets every library uses are fixed when it starts), holding
each library to what such a CPU has: oneDNN (``ONEDNN_MAX_CPU_ISA``), PyTorch's vector kernels
(``ATEN_CPU_CAPABILITY``) and quantkit's compiled operators (``QUANTKIT_CPU_MARCH``, a build for that
class). The emulation is of instruction sets only: clock, caches and memory stay this machine's.

Prints one JSON line: the prompt's tokens per second (median of ``--repeats`` prefills from an empty
cache) and the decode's after it (``--new-tokens`` greedy steps, median of ``--repeats``), as bench_8b's
own rows; the prefill kernel the runtime chose, the instruction set of the compiled integer kernel and
PyTorch's.

    python -m quantkit.eval.bench.bench_8b_emulated --artifact out/bench-8b/w4-rtn-w4g128-32-layer --layers 32
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click

# name -> (environment of the emulating process, a flag of this CPU without which the class is this CPU
# itself or more than it has, so not emulated)
CPU_CLASSES = {
    "AVX-512 without AMX": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "amx_tile"),
    "AVX2 desktop (no AVX-512, no VNNI)": ({"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                                            "QUANTKIT_CPU_MARCH": "haswell"}, "avx512f"),
}


def emulated_classes(flags: list[str]) -> list[str]:
    return [name for name, (_, above) in CPU_CLASSES.items() if above in flags]


def measure(cpu_class: str, artifact: Path, layers: int, prompt_tokens: int, new_tokens: int, repeats: int,
            threads: int) -> dict:
    """This module's command in a process with ``cpu_class``'s environment; its result."""
    environment, _ = CPU_CLASSES[cpu_class]
    command = [sys.executable, "-m", "quantkit.eval.bench.bench_8b_emulated", "--artifact", str(artifact),
               "--layers", str(layers), "--prompt-tokens", str(prompt_tokens), "--new-tokens", str(new_tokens),
               "--repeats", str(repeats), "--threads", str(threads)]
    done = subprocess.run(command, env={**os.environ, **environment}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the runtime as {cpu_class} failed:\n{done.stderr[-3000:]}")
    return {"cpu_class": cpu_class, "environment": environment, **json.loads(done.stdout.strip().splitlines()[-1])}


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
