"""Does GPTQ's lead over llama.cpp's importance-weighted rounding, earned on the calibration rows'
statistics, hold on text the calibration never saw?

For every decoder linear of the model, at the GGUF type a file type's mix gives it, two solutions from
the same calibration rows: llama.cpp + imatrix (its scale search weighted by diag H, the importance
matrix) and GPTQ on that type (quantkit's recipes: H itself). Each is scored by its output error
tr(ΔW H_t ΔWᵀ) under the input statistics H_t of the calibration rows and of every held-out text, and
the table gives GPTQ's error over llama.cpp's, per kind of linear (mean over layers) and text. GPTQ moves
each rounding error onto directions the calibration inputs rarely take; a ratio well below 1 on the
calibration rows but near 1 on a text says that text's inputs take those directions more often: the
compensation was fitted to correlations it does not share. The inputs are the unquantized model's.

``--shrink`` also solves on (1 − a)·H + a·diag(H) for each a given: the correlations trusted less, the
diagonal (llama.cpp's weighting) kept.

    python -m quantkit.eval.bench.bench_gptq_transfer --file-type iq2_m --json out/bench-gptq-transfer.json
"""
from __future__ import annotations

from pathlib import Path
from statistics import fmean

import click

from quantkit.eval.bench.across_texts import names, text_tokens, texts_option
from quantkit.eval.bench.common import machine, report
from quantkit.table import format_table

CALIBRATION = "calibration"
BATCH = 8  # rows per forward while the statistics are gathered


def input_hessians(model, linears: list[str], rows: dict) -> dict[str, dict]:
    """{set: {linear path: H = 2/n Σ xᵀx}} of the inputs reaching each linear while ``rows[set]``
    ([n, seq] token ids) run through the decoder."""
    import torch
    from tqdm.auto import tqdm

    from quantkit.stats import InputCapture

    hessians = {}
    with tqdm(total=sum(len(ids) for ids in rows.values()), desc="input statistics", unit="row") as bar:
        for name, input_ids in rows.items():
            with InputCapture(model, tuple(linears)) as capture, torch.no_grad():
                for start in range(0, len(input_ids), BATCH):
                    capture.run(model.model, input_ids[start:start + BATCH])
                    bar.update(len(input_ids[start:start + BATCH]))
            hessians[name] = {linear: stats.hessian for linear, stats in capture.stats.items()}
    return hessians


def output_error(weight, approx, hessian) -> float:
    """tr(ΔW H ΔWᵀ): the squared error of the layer's outputs, up to the token count."""
    delta = weight - approx
    return float(((delta @ hessian) * delta).sum())


def shrunk(hessian, amount: float):
    """(1 − amount)·H + amount·diag(H)."""
    import torch

    return hessian if amount == 0 else (1 - amount) * hessian + amount * torch.diag(hessian.diagonal())


@click.command()
@click.option("--model", default="default", show_default=True)
@click.option("--file-type", default="iq2_m", show_default=True, help="The GGUF mix whose types the linears get.")
@texts_option("austen,zh-heldout,test-fiction,test-manual,test-code,test-zh")
@click.option("--max-tokens", default=8192, show_default=True, help="Tokens of each text, in rows of --window.")
@click.option("--window", default=512, show_default=True)
@click.option("--calibration", default="default", show_default=True,
              help="Calibration source of both solutions: a mix, a corpus or a text file (as calibration.source).")
@click.option("--n-samples", default=128, show_default=True, help="Calibration rows (both solutions).")
@click.option("--seq-len", default=512, show_default=True)
@click.option("--damp", default=0.01, show_default=True, help="GPTQ's damp_percent (the gguf recipes').")
@click.option("--shrink", default="0", show_default=True,
              help="Comma-separated amounts a of (1 − a)·H + a·diag(H), each solved by GPTQ (0: H itself).")
@click.option("--threads", default=2, show_default=True)
@click.option("--json", "json_path", default=None, type=click.Path(path_type=Path), help="Also write the rows here.")
def main(model, file_type, texts, max_tokens, window, calibration, n_samples, seq_len, damp, shrink, threads,
         json_path):
    """GPTQ's output error over llama.cpp + imatrix's, under the calibration rows' and each text's inputs."""
    import numpy as np
    import torch
    from tqdm.auto import tqdm

    from quantkit import calib
    from quantkit.algorithms.gptq import gptq_quantize
    from quantkit.formats.gguf import target
    from quantkit.gguf.mixes import MIXES
    from quantkit.loading import load_model
    from quantkit.models.layers import LINEARS, layer_prefix
    from quantkit.tokenizer import load_tokenizer
    from quantkit.zoo import resolve_model

    if file_type not in MIXES:
        raise click.BadParameter(f"{file_type!r} is not a GGUF file type ({', '.join(MIXES)})",
                                 param_hint="--file-type")
    try:
        amounts = [float(a) for a in names(shrink)]
    except ValueError:
        amounts = []
    if not amounts or not all(0 <= a <= 1 for a in amounts):
        raise click.BadParameter(f"{shrink!r}: give comma-separated numbers in [0, 1]", param_hint="--shrink")
    torch.set_num_threads(threads)
    model_dir = resolve_model(model)
    tokenizer = load_tokenizer(model_dir)
    rows = {CALIBRATION: calib.calibration_set(tokenizer, source=calibration, n_samples=n_samples,
                                               seq_len=seq_len).input_ids}
    for name, tokens in text_tokens(tokenizer, names(texts), max_tokens).items():
        rows[name] = tokens[:len(tokens) // window * window].view(-1, window)
    lm = load_model(model_dir)
    config = lm.config
    linears = {f"{layer_prefix(layer)}{linear}": (layer, linear)
               for layer in range(config.num_hidden_layers) for linear in LINEARS}
    hessians = input_hessians(lm, list(linears), rows)

    records = []
    for path, (layer, linear) in tqdm(linears.items(), desc="solve", unit="linear"):
        weight = lm.get_submodule(path).weight.detach().float()
        tensor_type = target(file_type, linear, layer, config, tuple(weight.shape))
        if not tensor_type.solvable:
            continue
        k = weight.shape[1]
        hessian = hessians[CALIBRATION][path]
        imatrix = tensor_type.quantize_fast(weight.numpy(), hessian.diagonal().numpy())
        baseline = torch.from_numpy(tensor_type.dequantize(imatrix, k))
        for amount in amounts:
            solved = gptq_quantize(weight, shrunk(hessian, amount), tensor_type, damp_percent=damp, block_size=256,
                                   group_aware=True)
            approx = torch.from_numpy(tensor_type.dequantize(np.ascontiguousarray(solved.data.numpy()), k))
            records.append({"layer": layer, "linear": linear, "type": tensor_type.name, "shrink": amount,
                            "ratio": {name: output_error(weight, approx, by_set[path])
                                      / output_error(weight, baseline, by_set[path])
                                      for name, by_set in hessians.items()}})

    sets = list(rows)
    table_rows = []
    for amount in amounts:
        for linear in [*LINEARS, "all"]:
            chosen = [r for r in records if r["shrink"] == amount and linear in ("all", r["linear"])]
            if chosen:
                types = sorted({r["type"] for r in chosen})
                table_rows.append([linear, amount, ", ".join(types) if len(types) < 4 else f"{len(types)} types",
                                   *(fmean(r["ratio"][s] for r in chosen) for s in sets)])
    table = format_table(["linear", "shrink", "types", *sets], table_rows)
    setup = (f"model {model_dir.name}, {file_type} mix; GPTQ (damp {damp}, block 256, group-aware order) over "
             f"llama.cpp + imatrix, output error under each set's inputs, mean over layers; calibration "
             f"{n_samples} x {seq_len} tokens ({calibration}), texts {max_tokens} tokens in rows of {window}; "
             f"machine: {machine()}")
    report(setup, table, records, json_path=json_path)


if __name__ == "__main__":
    main()
