"""MiniCPM state-dict keys <-> llama.cpp GGUF tensor names, and the q/k row order llama.cpp's rope
needs. The one table both directions read: GGUF import (``models.gguf_convert``) and export."""
from __future__ import annotations

import re

import torch

from quantkit.models.layers import DOWN, EMBEDDING, FINAL_NORM, GATE, K, LM_HEAD, O, Q, UP, V, layer_prefix

# GGUF tensor stems -> MiniCPM names; the per-layer ones are relative to model.layers.{i}.
GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": EMBEDDING.removesuffix(".weight"),
    "output_norm": FINAL_NORM.removesuffix(".weight"),
    "output": LM_HEAD.removesuffix(".weight"),
}
LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": Q, "attn_k": K, "attn_v": V, "attn_output": O,
    "ffn_gate": GATE, "ffn_up": UP, "ffn_down": DOWN,
}
LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GGUF_STEMS = {minicpm: stem for stem, minicpm in {**GLOBAL_TENSORS, **LAYER_TENSORS}.items()}
_MINICPM_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


def minicpm_name(gguf_name: str) -> str:
    """The MiniCPM state-dict key of a GGUF tensor; ValueError for a tensor we cannot place."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in GLOBAL_TENSORS and kind == "weight":
        return f"{GLOBAL_TENSORS[stem]}.weight"
    match = LAYER_TENSOR_NAME.fullmatch(gguf_name)
    if match and match[2] in LAYER_TENSORS:
        return f"{layer_prefix(int(match[1]))}{LAYER_TENSORS[match[2]]}.{match[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no MiniCPM counterpart")


def gguf_name(minicpm_key: str) -> str:
    """Inverse of ``minicpm_name``."""
    stem, _, kind = minicpm_key.rpartition(".")
    if stem in _GGUF_STEMS and kind == "weight":
        return f"{_GGUF_STEMS[stem]}.weight"
    match = _MINICPM_LAYER_KEY.fullmatch(minicpm_key)
    if match and match[2] in _GGUF_STEMS:
        return f"blk.{match[1]}.{_GGUF_STEMS[match[2]]}.{match[3]}"
    raise ValueError(f"MiniCPM tensor {minicpm_key!r} has no GGUF counterpart in llama.cpp's MiniCPM architecture")


def permute_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's q/k permutation: per head, rows [first half, second half] (rotate_half rope)
    -> interleaved pairs (GGML's normal rope)."""
    rows = weight.shape[0]
    return (weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def unpermute_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of ``permute_rows``: per head, rows [pairs (0,1),(2,3)…] -> [evens, odds]."""
    rows = weight.shape[0]
    return (weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))
