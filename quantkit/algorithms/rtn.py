"""Round-to-nearest: every group's grid from its own min/max, each weight rounded independently
(``quantkit.quant.rtn_quantize``); on a GGUF block type, llama.cpp's own quantizer, the baseline the
solvers must beat. It has no settings."""
from __future__ import annotations

from quantkit.algorithms.base import Algorithm
from quantkit.gguf.record import GGUFTensor
from quantkit.quant import QuantConfig, rtn_quantize


class RTN(Algorithm):
    name = "rtn"
    solves_block_types = True

    def __call__(self, weight, stats, target, values):
        return rtn_quantize(weight, target) if isinstance(target, QuantConfig) else GGUFTensor.quantize(weight, target)
