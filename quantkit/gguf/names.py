"""MiniCPM state-dict keys <-> llama.cpp GGUF tensor names, and the q/k row order llama.cpp's rope
needs. The one table both directions read: GGUF import (``gguf.importer``) and export."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

import torch

from quantkit.models.layers import DOWN, EMBEDDING, FINAL_NORM, GATE, LM_HEAD, O_PROJ, UP, K, Q, V

# GGUF tensor stems -> MiniCPM names; the per-layer ones are relative to model.layers.{i}.
GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": EMBEDDING.removesuffix(".weight"),
    "output_norm": FINAL_NORM.removesuffix(".weight"),
    "output": LM_HEAD.removesuffix(".weight"),
}
LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": Q, "attn_k": K, "attn_v": V, "attn_output": O_PROJ,
    "ffn_gate": GATE, "ffn_up": UP, "ffn_down": DOWN,
}
LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_MINICPM_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


@dataclass(frozen=True)
class _Naming:
    """One direction of the table: global stems, the per-layer pattern and stems, the layer format."""
    globals: dict[str, str]
    layer_pattern: re.Pattern
    layers: dict[str, str]
    layer_format: str  # .format(index, stem, kind)

    def translate(self, name: str, what: str) -> str:
        stem, _, kind = name.rpartition(".")
        if stem in self.globals and kind == "weight":
            return f"{self.globals[stem]}.weight"
        match = self.layer_pattern.fullmatch(name)
        if match and match[2] in self.layers:
            return self.layer_format.format(match[1], self.layers[match[2]], match[3])
        raise ValueError(f"{what} tensor {name!r} has no counterpart")


_TO_MINICPM = _Naming(GLOBAL_TENSORS, LAYER_TENSOR_NAME, LAYER_TENSORS, "model.layers.{}.{}.{}")
_TO_GGUF = _Naming({v: k for k, v in GLOBAL_TENSORS.items()}, _MINICPM_LAYER_KEY,
                   {v: k for k, v in LAYER_TENSORS.items()}, "blk.{}.{}.{}")


def minicpm_name(gguf_name: str) -> str:
    """The MiniCPM state-dict key of a GGUF tensor; ValueError for a tensor we cannot place."""
    return _TO_MINICPM.translate(gguf_name, "GGUF")


def gguf_name(minicpm_key: str) -> str:
    """Inverse of ``minicpm_name``: the tensor's name in llama.cpp's MiniCPM architecture."""
    return _TO_GGUF.translate(minicpm_key, "MiniCPM")


def permute_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's q/k permutation: per head, rows [first half, second half] (rotate_half rope)
    -> interleaved pairs (GGML's normal rope)."""
    return permuted_view(weight, n_heads).reshape(weight.shape)


def permuted_view(weight, n_heads: int):
    """``permute_rows`` without its copy, of a tensor or a NumPy array: a view [heads, rows / heads / 2,
    2, ...] whose elements in row-major order are the permuted weight's."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2)


def unpermute_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of ``permute_rows``: per head, rows [pairs (0,1),(2,3)…] -> [evens, odds]."""
    rows = weight.shape[0]
    return (weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def layer_table(values: Mapping[str, object]) -> tuple[list[str], list[list]]:
    """Values by decoder tensor GGUF name (blk.N.<stem>.weight) as one row per layer and one column per stem,
    in the order the stems first appear: headers and rows. Names outside the layers are left out."""
    layers: dict[int, dict[str, object]] = {}
    for name, value in values.items():
        if match := LAYER_TENSOR_NAME.fullmatch(name):
            layers.setdefault(int(match[1]), {})[match[2]] = value
    stems = list(dict.fromkeys(stem for row in layers.values() for stem in row))
    return ["layer", *stems], [[index, *(row.get(stem, "") for stem in stems)] for index, row in sorted(layers.items())]
