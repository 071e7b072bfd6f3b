"""Quantized records written as GGUF blocks without re-rounding, where a block type holds their grid.

A GPTQ/AWQ record with 32-wide symmetric groups in natural order *is* Q4_0 (4-bit, zero point 8:
w = (q − 8)·d) or Q8_0 (8-bit, zero point 128: w = (q − 128)·d), with the record's fp16 scale as
the block's d. Writing its codes directly keeps the solver's error compensation, which re-rounding
with llama.cpp's own rule (d from each block's largest weight) would throw away. This is how a
GPTQ-quantized model reaches llama.cpp unchanged: every build of llama.cpp reads the file.
A ``GGUFTensor`` (format ``gguf-*``) already is blocks: it is written as it is when its type is asked for.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from quantkit.fp8 import FP8Tensor
from quantkit.gguf.legacy import pack_nibbles
from quantkit.gguf.record import GGUFTensor
from quantkit.quant import QuantConfig, QuantizedTensor, default_g_idx

BLOCK = 32


def _q4_0(qt: QuantizedTensor) -> np.ndarray:
    codes = qt.codes.numpy().reshape(qt.shape[0], -1, BLOCK)
    return np.concatenate([_scale_bytes(qt), pack_nibbles(codes)], axis=-1).reshape(qt.shape[0], -1)


def _q8_0(qt: QuantizedTensor) -> np.ndarray:
    signed = (qt.codes.to(torch.int16) - 128).to(torch.int8).numpy().reshape(qt.shape[0], -1, BLOCK)
    return np.concatenate([_scale_bytes(qt), signed.view(np.uint8)], axis=-1).reshape(qt.shape[0], -1)


def _scale_bytes(qt: QuantizedTensor) -> np.ndarray:
    """The record's fp16 scales [G, N] as each row's per-block d bytes [N, G, 2]."""
    return qt.scales.T.contiguous().numpy().astype("<f2").view(np.uint8).reshape(qt.shape[0], -1, 2)


# GGUF type -> (the record grid it holds exactly, the record's zero point, the writer)
EXACT: dict[str, tuple[QuantConfig, int, Callable[[QuantizedTensor], np.ndarray]]] = {
    "q4_0": (QuantConfig(4, BLOCK, True), 8, _q4_0),
    "q8_0": (QuantConfig(8, BLOCK, True), 128, _q8_0),
}


def exact_blocks(qt: QuantizedTensor | GGUFTensor | FP8Tensor, type_name: str) -> np.ndarray | None:
    """The record as ``type_name`` blocks [N, row bytes] if that type holds its grid exactly, else None."""
    if isinstance(qt, GGUFTensor):
        return qt.data.numpy() if qt.type_name == type_name else None
    if not isinstance(qt, QuantizedTensor) or type_name not in EXACT:  # FP8 is on no GGUF grid
        return None
    config, zero, write = EXACT[type_name]
    if qt.config != config or not bool((qt.zeros == zero).all()):
        return None
    if not torch.equal(qt.g_idx, default_g_idx(qt.shape[1], BLOCK)):
        return None
    return write(qt)
