"""MiniCPM4 / MiniCPM4.1's decoder in plain PyTorch: its modules, and the model's module tree without
transformers (``MiniCPMSkeleton``).

``quantkit.models.minicpm`` wraps these modules as a transformers model (what calibration and evaluation
run); the runtime (``quantkit.kernels``) and whatever only needs tensor names and shapes build the
skeleton instead, because importing transformers' modeling code takes seconds and they use none of it.
Tensor names match the official checkpoints (see quantkit/models/layers.py). What differs from a plain
Llama, all per the official modeling_minicpm.py:
- μP scalings: embeddings × scale_emb, each residual branch × scale_depth/√L, and
  logits = lm_head(h / (hidden_size / dim_model_base)) returned as float32;
- RMSNorm casts back to the input dtype *before* multiplying by its weight;
- RoPE is applied in float32 and may be LongRoPE (per-frequency factors and an attention factor
  that multiplies both cos and sin).
"""
from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.models.layers import layer_prefix

if TYPE_CHECKING:
    from quantkit.models.settings import MiniCPMSettings

# query [B, Hq, T, d], key/value [B, Hkv, S, d] (KV heads not repeated), mask, softmax scale
# -> [B, Hq, T, d]. The mask is None (causal when T > 1, aligned to the first key), or a boolean
# (True = attend) or additive float mask broadcastable to [B, Hq, T, S].
AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", float], torch.Tensor]


def sdpa_attention_core(query, key, value, attention_mask, scaling):
    """Exact softmax attention through PyTorch SDPA (the default core; InfLLM v2 replaces it)."""
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        is_causal=attention_mask is None and query.shape[2] > 1,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )


class MiniCPMRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        normalized = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return normalized.to(hidden_states.dtype) * self.weight


class MiniCPMRotaryEmbedding(nn.Module):
    """Half-split RoPE, optionally LongRoPE. cos/sin are computed on the fly from the config (no
    buffers), so the module is exact on any device, including models built on the meta device."""

    def __init__(self, config: MiniCPMSettings):
        super().__init__()
        self.head_dim = config.head_dim
        self.base = config.rope_theta
        self.max_position_embeddings = config.max_position_embeddings
        scaling = config.rope_scaling
        self.short_factor = scaling["short_factor"] if scaling else None
        self.long_factor = scaling["long_factor"] if scaling else None
        self.original_max_position_embeddings = (
            scaling["original_max_position_embeddings"] if scaling else config.max_position_embeddings
        )
        ratio = self.max_position_embeddings / self.original_max_position_embeddings
        self.attention_factor = (
            math.sqrt(1 + math.log(ratio) / math.log(self.original_max_position_embeddings)) if ratio > 1 else 1.0
        )

    def _position_factors(self, position_ids: torch.Tensor) -> list[float] | None:
        # The official code picks the factor set by the length its cos/sin cache covers: at least
        # max_position_embeddings, extended when a position runs past it.
        if self.short_factor is None:
            return None
        covered = max(self.max_position_embeddings, int(position_ids.max()) + 1)
        return self.long_factor if covered > self.original_max_position_embeddings else self.short_factor

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> (cos, sin), each [B, T, head_dim] in x.dtype."""
        device = x.device
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        positions = position_ids.to(device=device, dtype=torch.float32)[..., None]
        factors = self._position_factors(position_ids)
        if factors is not None:
            positions = positions * (1.0 / torch.tensor(factors, dtype=torch.float32, device=device))
        freqs = positions * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_factor
        sin = emb.sin() * self.attention_factor
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """states [B, H, T, d]; cos/sin [B, T, d]. Rotates in float32, returns states' dtype."""
    cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    rotated = states.float() * cos + rotate_half(states.float()) * sin
    return rotated.to(states.dtype)


class MiniCPMAttention(nn.Module):
    def __init__(self, config: MiniCPMSettings, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        q_width = config.num_attention_heads * self.head_dim
        kv_width = config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_width, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=bias)
        self.o_proj = nn.Linear(q_width, config.hidden_size, bias=bias)
        self.core: AttentionCore = sdpa_attention_core

    def _heads(self, projected: torch.Tensor) -> torch.Tensor:
        batch, length, _ = projected.shape
        return projected.view(batch, length, -1, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None):
        return self.o_proj(self.mix(hidden_states, position_embeddings, attention_mask, past_key_values))

    def mix(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None):
        """Everything before o_proj: the attended heads, concatenated (o_proj's input)."""
        cos, sin = position_embeddings
        query = apply_rotary(self._heads(self.q_proj(hidden_states)), cos, sin)
        key = apply_rotary(self._heads(self.k_proj(hidden_states)), cos, sin)
        value = self._heads(self.v_proj(hidden_states))
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        attended = self.core(query, key, value, attention_mask, self.scaling)
        return attended.transpose(1, 2).flatten(2)


class MiniCPMMLP(nn.Module):
    def __init__(self, config: MiniCPMSettings):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated(x))

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """down_proj's input: the SiLU-gated product of gate_proj and up_proj."""
        return F.silu(self.gate_proj(x)) * self.up_proj(x)


class MiniCPMDecoderLayer(nn.Module):
    def __init__(self, config: MiniCPMSettings, layer_idx: int):
        super().__init__()
        self.residual_scale = config.residual_scale
        self.self_attn = MiniCPMAttention(config, layer_idx)
        self.mlp = MiniCPMMLP(config)
        self.input_layernorm = MiniCPMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = MiniCPMRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        mixed = self.self_attn.mix(self.input_layernorm(hidden_states), position_embeddings, attention_mask,
                                   past_key_values)
        return self.after_attention(hidden_states, mixed)

    def after_attention(self, hidden_states, mixed):
        """The layer from o_proj on, given o_proj's input: calibration reuses one attention pass for
        every sublayer quantized after q/k/v."""
        return self.feed_forward(self.attended(hidden_states, mixed))

    def attended(self, hidden_states, mixed):
        """The residual stream after attention, given o_proj's input."""
        return hidden_states + self.self_attn.o_proj(mixed) * self.residual_scale

    def feed_forward(self, hidden_states):
        """The layer from post_attention_layernorm on, given the residual stream after attention:
        calibration reuses one o_proj pass for the MLP's sublayers."""
        return self.finished(hidden_states, self.gated(hidden_states))

    def gated(self, hidden_states):
        """down_proj's input, given the residual stream after attention."""
        return self.mlp.gated(self.post_attention_layernorm(hidden_states))

    def finished(self, hidden_states, gated):
        """The layer's output, given the residual stream after attention and down_proj's input:
        calibration reuses one gate/up pass for down_proj's statistics and the output."""
        return hidden_states + self.mlp.down_proj(gated) * self.residual_scale


def add_decoder_modules(model: nn.Module, config: MiniCPMSettings, initialized: bool = True) -> None:
    """The base model's modules, in the official order and names: embed_tokens, layers, norm, rotary_emb.
    ``initialized=False`` leaves the embedding's values unset (a skeleton's are loaded): its random
    initialisation on the meta device imports torch's compiler (~1 s) to do nothing."""
    shape = (config.vocab_size, config.hidden_size)
    model.embed_tokens = nn.Embedding(*shape, config.pad_token_id, _weight=None if initialized else torch.empty(shape))
    model.layers = nn.ModuleList(MiniCPMDecoderLayer(config, i) for i in range(config.num_hidden_layers))
    model.norm = MiniCPMRMSNorm(config.hidden_size, config.rms_norm_eps)
    model.rotary_emb = MiniCPMRotaryEmbedding(config)


class MiniCPMSkeleton(nn.Module):
    """``MiniCPMForCausalLM``'s module tree and state-dict names (``model.*``, ``lm_head``) with no forward
    of its own: what the runtime fills with weights and replays (``quantkit.kernels.model``)."""

    def __init__(self, config: MiniCPMSettings):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        add_decoder_modules(self.model, config, initialized=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def tie_weights(self) -> None:
        """The LM head shares the embedding's tensor (a tied checkpoint stores only the embedding)."""
        self.lm_head.weight = self.model.embed_tokens.weight


def weight_shapes(config: MiniCPMSettings) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config stores, with its shape, in the model's order (no memory:
    meta device). The decoder layers are alike, so one is built and its shapes repeated: building all
    of them took 0.05 s of every GGUF export of the default model."""
    one_layer = copy.copy(config)
    one_layer.num_hidden_layers = 1
    with torch.device("meta"):
        model = MiniCPMSkeleton(one_layer)
    first = layer_prefix(0)
    outside, layer, layers_at = [], {}, 0
    for name, tensor in model.state_dict().items():
        if name.startswith(first):
            layers_at = layers_at or len(outside)
            layer[name.removeprefix(first)] = tuple(tensor.shape)
        else:
            outside.append((name, tuple(tensor.shape)))
    layers = [(layer_prefix(i) + key, shape) for i in range(config.num_hidden_layers) for key, shape in layer.items()]
    shapes = dict(outside[:layers_at] + layers + outside[layers_at:])
    if config.tie_word_embeddings:
        del shapes["lm_head.weight"]
    return shapes
