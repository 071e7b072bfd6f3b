"""The one interface every quantization algorithm implements (``Algorithm``), with defaults for what
an algorithm without settings of its own does not override."""
from __future__ import annotations

from typing import Any, Mapping

from torch import Tensor

from quantkit.fp8 import FloatGrid, FP8Tensor
from quantkit.gguf.record import GGUFTensor
from quantkit.gguf.types import TensorType
from quantkit.quant import QuantConfig, QuantizedTensor
from quantkit.stats import InputStats

# what a linear is rounded to: the uniform grid, a GGUF block type, or FP8 E4M3
Target = QuantConfig | TensorType | FloatGrid


class Algorithm:
    """An algorithm maps (weight [N, K] in float32, the statistics of the linear's calibration inputs,
    the target the format asks for, the recipe's values) to the linear's record: a QuantizedTensor on
    a QuantConfig's uniform grid, a GGUFTensor for a GGUF block type (formats ``gguf-*``) or an FP8Tensor
    for E4M3 (compressed-tensors ``weights: fp8``); only algorithms that ``solves_block_types`` are given
    the last two."""

    name: str
    solves_block_types = False

    def __call__(self, weight: Tensor, stats: InputStats, target: Target,
                 values: Mapping[str, Any]) -> QuantizedTensor | GGUFTensor | FP8Tensor:
        raise NotImplementedError

    def solve(self, weight: Tensor, stats: InputStats, target: Target,
              values: Mapping[str, Any]) -> tuple[QuantizedTensor | GGUFTensor | FP8Tensor, Tensor]:
        """The record and the weights [N, K] it rounded (its rounding point), from which block reconstruction
        starts: the weight itself for an algorithm that rounds each weight where it is; GPTQ's, compensated."""
        return self(weight, stats, target, values), weight

    def clips(self, values: Mapping[str, Any]) -> bool:
        """Whether it searches each group's range, which a ternary grid (scale = mean |w|) does not have."""
        return False

    def uniform_grid_settings(self, values: Mapping[str, Any]) -> tuple[str, ...]:
        """The recipe keys (``section.key``) turned on that act on the uniform grid only, which GGUF
        block types, whose scales llama.cpp's quantizer chooses, refuse."""
        return ()

    def act_order(self, values: Mapping[str, Any]) -> bool:
        """Whether the records it writes have their columns in act-order (a non-trivial g_idx): what it
        records as ``desc_act``."""
        return bool(self.recorded_settings(values).get("desc_act", False))

    def recorded_settings(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Its settings as keyword arguments of ``Format.quantization_config`` (what the artifact's
        config records of them); an algorithm that records none leaves the formats' defaults."""
        return {}
