"""Quantize a MiniCPM checkpoint with GPTQModel, as a peer for quantkit's GPTQ. Runs in the interop venv:

    .venv-interop/bin/python -m quantkit.eval.interop.gptqmodel_quantize MODEL_DIR|default OUT \\
        --bits 4 --group-size 128 --nsamples 128 --seqlen 512

GPTQ, symmetric, true-sequential, GPTQModel's defaults otherwise (damp 0.05, group-aware
reordering, its CPU dtype choice: bf16 always); --damp-percent, --[no-]act-group-aware and --dtype
override three of them. Where the CPU has no bf16 hardware (AVX2 only) torch emulates bf16 products
many times slower, so the benchmarks pass --dtype float32 there, as quantkit's `compute_dtype: auto`
does for its own calibration forwards.
Calibration is exactly quantkit's token rows (quantkit.calib.calibration_set, source "default",
same seed), so the two quantizers see the same data.
OUT is a GPTQ checkpoint (checkpoint_format "gptq") that quantkit.loading.load_model reads; beside
GPTQModel's files it holds gptqmodel_run.json (settings, calibration fingerprint, wall time).
"""
from __future__ import annotations

import argparse
import time

import torch

from quantkit.atomic import write_json
from quantkit.eval.interop.gptqmodel_runtime import GPTQConfig, GPTQModel, versions
from quantkit.eval.interop.peer_cli import calibration_of, model_dir_of, peer_parser

RUN_FILE = "gptqmodel_run.json"


def main(argv: list[str] | None = None) -> None:
    parser = peer_parser(__doc__.splitlines()[0])
    parser.add_argument("--damp-percent", type=float, help="default: GPTQModel's")
    parser.add_argument("--act-group-aware", action=argparse.BooleanOptionalAction, help="default: GPTQModel's")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), help="the model's dtype; default: GPTQModel's")
    args = parser.parse_args(argv)
    model_dir = model_dir_of(args)

    started = time.perf_counter()
    calibration = calibration_of(args, model_dir)
    overrides = {"damp_percent": args.damp_percent, "act_group_aware": args.act_group_aware}
    config = GPTQConfig(bits=args.bits, group_size=args.group_size, sym=True, true_sequential=True,
                        **{key: value for key, value in overrides.items() if value is not None})
    # GPTQModel takes only a torch.dtype as a choice; any string but its own names is "auto"
    dtype = getattr(torch, args.dtype) if args.dtype else "auto"
    model = GPTQModel.load(str(model_dir), quantize_config=config, device="cpu", dtype=dtype)
    model.quantize(calibration.input_ids.tolist(), batch_size=1)
    model.save(str(args.out))
    seconds = time.perf_counter() - started
    write_json(args.out / RUN_FILE, {
        "settings": {"bits": args.bits, "group_size": args.group_size, "sym": True, "true_sequential": True,
                     "damp_percent": config.damp_percent, "act_group_aware": config.act_group_aware,
                     "desc_act": config.desc_act, "dtype": str(model.model.dtype).removeprefix("torch.")},
        "calibration": calibration.describe(),
        "seconds": round(seconds, 1),
        "versions": versions(),
    })


if __name__ == "__main__":
    main()
