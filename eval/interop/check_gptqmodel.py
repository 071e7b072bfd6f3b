"""Does GPTQModel read a quantkit GPTQ checkpoint the way quantkit means it? Runs in quantkit's venv:

    python -m quantkit.eval.interop.check_gptqmodel ARTIFACT [--interop-python .venv-interop/bin/python]

It runs gptqmodel_logits.py in the GPTQModel venv (subprocesses), then compares with
quantkit.loading.load_model on the same artifact:
1. weights: every quantized linear as GPTQModel unpacks it must equal quantkit's dequantized weight
   bit for bit. GPTQModel decodes in float16 for this (the scales' own dtype: one correctly rounded
   product per weight on both sides); a bfloat16 load rounds the scales themselves.
2. logits on held-out text, GPTQModel in bfloat16 (its own CPU default) against quantkit's float32
   forward: max |Δlogit|, mean KL (float64) and top-1 agreement. The bound is quantkit's own
   bfloat16 forward of the same artifact, measured alongside (bfloat16 rounding alone costs that
   much), within LOGIT_TOLERANCE. float16
   activations are no option: on the default model, layer 11's down_proj output at position 0 is
   8.9e4 (the μP residual factor scale_depth/√L ≈ 0.26 then shrinks it), past float16's 65504,
   so every logit is NaN, in quantkit's float16 forward as in GPTQModel's.
Prints one JSON report; exits non-zero if a check fails.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from quantkit import calib
from quantkit.checkpoint import CheckpointReader
from quantkit.eval.kld import kl_divergence
from quantkit.loading import load_model

REPO = Path(__file__).resolve().parents[2]
DEFAULT_INTEROP_PYTHON = REPO / ".venv-interop" / "bin" / "python"
# GPTQModel 7.7's auto-selected CPU kernels (TorchAtenLinear, TorchFusedLinear) call
# aten::_weight_int4pack_mm_for_cpu, which rejects K % group_size != 0 (the default model's K=576
# at group 128) at the first forward; TorchLinear (dequantize, then matmul) reads any shape.
DEFAULT_BACKEND = "gptq_torch"
WEIGHT_DTYPE, LOGIT_DTYPE = "float16", "bfloat16"  # see the module docstring for why these two


@dataclass(frozen=True)
class Tolerance:
    """GPTQModel's deviation from the float32 reference, relative to quantkit's own bfloat16 one."""
    max_abs_logit_ratio: float
    mean_kl_ratio: float
    top1_drop: float


# Default model, 512 Austen tokens, GPTQModel bf16 vs quantkit bf16 deviation from float32
# (max |Δlogit|, mean KL, top-1): quantkit GPTQ W4 g128 artifact 1.30 vs 1.62, 1.42e-3 vs 1.33e-3,
# 0.957 vs 0.943; the same with 16 calibration rows 1.71 vs 1.08, 1.59e-3 vs 1.49e-3, 0.971 vs 0.975;
# GPTQModel's own W4 g128 artifact 2.29 vs 2.54, 1.48e-3 vs 1.35e-3, 0.977 vs 0.982.
LOGIT_TOLERANCE = Tolerance(max_abs_logit_ratio=2.5, mean_kl_ratio=2.0, top1_drop=0.03)


@dataclass(frozen=True)
class WeightCheck:
    linears: int
    mismatched_linears: list[str]
    max_abs_diff: float


@dataclass(frozen=True)
class LogitCheck:
    tokens: int  # positions scored for KL and top-1; max |Δlogit| is over every position
    max_abs_logit_diff: float
    mean_kl: float
    max_kl: float
    top1_agreement: float
    perplexity: float
    reference_perplexity: float


class RecordedLogits:
    """Stands in for a model whose logits for one token sequence were computed elsewhere."""

    def __init__(self, input_ids: torch.Tensor, logits: torch.Tensor):
        self.input_ids, self.logits = input_ids, logits

    def __call__(self, input_ids: torch.Tensor) -> SimpleNamespace:
        if not torch.equal(input_ids[0], self.input_ids):
            raise ValueError("asked for the logits of a token sequence other than the recorded one")
        return SimpleNamespace(logits=self.logits[None])


def run_gptqmodel(interop_python: Path, artifact: Path, out: Path, dtype: str, backend: str,
                  *options: str) -> dict[str, str]:
    """Run gptqmodel_logits in the interop venv, writing ``out``; returns the metadata it recorded."""
    if not interop_python.is_file():
        raise FileNotFoundError(f"interop venv python not found: {interop_python} (run `make interop` first)")
    command = [str(interop_python), "-m", "quantkit.eval.interop.gptqmodel_logits", str(artifact),
               "--dtype", dtype, "--backend", backend, *options]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode:
        raise RuntimeError(f"GPTQModel failed on {artifact} (exit {completed.returncode}):\n"
                           + completed.stderr[-4000:])
    with safe_open(str(out), framework="pt") as f:
        return f.metadata()


def quantized_linears(artifact: Path) -> set[str]:
    """``<module>.weight`` for every linear the checkpoint stores packed."""
    return {name.removesuffix(".qweight") + ".weight" for name in CheckpointReader(artifact).names
            if name.endswith(".qweight")}


def compare_weights(model, decoded: dict[str, torch.Tensor], expected: set[str]) -> WeightCheck:
    """``decoded`` must cover exactly the ``expected`` linears and equal quantkit's weights bit for bit."""
    if set(decoded) != expected:
        raise ValueError(f"GPTQModel decoded {len(decoded)} linears, the checkpoint packs {len(expected)}: "
                         f"extra {sorted(set(decoded) - expected)[:3]}, missing {sorted(expected - set(decoded))[:3]}")
    reference = model.state_dict()
    mismatched, worst = [], 0.0
    for name, weight in decoded.items():
        expected = reference[name].to(weight.dtype)
        if expected.shape != weight.shape:
            raise ValueError(f"{name}: GPTQModel shape {tuple(weight.shape)}, quantkit {tuple(expected.shape)}")
        if not torch.equal(expected, weight):
            mismatched.append(name)
            worst = max(worst, (expected.float() - weight.float()).abs().max().item())
    return WeightCheck(len(decoded), mismatched, worst)


def compare_logits(reference: torch.Tensor, logits: torch.Tensor, input_ids: torch.Tensor) -> LogitCheck:
    result = kl_divergence(RecordedLogits(input_ids, logits), RecordedLogits(input_ids, reference), input_ids,
                           window=len(input_ids))
    return LogitCheck(result.tokens, (logits - reference).abs().max().item(), result.mean_kl,
                      result.max_kl, result.top1_agreement, result.perplexity, result.reference_perplexity)


@torch.inference_mode()
def forward_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids[None]).logits[0].float()


def failures(weights: WeightCheck, gptqmodel: LogitCheck, floor: LogitCheck, tolerance: Tolerance) -> list[str]:
    """What is out of bounds; written as `not (x <= bound)` so that NaN fails too."""
    problems = []
    if weights.mismatched_linears:
        problems.append(f"{len(weights.mismatched_linears)} linears decode differently "
                        f"(max |Δw| {weights.max_abs_diff:.3g}), e.g. {weights.mismatched_linears[:3]}")
    bound = tolerance.max_abs_logit_ratio * floor.max_abs_logit_diff
    if not gptqmodel.max_abs_logit_diff <= bound:
        problems.append(f"max |Δlogit| {gptqmodel.max_abs_logit_diff:.4g} exceeds {bound:.4g}")
    bound = tolerance.mean_kl_ratio * floor.mean_kl
    if not gptqmodel.mean_kl <= bound:
        problems.append(f"mean KL {gptqmodel.mean_kl:.3g} exceeds {bound:.3g}")
    bound = floor.top1_agreement - tolerance.top1_drop
    if not gptqmodel.top1_agreement >= bound:
        problems.append(f"top-1 agreement {gptqmodel.top1_agreement:.4f} is below {bound:.4f}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, help="GPTQ checkpoint directory (quantkit's, or any quantkit loads)")
    parser.add_argument("--interop-python", type=Path, default=DEFAULT_INTEROP_PYTHON)
    parser.add_argument("--data", default="austen", help="held-out set name or local text file")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--backend", default=DEFAULT_BACKEND, help="GPTQModel backend")
    args = parser.parse_args(argv)
    if not (args.artifact / "config.json").is_file():
        raise FileNotFoundError(f"{args.artifact}: no config.json, not a checkpoint directory")

    with tempfile.TemporaryDirectory(prefix="quantkit-interop-") as scratch:
        scratch = Path(scratch)
        text_file, weights_file, logits_file = (scratch / name for name in
                                                ("text.txt", "weights.safetensors", "logits.safetensors"))
        text_file.write_text("\n\n".join(calib.load_documents(args.data)), encoding="utf-8")
        weight_run = run_gptqmodel(args.interop_python, args.artifact, weights_file, WEIGHT_DTYPE, args.backend,
                                   "--weights-out", str(weights_file))
        logit_run = run_gptqmodel(args.interop_python, args.artifact, logits_file, LOGIT_DTYPE, args.backend,
                                  "--out", str(logits_file), "--text-file", str(text_file),
                                  "--max-tokens", str(args.max_tokens))
        model = load_model(args.artifact)
        weights = compare_weights(model, load_file(weights_file), quantized_linears(args.artifact))
        recorded = load_file(logits_file)
    input_ids = recorded["input_ids"]
    reference = forward_logits(model, input_ids)
    gptqmodel = compare_logits(reference, recorded["logits"], input_ids)
    floor = compare_logits(reference, forward_logits(model.to(torch.bfloat16), input_ids), input_ids)
    problems = failures(weights, gptqmodel, floor, LOGIT_TOLERANCE)
    report = {"artifact": str(args.artifact), "gptqmodel_runs": {"weights": weight_run, "logits": logit_run},
              "weights": asdict(weights), "logits_gptqmodel_bf16": asdict(gptqmodel),
              "logits_quantkit_bf16": asdict(floor), "tolerance": asdict(LOGIT_TOLERANCE), "failures": problems}
    print(json.dumps(report, indent=2, sort_keys=True))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
