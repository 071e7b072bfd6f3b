"""Quantization algorithms, one module each, behind one signature.

An algorithm maps (weight [N, K] in float32, the statistics of the linear's calibration inputs,
QuantConfig, the recipe's settings) to a QuantizedTensor. Adding one is a module plus a line in
ALGORITHMS.
"""
from __future__ import annotations

from typing import Callable

from torch import Tensor

from quantkit.algorithms.awq import awq_quantize
from quantkit.algorithms.gptq import gptq_quantize
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.quant import QuantConfig, QuantizedTensor
from quantkit.stats import InputStats

Algorithm = Callable[[Tensor, InputStats, QuantConfig, dict], QuantizedTensor]

ALGORITHMS: dict[str, Algorithm] = {
    "rtn": lambda weight, stats, config, settings: rtn_quantize(weight, config),
    "awq": lambda weight, stats, config, settings: awq_quantize(weight, stats.hessian, config),
    "gptq": lambda weight, stats, config, settings: gptq_quantize(weight, stats.hessian, config, **settings["gptq"]),
}
