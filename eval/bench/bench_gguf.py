"""`make bench-gguf`: quantkit's GGUF export against llama.cpp's own quantizer, and GPTQ on the GGUF
grids, every file measured in llama.cpp on the same tokens of each test text.

For each type, quantkit exports the model directly and llama.cpp's ``llama_model_quantize``
quantizes quantkit's F32 export; the table says whether their tensors are identical and how long
each took. Each file is then scored in llama.cpp against the F32 file (also in llama.cpp):
perplexity, mean KL and top-1 agreement, with quantkit's windows and float64 arithmetic. Then, with
an importance matrix: llama.cpp's own anchor (``llama-imatrix`` on quantkit's calibration text, then
``llama-quantize --imatrix``), llama-quantize fed quantkit's imatrix (``quantkit imatrix``), and the
GPTQ-on-GGUF recipes, whose block scales are llama.cpp's imatrix search weighted by diag(H), each
exported without re-rounding as the file type it targets. The two llama.cpp tools are built once from
the llama.cpp source that the installed llama-cpp-python vendors (``make llama-tools``, ~10 min on 2
cores; ``llama_build``).

    python -m quantkit.eval.bench.bench_gguf --out out/bench-gguf
"""
from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

import click

from quantkit.eval.bench.across_texts import names, text_tokens, texts_option
from quantkit.eval.bench.common import machine, pyplot, quantize_command, report, save_figure, timed
from quantkit.eval.bench.llama_build import NATIVE, llama_cpp_programs
from quantkit.table import format_table

# bench row -> (recipe, the GGUF file type its artifact is exported as unchanged, recipe overrides).
# gguf-q4_0 solves on the Q4_0 blocks with llama.cpp's imatrix scale search weighted by diag(H);
# -own-grid is the ablation on GPTQ's own W4 g32 grid with its clip search (exported as Q4_0).
GPTQ_RECIPES = {
    "gguf-q4_0": ("gguf-q4_0", "q4_0", ()),
    "gguf-q4_0-own-grid": ("gguf-q4_0", "q4_0", ("format=gptq", "gptq.clip_search=true")),
    "gguf-q4_k_m": ("gguf-q4_k_m", "q4_k_m", ()),
    "gguf-q5_k_m": ("gguf-q5_k_m", "q5_k_m", ()),
    "gguf-iq4_xs": ("gguf-iq4_xs", "iq4_xs", ()),
    "gguf-q3_k_m": ("gguf-q3_k_m", "q3_k_m", ()),
    "gguf-q2_k": ("gguf-q2_k", "q2_k", ()),
    # then each layer's codes trained against its FP output (docs/lowbit.md), the recipe defaults
    "gguf-q3_k_m-recon": ("gguf-q3_k_m", "q3_k_m", ("reconstruct.iterations=200",)),
    "gguf-q2_k-recon": ("gguf-q2_k", "q2_k", ("reconstruct.iterations=200",)),
    "gguf-iq3_m": ("gguf-iq3_m", "iq3_m", ()),
    "gguf-iq2_m": ("gguf-iq2_m", "iq2_m", ()),
    "gguf-iq1_m": ("gguf-iq1_m", "iq1_m", ()),
}
# the rows `make bench-gguf` runs; `make bench-lowbit` runs the -recon ones (an hour or more each)
DEFAULT_RECIPES = tuple(name for name in GPTQ_RECIPES if not name.endswith("-recon"))
PLAIN_TYPES = ("q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_k_s", "q4_1", "q4_0", "iq4_xs", "iq4_nl", "q3_k_m", "q3_k_s",
               "iq3_m", "iq3_s", "q2_k")
# quantkit's best file of the type, against llama.cpp + llama-imatrix
TARGET_TYPES, TARGET_RATIO = ("q4_0", "q4_k_m", "iq4_xs", "q3_k_m", "iq3_m", "q2_k", "iq2_m", "iq1_m"), 0.8
# the file types made with an importance matrix only (llama.cpp + llama-imatrix rows), beside TARGET_TYPES
LATTICE_TYPES = ("iq3_xxs", "iq2_xxs")
# quantkit's imatrix against llama-imatrix's: the median tensor's largest relative difference
IMATRIX_TOLERANCE = 0.05
# The prefix-aware imatrix row: the MiniCPM4 report's P-GPTQ cut
PREFIX_TOKENS = 4

LLAMA_TOOLS = ("llama-imatrix", "llama-quantize")


def llama_tools(build: bool = True, jobs: int = 1) -> Path | None:
    """The directory holding llama-imatrix and llama-quantize for this CPU, built on first use (or None
    if absent and ``build`` is off)."""
    return llama_cpp_programs("tools", LLAMA_TOOLS, NATIVE, build=build, jobs=jobs)


def calibration_text(model_dir: Path, n_samples: int, seq_len: int) -> str:
    """quantkit's calibration rows (the recipes' source and seed) as text for llama-imatrix, which only
    reads text: it re-tokenizes, so its chunks hold the same text, not exactly the same tokens."""
    from transformers import AutoTokenizer

    from quantkit import calib

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = calib.calibration_set(tokenizer, source="default", n_samples=n_samples, seq_len=seq_len, seed=0)
    return "\n\n".join(tokenizer.decode(row) for row in rows.input_ids.tolist())


def check_loaded(log: str, entries: int, anchor_log: str) -> None:
    """llama-quantize's own account of reading quantkit's imatrix: every entry loaded, and no tensor left
    without weights that llama-imatrix's file covers (neither covers token_embd, nor output.weight,
    which llama-imatrix does not collect by default)."""
    def uncovered(text: str) -> set[str]:
        return set(re.findall(r"did not find weights for (\S+)", text))

    missing = uncovered(log) - uncovered(anchor_log)
    if f"loaded {entries} importance matrix entries" not in log or missing:
        raise click.ClickException(f"llama-quantize did not take all {entries} entries of quantkit's imatrix "
                                   f"(no weights for {sorted(missing)}):\n"
                                   + "\n".join(line for line in log.splitlines() if "imatrix" in line.lower()))


def compare_imatrices(theirs: Path, ours: Path) -> dict:
    """llama-imatrix's file against quantkit's on the same calibration text: the same entries and
    counts, and how far each tensor's per-channel mean x² is from llama.cpp's (llama-imatrix
    re-tokenizes the text, so the activations are close, not equal)."""
    import numpy as np
    from gguf import GGUFReader

    def entries(path: Path) -> dict[str, np.ndarray]:
        return {t.name: np.array(t.data, dtype=np.float64).ravel() for t in GGUFReader(path).tensors}

    a, b = entries(theirs), entries(ours)
    sums = sorted(name for name in a if name.endswith(".in_sum2"))
    relative, correlation = [], []
    for name in sums:
        counts = name.removesuffix(".in_sum2") + ".counts"
        x, y = a[name] / a[counts][0], b[name] / b[counts][0]
        relative.append(float(np.abs(x - y).max() / np.abs(x).max()))
        correlation.append(float(np.corrcoef(x, y)[0, 1]))
    same_counts = set(a) == set(b) and all(np.array_equal(a[n], b[n]) for n in a if n.endswith(".counts"))
    return {"entries": len(sums), "same_names_and_counts": same_counts,
            "median_max_relative_difference": float(np.median(relative)),
            "worst_max_relative_difference": max(relative), "min_correlation": min(correlation)}


def _run(command: list[str], log: Path) -> float:
    started = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - started


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
    kl_per_text: dict[str, float]


def target_line(file_type: str, ours: Row, anchor: Row) -> str:
    """Whether quantkit's best file of the type is within TARGET_RATIO of llama.cpp + imatrix on every text."""
    ratios = {text: kl / anchor.kl_per_text[text] for text, kl in ours.kl_per_text.items()}
    passed = all(ratio <= TARGET_RATIO for ratio in ratios.values())
    return (f"target {file_type}: {ours.file} / llama.cpp+imatrix per text "
            f"{', '.join(f'{text} {ratio:.2f}' for text, ratio in ratios.items())} (<= {TARGET_RATIO} on every "
            f"text: {'PASS' if passed else 'FAIL'})")


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
@click.option("--types", default=",".join(PLAIN_TYPES), show_default=True,
              help="Comma-separated GGUF types, exported plain (no importance matrix).")
@texts_option("test-fiction,test-manual,test-code,test-zh")
@click.option("--max-tokens", default=4096, show_default=True, help="Tokens scored per text.")
@click.option("--window", default=512, show_default=True, help="Tokens per llama.cpp evaluation window.")
@click.option("--recipes", default=",".join(DEFAULT_RECIPES), show_default=True,
              help=f"Comma-separated GPTQ-on-GGUF rows, of {', '.join(GPTQ_RECIPES)}.")
@click.option("--imatrix-types", default=",".join(TARGET_TYPES + LATTICE_TYPES), show_default=True,
              help="Comma-separated types quantized by llama-quantize --imatrix (empty: none).")
@click.option("--llama-tools/--no-llama-tools", "use_llama_tools", default=True, show_default=True,
              help="Build (once) and run llama-imatrix and llama-quantize for the imatrix rows.")
@click.option("--anchors-only", is_flag=True,
              help="Per imatrix type, only llama.cpp + llama-imatrix (skip llama.cpp on quantkit's imatrices).")
@click.option("--n-samples", default=128, show_default=True, help="Calibration rows (GPTQ and both imatrices).")
@click.option("--seq-len", default=512, show_default=True)
@click.option("--threads", default=2, show_default=True, help="Threads of the llama.cpp tools.")
@click.option("--out", default="out/bench-gguf", show_default=True, type=click.Path(path_type=Path))
def main(model, types, recipes, imatrix_types, use_llama_tools, anchors_only, texts, max_tokens, window, n_samples,
         seq_len, threads, out):
    """Export every type both ways, score each file in llama.cpp, print one table."""
    from transformers import AutoTokenizer

    from quantkit.eval.kld import kl_divergence
    from quantkit.eval.llamacpp import LlamaCppModel, llama_quantize
    from quantkit.gguf.export import export_gguf
    from quantkit.gguf.mixes import FILE_TYPES
    from quantkit.zoo import resolve_model

    model_dir = resolve_model(model)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.gguf"):
        stale.unlink()
    tokens = text_tokens(AutoTokenizer.from_pretrained(model_dir), names(texts), max_tokens)
    f32 = out / "f32.gguf"
    weights = export_gguf(model_dir, f32, "f32", progress=False).weights
    reference = LlamaCppModel(f32, n_ctx=window)

    def on_every_text(model) -> dict:
        return {name: kl_divergence(model, reference, text, window=window) for name, text in tokens.items()}

    def score(path: Path, made_by: str, seconds: float, same: str) -> Row:
        candidate = LlamaCppModel(path, n_ctx=window)
        try:
            kls = on_every_text(candidate)
        finally:
            candidate.close()
        size = path.stat().st_size
        row = Row(path.name, made_by, 8 * size / weights, size / 2**20, fmean(k.perplexity for k in kls.values()),
                  fmean(k.mean_kl for k in kls.values()), fmean(k.top1_agreement for k in kls.values()),
                  round(seconds, 1), same, {name: k.mean_kl for name, k in kls.items()})
        click.echo(f"[{row.file}] KL {row.mean_kl:.4f}", err=True)
        return row

    fp = on_every_text(reference)
    rows = [Row(f32.name, "quantkit export", 8 * f32.stat().st_size / weights, f32.stat().st_size / 2**20,
                fmean(k.perplexity for k in fp.values()), 0.0, 1.0, 0.0, "", {name: 0.0 for name in fp})]
    for file_type in names(types):
        ours, theirs = out / f"{file_type}.gguf", out / f"{file_type}-llama.cpp.gguf"
        started = time.perf_counter()
        export_gguf(model_dir, ours, file_type, progress=False)
        export_seconds = time.perf_counter() - started
        quantize_seconds = llama_quantize(f32, theirs, FILE_TYPES[file_type])
        same = "yes" if tensor_digest(ours) == tensor_digest(theirs) else "NO"
        rows.append(score(ours, "quantkit export", export_seconds, same))
        rows.append(Row(theirs.name, "llama.cpp quantize (of f32.gguf)", rows[-1].bits_per_weight,
                        theirs.stat().st_size / 2**20, rows[-1].perplexity, rows[-1].mean_kl, rows[-1].top1,
                        round(quantize_seconds, 1), same, rows[-1].kl_per_text))
        if same != "yes":  # not expected: score llama.cpp's file on its own
            rows[-1] = score(theirs, "llama.cpp quantize (of f32.gguf)", quantize_seconds, same)

    anchors: dict[str, Row] = {}  # file type -> llama.cpp + llama-imatrix
    best: dict[str, Row] = {}  # file type -> quantkit's GPTQ file with the least mean KL
    wanted = names(imatrix_types)
    bin_dir = llama_tools(build=use_llama_tools) if wanted else None
    imatrix_note = ""
    if bin_dir is not None:
        from quantkit.imatrix import imatrix_for

        calibration = out / "calibration.txt"
        calibration.write_text(calibration_text(model_dir, n_samples, seq_len))
        theirs_imatrix, ours_imatrix = out / "imatrix-llama.cpp.gguf", out / "imatrix-quantkit.gguf"
        prefix_imatrix = out / f"imatrix-quantkit-prefix{PREFIX_TOKENS}.gguf"
        ours_imatrix.unlink(missing_ok=True)
        prefix_imatrix.unlink(missing_ok=True)
        made = {theirs_imatrix: _run([str(bin_dir / "llama-imatrix"), "-m", str(f32), "-f", str(calibration), "-o",
                                      str(theirs_imatrix), "-c", str(seq_len), "-b", str(seq_len), "--chunks",
                                      str(n_samples), "-t", str(threads), "--no-ppl"], out / "llama-imatrix.log")}
        started = time.perf_counter()
        entries = len(imatrix_for(model_dir, ours_imatrix, n_samples=n_samples, seq_len=seq_len).sums)
        made[ours_imatrix] = time.perf_counter() - started
        if not anchors_only:
            started = time.perf_counter()
            imatrix_for(model_dir, prefix_imatrix, n_samples=n_samples, seq_len=seq_len, prefix_tokens=PREFIX_TOKENS)
            made[prefix_imatrix] = time.perf_counter() - started
        agreement = compare_imatrices(theirs_imatrix, ours_imatrix)
        agrees = (agreement["same_names_and_counts"]
                  and agreement["median_max_relative_difference"] <= IMATRIX_TOLERANCE)
        imatrix_note = (f"quantkit's imatrix vs llama-imatrix's on the same text: {agreement['entries']} entries, "
                        f"names and counts {'equal' if agreement['same_names_and_counts'] else 'DIFFERENT'}; "
                        f"per-channel mean x² within {agreement['median_max_relative_difference']:.1%} of "
                        f"llama.cpp's (median over tensors of the largest difference; worst tensor "
                        f"{agreement['worst_max_relative_difference']:.1%}), correlation >= "
                        f"{agreement['min_correlation']:.3f}: {'PASS' if agrees else 'FAIL'} "
                        f"(tolerance {IMATRIX_TOLERANCE:.0%}; llama-imatrix re-tokenizes the text)")
        for file_type in wanted:
            sources = ((theirs_imatrix, "llama-imatrix"), (ours_imatrix, "quantkit imatrix"),
                       (prefix_imatrix, f"quantkit imatrix --prefix-tokens {PREFIX_TOKENS}"))
            chosen = sources[:1] if anchors_only else sources  # llama-imatrix's first: the anchor
            for imatrix, by in chosen:
                path = out / f"{file_type}-{imatrix.stem}.gguf"
                log = out / f"{path.stem}.log"
                seconds = _run([str(bin_dir / "llama-quantize"), "--imatrix", str(imatrix), str(f32), str(path),
                                file_type.upper(), str(threads)], log)
                if imatrix != theirs_imatrix:
                    check_loaded(log.read_text(), entries, (out / f"{file_type}-{theirs_imatrix.stem}.log").read_text())
                rows.append(score(path, f"llama.cpp quantize --imatrix ({by}; seconds include it)",
                                  made[imatrix] + seconds, ""))
            anchors[file_type] = rows[-len(chosen)]

    for name in names(recipes):
        recipe, file_type, settings = GPTQ_RECIPES[name]
        artifact = out / name
        shutil.rmtree(artifact, ignore_errors=True)
        settings = (*settings, f"calibration.n_samples={n_samples}", f"calibration.seq_len={seq_len}")
        seconds, _ = timed(quantize_command(recipe, model_dir, artifact, settings), out / f"{name}.log")
        started = time.perf_counter()
        exported = export_gguf(artifact, out / f"{name}.gguf", file_type, progress=False)
        rows.append(score(out / f"{name}.gguf", f"quantkit {name} ({exported.exact_tensors} tensors solved by GPTQ)",
                          seconds + time.perf_counter() - started, ""))
        if file_type not in best or rows[-1].mean_kl < best[file_type].mean_kl:
            best[file_type] = rows[-1]
    reference.close()
    targets = [target_line(t, best[t], anchors[t]) for t in TARGET_TYPES if t in anchors and t in best]

    table = format_table(["file", "made by", "bits/weight", "MB", "ppl", "mean KL", *tokens, "top-1", "seconds",
                          "same tensors"],
                         [[r.file, r.made_by, r.bits_per_weight, r.size_mb, r.perplexity, r.mean_kl,
                           *r.kl_per_text.values(), r.top1, r.seconds, r.same_tensors_as_llama_cpp] for r in rows])
    scored = next(iter(fp.values())).tokens
    header = (f"model {model_dir.name}; {', '.join(tokens)}, {scored} scored tokens each (ppl, KL and top-1 "
              f"are means over the texts), llama.cpp windows of {window} "
              f"(weight repacking off, KV cache f16), reference f32.gguf in llama.cpp; GPTQ calibration "
              f"{n_samples} x {seq_len} tokens; machine: {machine()}")
    notes = "\n".join([*targets, imatrix_note])
    report(header, table, rows, json_path=out / "bench.json", markdown_path=out / "bench.md", notes=notes.strip(),
           extra={"targets": targets, "imatrix_agreement": imatrix_note})
    plot_kl_against_size(rows, out / "kl-vs-size.png", f"{model_dir.name}: mean KL on {', '.join(tokens)}")
    click.echo(f"plot: {out / 'kl-vs-size.png'}")


# the made-by prefixes of the plot's series, each file's row in the one it starts with
SERIES = {"quantkit export": "quantkit export (plain)", "llama.cpp quantize (of": "llama.cpp (plain)",
          "llama.cpp quantize --imatrix (llama-imatrix": "llama.cpp + llama-imatrix", "quantkit gguf-": "quantkit GPTQ",
          "quantkit --target-size": "quantkit size budget"}


def plot_kl_against_size(rows: list[Row], path: Path, title: str) -> None:
    """Mean KL against file size (bits per weight), one series per way of making the file, each point
    named by its file type: where quantkit and llama.cpp stand at every size."""
    figure, axes = pyplot().subplots(figsize=(9, 6))
    for prefix, label in SERIES.items():
        points = sorted((r.bits_per_weight, r.mean_kl, r.file.removesuffix(".gguf")) for r in rows
                        if r.made_by.startswith(prefix) and r.mean_kl > 0)
        if not points:
            continue
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=4, linewidth=1, label=label)
        for bits, kl, name in points:
            axes.annotate(name.removeprefix("gguf-").split("-")[0], (bits, kl), fontsize=6, xytext=(3, 2),
                          textcoords="offset points")
    axes.set(xlabel="bits per weight (file size)", ylabel="mean KL against F32", yscale="log", title=title)
    save_figure(figure, axes, path)


if __name__ == "__main__":
    main()
