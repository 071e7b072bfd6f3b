"""CPM.cu's ``model_gptq.safetensors`` layout for one decoder layer (docs/formats.md, "CPM.cu").

CPM.cu runs one Marlin GEMM per projection it fuses: the parts listed in ``FUSIONS`` are
concatenated along the output dimension *before* the Marlin repack (gate before up, q, k, v in
that order); the other linears are packed alone. Each packed module stores ``qweight`` and
``scales`` in the Marlin layout (``quantkit.formats.marlin``); zeros and g_idx are dropped.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from quantkit.formats import marlin
from quantkit.formats.base import Format
from quantkit.formats.consumers import CPMCU, QUANTKIT
from quantkit.formats.marlin import marlin_tensors, read_marlin_tensors
from quantkit.models.layers import FUSIONS, LINEARS
from quantkit.quant import QuantizedTensor


def _packed_modules() -> dict[str, tuple[str, ...]]:
    """Stored module -> the linears it holds, in checkpoint order (qkv, o, gate_up, down)."""
    owner = {part: fused for fused, parts in FUSIONS.items() for part in parts}
    modules: dict[str, tuple[str, ...]] = {}
    for linear in LINEARS:
        module = owner.get(linear, linear)
        modules[module] = FUSIONS.get(module, (linear,))
    return modules


PACKED_MODULES = _packed_modules()


def _require_layer_keys(given: Mapping[str, object], what: str) -> None:
    missing = [name for name in LINEARS if name not in given]
    unexpected = sorted(set(given) - set(LINEARS))
    if missing or unexpected:
        raise ValueError(f"{what} must have exactly the layer-table linears {list(LINEARS)}; "
                         f"missing {missing}, unexpected {unexpected}")


def _require_layer_prefix(prefix: str) -> None:
    if prefix and not prefix.endswith("."):
        raise ValueError(f"prefix is a layer prefix such as 'model.layers.0.' (with the trailing dot), got {prefix!r}")


def _fuse(parts: dict[str, QuantizedTensor], module: str) -> QuantizedTensor:
    """One record whose output rows are the parts' rows, stacked in order."""
    if len(parts) == 1:
        return next(iter(parts.values()))
    first_name, first = next(iter(parts.items()))
    for name, qt in parts.items():
        if qt.config != first.config or qt.shape[1] != first.shape[1] or not torch.equal(qt.g_idx, first.g_idx):
            raise ValueError(f"{module}: cannot fuse {name} (K={qt.shape[1]}, {qt.config}) with {first_name} "
                             f"(K={first.shape[1]}, {first.config}): in_features, config and g_idx must agree")
    records = list(parts.values())
    return QuantizedTensor(
        codes=torch.cat([qt.codes for qt in records], dim=0),
        scales=torch.cat([qt.scales for qt in records], dim=1),
        zeros=torch.cat([qt.zeros for qt in records], dim=1),
        g_idx=first.g_idx,
        config=first.config,
    )


def cpmcu_layer_tensors(qts: Mapping[str, QuantizedTensor], prefix: str) -> dict[str, Tensor]:
    """The layer's CPM.cu tensors from one record per layer-table linear.

    ``prefix`` is the layer prefix as ``layer_prefix(i)`` gives it (``"model.layers.3."``).
    """
    _require_layer_keys(qts, "qts")
    _require_layer_prefix(prefix)
    tensors: dict[str, Tensor] = {}
    for module, parts in PACKED_MODULES.items():
        tensors.update(marlin_tensors(_fuse({name: qts[name] for name in parts}, module), prefix + module))
    return tensors


def read_cpmcu_layer(tensors: Mapping[str, Tensor], prefix: str, shapes: Mapping[str, tuple[int, int]],
                     group_size: int = 128) -> dict[str, tuple[Tensor, Tensor]]:
    """Inverse of ``cpmcu_layer_tensors``: linear -> (codes uint8 [N, K], scales fp16 [G, N]).

    ``shapes`` maps each layer-table linear to its weight shape (out_features, in_features);
    the fused tensors are split back by those output sizes. ``group_size`` is the checkpoint
    config's (CPM.cu's converter accepts only 128).
    """
    _require_layer_keys(shapes, "shapes")
    _require_layer_prefix(prefix)
    layer: dict[str, tuple[Tensor, Tensor]] = {}
    for module, parts in PACKED_MODULES.items():
        in_features = {shapes[name][1] for name in parts}
        if len(in_features) != 1:
            raise ValueError(f"{module}: fused parts {list(parts)} must share in_features, got "
                             f"{[shapes[name] for name in parts]}")
        widths = [shapes[name][0] for name in parts]
        codes, scales = read_marlin_tensors(tensors, prefix + module, in_features.pop(), sum(widths), group_size)
        for name, part_codes, part_scales in zip(parts, codes.split(widths, dim=0), scales.split(widths, dim=1)):
            layer[name] = (part_codes.contiguous(), part_scales.contiguous())
    return layer


class CPMcu(Format):
    name = "cpmcu"
    list_order = 40
    summary = "CPM.cu model_gptq.safetensors: fused qkv/gate_up Marlin tensors"
    suffixes = marlin.SUFFIXES
    weights_file = "model_gptq.safetensors"
    consumers = (CPMCU, QUANTKIT)
    draft_head_fc = "marlin"  # CPM.cu packs the fc alone, in Marlin's layout
    check = staticmethod(marlin.check_marlin)
    write_layer = staticmethod(cpmcu_layer_tensors)
    quantization_config = staticmethod(marlin.quantization_config)
    parse_config = staticmethod(marlin.parse_config)

    def read_layer(self, tensors, prefix, config, shapes):
        parts = read_cpmcu_layer(tensors, prefix, shapes, config.group_size)
        return {name: marlin.symmetric_record(codes, scales, config) for name, (codes, scales) in parts.items()}
