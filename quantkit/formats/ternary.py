"""quantkit's ternary checkpoint: BitCPM4-style weights t·s, t in {-1, 0, +1}, as two bit planes.

Per linear (K = in_features, N = out_features):

- ``qweight`` int32 [N, K/16]: word w of row n covers input channels 16w .. 16w+15. Bit j is set
  when channel 16w + j is +1, bit 16 + j when it is -1; neither when it is 0, never both.
- ``scales`` float16 [N, G]: the scale s of each group of ``group_size`` channels (G groups).

2 bits per weight plus the scales, like llama.cpp's TQ2_0, but with BitCPM's per-group absmean
scales (TQ2_0 has one max|w| scale per 256). Planes rather than 2-bit codes because a SIMD
kernel then needs no unpacking: it adds x into a + sum where the + mask is set and into a - sum
where the - mask is (two AVX-512 masked adds per 16 weights, quantkit/cpu_ops). Rows are
contiguous, so one output row's weights and scales are a single stream.

The record is the uniform grid's (``QuantConfig(2, g, sym=False, ternary=True)``: code t + 1, zero
point 1); writing and reading are exact inverses.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from quantkit.formats.base import Format, fetch_packed, tensor_key
from quantkit.quant import QuantConfig, QuantizedTensor, default_g_idx

QUANT_METHOD = "quantkit_ternary"
LANES = 16  # channels per word: one AVX-512 float vector
_PLUS = 1 << torch.arange(LANES, dtype=torch.int64)
_MINUS = _PLUS << LANES


def check_ternary(config: QuantConfig, in_features: int, out_features: int, desc_act: bool = False,
                  name: str = "") -> None:
    """Raise a ValueError naming ``name`` and every rule of the format this linear breaks."""
    rules = (
        ("a ternary grid (quant.ternary: true, bits 2, sym false)", config.ternary, f"ternary={config.ternary}"),
        ("no act-order", not desc_act, f"desc_act={desc_act}"),
        (f"K % {LANES} == 0", in_features % LANES == 0, f"in_features K={in_features}"),
    )
    broken = [f"{rule} ({found})" for rule, holds, found in rules if not holds]
    if broken:
        raise ValueError(f"{name or 'linear'}: cannot use the ternary format: " + "; ".join(broken))


def pack_planes(trits: Tensor) -> Tensor:
    """int8 [N, K] in {-1, 0, 1} -> int32 [N, K/16] bit planes."""
    n, k = trits.shape
    lanes = trits.reshape(n, k // LANES, LANES).to(torch.int64)
    words = ((lanes == 1) * _PLUS + (lanes == -1) * _MINUS).sum(dim=-1)
    return (words - (words >= 1 << 31) * (1 << 32)).to(torch.int32)  # two's complement of bit 31


def unpack_planes(words: Tensor) -> Tensor:
    """Inverse of ``pack_planes``: int32 [N, W] -> int8 [N, 16W]; a word with a channel in both planes
    is corrupt."""
    bits = words.to(torch.int64).unsqueeze(-1) & 0xFFFFFFFF
    plus, minus = (bits & _PLUS) != 0, (bits & _MINUS) != 0
    if bool((plus & minus).any()):
        raise ValueError("corrupt ternary weights: a channel is marked both +1 and -1")
    return (plus.to(torch.int8) - minus.to(torch.int8)).flatten(1)


def ternary_tensors(qt: QuantizedTensor, prefix: str) -> dict[str, Tensor]:
    """``{prefix}.qweight`` and ``{prefix}.scales`` for one linear (``prefix`` = its module name)."""
    n, k = qt.shape
    check_ternary(qt.config, k, n, name=prefix)
    if not torch.equal(qt.g_idx, default_g_idx(k, qt.config.group_size)):
        raise ValueError(f"{prefix or 'linear'}: the ternary format stores no g_idx; this record has an act-order one")
    if bool((qt.zeros != 1).any()):
        raise ValueError(f"{prefix or 'linear'}: ternary records have zero point 1 everywhere")
    return {tensor_key(prefix, "qweight"): pack_planes(qt.codes.to(torch.int8) - 1),
            tensor_key(prefix, "scales"): qt.scales.T.contiguous()}


def read_ternary_tensors(tensors: Mapping[str, Tensor], prefix: str, config: QuantConfig, in_features: int,
                         out_features: int) -> QuantizedTensor:
    """Exact inverse of ``ternary_tensors``."""
    k, n = in_features, out_features
    check_ternary(config, k, n, name=prefix)
    groups = config.num_groups(k)
    words = fetch_packed(tensors, tensor_key(prefix, "qweight"), torch.int32, (n, k // LANES), "ternary")
    scales = fetch_packed(tensors, tensor_key(prefix, "scales"), torch.float16, (n, groups), "ternary")
    codes = (unpack_planes(words) + 1).to(torch.uint8)
    return QuantizedTensor(codes, scales.T.contiguous(), torch.ones(groups, n, dtype=torch.uint8),
                           default_g_idx(k, config.group_size), config)


def quantization_config(config: QuantConfig, *, desc_act: bool = False, static_groups: bool = False,
                        damp_percent: float | None = None, quantizer: str | None = None) -> dict[str, Any]:
    """``config.json["quantization_config"]``; the formats' common keyword arguments that mean nothing
    here (static_groups, damp_percent) are accepted and left out."""
    check_ternary(config, LANES, 1, desc_act, "quantization_config")
    result: dict[str, Any] = {"quant_method": QUANT_METHOD, "bits": 2, "group_size": config.group_size,
                              "weights": "ternary", "scale": "absmean", "layout": "sign_planes_int32"}
    if quantizer is not None:
        result["meta"] = {"quantizer": [quantizer]}
    return result


def parse_quantization_config(d: Mapping[str, Any]) -> QuantConfig:
    if d.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"quant_method {d.get('quant_method')!r} is not {QUANT_METHOD!r}")
    if d.get("layout") != "sign_planes_int32":
        raise ValueError(f"ternary layout {d.get('layout')!r} is not supported; only 'sign_planes_int32' is")
    return QuantConfig(bits=2, group_size=d["group_size"], sym=False, ternary=True)


class Ternary(Format):
    name = "ternary"
    list_order = 50
    summary = "BitCPM4 ternary weights as +1/-1 bit planes with per-group scales (quantkit runtime)"
    suffixes = ("qweight", "scales")
    reads = ((QUANT_METHOD, None),)
    stored_layout = "ternary planes"  # the CPU kernel adds x under the planes' masks as stored
    check = staticmethod(check_ternary)
    write_linear = staticmethod(ternary_tensors)
    quantization_config = staticmethod(quantization_config)
    parse_config = staticmethod(parse_quantization_config)

    def read_linear(self, tensors, module, config, shape):
        return read_ternary_tensors(tensors, module, config, shape[1], shape[0])
