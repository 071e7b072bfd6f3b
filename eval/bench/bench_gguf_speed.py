"""`make bench-gguf-speed`: how long ``quantkit export gguf`` takes against llama.cpp's own quantizer.

For each type, quantkit exports the checkpoint and llama.cpp's ``llama_model_quantize`` quantizes
quantkit's F32 export of it, both in this process with the same threads, median of repeats after a
warm-up (on the slice one call each); the ratio's target is 1.5 and the files' tensors must be identical; the
types below 4.5 bits are made with the same importance matrix, recorded from the model's own activations
on seeded random tokens. Models: the default model and an 8B-shaped slice, MiniCPM4.1-8B's shapes
(73,448 × 4,096 embedding and output, hidden 4,096, intermediate 16,384, 32 query / 2 key-value heads of
128) with ``--layers`` decoder layers of random weights, written once as ``make bench-scale`` writes the
whole model. The slice's Q4_K_M export is also run as a command under ``/usr/bin/time -v`` for its wall
time and peak memory (``--layers 32`` makes that the full 8B export).

    python -m quantkit.eval.bench.bench_gguf_speed --out out/bench-gguf-speed
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

import click

from quantkit.eval.bench.bench_gguf import tensor_digest
from quantkit.eval.bench.common import export_command, machine, median_seconds, report, timed, timing_options
from quantkit.table import format_table

TARGET_RATIO = 1.5
DEFAULT_TYPES = "q8_0,q6_k,q5_k_m,q4_k_m,q4_k_s,q4_1,q4_0"
# the file types below 4.5 bits, made with an importance matrix (the IQ1/IQ2 ones need it)
IMATRIX_TYPES = "iq4_xs,q3_k_m,iq3_m,q2_k,iq2_m,iq1_m"
# Each call on the slice quantizes its 0.8 B weights (a minute or more on 2 cores): fewer types there
SLICE_TYPES = "q8_0,q4_k_m,q4_0"
SLICE_IMATRIX_TYPES = "q3_k_m,iq3_m,iq2_m"
# the recorded importance matrix: seeded random token rows of this many tokens
IMATRIX_ROWS, IMATRIX_TOKENS = 16, 256
MEMORY_TYPE = "q4_k_m"  # the slice's export run as a command, for wall time and peak RSS


def eight_b_slice(folder: Path, layers: int) -> Path:
    """MiniCPM4.1-8B's shapes with ``layers`` decoder layers, random weights, written once."""
    from quantkit.synthetic import minicpm41_8b_config, write_sharded_checkpoint

    if (folder / "config.json").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    config = minicpm41_8b_config()
    config.num_hidden_layers = layers
    return write_sharded_checkpoint(folder, config, progress=True)


def _seconds(run: Callable[[], object], repeats: int) -> float:
    """Median of ``repeats`` calls after a warm-up, or with ``repeats`` 0 one call: the slice's calls take
    minutes, and the default model's runs before them have already paid the imports."""
    if repeats:
        return median_seconds(run, repeats)
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def recorded_imatrix(model_dir: Path, out: Path) -> Path:
    """An importance matrix recorded from the model's own activations on seeded random tokens: timing
    needs statistics of the right tensors and sizes through both quantizers, not a calibration set."""
    import torch

    from quantkit.gguf.imatrix_file import write_imatrix
    from quantkit.imatrix import collect
    from quantkit.json_files import read_config_json

    vocab = read_config_json(model_dir)["vocab_size"]
    tokens = torch.randint(vocab, (IMATRIX_ROWS, IMATRIX_TOKENS), generator=torch.Generator().manual_seed(0))
    return write_imatrix(collect(model_dir, tokens, ["seeded random tokens"], batch_size=4), out)


def compare(label: str, model_dir: Path, types: list[str], work: Path, repeats: int, threads: int,
            imatrix_types: list[str] = ()) -> list[dict]:
    """One row per type: quantkit's export and llama.cpp's quantize of the F32 export, in seconds; the
    ``imatrix_types`` both with the same recorded importance matrix."""
    from quantkit.eval.llamacpp import llama_quantize
    from quantkit.gguf.export import export_gguf
    from quantkit.gguf.imatrix_file import read_imatrix
    from quantkit.gguf.mixes import FILE_TYPES

    f32 = work / f"{label}-f32.gguf"
    f32.unlink(missing_ok=True)
    export_gguf(model_dir, f32, "f32", progress=False)
    ours, theirs = work / f"{label}.gguf", work / f"{label}-llama.cpp.gguf"
    imatrix_path = recorded_imatrix(model_dir, work / f"{label}-imatrix.gguf") if imatrix_types else None

    def export(file_type: str, imatrix: Path | None) -> None:
        ours.unlink(missing_ok=True)
        export_gguf(model_dir, ours, file_type, imatrix=imatrix, progress=False)

    def quantize(file_type: str, imatrix: Path | None) -> None:
        theirs.unlink(missing_ok=True)
        llama_quantize(f32, theirs, FILE_TYPES[file_type], threads, None if imatrix is None else read_imatrix(imatrix))

    rows = []
    runs = [(t, None) for t in types] + [(t, imatrix_path) for t in imatrix_types]
    for file_type, imatrix in runs:
        quantkit_s = _seconds(lambda: export(file_type, imatrix), repeats)
        llama_s = _seconds(lambda: quantize(file_type, imatrix), repeats)
        same = tensor_digest(ours) == tensor_digest(theirs)
        name = file_type if imatrix is None else f"{file_type} +imatrix"
        rows.append({"model": label, "type": name, "quantkit_s": round(quantkit_s, 2),
                     "llama_cpp_s": round(llama_s, 2), "ratio": round(quantkit_s / llama_s, 2),
                     "target_met": quantkit_s / llama_s <= TARGET_RATIO, "identical": same})
        click.echo(f"[{label} {name}] {quantkit_s:.2f} s vs {llama_s:.2f} s, identical: {same}", err=True)
    for path in (f32, ours, theirs, imatrix_path):
        if path is not None:
            path.unlink(missing_ok=True)
    return rows


def export_memory(model_dir: Path, work: Path) -> dict:
    """``quantkit export gguf --type q4_k_m`` of ``model_dir`` as its own process: wall s, peak RSS MB."""
    out = work / f"memory-{MEMORY_TYPE}.gguf"
    out.unlink(missing_ok=True)
    seconds, rss = timed(export_command(model_dir, MEMORY_TYPE, out), work / "export-memory.log")
    out.unlink()
    return {"type": MEMORY_TYPE, "wall_s": round(seconds, 1), "peak_rss_mb": round(rss)}


def side_by_side(model_dir: Path, types: list[str], imatrix_types: list[str], slice_types: list[str],
                 slice_imatrix_types: list[str], layers: int, work: Path, repeats: int, slice_repeats: int,
                 threads: int) -> tuple[list[dict], dict | None]:
    """``compare`` on the model and (``slice_types``, ``slice_imatrix_types``) on the 8B-shaped slice, whose
    Q4_K_M export is also run as a command: the rows and that run's wall time and peak memory."""
    rows = compare("default", model_dir, types, work, repeats, threads, imatrix_types)
    if not slice_types and not slice_imatrix_types:
        return rows, None
    checkpoint = eight_b_slice(work / f"minicpm41-8b-{layers}-layer", layers)
    rows += compare(f"8b-{layers}-layer", checkpoint, slice_types, work, slice_repeats, threads, slice_imatrix_types)
    return rows, export_memory(checkpoint, work)


def speed_table(rows: list[dict]) -> str:
    headers = ["model", "type", "quantkit s", "llama.cpp s", "ratio", f"<= {TARGET_RATIO}", "identical"]
    return format_table(headers, [[r["model"], r["type"], r["quantkit_s"], r["llama_cpp_s"], r["ratio"],
                                   "yes" if r["target_met"] else "NO", "yes" if r["identical"] else "NO"]
                                  for r in rows])


def memory_note(memory: dict, layers: int) -> str:
    return (f"`quantkit export gguf --type {memory['type']}` of the 8B-shaped {layers}-layer checkpoint as a command: "
            f"{memory['wall_s']} s wall, peak RSS {memory['peak_rss_mb']} MB (/usr/bin/time -v)")


def quantizer() -> str:
    from quantkit.gguf import native

    return "ggml_quantize_chunk" if native.load_libggml() is not None else "NumPy codecs (no libggml)"


def split_types(types: str) -> list[str]:
    return [t.strip() for t in types.split(",") if t.strip()]


@click.command()
@click.option("--model", default="default", show_default=True)
@click.option("--types", default=DEFAULT_TYPES, show_default=True, help="Comma-separated GGUF types.")
@click.option("--imatrix-types", default=IMATRIX_TYPES, show_default=True,
              help="Comma-separated GGUF types made with a recorded importance matrix.")
@click.option("--slice-types", default=SLICE_TYPES, show_default=True,
              help="Types for the 8B-shaped slice (empty, with no --slice-imatrix-types: no slice).")
@click.option("--slice-imatrix-types", default=SLICE_IMATRIX_TYPES, show_default=True,
              help="Types for the 8B-shaped slice made with a recorded importance matrix.")
@click.option("--layers", default=1, show_default=True, help="Decoder layers of the 8B-shaped checkpoint.")
@click.option("--slice-repeats", default=0, show_default=True,
              help="Timed calls per type on the slice (0: one call, no warm-up).")
@click.option("--out", default="out/bench-gguf-speed", show_default=True, type=click.Path(path_type=Path))
@timing_options(repeats=3)
def main(model, types, imatrix_types, slice_types, slice_imatrix_types, layers, slice_repeats, out, repeats, threads,
         json_path):
    """Time both quantizers per type on the default model and the 8B-shaped slice, print one table."""
    import torch

    from quantkit.zoo import resolve_model

    torch.set_num_threads(threads)  # quantkit's fast path splits rows across torch's thread count
    out.mkdir(parents=True, exist_ok=True)
    rows, memory = side_by_side(resolve_model(model), split_types(types), split_types(imatrix_types),
                                split_types(slice_types), split_types(slice_imatrix_types), layers, out, repeats,
                                slice_repeats, threads)
    setup = (f"{machine()}; quantkit export (quantizer: {quantizer()}) vs llama_model_quantize of its F32 "
             f"export, both {threads} threads, in-process; median of {repeats} after a warm-up "
             f"(slice: {slice_repeats or 'one call'}); target ratio <= {TARGET_RATIO}")
    notes = "" if memory is None else memory_note(memory, layers)
    report(setup, speed_table(rows), rows, json_path=json_path, notes=notes, extra={"export_memory": memory})


if __name__ == "__main__":
    main()
