"""Quantize a MiniCPM checkpoint with llm-compressor, as a peer for quantkit's AWQ and GPTQ. Runs in its own venv:

    .venv-llmc/bin/python -m quantkit.eval.interop.llmcompressor_quantize MODEL_DIR|default OUT \\
        --method gptq --bits 4 --group-size 128 --nsamples 128 --seqlen 512

Each method is llm-compressor's own modifiers at their defaults (``METHODS``): ``awq`` is AWQModifier
(smoothing: duo scaling, 20-point grid, mappings inferred from the model; no clipping search) and
QuantizationModifier (asymmetric W{bits}A16 in ``group_size`` groups, min/max observer); ``gptq`` is
GPTQModifier on its symmetric W{bits}A16 scheme (the ``W4A16`` preset's, in ``group_size`` groups);
``w8a8`` is SmoothQuantModifier then GPTQModifier on the ``W8A8`` preset (INT8 weights per channel,
INT8 activations per token); ``fp8`` is QuantizationModifier on the ``FP8_DYNAMIC`` preset (E4M3
weights per channel, rounded to nearest; E4M3 activations per token).
Calibration is quantkit's token rows (``quantkit.calib.calibration_set``, same source and seed).
OUT is the compressed-tensors checkpoint llm-compressor saves (quantkit reads it as format
compressed-tensors), with the source's config files and tokenizer, plus llmcompressor_run.json
(settings, calibration fingerprint, wall time, versions).
"""
from __future__ import annotations

import shutil
import time

import torch
from transformers import AutoModelForCausalLM

import quantkit  # noqa: F401  (registers model_type "minicpm" with transformers' Auto classes)
from quantkit.atomic import publish_dir, write_json
from quantkit.eval.interop.peer_cli import adopt_source_configs, calibration_of, model_dir_of, peer_parser

RUN_FILE = "llmcompressor_run.json"


def _awq(bits: int, group_size: int) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    return [AWQModifier(), QuantizationModifier(config_groups={"group_0": _scheme(bits, group_size, sym=False)},
                                                ignore=["lm_head"], bypass_divisibility_checks=True)]


def _gptq(bits: int, group_size: int) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier

    return [GPTQModifier(config_groups={"group_0": _scheme(bits, group_size, sym=True)}, ignore=["lm_head"])]


def _w8a8(bits: int, group_size: int) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    return [SmoothQuantModifier(), GPTQModifier(scheme="W8A8", targets=["Linear"], ignore=["lm_head"])]


def _fp8(bits: int, group_size: int) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [QuantizationModifier(scheme="FP8_DYNAMIC", targets=["Linear"], ignore=["lm_head"])]


def _scheme(bits: int, group_size: int, sym: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="group", group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=weights)


# method -> (its modifiers, what the run record says of them)
METHODS = {
    "awq": (_awq, ["AWQModifier (defaults)", "QuantizationModifier (int, group, asymmetric)"]),
    "gptq": (_gptq, ["GPTQModifier (defaults; int, group, symmetric)"]),
    # its INT8 W8A8 recipe: SmoothQuant (default strength 0.8), then GPTQ on the W8A8 preset (8-bit
    # per-channel weights, INT8 activations per token); --bits and --group-size do not apply
    "w8a8": (_w8a8, ["SmoothQuantModifier (defaults)", "GPTQModifier (scheme W8A8)"]),
    # its FP8 recipe: E4M3 weights per channel rounded to nearest under absmax / 448 (no calibration),
    # activations E4M3 per token at run time; --bits and --group-size do not apply
    "fp8": (_fp8, ["QuantizationModifier (scheme FP8_DYNAMIC)"]),
}


def main(argv: list[str] | None = None) -> None:
    parser = peer_parser(__doc__.splitlines()[0])
    parser.add_argument("--method", choices=tuple(METHODS), default="awq")
    args = parser.parse_args(argv)
    model_dir = model_dir_of(args)

    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.pipelines.cache import IntermediatesCache

    # llm-compressor 0.14 pins its cached activations for faster GPU copies; without an accelerator
    # pin_memory() raises, so on a CPU-only machine pinning must be a no-op.
    if not torch.cuda.is_available():
        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None

    started = time.perf_counter()
    calibration = calibration_of(args, model_dir)
    rows = calibration.input_ids.tolist()
    dataset = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    modifiers, described = METHODS[args.method]
    oneshot(model=model, dataset=dataset, recipe=modifiers(args.bits, args.group_size),
            max_seq_length=args.seqlen, num_calibration_samples=len(rows))
    seconds = time.perf_counter() - started

    staging = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, save_compressed=True)
    adopt_source_configs(staging, model_dir)
    write_json(staging / RUN_FILE, {
        "settings": {"method": args.method, "bits": args.bits, "group_size": args.group_size, "modifiers": described},
        "calibration": calibration.describe(),
        "seconds": round(seconds, 1),
        "versions": {name: __import__(name).__version__
                     for name in ("llmcompressor", "compressed_tensors", "torch", "transformers")},
    })
    publish_dir(staging, args.out)


if __name__ == "__main__":
    main()
