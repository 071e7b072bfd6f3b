"""AutoAWQ GEMM layout (``version: "gemm"``), the AWQ checkpoints vLLM and transformers load.

Per linear (K = in_features, N = out_features; see docs/formats.md, "AutoAWQ GEMM"):

- ``qweight`` int32 [K, N/8]: the codes as a [K, N] matrix packed along N, eight per word;
  nibble i of word c holds column ``8c + AWQ_ORDER[i]``.
- ``qzeros`` int32 [G, N/8]: the true zero points packed the same way (no GPTQ −1 offset).
- ``scales`` fp16 [G, N].

Groups run in natural channel order and must tile K exactly (AutoAWQ reshapes K into groups; vLLM
checks ``K % group_size``). Only 4-bit. A symmetric record is written with its zero points (all 8)
and ``zero_point: false``, as GPTQModel does: AWQ kernels that read qzeros and vLLM's awq_marlin,
which then uses the uint4b8 type, dequantize it identically.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from quantkit.formats import gptq
from quantkit.formats.base import Format, fetch_packed, tensor_key
from quantkit.formats.consumers import QUANTKIT, SGLANG, TRANSFORMERS, VLLM
from quantkit.formats.marlin import NIBBLE_INTERLEAVE
from quantkit.quant import QuantConfig, QuantizedTensor, default_g_idx

BITS = 4
PACK = 32 // BITS
# AutoAWQ's AWQ_ORDER: the same nibble interleave as Marlin's, so one mask yields an fp16 pair.
AWQ_ORDER = NIBBLE_INTERLEAVE
TENSOR_NAMES = ("qweight", "qzeros", "scales")


def check_awq(config: QuantConfig, in_features: int, out_features: int, desc_act: bool = False,
              name: str = "") -> None:
    """Raise a ValueError naming ``name`` and every AWQ GEMM rule this linear breaks (before quantizing)."""
    group = in_features if config.group_size == -1 else config.group_size
    rules = (
        ("4-bit only", config.bits == BITS, f"bits={config.bits}"),
        ("no act-order", not desc_act, f"desc_act={desc_act}"),
        (f"N % {PACK} == 0", out_features % PACK == 0, f"out_features N={out_features}"),
        ("K a whole number of groups", in_features % group == 0,
         f"in_features K={in_features}, group_size={config.group_size}; try quant.group_size=64 or format=gptq"),
    )
    broken = [f"{rule} ({found})" for rule, holds, found in rules if not holds]
    if broken:
        raise ValueError(f"{name or 'linear'}: cannot use the AWQ GEMM format: " + "; ".join(broken))


def pack_awq(values: Tensor) -> Tensor:
    """uint8 [R, N] (values 0..15) -> int32 [R, N/8] in AWQ nibble order."""
    rows, cols = values.shape
    interleaved = values.reshape(rows, cols // PACK, PACK)[..., list(AWQ_ORDER)].reshape(rows, cols)
    return gptq.pack_cols(interleaved, BITS)


def unpack_awq(words: Tensor) -> Tensor:
    """Inverse of ``pack_awq``: int32 [R, W] -> uint8 [R, 8W]."""
    interleaved = gptq.unpack_cols(words, BITS)
    rows, cols = interleaved.shape
    values = torch.empty_like(interleaved).reshape(rows, cols // PACK, PACK)
    values[..., list(AWQ_ORDER)] = interleaved.reshape(rows, cols // PACK, PACK)
    return values.reshape(rows, cols)


def awq_tensors(qt: QuantizedTensor, prefix: str) -> dict[str, Tensor]:
    """``{prefix}.qweight/.qzeros/.scales`` for one linear (``prefix`` = its module name)."""
    n, k = qt.shape
    check_awq(qt.config, k, n, name=prefix)
    if not torch.equal(qt.g_idx, default_g_idx(k, qt.config.group_size)):
        raise ValueError(f"{prefix or 'linear'}: AWQ stores no g_idx; this record has an act-order one")
    return {
        tensor_key(prefix, "qweight"): pack_awq(qt.codes.T.contiguous()),
        tensor_key(prefix, "qzeros"): pack_awq(qt.zeros),
        tensor_key(prefix, "scales"): qt.scales.contiguous(),
    }


def read_awq_tensors(tensors: Mapping[str, Tensor], prefix: str, config: QuantConfig, in_features: int,
                     out_features: int) -> QuantizedTensor:
    """Exact inverse of ``awq_tensors``."""
    k, n = in_features, out_features
    check_awq(config, k, n, name=prefix)
    groups = config.num_groups(k)
    qweight = fetch_packed(tensors, tensor_key(prefix, "qweight"), torch.int32, (k, n // PACK), "AWQ")
    qzeros = fetch_packed(tensors, tensor_key(prefix, "qzeros"), torch.int32, (groups, n // PACK), "AWQ")
    scales = fetch_packed(tensors, tensor_key(prefix, "scales"), torch.float16, (groups, n), "AWQ")
    return QuantizedTensor(unpack_awq(qweight).T.contiguous(), scales.contiguous(), unpack_awq(qzeros),
                           default_g_idx(k, config.group_size), config)


def quantization_config(config: QuantConfig, *, desc_act: bool = False, static_groups: bool = False,
                        damp_percent: float | None = None, quantizer: str | None = None) -> dict[str, Any]:
    """``config.json["quantization_config"]`` in the transformers spelling vLLM's awq/awq_marlin read.

    ``static_groups`` and ``damp_percent`` are accepted for the formats' common signature (AWQ has
    neither); ``quantizer`` is recorded as GPTQModel records it.
    """
    if config.bits != BITS or desc_act:
        raise ValueError(f"the AWQ GEMM format holds 4-bit weights without act-order, got bits={config.bits}, "
                         f"desc_act={desc_act}")
    result: dict[str, Any] = {"quant_method": "awq", "version": "gemm", "bits": BITS,
                              "group_size": config.group_size, "zero_point": not config.sym,
                              "modules_to_not_convert": None}
    if quantizer is not None:
        result["meta"] = {"quantizer": [quantizer]}
    return result


def parse_quantization_config(d: Mapping[str, Any]) -> QuantConfig:
    """QuantConfig of an AWQ GEMM quantization config (transformers or AutoAWQ key spellings)."""
    if d.get("quant_method") != "awq":
        raise ValueError(f"quant_method {d.get('quant_method')!r} is not 'awq'")
    version = str(d.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported; only 'gemm' is")
    bits = d.get("bits", d.get("w_bit"))
    group_size = d.get("group_size", d.get("q_group_size"))
    if bits is None or group_size is None or "zero_point" not in d:
        raise ValueError("AWQ quantization config needs bits (w_bit), group_size (q_group_size) and zero_point")
    if d.get("modules_to_not_convert"):
        raise ValueError(f"modules_to_not_convert {d['modules_to_not_convert']!r} is not supported")
    return QuantConfig(bits=bits, group_size=group_size, sym=not d["zero_point"])


class AWQ(Format):
    name = "awq"
    list_order = 20
    summary = "AutoAWQ GEMM checkpoint (vLLM awq/awq_marlin, transformers)"
    suffixes = TENSOR_NAMES
    reads = (("awq", None),)
    consumers = (TRANSFORMERS, VLLM, SGLANG, QUANTKIT)
    stored_layout = "awq"  # Triton's W4A16 kernel reads AutoAWQ's packing as it is
    check = staticmethod(check_awq)
    write_linear = staticmethod(awq_tensors)
    quantization_config = staticmethod(quantization_config)
    parse_config = staticmethod(parse_quantization_config)

    def read_linear(self, tensors, module, config, shape):
        return read_awq_tensors(tensors, module, config, shape[1], shape[0])
