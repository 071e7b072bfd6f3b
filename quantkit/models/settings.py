"""MiniCPM4 / MiniCPM4.1's configuration as plain data, with the official config.json keys and defaults.

``MiniCPMSettings`` is what a model is built from: the runtime's plain-PyTorch decoder reads it directly,
without transformers (importing it takes about half a second of a first answer), and
``quantkit.models.configuration_minicpm.MiniCPMConfig`` is the same fields as a transformers config (it
inherits them). Every value is checked when the settings are made, and ``read`` checks config.json's
values by the same rules, naming the file.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

from quantkit.errors import CheckpointError
from quantkit.json_files import read_json_object
from quantkit.models.sparse_attention import SparseAttentionConfig

MODEL_TYPE = "minicpm"
LONGROPE_KEYS = frozenset({"short_factor", "long_factor", "original_max_position_embeddings"})
ARCHITECTURES = ("MiniCPMForCausalLM",)  # what quantkit's MiniCPM code is (the default model and conversions too)


@dataclass(frozen=True)
class Rule:
    """What one config value must be: ``holds(value)``, described as ``wants`` in the refusal."""
    holds: Callable[[object], bool]
    wants: str


def _number(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)  # bool is no number here, NaN and inf none either


COUNT = Rule(lambda v: type(v) is int and v >= 1, "an integer >= 1")
TOKEN_ID = Rule(lambda v: type(v) is int and v >= 0, "an integer >= 0")
POSITIVE = Rule(lambda v: _number(v) and v > 0, "a finite number > 0")
FINITE = Rule(_number, "a finite number")
FLAG = Rule(lambda v: type(v) is bool, "true or false")


def optional(rule: Rule) -> Rule:
    return Rule(lambda v: v is None or rule.holds(v), f"null or {rule.wants}")


def listed(rule: Rule) -> Rule:
    return Rule(lambda v: isinstance(v, list) and all(map(rule.holds, v)), f"a list, each entry {rule.wants}")


# Every config.json value the model is built from, checked before anything uses it: a size of -1, "four"
# heads or 2.5 layers would fail deep inside torch, and a NaN epsilon would silently zero every layer.
FIELD_RULES: dict[str, Rule] = {
    "architectures": optional(Rule(lambda v: isinstance(v, list) and bool(v) and set(v) <= set(ARCHITECTURES),
                                   f"a list of {', '.join(ARCHITECTURES)} (the architectures quantkit runs)")),
    "vocab_size": COUNT,
    "hidden_size": COUNT,
    "intermediate_size": COUNT,
    "num_hidden_layers": COUNT,
    "num_attention_heads": COUNT,
    "num_key_value_heads": optional(COUNT),
    "head_dim": optional(COUNT),
    "max_position_embeddings": COUNT,
    "rms_norm_eps": POSITIVE,
    "rope_theta": POSITIVE,
    "initializer_range": FINITE,
    "attention_dropout": Rule(lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "scale_emb": FINITE,
    "dim_model_base": POSITIVE,
    "scale_depth": FINITE,
    "mup_denominator": optional(POSITIVE),
    "use_cache": FLAG,
    "tie_word_embeddings": FLAG,
    "attention_bias": FLAG,
    "pad_token_id": optional(TOKEN_ID),
    "bos_token_id": optional(TOKEN_ID),
    "eos_token_id": optional(Rule(lambda v: TOKEN_ID.holds(v) or listed(TOKEN_ID).holds(v),
                                  "an integer >= 0 or a list of them")),
    "rope_scaling": optional(Rule(lambda v: isinstance(v, dict), "an object")),
    "sparse_config": optional(Rule(lambda v: isinstance(v, dict), "an object")),
}
# LongRoPE's keys, once rope_scaling is an object of rope_type longrope
LONGROPE_RULES = {"short_factor": listed(POSITIVE), "long_factor": listed(POSITIVE),
                  "original_max_position_embeddings": COUNT}


def _kv_heads(values: dict) -> int:
    return values["num_key_value_heads"] or values["num_attention_heads"]


# Rules between values, judged once each value has passed its own; (holds, the refusal's text).
RELATIONS: tuple[tuple[Callable[[dict], bool], str], ...] = (
    (lambda v: v["num_attention_heads"] % _kv_heads(v) == 0,
     "num_attention_heads ({num_attention_heads}) must be a multiple of num_key_value_heads ({num_key_value_heads})"),
    (lambda v: v["head_dim"] is not None or v["hidden_size"] % v["num_attention_heads"] == 0,
     "hidden_size ({hidden_size}) must be a multiple of num_attention_heads ({num_attention_heads}), or head_dim "
     "given"),
)


def check_values(values: dict, rules: dict[str, Rule], where: str) -> None:
    """Refuse, in one line naming ``where``, the first value of ``values`` its rule does not hold for."""
    for key, rule in rules.items():
        if key in values and not rule.holds(values[key]):
            raise CheckpointError(f"{where}: {key} must be {rule.wants}, got {values[key]!r}")


def check_config(values: dict, where: str) -> None:
    """Refuse a config whose ``values`` (every key of ``FIELD_RULES``) break a rule, naming ``where``."""
    check_values(values, FIELD_RULES, where)
    for holds, text in RELATIONS:
        if not holds(values):
            raise CheckpointError(f"{where}: {text.format(**values)}")


@dataclass(kw_only=True)
class MiniCPMSettings:
    """Defaults are those of the official ``configuration_minicpm.py`` (so a config.json that omits a
    key, like MiniCPM4-0.5B's missing ``tie_word_embeddings``, means what it means officially)."""

    architectures: list[str] | None = None
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    scale_emb: float = 1.0
    dim_model_base: float = 1.0
    scale_depth: float = 1.0
    mup_denominator: float | None = None
    sparse_config: dict | None = None

    def __post_init__(self):
        check_config({key: getattr(self, key) for key in FIELD_RULES}, "MiniCPM config")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_act != "silu":
            raise CheckpointError(f"hidden_act: only 'silu' is implemented, got {self.hidden_act!r}")
        self._check_rope_scaling()
        if self.sparse_config is not None:
            SparseAttentionConfig.from_dict(self.sparse_config)

    @classmethod
    def from_values(cls, values: dict) -> MiniCPMSettings:
        """The settings among config.json's ``values`` (``checked_values``); other keys are left out."""
        return cls(**{f.name: values[f.name] for f in fields(MiniCPMSettings) if f.name in values})

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling is None:
            return
        rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
        if rope_type != "longrope":
            raise CheckpointError(f"rope_scaling: only rope_type 'longrope' is implemented, got {rope_type!r}")
        missing = LONGROPE_KEYS - self.rope_scaling.keys()
        if missing:
            raise CheckpointError(f"rope_scaling: missing keys {sorted(missing)}")
        check_values(self.rope_scaling, LONGROPE_RULES, "rope_scaling")
        for key in ("short_factor", "long_factor"):
            if len(self.rope_scaling[key]) != self.head_dim // 2:
                raise CheckpointError(
                    f"rope_scaling.{key} has {len(self.rope_scaling[key])} values; "
                    f"head_dim {self.head_dim} needs {self.head_dim // 2}"
                )

    @property
    def sparse_attention(self) -> SparseAttentionConfig | None:
        """``sparse_config`` parsed, or None when the checkpoint is dense-only."""
        return None if self.sparse_config is None else SparseAttentionConfig.from_dict(self.sparse_config)

    @property
    def residual_scale(self) -> float:
        """μP multiplier applied to each attention and MLP branch before the residual add."""
        return self.scale_depth / self.num_hidden_layers**0.5

    @property
    def logit_divisor(self) -> float:
        """μP divisor applied to the final hidden state before lm_head."""
        return self.hidden_size / self.dim_model_base


def checked_values(path: str | Path, decode=lambda values: values) -> dict:
    """config.json read strictly (no NaN, no key twice; ``decode`` undoes an encoding of special floats) and
    checked against the rules, naming the file: transformers' reader would pass a bare NaN on, and keep
    the last of two values under one key."""
    values = decode(read_json_object(path))
    model_type = values.get("model_type", MODEL_TYPE)
    if model_type != MODEL_TYPE:
        raise CheckpointError(f"{path}: model_type {model_type!r} is not supported: quantkit runs "
                              f"model_type {MODEL_TYPE!r} ({', '.join(ARCHITECTURES)}) only")
    defaults = {f.name: f.default for f in fields(MiniCPMSettings) if f.name in FIELD_RULES}
    check_config({**defaults, **{key: values[key] for key in FIELD_RULES if key in values}}, str(path))
    return values
