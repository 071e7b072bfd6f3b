"""Round-to-nearest: every group's grid from its own min/max, each weight rounded independently
(``quantkit.quant.rtn_quantize``); on a GGUF block type, llama.cpp's own quantizer; on FP8, E4M3 under
min/max scales (llm-compressor's FP8): the baselines the solvers must beat. It has no settings."""
from __future__ import annotations

from quantkit.algorithms.base import Algorithm
from quantkit.fp8 import FloatGrid, FP8Tensor
from quantkit.gguf.record import GGUFTensor
from quantkit.gguf.types import TensorType
from quantkit.quant import QuantConfig, rtn_quantize

# the kind of target -> its round-to-nearest quantizer
QUANTIZERS = {QuantConfig: rtn_quantize, TensorType: GGUFTensor.quantize, FloatGrid: FP8Tensor.quantize}


class RTN(Algorithm):
    name = "rtn"
    solves_block_types = True

    def __call__(self, weight, stats, target, values):
        kind = next(kind for kind in QUANTIZERS if isinstance(target, kind))
        return QUANTIZERS[kind](weight, target)
