"""Writing a quantized EAGLE-3 head: its linears in a checkpoint format (gptq, marlin, cpmcu), everything
else as the format's consumers read it. ``quantkit.reader.load_head`` reads what this writes."""
from __future__ import annotations

from pathlib import Path

import torch

from quantkit.atomic import save_safetensors, write_json
from quantkit.formats import FORMATS
from quantkit.models.eagle3 import CONFIG_FILE, MIDLAYER, WEIGHTS_FILE, Eagle3Head


def quantized_head_tensors(head: Eagle3Head, records: dict, fmt: str) -> dict[str, torch.Tensor]:
    """A head's tensors with its linears as ``records`` (name -> QuantizedTensor) in format ``fmt``
    (gptq, marlin, cpmcu), everything else fp16, ``d2t`` int32 (and no ``t2d`` for CPM.cu, whose
    converter drops it)."""
    midlayer = {name.removeprefix(MIDLAYER): record for name, record in records.items() if name.startswith(MIDLAYER)}
    tensors = {**FORMATS[fmt].write_layer(midlayer, MIDLAYER),
               **FORMATS[FORMATS[fmt].draft_head_fc].write_layer({"fc": records["fc"]}, "")}
    quantized = {f"{name}.weight" for name in records}
    for name, tensor in head.state_dict().items():
        if name in quantized or (name == "t2d" and fmt == "cpmcu"):
            continue
        tensors[name] = tensor.to(torch.int32) if name == "d2t" else tensor if name == "t2d" else tensor.half()
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def save_quantized_head(head: Eagle3Head, records: dict, fmt: str, directory: str | Path) -> Path:
    """Write ``head`` with its linears as ``records`` in layout ``fmt`` (``quantized_head_tensors``) and a
    config.json whose quantization_config is the format's, with the LM head unquantized."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_safetensors(directory / WEIGHTS_FILE, quantized_head_tensors(head, records, fmt), metadata={"format": "pt"})
    grid = next(iter(records.values())).config
    write_json(directory / CONFIG_FILE, {**head.config.to_dict(head.target),
                                         "quantization_config": {**FORMATS[fmt].quantization_config(grid),
                                                                 "lm_head": False}})
    return directory
