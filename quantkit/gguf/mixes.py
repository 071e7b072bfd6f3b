"""Which GGUF type each tensor gets for a requested file type: llama.cpp's choices, in one table.

For the float types every matrix takes the type (``convert_hf_to_gguf.py --outtype``). For the
block types the choices are ``llama-quantize``'s (``llama_tensor_get_type``, dense models):

- the output matrix (or the tied embedding serving as it) gets Q6_K, or Q8_0 in a Q8_0 file or
  when its rows are not whole blocks of the file's own type;
- the _M mixes give attn_v and ffn_down Q6_K in the layers ``use_more_bits`` picks (the first and
  last eighth, and every third layer between them); Q4_K_S gives the first four attn_v and the
  first eighth of ffn_down Q5_K;
- the ternary files keep the token embedding at Q4_K;
- a 256-block type that does not divide a tensor's rows falls back (Q4_K -> Q5_0, Q5_K -> Q5_1,
  Q6_K -> Q8_0, TQ1_0/TQ2_0 -> Q4_0; F16 if even that does not fit), as llama.cpp does.

Vectors (norms, rope factors) always stay F32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from gguf import LlamaFileType

from quantkit.gguf.names import LAYER_TENSOR_NAME
from quantkit.gguf.types import TYPES, TensorType

# (layer, number of layers) -> the type for that layer's tensor, or None for the mix's default
LayerRule = Callable[[int, int], "str | None"]


def use_more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _more_bits(type_name: str) -> LayerRule:
    return lambda layer, layers: type_name if use_more_bits(layer, layers) else None


@dataclass(frozen=True)
class Mix:
    file_type: LlamaFileType
    default: str  # type of every matrix no rule names
    rules: dict[str, LayerRule] = field(default_factory=dict)  # by GGUF tensor stem (attn_v, ffn_down)
    embedding: str | None = None  # token_embd's type when it is not also the output


MIXES: dict[str, Mix] = {
    "f32": Mix(LlamaFileType.ALL_F32, "f32"),
    "f16": Mix(LlamaFileType.MOSTLY_F16, "f16"),
    "bf16": Mix(LlamaFileType.MOSTLY_BF16, "bf16"),
    "q8_0": Mix(LlamaFileType.MOSTLY_Q8_0, "q8_0"),
    "q6_k": Mix(LlamaFileType.MOSTLY_Q6_K, "q6_k"),
    "q5_k_m": Mix(LlamaFileType.MOSTLY_Q5_K_M, "q5_k", {"attn_v": _more_bits("q6_k"), "ffn_down": _more_bits("q6_k")}),
    "q5_k_s": Mix(LlamaFileType.MOSTLY_Q5_K_S, "q5_k"),
    "q4_k_m": Mix(LlamaFileType.MOSTLY_Q4_K_M, "q4_k", {"attn_v": _more_bits("q6_k"), "ffn_down": _more_bits("q6_k")}),
    "q4_k_s": Mix(LlamaFileType.MOSTLY_Q4_K_S, "q4_k", {
        "attn_v": lambda layer, layers: "q5_k" if layer < 4 else None,
        "ffn_down": lambda layer, layers: "q5_k" if layer < layers // 8 else None,
    }),
    "q4_0": Mix(LlamaFileType.MOSTLY_Q4_0, "q4_0"),
    "q4_1": Mix(LlamaFileType.MOSTLY_Q4_1, "q4_1"),
    "tq2_0": Mix(LlamaFileType.MOSTLY_TQ2_0, "tq2_0", embedding="q4_k"),
    "tq1_0": Mix(LlamaFileType.MOSTLY_TQ1_0, "tq1_0", embedding="q4_k"),
}
FILE_TYPES: dict[str, LlamaFileType] = {name: mix.file_type for name, mix in MIXES.items()}
FLOAT_TYPES = ("f32", "f16", "bf16")
# llama-quantize's replacement for a 256-block type that does not divide a tensor's rows
BLOCK_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "tq2_0": "q4_0", "tq1_0": "q4_0"}


def _fitting(type_name: str, k: int) -> TensorType:
    if not TYPES[type_name].fits(k) and type_name in BLOCK_FALLBACK:
        type_name = BLOCK_FALLBACK[type_name]
    return TYPES[type_name] if TYPES[type_name].fits(k) else TYPES["f16"]


def choose_type(file_type: str, name: str, shape: tuple[int, ...], tied_embeddings: bool,
                num_layers: int) -> TensorType:
    """The type of GGUF tensor ``name`` (numpy shape ``shape``) in a ``file_type`` file."""
    mix = MIXES[file_type]
    if len(shape) == 1:
        return TYPES["f32"]
    if mix.default in FLOAT_TYPES:
        return TYPES[mix.default]
    k = shape[-1]
    if name == "output.weight" or (tied_embeddings and name == "token_embd.weight"):
        if mix.default == "q8_0" or k % TYPES[mix.default].block_size:
            return TYPES["q8_0"]
        return _fitting("q6_k", k)
    chosen = mix.embedding if name == "token_embd.weight" and mix.embedding else mix.default
    match = LAYER_TENSOR_NAME.fullmatch(name)
    if match and match[2] in mix.rules:
        chosen = mix.rules[match[2]](int(match[1]), num_layers) or chosen
    return _fitting(chosen, k)
