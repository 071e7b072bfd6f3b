"""What the benchmarks share: timing (medians of repeats, a child process under ``/usr/bin/time -v``),
the machine a number was measured on (CPU model, its SIMD flags, threads, torch), and the report: the
setup line and table on stdout, the same as JSON for machines and Markdown for people.

Nothing here imports torch or the kernels at import time, so every benchmark's ``--help`` is quick.
"""
from __future__ import annotations

import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Callable, Iterable

import click

# The CPU flags that decide which kernels run fast (x86 /proc/cpuinfo "flags", arm64 "Features").
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni",
              "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
              "asimd", "asimddp", "i8mm", "bf16", "sve", "sve2")


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``repeats`` calls of ``run``, after one warm-up call (which also pays
    one-time costs such as a cache's first pooling or a kernel's compilation)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_rate(run: Callable[[], float], count: int, repeats: int) -> float:
    """Items per second for a ``run`` that times itself: it returns its own elapsed seconds for
    ``count`` items (so that its set-up is left out), median of ``repeats``."""
    return count / statistics.median(run() for _ in range(repeats))


def timed(command: list[str], log: Path, timeout: float | None = None) -> tuple[float, float]:
    """Run a command under /usr/bin/time -v, its output in ``log``; return (wall seconds, peak RSS MB)
    of that process alone (not inherited from this one). Past ``timeout`` seconds it is killed
    (``subprocess.TimeoutExpired``)."""
    with open(log, "w") as f:
        # its own session, so that a timeout stops the command and not only /usr/bin/time
        process = subprocess.Popen(["/usr/bin/time", "-v", *command], stdout=f, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            returncode = process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    if returncode != 0:
        raise subprocess.CalledProcessError(returncode, command)
    text = log.read_text()
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text).group(1)
    seconds = sum(float(part) * 60 ** i for i, part in enumerate(reversed(wall.split(":"))))
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    return seconds, rss_kb / 1024


def quantize_command(recipe: str, model: Path, out: Path, settings: Iterable[str] = ()) -> list[str]:
    """``quantkit quantize`` of ``model`` with ``recipe`` into ``out`` as a command for this Python,
    each of ``settings`` (``KEY=VALUE``) given as ``--set``."""
    return [sys.executable, "-m", "quantkit.cli", "quantize", "--recipe", recipe, "--model", str(model),
            "--out", str(out), "--no-progress", *(arg for setting in settings for arg in ("--set", setting))]


def export_command(model: Path, file_type: str, out: Path) -> list[str]:
    """``quantkit export gguf`` of ``model`` as ``file_type`` into the file ``out`` as a command for this Python."""
    return [sys.executable, "-m", "quantkit.cli", "export", "gguf", "--model", str(model), "--type", file_type,
            "--out", str(out), "--no-progress"]


def random_keys_values(kv_heads: int, length: int, head_dim: int, generator):
    """Random bf16 keys and values, [2, Hkv, length, d] (unpack as ``k, v``): how the long-context
    benchmarks fill a cache without a prefill, since attention's speed does not depend on the values."""
    import torch

    return torch.randn(2, kv_heads, length, head_dim, generator=generator).bfloat16()


def timing_options(repeats: int):
    """The options of a timing benchmark: ``--repeats`` (default ``repeats``), ``--threads`` and ``--json``."""
    options = (click.option("--repeats", default=repeats, show_default=True, help="Timed calls; the median is kept."),
               click.option("--threads", default=2, show_default=True, help="torch threads."),
               click.option("--json", "json_path", type=click.Path(path_type=Path), default=None,
                            help="Also write the setup and the rows here as JSON."))

    def decorate(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn
    return decorate


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() not in fields:
                    fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_flags() -> list[str]:
    """The SIMD flags of ``SIMD_FLAGS`` this CPU reports, in that order."""
    info = _cpuinfo()
    have = set((info.get("flags") or info.get("Features") or "").split())
    return [flag for flag in SIMD_FLAGS if flag in have]


def machine() -> str:
    """One line naming what a number was measured on: CPU model and SIMD flags, threads used out of the
    CPUs there are, torch and the instruction set its kernels picked."""
    import torch

    info = _cpuinfo()
    cpu = info.get("model name") or platform.processor() or platform.machine()
    capability = torch.backends.cpu.get_cpu_capability()
    return (f"{cpu} ({' '.join(cpu_flags()) or 'no SIMD flags listed'}), {torch.get_num_threads()} threads of "
            f"{os.cpu_count()} CPUs, torch {torch.__version__} ({capability} kernels)")


def dense_paths(q, k, v, repeats: int) -> dict[str, float]:
    """Median seconds of dense attention of the last T positions by each of the runtime's dense paths:
    SDPA, and for one query (T = 1) over a bf16 cache, when the fused CPU operators build, the one-query
    operator (short contexts) and the block kernel over every block (longer ones)."""
    from quantkit import cpu_ops
    from quantkit.kernels.infllm.cpu import every_block_attention, sdpa_attention_of_last_positions

    timings = {"SDPA": median_seconds(lambda: sdpa_attention_of_last_positions(q, k, v), repeats)}
    ops = cpu_ops.load()
    if q.shape[1] == 1 and ops is not None:
        query = q.float().contiguous()
        timings["fused operator"] = median_seconds(
            lambda: ops.decode_attention(query, k, v, k.shape[1], q.shape[-1] ** -0.5), repeats)
        timings["block kernel"] = median_seconds(lambda: every_block_attention(ops, q, k, v), repeats)
    return timings


def report(setup: str, table: str, rows: list, *, json_path: Path | None = None,
           markdown_path: Path | None = None, notes: str = "", extra: dict | None = None) -> None:
    """Print the setup line, the table and any notes. With ``json_path`` also write
    ``{"setup", "rows", **extra}`` there (rows are dicts or dataclasses); with ``markdown_path`` the
    same text as Markdown."""
    body = table + (f"\n\n{notes}" if notes else "")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        records = [asdict(row) if is_dataclass(row) else row for row in rows]
        json_path.write_text(json.dumps({"setup": setup, "rows": records, **(extra or {})}, indent=2))
    if markdown_path is not None:
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        markdown_path.write_text(f"{setup}\n\n```\n{body}\n```\n")
    click.echo(f"{setup}\n\n{body}")


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (benchmarks run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, axes, path: Path) -> None:
    """A benchmark's plot as the others are: a small title over the axes, a legend, 100 dpi; then closed."""
    axes.title.set_fontsize(9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot().close(figure)


LOG_TAIL_LINES = 30


def log_tail(text: str) -> str:
    return "\n".join(text.rstrip().splitlines()[-LOG_TAIL_LINES:])


@dataclass
class Variant:
    """One artifact a benchmark makes with a quantkit command, and where."""

    key: str  # its directory and file names in the benchmark's --out
    label: str
    command: list[str]
    checkpoint: str | None = None  # a training run's checkpoint (its record): its --resume needs it in <key>.partial


def _same_command(made: list[str], wanted: list[str]) -> bool:
    """Whether two benchmark commands are the same up to where the checkout lives: the interpreter is
    compared by its venv (``.venv/bin/python`` against ``.venv-llmc/bin/python``), not its absolute path,
    so a clone elsewhere reuses what this one made."""
    def venv(executable: str) -> tuple[str, ...]:
        return Path(executable).parts[-3:]
    return made[1:] == wanted[1:] and venv(made[0]) == venv(wanted[0])


def make_variant(variant: Variant, out: Path, reuse: bool, timeout: float | None = None) -> dict:
    """Make ``variant``'s artifact (a directory, or a file such as a GGUF) under ``/usr/bin/time -v`` (or,
    with ``reuse``, take the one an earlier run of the benchmark left with the same command, or continue
    its interrupted run); return its record: command, seconds, peak RSS MB, resumed, reused. A command
    still running after ``timeout`` seconds is stopped and reported as a ClickException."""
    import shlex
    import shutil

    from quantkit.atomic import staging_dir

    artifact, record_path = out / variant.key, out / f"{variant.key}.run.json"
    staging = staging_dir(artifact)
    if reuse and artifact.exists():
        if not record_path.is_file():
            raise click.ClickException(f"--reuse: {artifact} has no {record_path.name}, so this bench did not "
                                       "write it; remove it or drop --reuse")
        record = json.loads(record_path.read_text())
        if not _same_command(record["command"], variant.command):
            raise click.ClickException(f"--reuse: {artifact} was made by\n  {shlex.join(record['command'])}\n"
                                       f"not by\n  {shlex.join(variant.command)}\nremove it or drop --reuse")
        return {**record, "reused": True}
    if artifact.is_file():
        artifact.unlink()
    shutil.rmtree(artifact, ignore_errors=True)
    resume = reuse and staging.exists() and (variant.checkpoint is None or (staging / variant.checkpoint).is_file())
    if not resume:
        shutil.rmtree(staging, ignore_errors=True)
    command = variant.command + (["--resume"] if resume else [])
    click.echo(f"[{variant.label}] {shlex.join(command)}", err=True)
    log = out / f"{variant.key}.log"
    try:
        seconds, rss = timed(command, log, timeout)
    except subprocess.TimeoutExpired as e:
        raise click.ClickException(f"stopped: did not finish within {timeout:.0f} s on this machine") from e
    except subprocess.CalledProcessError as e:
        raise click.ClickException(f"exit {e.returncode}: {shlex.join(command)}\n"
                                   f"last lines of {log}:\n{log_tail(log.read_text())}") from e
    record = {"command": variant.command, "seconds": round(seconds, 1), "peak_rss_mb": round(rss), "resumed": resume}
    record_path.write_text(json.dumps(record, indent=2))
    return {**record, "reused": False}
