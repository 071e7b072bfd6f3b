"""Quantized records written as GGUF blocks without re-rounding, where a block type holds their grid.

A GPTQ/AWQ record with symmetric groups of 32 (or of a multiple of 32) in natural order *is* Q4_0 (4-bit,
zero point 8: w = (q − 8)·d) or Q8_0 (8-bit, zero point 128: w = (q − 128)·d), with the record's fp16
scale as the d of each 32-block of its group. Writing its codes directly keeps the solver's error
compensation, which re-rounding with llama.cpp's own rule (d from each block's largest weight) would throw
away. This is how a GPTQ-quantized model reaches llama.cpp unchanged: every build of llama.cpp reads the file.
A ``GGUFTensor`` (format ``gguf-*``) already is blocks: it is written as it is when its type is asked for.
"""
from __future__ import annotations

from dataclasses import replace
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


def _group_size(qt: QuantizedTensor) -> int:
    return qt.config.group_size if qt.config.group_size > 0 else qt.shape[1]


def _scale_bytes(qt: QuantizedTensor) -> np.ndarray:
    """The record's fp16 scales [G, N] as each row's per-block d bytes [N, K / 32, 2]: a group's scale for
    each of its 32-blocks (a ragged last group, K = 576 in groups of 128, has fewer)."""
    scales = qt.scales[torch.arange(qt.shape[1] // BLOCK) * BLOCK // _group_size(qt)]
    return scales.T.contiguous().numpy().astype("<f2").view(np.uint8).reshape(qt.shape[0], -1, 2)


# GGUF type -> (the record grid it holds exactly, in groups of 32 or a multiple, the record's zero point, the writer)
EXACT: dict[str, tuple[QuantConfig, int, Callable[[QuantizedTensor], np.ndarray]]] = {
    "q4_0": (QuantConfig(4, BLOCK, True), 8, _q4_0),
    "q8_0": (QuantConfig(8, BLOCK, True), 128, _q8_0),
}


def holds_exactly(qt: QuantizedTensor | GGUFTensor | FP8Tensor, type_name: str) -> bool:
    """Whether ``type_name``'s blocks hold the record's grid exactly (``exact_blocks`` then writes them)."""
    if isinstance(qt, GGUFTensor):
        return qt.type_name == type_name
    if not isinstance(qt, QuantizedTensor) or type_name not in EXACT:  # FP8 is on no GGUF grid
        return False
    config, zero, _ = EXACT[type_name]
    group = _group_size(qt)
    if group % BLOCK or qt.shape[1] % BLOCK or qt.config != replace(config, group_size=qt.config.group_size):
        return False
    return bool((qt.zeros == zero).all()) and torch.equal(qt.g_idx, default_g_idx(qt.shape[1], group))


def exact_blocks(qt: QuantizedTensor | GGUFTensor | FP8Tensor, type_name: str) -> np.ndarray | None:
    """The record as ``type_name`` blocks [N, row bytes] if that type holds its grid exactly, else None."""
    if not holds_exactly(qt, type_name):
        return None
    return qt.data.numpy() if isinstance(qt, GGUFTensor) else EXACT[type_name][2](qt)
