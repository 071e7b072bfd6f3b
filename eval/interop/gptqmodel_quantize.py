"""Quantize a MiniCPM checkpoint with GPTQModel, as a peer for quantkit's GPTQ. Runs in the interop venv:

    .venv-interop/bin/python -m quantkit.eval.interop.gptqmodel_quantize MODEL_DIR|default OUT \\
        --bits 4 --group-size 128 --nsamples 128 --seqlen 512

GPTQ, symmetric, true-sequential, GPTQModel's defaults otherwise (damp 0.05, group-aware
reordering, its CPU dtype choice); --damp-percent and --[no-]act-group-aware override two of them.
Calibration is exactly quantkit's token rows (quantkit.calib.calibration_set, source "default",
same seed), so the two quantizers see the same data.
OUT is a GPTQ checkpoint (checkpoint_format "gptq") that quantkit.loading.load_model reads; beside
GPTQModel's files it holds gptqmodel_run.json (settings, calibration fingerprint, wall time).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from transformers import AutoTokenizer

from quantkit import calib
from quantkit.atomic import write_json
from quantkit.eval.interop.gptqmodel_runtime import GPTQConfig, GPTQModel, versions
from quantkit.models import zoo

RUN_FILE = "gptqmodel_run.json"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="unquantized MiniCPM checkpoint directory, or 'default'")
    parser.add_argument("out", type=Path, help="output directory (must not exist)")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--nsamples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--calibration", default="default", help="quantkit calibration source")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--damp-percent", type=float, help="default: GPTQModel's")
    parser.add_argument("--act-group-aware", action=argparse.BooleanOptionalAction, help="default: GPTQModel's")
    args = parser.parse_args(argv)
    model_dir = zoo.ensure_model(zoo.DEFAULT_MODEL) if args.model_dir == "default" else Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json, not a checkpoint directory")
    if args.out.exists():
        raise FileExistsError(f"output directory already exists: {args.out}")

    started = time.perf_counter()
    calibration = calib.calibration_set(AutoTokenizer.from_pretrained(model_dir), source=args.calibration,
                                        n_samples=args.nsamples, seq_len=args.seqlen, seed=args.seed)
    overrides = {"damp_percent": args.damp_percent, "act_group_aware": args.act_group_aware}
    config = GPTQConfig(bits=args.bits, group_size=args.group_size, sym=True, true_sequential=True,
                        **{key: value for key, value in overrides.items() if value is not None})
    model = GPTQModel.load(str(model_dir), quantize_config=config, device="cpu")
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
