"""`quantkit export gguf|mlx` and `quantkit imatrix`: files for other runtimes (llama.cpp, Ollama, LM Studio,
mlx-lm), and llama.cpp's importance matrix from quantkit's calibration set."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import click

from quantkit.cli import (
    emit,
    friendly_errors,
    json_option,
    out_dir_option,
    progress_option,
    revision_option,
    seed_option,
)
from quantkit.table import format_table


@click.group("export")
def export_group():
    """Write a checkpoint or artifact in another runtime's format."""


@export_group.command("gguf")
@click.option("--model", default="default", show_default=True,
              help="Checkpoint or quantized artifact (a quantized linear is copied as it is where the type holds "
                   "its grid, else dequantized and re-quantized).")
@revision_option("--model")
@click.option("--type", "file_type", required=True, metavar="TYPE",
              help="llama.cpp's file type: f32, f16, bf16, q8_0, q6_k, q5_k_m, q5_k_s, q5_0, q5_1, q4_k_m, "
                   "q4_k_s, q4_0, q4_1, iq4_xs, iq4_nl, q3_k_l, q3_k_m, q3_k_s, iq3_m, iq3_s, iq3_xs, iq3_xxs, q2_k, "
                   "q2_k_s, iq2_m, iq2_s, iq2_xs, iq2_xxs, iq1_m, iq1_s, tq2_0 or tq1_0; each tensor's type is "
                   "chosen as llama.cpp's quantizer chooses it (iq1_*, iq2_*, iq3_xs, iq3_xxs and q2_k_s need "
                   "--imatrix).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output .gguf file (must not exist).")
@click.option("--tokenizer-pre", default=None, help="llama.cpp pre-tokenizer name, if it cannot be recognised.")
@click.option("--imatrix", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="llama.cpp importance-matrix file (`quantkit imatrix` or llama-imatrix): types and scale "
                   "searches as `llama-quantize --imatrix` makes them.")
@progress_option
@json_option
@friendly_errors
def export_gguf(model, revision, file_type, out, tokenizer_pre, imatrix, progress, as_json):
    """Export a MiniCPM model as a GGUF file for llama.cpp (and Ollama, LM Studio)."""
    from quantkit.gguf.export import export_gguf as export
    from quantkit.zoo import resolve_model

    report = export(resolve_model(model, revision=revision), out, file_type, tokenizer_pre=tokenizer_pre,
                    imatrix=imatrix, progress=progress)
    payload = {**asdict(report), "bits_per_weight": report.bits_per_weight}
    rows = [["file", report.path], ["type", report.file_type], ["size MB", report.file_bytes / 2**20],
            ["bits per weight", report.bits_per_weight], ["tensors by type", report.tensors_by_type],
            ["seconds", report.seconds]]
    emit(as_json, payload, format_table(["field", "value"], rows))


@export_group.command("gguf-head")
@click.option("--head", required=True, type=click.Path(path_type=Path),
              help="EAGLE-3 head folder in quantkit's layout: FP (`quantkit draft train`) or quantized (`quantkit "
                   "draft quantize`, symmetric 4 or 8 bits: written as Q4_0 / Q8_0 blocks of its own codes).")
@click.option("--target", required=True,
              help="The model the head drafts for (folder, `default` or Hub id): its config.json and tokenizer "
                   "go into the file, as llama.cpp's converter takes them from --target-model-dir.")
@revision_option("--target")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output .gguf file (must not exist).")
# the choices are quantkit.gguf.eagle3_head.OUTTYPES, which imports torch: checked there, in one line
@click.option("--outtype", default="f16", show_default=True, metavar="TYPE",
              help="Type of the matrices, as the converter's --outtype: f32, f16, bf16 or q8_0 (norms stay F32; a "
                   "quantized head's quantized linears keep their blocks).")
@click.option("--tokenizer-pre", default=None, help="llama.cpp pre-tokenizer name, if it cannot be recognised.")
@json_option
@friendly_errors
def export_gguf_head(head, target, revision, out, outtype, tokenizer_pre, as_json):
    """Export an EAGLE-3 draft head as the GGUF llama.cpp's converter writes (`--spec-type draft-eagle3`)."""
    from quantkit.atomic import refuse_existing
    from quantkit.gguf.eagle3_head import check_outtype, export_head_gguf
    from quantkit.zoo import resolve_model

    refuse_existing(out)  # these two before the target is resolved (a Hub id is fetched)
    check_outtype(outtype)
    report = export_head_gguf(head, resolve_model(target, revision=revision), out, outtype,
                              tokenizer_pre=tokenizer_pre)
    rows = [["file", report.path], ["type", report.outtype], ["target", report.target_model_type],
            ["folded scales", report.folded or "none"], ["tensors by type", report.tensors_by_type],
            ["size MB", report.file_bytes / 2**20], ["seconds", report.seconds]]
    emit(as_json, asdict(report), format_table(["field", "value"], rows + ([["note", report.note]] if report.note
                                                                           else [])))


@export_group.command("mlx")
@click.option("--model", required=True, help="A quantized artifact whose grid MLX holds (natural groups of 32, 64 "
                                             "or 128 channels that tile K): the codes and scales are kept, "
                                             "bias = -zero * scale.")
@revision_option("--model")
@out_dir_option
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "float16", "bfloat16"]),
              help="dtype of the scales and biases: float32 makes mlx compute exactly the artifact's weights; "
                   "float16/bfloat16 (half the size) only where every value is exact in it.")
@json_option
@friendly_errors
def export_mlx(model, revision, out, dtype, as_json):
    """Export a quantized artifact for mlx-lm (run it with `mlx_lm.generate --model OUT`)."""
    from quantkit.mlx_export import export_mlx as export
    from quantkit.zoo import resolve_model

    report = export(resolve_model(model, revision=revision), out, dtype)
    emit(as_json, asdict(report), format_table(["field", "value"], [[k, v] for k, v in asdict(report).items()]))


@click.command()
@click.option("--model", default="default", show_default=True, help="Checkpoint (or artifact) whose activations count.")
@revision_option("--model")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output .gguf file (must not exist).")
@click.option("--calibration", default="default", show_default=True,
              help="Calibration source, as the recipes' calibration.source (corpus or mix name, file, hf:<dataset>).")
@click.option("--n-samples", default=128, show_default=True, type=click.IntRange(min=1), help="Calibration sequences.")
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(min=16), help="Tokens per sequence.")
@seed_option("the sample draw")
@click.option("--prefix-tokens", default=0, show_default=True, type=click.IntRange(min=0),
              help="P-GPTQ's cut: leave the first N positions of every sequence (the attention sink's massive "
                   "activations) out of the sums; the MiniCPM4 report uses 4.")
@progress_option
@json_option
@friendly_errors
def imatrix(model, revision, out, calibration, n_samples, seq_len, seed, prefix_tokens, progress, as_json):
    """Write llama.cpp's importance matrix (for `llama-quantize --imatrix`) from quantkit's calibration set."""
    from quantkit.imatrix import imatrix_for
    from quantkit.zoo import resolve_model

    report = imatrix_for(resolve_model(model, revision=revision), out, source=calibration, n_samples=n_samples,
                         seq_len=seq_len, seed=seed, prefix_tokens=prefix_tokens, progress=progress).describe()
    emit(as_json, {"path": str(out), **report},
          format_table(["field", "value"], [["file", str(out)], *[[k, v] for k, v in report.items()]]))
