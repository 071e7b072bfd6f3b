"""`make bench-gguf`: quantkit's GGUF export against llama.cpp's own quantizer, and GPTQ on the GGUF
grids, every file measured in llama.cpp on the same held-out tokens.

For each type, quantkit exports the model directly and llama.cpp's ``llama_model_quantize``
quantizes quantkit's F32 export; the table says whether their tensors are identical and how long
each took. Each file is then scored in llama.cpp against the F32 file (also in llama.cpp):
perplexity, mean KL and top-1 agreement, with quantkit's windows and float64 arithmetic. The last
rows are the GPTQ-on-GGUF recipes, each exported without re-rounding as the file type it targets.

    python -m quantkit.eval.bench.bench_gguf --out out/bench-gguf
"""
from __future__ import annotations

import hashlib
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import click
from quantkit.eval.bench.common import machine, quantize_command, report, timed

from quantkit.table import format_table

# GPTQ recipe -> the GGUF file type its artifact is exported as, unchanged
GPTQ_RECIPES = {"gguf-q4_0": "q4_0", "gguf-q4_k_m": "q4_k_m", "gguf-q5_k_m": "q5_k_m"}


@dataclass
class Row:
    file: str
    made_by: str
    bits_per_weight: float
    size_mb: float
    perplexity: float
    mean_kl: float
    top1: float
    seconds: float
    same_tensors_as_llama_cpp: str


def tensor_digest(path: Path) -> str:
    """SHA-256 over every tensor's name, type and bytes (the metadata may differ, the weights may not)."""
    from gguf import GGUFReader

    digest = hashlib.sha256()
    for tensor in sorted(GGUFReader(path).tensors, key=lambda t: t.name):
        digest.update(f"{tensor.name}:{tensor.tensor_type.name}".encode())
        digest.update(memoryview(tensor.data).cast("B"))
    return digest.hexdigest()


@click.command()
@click.option("--model", default="default", show_default=True)
@click.option("--types", default="q8_0,q6_k,q5_k_m,q4_k_m,q4_k_s,q4_1,q4_0", show_default=True,
              help="Comma-separated GGUF types.")
@click.option("--max-tokens", default=4096, show_default=True, help="Held-out tokens scored.")
@click.option("--window", default=512, show_default=True, help="Tokens per llama.cpp evaluation window.")
@click.option("--recipes", default=",".join(GPTQ_RECIPES), show_default=True,
              help=f"Comma-separated GPTQ-on-GGUF recipes, of {', '.join(GPTQ_RECIPES)}.")
@click.option("--n-samples", default=128, show_default=True, help="GPTQ calibration rows.")
@click.option("--seq-len", default=512, show_default=True)
@click.option("--out", default="out/bench-gguf", show_default=True, type=click.Path(path_type=Path))
def main(model, types, recipes, max_tokens, window, n_samples, seq_len, out):
    """Export every type both ways, score each file in llama.cpp, print one table."""
    from quantkit.eval.kld import kl_divergence
    from quantkit.eval.llamacpp import LlamaCppModel, llama_quantize
    from transformers import AutoTokenizer

    from quantkit import calib
    from quantkit.gguf.export import export_gguf
    from quantkit.gguf.mixes import FILE_TYPES
    from quantkit.models.zoo import resolve_model

    model_dir = resolve_model(model)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.gguf"):
        stale.unlink()
    tokens = calib.heldout_tokens(AutoTokenizer.from_pretrained(model_dir), name="austen", max_tokens=max_tokens)
    f32 = out / "f32.gguf"
    weights = export_gguf(model_dir, f32, "f32", progress=False).weights
    reference = LlamaCppModel(f32, n_ctx=window)

    def score(path: Path, made_by: str, seconds: float, same: str) -> Row:
        candidate = LlamaCppModel(path, n_ctx=window)
        try:
            kl = kl_divergence(candidate, reference, tokens, window=window)
        finally:
            candidate.close()
        size = path.stat().st_size
        row = Row(path.name, made_by, 8 * size / weights, size / 2**20, kl.perplexity, kl.mean_kl,
                  kl.top1_agreement, round(seconds, 1), same)
        click.echo(f"[{row.file}] KL {row.mean_kl:.4f}", err=True)
        return row

    fp = kl_divergence(reference, reference, tokens, window=window)
    rows = [Row(f32.name, "quantkit export", 8 * f32.stat().st_size / weights, f32.stat().st_size / 2**20,
                fp.perplexity, 0.0, 1.0, 0.0, "")]
    for file_type in [t.strip() for t in types.split(",") if t.strip()]:
        ours, theirs = out / f"{file_type}.gguf", out / f"{file_type}-llama.cpp.gguf"
        started = time.perf_counter()
        export_gguf(model_dir, ours, file_type, progress=False)
        export_seconds = time.perf_counter() - started
        quantize_seconds = llama_quantize(f32, theirs, FILE_TYPES[file_type])
        same = "yes" if tensor_digest(ours) == tensor_digest(theirs) else "NO"
        rows.append(score(ours, "quantkit export", export_seconds, same))
        rows.append(Row(theirs.name, "llama.cpp quantize (of f32.gguf)", rows[-1].bits_per_weight,
                        theirs.stat().st_size / 2**20, rows[-1].perplexity, rows[-1].mean_kl, rows[-1].top1,
                        round(quantize_seconds, 1), same))
        if same != "yes":  # not expected: score llama.cpp's file on its own
            rows[-1] = score(theirs, "llama.cpp quantize (of f32.gguf)", quantize_seconds, same)

    for recipe in [r.strip() for r in recipes.split(",") if r.strip()]:
        file_type = GPTQ_RECIPES[recipe]
        artifact = out / recipe
        shutil.rmtree(artifact, ignore_errors=True)
        seconds, _ = timed(quantize_command(recipe, model_dir, artifact, (f"calibration.n_samples={n_samples}",
                                                                          f"calibration.seq_len={seq_len}")),
                           out / f"{recipe}.log")
        started = time.perf_counter()
        exported = export_gguf(artifact, out / f"{recipe}.gguf", file_type, progress=False)
        rows.append(score(out / f"{recipe}.gguf", f"quantkit {recipe} recipe ({exported.exact_tensors} tensors "
                          "solved by GPTQ)", seconds + time.perf_counter() - started, ""))
    reference.close()

    table = format_table(["file", "made by", "bits/weight", "MB", "ppl", "mean KL", "top-1", "seconds",
                          "same tensors"],
                         [[r.file, r.made_by, r.bits_per_weight, r.size_mb, r.perplexity, r.mean_kl, r.top1,
                           r.seconds, r.same_tensors_as_llama_cpp] for r in rows])
    header = (f"model {model_dir.name}; held-out Austen, {fp.tokens} scored tokens, llama.cpp windows of {window} "
              f"(weight repacking off, KV cache f16), reference f32.gguf in llama.cpp; GPTQ calibration "
              f"{n_samples} x {seq_len} tokens; machine: {machine()}")
    report(header, table, rows, json_path=out / "bench.json", markdown_path=out / "bench.md")


if __name__ == "__main__":
    main()
