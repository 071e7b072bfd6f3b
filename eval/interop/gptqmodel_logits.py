"""What GPTQModel makes of a GPTQ checkpoint on the CPU: logits and decoded weights. Runs in the interop venv:

    .venv-interop/bin/python -m quantkit.eval.interop.gptqmodel_logits ARTIFACT --text-file F --out L.safetensors

--out writes ``input_ids`` int64 [T] (the artifact's tokenizer on the text, cut to --max-tokens) and
``logits`` float32 [T, vocab]; --weights-out writes every quantized linear's weight as GPTQModel
unpacks it (``<module>.weight`` [N, K], in --dtype). Both carry the GPTQModel kernels, dtype and
versions as metadata. check_gptqmodel.py compares them with quantkit's own reading of the artifact.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from quantkit.atomic import save_safetensors
from quantkit.eval.interop.gptqmodel_runtime import BACKEND, DTYPES, BaseQuantLinear, GPTQModel, kernel_names, versions


def token_ids(artifact: Path, text_file: Path, max_tokens: int) -> torch.Tensor:
    if not text_file.is_file():
        raise FileNotFoundError(f"text file not found: {text_file}")
    ids = AutoTokenizer.from_pretrained(artifact)(text_file.read_text(encoding="utf-8"))["input_ids"][:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"{text_file}: gives {len(ids)} token(s); need at least 2")
    return torch.tensor(ids, dtype=torch.int64)


@torch.inference_mode()
def decoded_weights(model) -> dict[str, torch.Tensor]:
    """Each quantized linear's weight [N, K] as GPTQModel's own unpacking (v1 zeros included) yields it."""
    return {f"{name}.weight": module.dequantize_weight().T.contiguous()
            for name, module in model.named_modules() if isinstance(module, BaseQuantLinear)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, help="GPTQ checkpoint directory")
    parser.add_argument("--text-file", type=Path, help="text to run (needed with --out)")
    parser.add_argument("--out", type=Path, help="write input ids and logits to this .safetensors file")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="activation dtype; bfloat16 is what GPTQModel picks on the CPU by itself")
    parser.add_argument("--backend", default=BACKEND.AUTO.value, help="GPTQModel backend name (default: auto)")
    parser.add_argument("--weights-out", type=Path, help="also write the decoded weights to this .safetensors file")
    args = parser.parse_args(argv)
    if not (args.artifact / "config.json").is_file():
        raise FileNotFoundError(f"{args.artifact}: no config.json, not a checkpoint directory")
    if args.out is None and args.weights_out is None:
        parser.error("nothing to do: give --out, --weights-out or both")
    if args.out is not None and args.text_file is None:
        parser.error("--out needs --text-file")

    ids = token_ids(args.artifact, args.text_file, args.max_tokens) if args.out else None
    model = GPTQModel.load(str(args.artifact), device="cpu", dtype=getattr(torch, args.dtype),
                           backend=BACKEND(args.backend))
    kernels = kernel_names(model.model)
    if not kernels:
        raise RuntimeError(f"{args.artifact}: GPTQModel loaded no quantized linear; is it a GPTQ checkpoint?")
    metadata = {"dtype": args.dtype, "backend": args.backend, "kernels": json.dumps(kernels), **versions()}
    if args.out:
        with torch.inference_mode():
            logits = model.model(ids[None]).logits[0].float()
        save_safetensors(args.out, {"input_ids": ids, "logits": logits}, metadata)
    if args.weights_out:
        save_safetensors(args.weights_out, decoded_weights(model.model), metadata)


if __name__ == "__main__":
    main()
