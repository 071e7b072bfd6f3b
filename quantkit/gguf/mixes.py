"""Which GGUF type each tensor gets for a requested file type: llama.cpp's choices, in one table.

For the float types every matrix takes the type (``convert_hf_to_gguf.py --outtype``). For the
block types the choices are ``llama-quantize``'s for dense models (``llama_tensor_get_type`` of the
pinned llama.cpp): a file type names a default type, and per tensor stem (attn_v, ffn_down, ...) a rule
may pick another from where the tensor sits (``Place``: its layer, the model's grouped-query ratio,
whether the file is quantized with importance statistics). For example:

- the output matrix (or the tied embedding serving as it) gets Q6_K (Q5_K in the IQ1/IQ2 files), or
  Q8_0 in a Q8_0 file or when its rows are not whole blocks of the file's own type;
- the _M mixes give attn_v and ffn_down more bits in the layers ``use_more_bits`` picks (the first
  and last eighth, and every third layer between them); Q2_K, Q3_K and the IQ files raise attn_v,
  attn_output and the first ffn_down layers, more so where GQA shares one V among four or more heads;
- a type whose blocks do not divide a tensor's rows falls back (``BLOCK_FALLBACK``: the 256-block
  IQ types -> IQ4_NL, Q2_K/Q3_K/ternary -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; F16 if even
  that does not fit), as llama.cpp does.

Vectors (norms, rope factors) always stay F32. The IQ1/IQ2/IQ3_XXS types (and Q2_K in a Q2_K_S file)
are refused without importance statistics, as llama-quantize refuses them (``needs_imatrix``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from gguf import LlamaFileType

from quantkit.gguf.names import LAYER_TENSOR_NAME
from quantkit.gguf.types import TYPES, TensorType


@dataclass(frozen=True)
class Place:
    """Where a layer's matrix sits, as llama.cpp's rules read it."""

    layer: int
    layers: int
    gqa: int  # query heads per key/value head (llama.cpp's n_gqa)
    imatrix: bool  # the file is quantized with importance statistics


@dataclass(frozen=True)
class Model:
    """What the rules read of the model a file is made for."""

    layers: int
    gqa: int
    tied_embeddings: bool

    @classmethod
    def of(cls, config) -> Model:
        return cls(config.num_hidden_layers, config.num_attention_heads // config.num_key_value_heads,
                   bool(config.tie_word_embeddings))


# a layer's tensor -> the type its stem's rule gives it there, or None for the mix's default
Rule = Callable[[Place], "str | None"]


def use_more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _more_bits(type_name: str) -> Rule:
    return lambda at: type_name if use_more_bits(at.layer, at.layers) else None


def _first(fraction: int, type_name: str) -> Rule:
    """``type_name`` in the first 1/``fraction`` of the layers."""
    return lambda at: type_name if at.layer < at.layers // fraction else None


def _with_gqa(type_name: str, otherwise: str | None = None) -> Rule:
    """``type_name`` where four or more query heads share each key/value head, else ``otherwise``."""
    return lambda at: type_name if at.gqa >= 4 else otherwise


def _always(type_name: str) -> Rule:
    return lambda at: type_name


def _very_low_bits(small: str, attn_output: str | None = None) -> dict[str, Rule]:
    """The IQ1/IQ2 files: attn_v Q4_K under GQA (else ``small``), the first eighth of ffn_down ``small``."""
    rules = {"attn_v": _with_gqa("q4_k", small), "ffn_down": _first(8, small)}
    return rules | ({"attn_output": _always(attn_output)} if attn_output else {})


def _with_imatrix(rule: Rule) -> Rule:
    """``rule`` where the file is quantized with importance statistics, else the default."""
    return lambda at: rule(at) if at.imatrix else None


def _without_imatrix(rule: Rule) -> Rule:
    """``rule`` where the file is quantized without importance statistics, else the default."""
    return lambda at: None if at.imatrix else rule(at)


# the IQ4 files: attn_v Q5_K under GQA; without an imatrix, the first eighth of ffn_down Q5_K
_IQ4_RULES = {"attn_v": _with_gqa("q5_k"), "ffn_down": _without_imatrix(_first(8, "q5_k"))}


def _middle(type_name: str) -> Rule:
    """``type_name`` outside the first and last eighth of the layers."""
    return lambda at: type_name if at.layers // 8 <= at.layer < 7 * at.layers // 8 else None


@dataclass(frozen=True)
class Mix:
    file_type: LlamaFileType
    default: str  # type of every matrix no rule names
    rules: dict[str, Rule] = field(default_factory=dict)  # by GGUF tensor stem (attn_v, ffn_down)
    embedding: str | None = None  # token_embd's type when it is not also the output
    output: str = "q6_k"  # the output's (or tied embedding's) type where its rows are whole blocks


MIXES: dict[str, Mix] = {
    "f32": Mix(LlamaFileType.ALL_F32, "f32"),
    "f16": Mix(LlamaFileType.MOSTLY_F16, "f16"),
    "bf16": Mix(LlamaFileType.MOSTLY_BF16, "bf16"),
    "q8_0": Mix(LlamaFileType.MOSTLY_Q8_0, "q8_0", output="q8_0"),
    "q6_k": Mix(LlamaFileType.MOSTLY_Q6_K, "q6_k"),
    "q5_k_m": Mix(LlamaFileType.MOSTLY_Q5_K_M, "q5_k", {"attn_v": _more_bits("q6_k"), "ffn_down": _more_bits("q6_k")}),
    "q5_k_s": Mix(LlamaFileType.MOSTLY_Q5_K_S, "q5_k"),
    "q5_0": Mix(LlamaFileType.MOSTLY_Q5_0, "q5_0", {"ffn_down": _with_imatrix(_first(8, "q5_1"))}),
    "q5_1": Mix(LlamaFileType.MOSTLY_Q5_1, "q5_1"),
    "q4_k_m": Mix(LlamaFileType.MOSTLY_Q4_K_M, "q4_k", {"attn_v": _more_bits("q6_k"), "ffn_down": _more_bits("q6_k")}),
    "q4_k_s": Mix(LlamaFileType.MOSTLY_Q4_K_S, "q4_k", {"attn_v": lambda at: "q5_k" if at.layer < 4 else None,
                                                        "ffn_down": _first(8, "q5_k")}),
    "q4_0": Mix(LlamaFileType.MOSTLY_Q4_0, "q4_0", {"ffn_down": _with_imatrix(_first(8, "q4_1"))}),
    "q4_1": Mix(LlamaFileType.MOSTLY_Q4_1, "q4_1"),
    "iq4_xs": Mix(LlamaFileType.MOSTLY_IQ4_XS, "iq4_xs", _IQ4_RULES),
    "iq4_nl": Mix(LlamaFileType.MOSTLY_IQ4_NL, "iq4_nl", _IQ4_RULES),
    "q3_k_l": Mix(LlamaFileType.MOSTLY_Q3_K_L, "q3_k", {
        "attn_v": _always("q5_k"), "ffn_down": _always("q5_k"), "attn_output": _always("q5_k")}),
    "q3_k_m": Mix(LlamaFileType.MOSTLY_Q3_K_M, "q3_k", {
        "attn_v": lambda at: "q5_k" if at.layer < 2 else "q4_k",
        "ffn_down": lambda at: "q5_k" if at.layer < at.layers // 16 else "q4_k",
        "attn_output": _always("q4_k")}),
    "q3_k_s": Mix(LlamaFileType.MOSTLY_Q3_K_S, "q3_k"),
    "iq3_m": Mix(LlamaFileType.MOSTLY_IQ3_M, "iq3_s", {
        "attn_v": _always("q4_k"), "ffn_down": _first(8, "q4_k"), "attn_output": _always("q4_k")}),
    "iq3_s": Mix(LlamaFileType.MOSTLY_IQ3_S, "iq3_s", {"attn_v": _with_gqa("q4_k")}),
    "iq3_xs": Mix(LlamaFileType.MOSTLY_IQ3_XS, "iq3_s", {
        "attn_v": _with_gqa("q4_k"), "attn_k": _always("iq3_xxs"), "attn_q": _always("iq3_xxs"),
        "ffn_gate": _middle("iq3_xxs"), "ffn_up": _middle("iq3_xxs")}),
    "iq3_xxs": Mix(LlamaFileType.MOSTLY_IQ3_XXS, "iq3_xxs", {
        "attn_v": lambda at: "q4_k" if at.gqa >= 4 else "iq3_xxs" if at.imatrix else "iq3_s",
        "attn_k": _always("iq2_s"), "attn_q": _always("iq2_s"),
        "ffn_down": lambda at: None if at.imatrix else "q4_k" if at.layer < at.layers // 8 else "q3_k",
        "attn_output": _always("iq3_s")}, embedding="iq3_s", output="q5_k"),
    "q2_k": Mix(LlamaFileType.MOSTLY_Q2_K, "q2_k", {
        "attn_v": _with_gqa("q4_k", "q3_k"), "ffn_down": _always("q3_k"), "attn_output": _always("q3_k")}),
    "q2_k_s": Mix(LlamaFileType.MOSTLY_Q2_K_S, "q2_k", {"attn_v": _with_gqa("q4_k"), "ffn_down": _first(8, "q4_k")}),
    "iq2_m": Mix(LlamaFileType.MOSTLY_IQ2_M, "iq2_s", _very_low_bits("iq3_s", "iq3_s"), embedding="iq3_s",
                 output="q5_k"),
    "iq2_s": Mix(LlamaFileType.MOSTLY_IQ2_S, "iq2_xs", _very_low_bits("iq3_s", "iq3_s"), embedding="iq3_s",
                 output="q5_k"),
    "iq2_xs": Mix(LlamaFileType.MOSTLY_IQ2_XS, "iq2_xs", _very_low_bits("q2_k"), embedding="q2_k", output="q5_k"),
    "iq2_xxs": Mix(LlamaFileType.MOSTLY_IQ2_XXS, "iq2_xxs", _very_low_bits("q2_k"), embedding="q2_k", output="q5_k"),
    "iq1_m": Mix(LlamaFileType.MOSTLY_IQ1_M, "iq1_m", _very_low_bits("q2_k", "iq2_xxs"), embedding="q2_k",
                 output="q5_k"),
    "iq1_s": Mix(LlamaFileType.MOSTLY_IQ1_S, "iq1_s", _very_low_bits("q2_k", "iq2_xxs"), embedding="q2_k",
                 output="q5_k"),
    "tq2_0": Mix(LlamaFileType.MOSTLY_TQ2_0, "tq2_0", embedding="q4_k"),
    "tq1_0": Mix(LlamaFileType.MOSTLY_TQ1_0, "tq1_0", embedding="q4_k"),
}
FILE_TYPES: dict[str, LlamaFileType] = {name: mix.file_type for name, mix in MIXES.items()}
FLOAT_TYPES = ("f32", "f16", "bf16")
# llama-quantize's replacement for a type whose blocks do not divide a tensor's rows
BLOCK_FALLBACK = {
    **dict.fromkeys(("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq4_xs"), "iq4_nl"),
    **dict.fromkeys(("q2_k", "q3_k", "tq2_0", "tq1_0"), "q4_0"),
    "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0",
}
# the types llama-quantize will not write without importance statistics (but never for token_embd or
# output), and in a Q2_K_S file its Q2_K too
IMATRIX_TYPES = frozenset({"iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs"})


def _fitting(type_name: str, k: int) -> TensorType:
    if not TYPES[type_name].fits(k) and type_name in BLOCK_FALLBACK:
        type_name = BLOCK_FALLBACK[type_name]
    return TYPES[type_name] if TYPES[type_name].fits(k) else TYPES["f16"]


def choose_type(file_type: str, name: str, shape: tuple[int, ...], model: Model, imatrix: bool = False,
                overrides: Mapping[str, str] = {}) -> TensorType:
    """The type of GGUF tensor ``name`` (numpy shape ``shape``) in a ``file_type`` file for ``model``,
    quantized with importance statistics or without; ``overrides`` (name -> type, llama-quantize's
    ``--tensor-type``) replace the mix's choice, falling back as it would where blocks do not fit."""
    mix = MIXES[file_type]
    if len(shape) == 1:
        return TYPES["f32"]
    if name in overrides:
        return _fitting(overrides[name], shape[-1])
    if mix.default in FLOAT_TYPES:
        return TYPES[mix.default]
    k = shape[-1]
    if name == "output.weight" or (model.tied_embeddings and name == "token_embd.weight"):
        return _fitting("q8_0" if k % TYPES[mix.default].block_size else mix.output, k)
    chosen = mix.embedding if name == "token_embd.weight" and mix.embedding else mix.default
    match = LAYER_TENSOR_NAME.fullmatch(name)
    if match and match[2] in mix.rules:
        chosen = mix.rules[match[2]](Place(int(match[1]), model.layers, model.gqa, imatrix)) or chosen
    return _fitting(chosen, k)


def needs_imatrix(file_type: str, name: str, tensor_type: TensorType) -> bool:
    """Whether llama-quantize refuses to write tensor ``name`` as ``tensor_type`` in a ``file_type`` file
    without importance statistics."""
    if name in ("token_embd.weight", "output.weight"):
        return False
    return tensor_type.name in IMATRIX_TYPES or (file_type == "q2_k_s" and tensor_type.name == "q2_k")


def layer_types(file_type: str) -> frozenset[str]:
    """Every type a ``file_type`` file may give a decoder layer's matrix: its default, what its rules name at
    any layer of models of 1 to 64 layers, with or without GQA and importance statistics, and the
    fallbacks of those for rows that are not whole blocks."""
    mix = MIXES[file_type]
    places = [Place(layer, layers, gqa, imatrix) for layers in (1, 8, 16, 32, 40, 64) for layer in range(layers)
              for gqa in (1, 4) for imatrix in (False, True)]
    named = {mix.default} | {rule(at) for rule in mix.rules.values() for at in places} - {None}
    types = set()
    while named:  # a fallback may have its own
        name = named.pop()
        types.add(name)
        if BLOCK_FALLBACK.get(name) not in types | {None}:
            named.add(BLOCK_FALLBACK[name])
    return frozenset(types)
