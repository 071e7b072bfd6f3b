"""Quantization algorithms, one module each, behind one signature.

An algorithm maps (weight [N, K] in float32, the statistics of the linear's calibration inputs,
the target grid, the recipe's settings) to a record: a QuantizedTensor on a QuantConfig's uniform
grid, or a GGUFTensor for a GGUF block type (formats ``gguf-*``; only the algorithms in
SOLVES_BLOCK_TYPES can). Adding one is a module plus a line in ALGORITHMS.
"""
from __future__ import annotations

from typing import Callable

from torch import Tensor

from quantkit.algorithms.awq import awq_quantize
from quantkit.algorithms.gptq import gptq_quantize
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.gguf.record import GGUFTensor
from quantkit.gguf.types import TensorType
from quantkit.quant import QuantConfig, QuantizedTensor
from quantkit.stats import InputStats

Algorithm = Callable[[Tensor, InputStats, QuantConfig | TensorType, dict], QuantizedTensor | GGUFTensor]


def _round_to_nearest(weight: Tensor, target: QuantConfig | TensorType) -> QuantizedTensor | GGUFTensor:
    """RTN on the uniform grid; on a GGUF type, llama.cpp's own quantizer (the baseline GPTQ must beat)."""
    return rtn_quantize(weight, target) if isinstance(target, QuantConfig) else GGUFTensor.quantize(weight, target)


ALGORITHMS: dict[str, Algorithm] = {
    "rtn": lambda weight, stats, config, settings: _round_to_nearest(weight, config),
    "awq": lambda weight, stats, config, settings: awq_quantize(weight, stats.hessian, config),
    "gptq": lambda weight, stats, config, settings: gptq_quantize(weight, stats.hessian, config, **settings["gptq"]),
}
SOLVES_BLOCK_TYPES = ("rtn", "gptq")
