"""Quantize a MiniCPM checkpoint with llm-compressor's AWQ, as a peer for quantkit's AWQ. Runs in its own venv:

    .venv-llmc/bin/python -m quantkit.eval.interop.llmcompressor_awq MODEL_DIR|default OUT \\
        --bits 4 --group-size 128 --nsamples 128 --seqlen 512

llm-compressor's AWQ is two modifiers: AWQModifier (smoothing; its defaults: duo scaling, 20-point
grid, mappings inferred from the model) and QuantizationModifier (asymmetric W{bits}A16 with
``group_size``, min/max observer). It has no clipping search. Calibration is quantkit's token rows
(``quantkit.calib.calibration_set``, source "default", same seed).
llm-compressor saves compressed-tensors, which quantkit does not read, so OUT holds the weights its
quantized model computes with, dequantized, as an unquantized MiniCPM checkpoint, plus
llmcompressor_run.json (settings, calibration fingerprint, wall time, versions).
"""
from __future__ import annotations

import shutil
import time

import torch
from transformers import AutoModelForCausalLM

import quantkit  # noqa: F401  (registers model_type "minicpm" with transformers' Auto classes)
from quantkit.atomic import publish_dir, save_safetensors, write_json
from quantkit.checkpoint import CheckpointReader
from quantkit.eval.interop.peer_cli import calibration_of, model_dir_of, peer_parser

RUN_FILE = "llmcompressor_run.json"


def _recipe(bits: int, group_size: int):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=False, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    return [AWQModifier(), QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                      bypass_divisibility_checks=True)]


def _dequantized_state(model, names: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as the quantized model computes with them (fake-quantized linears)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    state = {}
    for name in names:
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        tensor = getattr(module, leaf).detach()
        scheme = getattr(module, "quantization_scheme", None)
        if leaf == "weight" and scheme is not None and scheme.weights is not None:
            tensor = fake_quantize(tensor, module.weight_scale, module.weight_zero_point, scheme.weights)
        state[name] = tensor.to(torch.float32).contiguous()
    return state


def main(argv: list[str] | None = None) -> None:
    args = peer_parser(__doc__.splitlines()[0]).parse_args(argv)
    model_dir = model_dir_of(args)

    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.pipelines.cache import IntermediatesCache

    # llm-compressor 0.14's AWQ pins its cached activations for faster GPU copies; without an
    # accelerator pin_memory() raises, so on a CPU-only machine pinning must be a no-op.
    if not torch.cuda.is_available():
        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None

    started = time.perf_counter()
    calibration = calibration_of(args, model_dir)
    rows = calibration.input_ids.tolist()
    dataset = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    oneshot(model=model, dataset=dataset, recipe=_recipe(args.bits, args.group_size),
            max_seq_length=args.seqlen, num_calibration_samples=len(rows))
    seconds = time.perf_counter() - started

    names = CheckpointReader(model_dir).names
    staging = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(model_dir, staging, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    save_safetensors(staging / "model.safetensors", _dequantized_state(model, names))
    write_json(staging / RUN_FILE, {
        "settings": {"bits": args.bits, "group_size": args.group_size, "sym": False,
                     "modifiers": ["AWQModifier (defaults)", "QuantizationModifier (int, group, asymmetric)"]},
        "calibration": calibration.describe(),
        "seconds": round(seconds, 1),
        "versions": {name: __import__(name).__version__ for name in ("llmcompressor", "torch", "transformers")},
    })
    publish_dir(staging, args.out)


if __name__ == "__main__":
    main()
