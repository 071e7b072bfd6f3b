"""The runtime's attention: dense, or InfLLM v2 with the model's (or a given) ``sparse_config``.

``--sparse auto`` follows the checkpoint (MiniCPM4.1 ships a sparse_config, most models do not),
``on`` forces InfLLM v2 (with MiniCPM4.1's settings when the checkpoint has none), ``off`` forces
dense attention. Below ``dense_len`` keys InfLLM v2 is dense attention anyway, as in the official
model.
"""
from __future__ import annotations

from quantkit.kernels.infllm import (
    CompressedKeyCache,
    SparseAttentionConfig,
    causal_attention_of_last_positions,
    sparse_attention,
    sparse_tree_attention,
)
from quantkit.kernels.kv_cache import KVCache

SPARSE_MODES = ("auto", "on", "off")


def sparse_config_for(mode: str, checkpoint_config: SparseAttentionConfig | None,
                      overrides: dict | None = None) -> SparseAttentionConfig | None:
    """The InfLLM v2 settings to run with, or None for dense attention. ``overrides`` replace single
    keys (e.g. a smaller dense_len and window for a model trained on 8K tokens); they are refused when
    they are not a mapping of known keys, or when attention is dense and they would change nothing."""
    if mode not in SPARSE_MODES:
        raise ValueError(f"sparse must be one of {SPARSE_MODES}, got {mode!r}")
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(f"sparse_config overrides must be an object of sparse_config keys, got "
                         f"{type(overrides).__name__}")
    unknown = sorted(set(overrides or ()) - set(SparseAttentionConfig().to_dict()))
    if unknown:
        raise ValueError(f"sparse_config overrides: unknown keys {unknown}; expected a subset of "
                         f"{sorted(SparseAttentionConfig().to_dict())}")
    chosen = None if mode == "off" else checkpoint_config
    if mode == "on" and chosen is None:
        chosen = SparseAttentionConfig()
    if overrides and chosen is None:
        raise ValueError("sparse_config overrides were given but attention is dense (sparse off, or a checkpoint "
                         "without sparse_config under sparse auto): use sparse on")
    if overrides:
        chosen = SparseAttentionConfig.from_dict({**chosen.to_dict(), **overrides})
    return chosen


class DenseAttention:
    compressed_keys = None
    dense = True  # the runtime may run a decode step's attention in its fused CPU operator
    scores_pre_rope = False

    def __call__(self, query, keys, values, layer: int, cache: KVCache, query_pre_rope=None):
        return causal_attention_of_last_positions(query, keys, values)


class InfLLMv2Attention:
    """InfLLM v2 per layer; the layer's compressed keys live in the KV cache and grow with it."""

    def __init__(self, config: SparseAttentionConfig, backend: str = "cpu"):
        self.config = config
        self.backend = backend
        # use_nope: blocks are scored with pre-RoPE queries and keys, which the runtime then keeps
        self.scores_pre_rope = config.use_nope

    def compressed_keys(self) -> CompressedKeyCache:
        return CompressedKeyCache(self.config)

    def __call__(self, query, keys, values, layer: int, cache: KVCache, query_pre_rope=None, tree_mask=None):
        """``tree_mask``: the rows are a draft tree's verification (``sparse_tree_attention``)."""
        keys_pre_rope = cache.pre_rope_keys(layer, keys.shape[1]) if self.scores_pre_rope else None
        if tree_mask is not None:
            return sparse_tree_attention(query, keys, values, self.config, cache.compressed[layer], tree_mask,
                                         q_nope=query_pre_rope, k_nope=keys_pre_rope)
        return sparse_attention(query, keys, values, self.config, cache.compressed[layer], backend=self.backend,
                                q_nope=query_pre_rope, k_nope=keys_pre_rope)


def make_attention(config: SparseAttentionConfig | None, backend: str = "cpu"):
    return DenseAttention() if config is None else InfLLMv2Attention(config, backend)
