"""The command line every peer quantizer script shares, and quantkit's calibration rows for it, so
that each peer sees exactly the tokens quantkit's own methods see."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from transformers import AutoTokenizer

from quantkit import calib, zoo
from quantkit.atomic import refuse_existing, write_json


def peer_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("model_dir", help="unquantized MiniCPM checkpoint directory, or 'default'")
    parser.add_argument("out", type=Path, help="output directory (must not exist)")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--nsamples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--calibration", default="default", help="quantkit calibration source")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def model_dir_of(args: argparse.Namespace) -> Path:
    """The checkpoint to quantize; refuses a missing checkpoint or an existing output directory."""
    model_dir = zoo.ensure_model(zoo.DEFAULT_MODEL) if args.model_dir == "default" else Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json, not a checkpoint directory")
    refuse_existing(args.out)
    return model_dir


def calibration_of(args: argparse.Namespace, model_dir: Path) -> calib.CalibrationSet:
    return calib.calibration_set(AutoTokenizer.from_pretrained(model_dir), source=args.calibration,
                                 n_samples=args.nsamples, seq_len=args.seqlen, seed=args.seed)


def adopt_source_configs(staging: Path, model_dir: Path) -> None:
    """Give the peer's checkpoint in ``staging`` the source's own config files and tokenizer (MiniCPM's, not
    transformers' re-serialisation), keeping the quantization_config the peer wrote into its config.json."""
    quantization_config = json.loads((staging / "config.json").read_text())["quantization_config"]
    for source in model_dir.iterdir():
        if source.is_file() and not source.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(source, staging / source.name)
    config = json.loads((model_dir / "config.json").read_text())
    write_json(staging / "config.json", {**config, "quantization_config": quantization_config})
