"""Quantize a MiniCPM checkpoint with one of mlx-lm's own learned quantizers, as a peer for quantkit's
MLX recipes (``make bench-mlx``)::

    python -m quantkit.eval.interop.mlx_lm_quantize MODEL_DIR|default OUT --method {gptq,awq,dwq,dynamic} \\
        --bits 4 --group-size 64 --nsamples 128 --seqlen 512 [--target-bpw 4.2 --high-bits 5]

The calibration rows are quantkit's (``quantkit.calib.calibration_set``), handed to mlx-lm's
functions directly: their command lines download a calibration text instead. Everything mlx-lm
would quantize by its converter's rule (the embedding and the LM head too) is at the same bits and
group, so that all rows of the benchmark have the same bits per weight:

- gptq: ``mlx_lm.quant.gptq.gptq_quantize`` (every Linear, LM head included; the embedding by its
  fallback, given the same bits and group);
- awq: ``mlx_lm.quant.awq.awq_quantize`` with its layer map for ``model_type``, or the llama map
  (MiniCPM's layers have llama's module names; its μP residual scales are inside the layer) when
  mlx-lm has none for MiniCPM;
- dwq: ``mlx_lm.quant.dwq.dwq_quantize``: mlx_lm.convert's grid, then scales and biases trained to
  the unquantized model's logits, in float32 (bfloat16 is emulated on CPUs without it);
- dynamic: ``mlx_lm.dynamic_quant``'s steps (``estimate_sensitivities``, ``estimate_threshold``): each module
  at ``--bits`` or, where its gradient-based sensitivity is above the threshold that meets ``--target-bpw``
  (mlx-lm's own bits per weight), at ``--high-bits``; round to nearest, as its command does.

OUT is an MLX directory mlx-lm loads, plus mlx_lm_run.json (settings, calibration, wall time).
"""
from __future__ import annotations

import argparse
import copy
import shutil
import time
from importlib.metadata import version

import mlx.core as mx
import numpy as np

import quantkit  # noqa: F401  (registers model_type "minicpm" with transformers, for mlx-lm's tokenizer)
from quantkit.atomic import publish_dir, write_json
from quantkit.eval.interop.peer_cli import calibration_of, model_dir_of, peer_parser
from quantkit.formats.mlx import config_files

RUN_FILE = "mlx_lm_run.json"
DWQ_VALID_ROWS = 8


def _gptq(model, config, rows, args):
    from mlx_lm.quant.gptq import gptq_quantize

    return gptq_quantize(model, rows, args.bits, args.group_size, args.bits, args.group_size)


def _awq(model, config, rows, args):
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize, update_config

    layer_map = AWQ_MODEL_CONFIGS.get(config["model_type"], AWQ_MODEL_CONFIGS["llama"])
    awq_quantize(model, rows, layer_map, group_size=args.group_size, bits=args.bits,
                 embed_group_size=args.group_size, embed_bits=args.bits)
    return model, update_config(model, config)["quantization"]


def _dwq(model, config, rows, args):
    import mlx.optimizers as optimizers
    from mlx_lm.quant.dwq import dwq_quantize
    from mlx_lm.utils import quantize_model

    teacher = model
    student = copy.deepcopy(model)
    _, quantized = quantize_model(student, config, group_size=args.group_size, bits=args.bits)
    data = [(row.tolist(), 0) for row in np.array(rows)]
    train, valid = data[DWQ_VALID_ROWS:], data[:DWQ_VALID_ROWS]
    dwq_quantize(student, lambda batch, index, split: teacher(batch), optimizers.Adam(learning_rate=1e-6),
                 train, valid, batch_size=4, max_seq_length=args.seqlen, seed=args.seed, dtype=mx.float32)
    return student, quantized["quantization"]


def _dynamic(model, config, rows, args):
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities, estimate_threshold
    from mlx_lm.utils import quantize_model

    if args.target_bpw is None:
        raise SystemExit("--method dynamic needs --target-bpw")
    low, high = (args.bits, args.group_size), (args.high_bits, args.group_size)
    sensitivities = dict(estimate_sensitivities(model, rows, *low, *high))
    threshold = estimate_threshold(model, sensitivities, args.target_bpw, *low, *high)

    def predicate(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        return {"bits": high[0], "group_size": high[1]} if sensitivities[path] > threshold else True

    model, quantized = quantize_model(model, config, group_size=low[1], bits=low[0], quant_predicate=predicate)
    return model, quantized["quantization"]


METHODS = {"gptq": _gptq, "awq": _awq, "dwq": _dwq, "dynamic": _dynamic}


def main(argv: list[str] | None = None) -> None:
    parser: argparse.ArgumentParser = peer_parser(__doc__.splitlines()[0])
    parser.add_argument("--method", required=True, choices=sorted(METHODS))
    parser.add_argument("--target-bpw", type=float, help="dynamic: mlx-lm's bits per weight to meet")
    parser.add_argument("--high-bits", type=int, default=5, help="dynamic: the bits of the sensitive modules")
    args = parser.parse_args(argv)
    model_dir = model_dir_of(args)
    from mlx_lm.utils import compute_bits_per_weight, load_config, load_model, save_config, save_model

    mx.random.seed(args.seed)
    started = time.perf_counter()
    calibration = calibration_of(args, model_dir)
    rows = mx.array(calibration.input_ids.numpy())
    model, _ = load_model(model_dir)
    config = load_config(model_dir)
    model, quantization = METHODS[args.method](model, config, rows, args)
    seconds = time.perf_counter() - started

    staging = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(model_dir, staging, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json",
                                                                     "config.json"))
    save_model(staging, model)
    files = config_files({**config, "quantization_config": quantization})
    save_config(files.pop("config.json"), staging / "config.json")
    for name, content in files.items():
        write_json(staging / name, content)
    write_json(staging / RUN_FILE, {
        "method": f"mlx-lm {args.method}", "settings": {"bits": args.bits, "group_size": args.group_size,
                                                       **({"target_bpw": args.target_bpw, "high_bits": args.high_bits}
                                                          if args.method == "dynamic" else {})},
        "calibration": calibration.describe(), "seconds": round(seconds, 1),
        "bits_per_weight": round(compute_bits_per_weight(model), 3),
        "versions": {name: version(name) for name in ("mlx", "mlx-lm", "transformers")},
    })
    publish_dir(staging, args.out)


if __name__ == "__main__":
    main()
