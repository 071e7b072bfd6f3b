"""Post-training quantization of an EAGLE-3 head (``quantkit draft quantize``).

The recipe's algorithm (RTN or GPTQ, from the engine's registry ``quantkit.algorithms.ALGORITHMS``)
runs on the head's linears in true-sequential order (fc, then q/k/v, o, gate/up, down: each group's
calibration inputs carry the error of the groups before it). The inputs are what the head sees
drafting: the target runs on the recipe's calibration rows, and the head runs its unrolled draft
steps on them (``ttt.unrolled_steps``), so the statistics, captured by the engine's hooks
(``quantkit.stats.InputCapture``), cover both the first step (on the target's states) and the later
ones (on the head's own outputs). Each linear's error is the engine's (``fast_relative_error``).

Written in the recipe's format, as its consumer reads a head: ``gptq`` (AutoGPTQ tensors, vLLM and
SGLang), ``marlin`` (each linear Marlin-packed), ``cpmcu`` (what CPM.cu's converter makes of a GPTQ
head: fc Marlin-packed alone, the midlayer's q/k/v and gate/up fused, ``d2t`` int32, no ``t2d``). The
LM head over the draft vocabulary stays fp16 in every layout, because CPM.cu reads only an fp16 one
(its converter requires ``lm_head: false``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from quantkit import calib
from quantkit.algorithms import ALGORITHMS
from quantkit.draft.head_files import save_quantized_head
from quantkit.draft.ttt import unrolled_steps
from quantkit.formats import FORMATS
from quantkit.loading import load_model
from quantkit.models.eagle3 import HEAD_LINEAR_GROUPS, DraftHeadError, entering_states
from quantkit.quant import QuantConfig
from quantkit.reader import load_head
from quantkit.recipe import Recipe
from quantkit.run import Run
from quantkit.stats import InputCapture, fast_relative_error

CALIBRATION_STEPS = 3  # draft steps whose inputs calibrate the head


def quantize_head(head_dir: str | Path, target_dir: str | Path, recipe: Recipe, out_dir: str | Path,
                  progress: bool = True) -> dict:
    """Quantize the head at ``head_dir`` (for the target at ``target_dir``) with ``recipe`` into
    ``out_dir``; returns a report (per-linear relative output error, seconds)."""
    from tqdm.auto import tqdm

    from quantkit.tokenizer import load_tokenizer

    run = Run(out_dir, resumable=False)
    if FORMATS[recipe["format"]].draft_head_fc is None:
        heads = ", ".join(name for name, fmt in FORMATS.items() if fmt.draft_head_fc is not None)
        raise DraftHeadError(f"recipe {recipe.name} writes format {recipe['format']!r}; draft heads are written as "
                             f"{heads}")
    if recipe["smooth"]["enabled"] or recipe["prefix_tokens"]:
        raise DraftHeadError(f"recipe {recipe.name} smooths or skips prefix tokens, which a draft head has no place "
                             "for; use gptq-w4g128 (or rtn-w4g128) with --set format=gptq|marlin|cpmcu")
    if recipe["algorithm"] not in ("rtn", "gptq"):
        raise DraftHeadError(f"recipe {recipe.name} uses {recipe['algorithm']!r}; draft heads quantize with rtn or "
                             "gptq")
    target = load_model(target_dir, torch.float32)
    head = load_head(head_dir, target.config)
    qconfig, fmt = QuantConfig(**recipe["quant"]), FORMATS[recipe["format"]]
    linears = {name: head.get_submodule(name) for group in HEAD_LINEAR_GROUPS for name in group}
    for name, module in linears.items():
        fmt.check(qconfig, module.in_features, module.out_features, False, name)
    settings = recipe["calibration"]
    rows = calib.calibration_set(load_tokenizer(target_dir), source=settings["source"],
                                 n_samples=settings["n_samples"], seq_len=settings["seq_len"],
                                 seed=settings["seed"]).input_ids
    inputs = []
    with torch.no_grad():
        for row in tqdm(rows, desc="target states", disable=not progress):
            _, states = entering_states(target, row[None, :-1], head.aux_layers)
            inputs.append((head.aux_from_states(states), head.embed(target.model.embed_tokens, row[None, 1:])))
    algorithm = ALGORITHMS[recipe["algorithm"]]
    records, errors = {}, {}
    for group in tqdm(HEAD_LINEAR_GROUPS, desc="head linears", disable=not progress):
        with InputCapture(head, group) as capture, torch.no_grad():
            for aux, embeds in inputs:
                capture.run(unrolled_steps, head, aux, embeds, CALIBRATION_STEPS)
        for name in group:
            weight, stats = linears[name].weight.data.float(), capture.stats[name]
            records[name] = algorithm(weight, stats, qconfig, recipe.values)
            quantized = records[name].dequantize()
            errors[name] = fast_relative_error(weight, quantized, stats.hessian)
            linears[name].weight.data = quantized.to(linears[name].weight.dtype)

    with run.publishing():
        save_quantized_head(head, records, recipe["format"], run.staging)
    return {"out_dir": str(run.out), "recipe": recipe.name, "format": recipe["format"],
            "calibration_rows": len(rows), "relative_output_error": errors, "seconds": round(run.elapsed(), 2)}
