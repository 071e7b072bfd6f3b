"""Quantize a MiniCPM checkpoint with Intel AutoRound (SignRound), as a peer for quantkit's low-bit methods.
Runs in its own venv:

    .venv-autoround/bin/python -m quantkit.eval.interop.autoround_quantize MODEL_DIR|default OUT \\
        --bits 2 --group-size 64 --nsamples 32 --seqlen 512 --seed 0 [--iters N] [--asym|--sym] [--best]

The recipe is AutoRound's own, as its command line sets it (``RECIPES`` in auto_round/cli/main.py of
auto-round 0.16.1): the default (``auto-round``) tunes each decoder layer for 200 sign-gradient steps on
128 samples x 2048 tokens in batches of 8, learning rate 1/iters, its min/max range tuning on, each layer
fed the previous quantized layers' outputs; ``--best`` (``auto-round-best``) takes 1000 steps on 512
samples, same 2048-token length and batch of 8, and AutoRound then raises the rate to 2/iters at 3 bits
or fewer (sign_round/config.py, ``_lr_for_bits``). Here the sample count and length are quantkit's
calibration rows instead (--nsamples x --seqlen, default 128 x 512; --best makes the count 512 unless
--nsamples is given): AutoRound calibrates on exactly those token rows, handed to it as [1, seqlen]
input_ids tensors, never re-tokenized. AutoRound masks the last token of each row out of its loss, and
out of attention, as it does with any dataset it is given as tokens.
Asymmetric by default (--sym for symmetric). On the CPU: no torch.compile, and its mixed precision (bf16,
its CPU default) only where the CPU multiplies bf16 in hardware: --dtype auto follows quantkit's
``compute_dtype: auto``; elsewhere bf16 is emulated many times slower and the layers are tuned in float32.
OUT is AutoRound's ``auto_gptq`` export with its zero points stored as GPTQ v2 (``checkpoint_format``
"gptq_v2", the zero itself): AutoRound's v1 packing stores zero - 1 and clamps a zero point of 0 to a
stored 0, read back as 1, so every group whose tuned zero point is 0 would be read a step off. Its codes
and scales are kept as it packed them; the zero points are AutoRound's own, taken from the tuned layers
(the export packs a copy: the model is held twice, which these model sizes afford). The source's config
files and tokenizer are adopted, and autoround_run.json records the settings, calibration fingerprint,
wall time, versions, and a check of the export as quantkit reads it against AutoRound's own
fake-quantized weights (how many groups differ, and by how much: none, once the zero points are v2).
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantkit  # noqa: F401  (registers model_type "minicpm" with transformers' Auto classes)
from quantkit.atomic import publish_dir, write_json
from quantkit.eval.interop.peer_cli import adopt_source_configs, calibration_of, model_dir_of, peer_parser

RUN_FILE = "autoround_run.json"
FORMAT = "auto_gptq"
CHECKPOINT_FORMAT = "gptq_v2"  # what the export's zero points are rewritten to: the zero point itself
# AutoRound's recipes (auto_round/cli/main.py, RECIPES): steps per layer, and samples; both tune in
# batches of 8 on 2048-token rows, which quantkit's calibration rows replace
RECIPES = {"default": {"iters": 200, "nsamples": 128}, "best": {"iters": 1000, "nsamples": 512}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = peer_parser(__doc__.splitlines()[0])
    parser.set_defaults(nsamples=None)  # the recipe's count unless given
    parser.add_argument("--iters", type=int, help="sign-gradient steps per layer; default: the recipe's")
    parser.add_argument("--best", action="store_true", help="AutoRound's auto-round-best recipe")
    grid = parser.add_mutually_exclusive_group()
    grid.add_argument("--asym", dest="sym", action="store_false", help="asymmetric grid (the default)")
    grid.add_argument("--sym", dest="sym", action="store_true", help="symmetric grid")
    parser.set_defaults(sym=False)
    parser.add_argument("--batch-size", type=int, default=8, help="rows per step (AutoRound's default 8)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="bfloat16: AutoRound's mixed precision; float32: none; auto: bfloat16 where the "
                             "CPU multiplies it in hardware")
    args = parser.parse_args(argv)
    args.recipe = "best" if args.best else "default"
    args.iters = RECIPES[args.recipe]["iters"] if args.iters is None else args.iters
    args.nsamples = RECIPES[args.recipe]["nsamples"] if args.nsamples is None else args.nsamples
    if args.dtype == "auto":
        from quantkit.stats import BF16_IN_HARDWARE

        args.dtype = "bfloat16" if BF16_IN_HARDWARE else "float32"
    return args


def own_weights(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Each quantized linear's fake-quantized weight, scales and zero points as AutoRound leaves them."""
    return {name: {"weight": module.weight.detach().float().clone(), "scale": module.scale.float(),
                   "zp": module.zp.float() if isinstance(module.zp, torch.Tensor) else torch.tensor(float(module.zp))}
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and getattr(module, "scale", None) is not None}


def store_zero_points_v2(checkpoint: Path, zero_points: dict[str, torch.Tensor], bits: int) -> None:
    """Rewrite every quantized linear's ``qzeros`` in ``checkpoint`` from AutoRound's own zero points
    ([out_features, groups] per linear name) as GPTQ v2 stores them, and say so in its config.json."""
    from safetensors.torch import load_file, save_file

    from quantkit.formats.gptq import ZERO_OFFSETS, pack_cols

    offset = ZERO_OFFSETS[CHECKPOINT_FORMAT]
    rewritten = set()
    for shard in sorted(checkpoint.glob("*.safetensors")):
        tensors = load_file(shard)
        for name, zero_point in zero_points.items():
            key = f"{name}.qzeros"
            if key in tensors:
                zeros = zero_point.reshape(zero_point.shape[0], -1).T.round().to(torch.int64) - offset
                packed = pack_cols(zeros, bits)
                if packed.shape != tensors[key].shape:
                    raise RuntimeError(f"{key}: AutoRound's zero points pack to {tuple(packed.shape)}, "
                                       f"its export holds {tuple(tensors[key].shape)}")
                tensors[key] = packed
                rewritten.add(name)
        save_file(tensors, shard, metadata={"format": "pt"})
    missing = sorted(set(zero_points) - rewritten)
    if missing:
        raise RuntimeError(f"{checkpoint}: no qzeros in the export for {missing[:3]} ({len(missing)} linears)")
    config_path = checkpoint / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["checkpoint_format"] = CHECKPOINT_FORMAT
    write_json(config_path, config)
    quantize_config = checkpoint / "quantize_config.json"
    if quantize_config.is_file():
        write_json(quantize_config, {**json.loads(quantize_config.read_text()), "checkpoint_format": CHECKPOINT_FORMAT})


def compare_export(artifact: Path, own: dict[str, dict[str, torch.Tensor]], group_size: int) -> dict:
    """How the export, dequantized by quantkit's reader, differs from AutoRound's own weights."""
    from quantkit.reader import ArtifactReader

    reader = ArtifactReader(artifact)
    read = {}
    for index in range(reader.num_layers):
        read |= reader.dequantized_layer(index)
    groups = differing = zero_zp = zero_zp_differing = 0
    worst = worst_elsewhere = 0.0
    for name, weights in own.items():
        theirs, ours = weights["weight"], read[f"{name}.weight"]
        out_features, in_features = theirs.shape
        # per (row, group): the largest gap, and whether it exceeds float rounding of a scale-sized step
        gap = torch.nn.functional.pad((ours - theirs).abs(), (0, -in_features % group_size))
        gap = gap.reshape(out_features, -1, group_size).amax(-1)
        off = gap > 1e-3 * weights["scale"].reshape(out_features, -1)
        zero = weights["zp"].reshape(out_features, -1) == 0 if weights["zp"].numel() > 1 else torch.zeros_like(off)
        groups += off.numel()
        differing += int(off.sum())
        zero_zp += int(zero.sum())
        zero_zp_differing += int((off & zero).sum())
        worst = max(worst, float(gap.max()))
        worst_elsewhere = max(worst_elsewhere, float(gap[~zero].max()))
    return {"linears": len(own), "groups": groups, "groups_differing": differing, "groups_zero_point_0": zero_zp,
            "groups_zero_point_0_differing": zero_zp_differing, "max_abs_difference": worst,
            "max_abs_difference_zero_point_not_0": worst_elsewhere}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir = model_dir_of(args)

    from auto_round import AutoRound

    started = time.perf_counter()
    calibration = calibration_of(args, model_dir)
    rows = [row[None] for row in calibration.input_ids]  # [1, seqlen] each: AutoRound's token-row input
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    autoround = AutoRound(model, tokenizer, scheme=f"W{args.bits}A16", bits=args.bits, group_size=args.group_size,
                          sym=args.sym, dataset=rows, iters=args.iters, nsamples=len(rows),
                          seqlen=calibration.seq_len, batch_size=args.batch_size, seed=args.seed,
                          device_map="cpu", enable_torch_compile=False, amp=args.dtype == "bfloat16",
                          low_cpu_mem_usage=False)

    staging = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    exported = staging / "autoround-export"
    # inplace=False packs a copy and leaves AutoRound's tuned layers (zero points, fake-quantized weights) in the model
    autoround.quantize_and_save(output_dir=str(exported), format=FORMAT, inplace=False)
    seconds = time.perf_counter() - started
    # AutoRound names its own subdirectory of output_dir (model name and grid): the one holding a config.json
    written = [path.parent for path in exported.rglob("config.json")]
    if len(written) != 1 or not written[0].resolve().is_relative_to(exported.resolve()):
        raise RuntimeError(f"{exported}: expected one exported checkpoint below it, found {written}")
    for path in written[0].iterdir():
        path.rename(staging / path.name)
    shutil.rmtree(exported)

    own = own_weights(autoround.model)
    store_zero_points_v2(staging, {name: weights["zp"] for name, weights in own.items()}, args.bits)
    adopt_source_configs(staging, model_dir)
    tuning = autoround.quantize_config
    record = {
        "settings": {"recipe": args.recipe, "bits": args.bits, "group_size": args.group_size, "sym": args.sym,
                     "iters": args.iters, "lr": tuning.lr, "minmax_lr": tuning.minmax_lr,
                     "enable_minmax_tuning": tuning.enable_minmax_tuning,
                     "enable_quanted_input": tuning.enable_quanted_input, "batch_size": args.batch_size,
                     "dtype": args.dtype, "device": "cpu", "torch_compile": False, "format": FORMAT,
                     "checkpoint_format": CHECKPOINT_FORMAT},
        "calibration": calibration.describe(),
        "seconds": round(seconds, 1),
        "versions": {name: __import__(name).__version__ for name in ("auto_round", "torch", "transformers")},
    }
    record["export_check"] = compare_export(staging, own, args.group_size)
    write_json(staging / RUN_FILE, record)
    publish_dir(staging, args.out)


if __name__ == "__main__":
    main()
