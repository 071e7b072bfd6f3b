"""MiniCPM4 / MiniCPM4.1 configuration, read and written with the official config.json keys.

transformers 5.x standardises RoPE settings into ``rope_parameters``; official MiniCPM loaders read
``rope_theta`` and ``rope_scaling`` instead. This config keeps both official keys as plain fields
(shadowing the base class's deprecated ``rope_scaling`` property), so ``config.json`` round-trips
unchanged and transformers' RoPE machinery never rewrites it: the model computes LongRoPE itself.
"""
from __future__ import annotations

from transformers import PretrainedConfig

from quantkit.models.sparse_attention import SparseAttentionConfig

LONGROPE_KEYS = frozenset({"short_factor", "long_factor", "original_max_position_embeddings"})


class MiniCPMConfig(PretrainedConfig):
    """Defaults are those of the official ``configuration_minicpm.py`` (so a config.json that omits a
    key, like MiniCPM4-0.5B's missing ``tie_word_embeddings``, means what it means officially)."""

    model_type = "minicpm"
    keys_to_ignore_at_inference = ["cache"]

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

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is implemented, got {self.hidden_act!r}")
        self._check_rope_scaling()
        if self.sparse_config is not None:
            SparseAttentionConfig.from_dict(self.sparse_config)
        super().__post_init__(**kwargs)

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling is None:
            return
        rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
        if rope_type != "longrope":
            raise ValueError(f"rope_scaling: only rope_type 'longrope' is implemented, got {rope_type!r}")
        missing = LONGROPE_KEYS - self.rope_scaling.keys()
        if missing:
            raise ValueError(f"rope_scaling: missing keys {sorted(missing)}")
        for key in ("short_factor", "long_factor"):
            if len(self.rope_scaling[key]) != self.head_dim // 2:
                raise ValueError(
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
