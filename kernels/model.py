"""MiniCPM's forward pass for inference: one sequence, a growing KV cache, any linear modules.

``quantkit.models.MiniCPMForCausalLM`` is the specification (and what calibration and evaluation run);
this module re-plays the same computation with fewer operations per token, because at decode a 135M
model spends more time dispatching PyTorch operators than reading weights. It reuses the modules and
tensors of the model's skeleton (``quantkit.models.decoder.MiniCPMSkeleton``: so a quantized linear is
swapped in once, in one place) and differs only in what a generic ``transformers`` forward does not
need here: no batch, no attention mask, no Cache object, cos/sin read from tables made once, KV heads
never repeated.
"""
from __future__ import annotations

import functools
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from quantkit import cpu_ops
from quantkit.kernels.infllm.cpu import verify_attention
from quantkit.kernels.kv_cache import KVCache
from quantkit.kernels.linear.prepacked import prepacked

if TYPE_CHECKING:
    from quantkit.models.decoder import MiniCPMSkeleton

# Query-key scores per KV head (group size x keys) up to which a decode step's dense attention runs in
# the fused one-query operator rather than the attention's own decode path (the fused block kernel over
# a bf16 cache): where the two cross on 2 threads (`python -m quantkit.eval.bench.bench_decode_attention`),
# ~300 keys for the default model's group of 3, ~100 for MiniCPM4.1-8B's group of 16.
FUSED_ATTENTION_MAX_SCORES = 1024

# Rows after a cache up to which dense causal attention runs as a speculative round's verification
# (``VerificationAttention``); longer chunks keep the attention's own masking, since SDPA's bias, repeated
# for each query head of a KV head, grows with rows x keys x group.
BIAS_MAX_ROWS = 64

# (q [Hq, T, d], keys [Hkv, S, d], values [Hkv, S, d], layer index, cache) -> [Hq, T, d]; an attention
# with ``scores_pre_rope`` also takes ``query_pre_rope=`` and reads pre-RoPE keys from the cache.
Attention = Callable[..., torch.Tensor]


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm of the float32 residual stream, scaled in float32 and rounded once to ``dtype`` (the
    official model rounds before scaling: a difference below bf16's resolution)."""
    return F.rms_norm(hidden, (hidden.shape[-1],), weight=weight, eps=eps).to(dtype)


def rotate(states: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """RoPE in float32 on [H, T, d]: rotate_half(x)·sin == roll(x, d/2)·[-sin₁, sin₂], one op fewer."""
    states32 = states.float()
    return torch.addcmul(states32 * cos, states32.roll(states.shape[-1] // 2, -1), signed_sin).to(dtype)


def causal_mask(cached: int, new: int, device: torch.device | str | None = None) -> torch.Tensor:
    """bool [new, cached + new]: each of ``new`` positions after ``cached`` cached ones attends the cache,
    the new positions before it and itself."""
    slots = torch.arange(cached + new, device=device)
    return slots[None, :] <= slots[cached:, None]


class RopeTables:
    """A model's RoPE at positions: cos [T, d] and sin with its first half negated (``rotate``). Rows
    come from tables made once for positions 0 .. n - 1 and doubled (up to max_position_embeddings) when
    a position passes them: a decode step, a verification and each draft step read rows in ~8 µs instead
    of running the rotary module in ~67 µs (default model; a chain round of three drafts makes four
    calls). Past max_position_embeddings, where LongRoPE's factors depend on the length, it computes them."""

    FIRST_SIZE = 1024

    def __init__(self, rotary: nn.Module):
        self._rotary = rotary
        self._cos = self._signed_sin = None

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end, limit = int(positions.max()) + 1, self._rotary.max_position_embeddings
        if end > limit:
            return self._computed(positions)
        if self._cos is None or end > len(self._cos):
            size = min(limit, max(self.FIRST_SIZE, 1 << (end - 1).bit_length()))
            self._cos, self._signed_sin = self._computed(torch.arange(size, device=positions.device))
        return self._cos[positions], self._signed_sin[positions]

    def _computed(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = (t[0].float().contiguous() for t in self._rotary(positions.float(), positions[None]))
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def masked_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
    """q [Hq, T, d], k/v [Hkv, S, d], an additive bias [Hq/Hkv·T, S] (``VerificationAttention.bias``)
    -> [Hq, T, d]. Each KV head's query heads are the rows of one problem, as in a decode step: SDPA's
    enable_gqa expands K and V instead, ~2x slower for a few rows (bit-identical)."""
    (q_heads, length, head_dim), kv_heads = query.shape, keys.shape[0]
    folded = query.reshape(1, kv_heads, q_heads // kv_heads * length, head_dim)
    return F.scaled_dot_product_attention(folded, keys[None], values[None], attn_mask=bias).view(query.shape)


class VerificationAttention:
    """Dense attention of a forward's T new positions that each see what their row of ``visible`` [T, all
    keys] allows (a speculative round's chain or draft tree; every row sees all cached keys): over bf16
    caches the fused kernel (``verify_attention``, kernels/infllm/cpu.py), else SDPA with an additive bias
    made once for the forward (``masked_attention``, the kernel's specification)."""

    def __init__(self, visible: torch.Tensor, cached: int, heads: tuple[int, int, int], kv_dtype: torch.dtype):
        self._visible = visible
        self._new = visible[:, cached:].contiguous()  # what the kernel takes: the new positions' mask
        self._rows_per_kv = heads[0] // heads[1]
        self._kv_dtype = kv_dtype

    @functools.cached_property
    def bias(self) -> torch.Tensor:
        """``masked_attention``'s bias [Hq/Hkv·T, all keys]: SDPA would convert a boolean mask in every layer."""
        bias = torch.zeros(self._visible.shape, dtype=self._kv_dtype, device=self._visible.device)
        bias.masked_fill_(~self._visible, float("-inf"))
        return bias.repeat(self._rows_per_kv, 1)  # the rows of each KV head's query heads, one after another

    def __call__(self, query, keys, values, layer: int, cache: KVCache, **_) -> torch.Tensor:
        fused = verify_attention(query, keys, values, self._new)
        return fused if fused is not None else masked_attention(query, keys, values, self.bias)


def fuse_linears(modules: list[nn.Module]) -> nn.Module | None:
    """One module computing the concatenated outputs of modules sharing an input (q/k/v, gate/up):
    fewer, larger matmuls. Plain linears are concatenated here; quantized ones fuse themselves
    (``fuse`` classmethod) when their layout allows; None when they cannot."""
    kinds = {type(module) for module in modules}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if kind is nn.Linear:
        fused = nn.Linear(modules[0].in_features, sum(m.out_features for m in modules),
                          bias=modules[0].bias is not None, device="meta")
        fused.weight = nn.Parameter(torch.cat([m.weight for m in modules]), requires_grad=False)
        if fused.bias is not None:
            fused.bias = nn.Parameter(torch.cat([m.bias for m in modules]), requires_grad=False)
        return fused
    fuse = getattr(kind, "fuse", None)
    return fuse(modules) if fuse is not None else None


class _Concat(nn.Module):
    """The fallback when linears cannot be fused: separate matmuls, one output."""

    def __init__(self, modules: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(modules)

    def forward(self, x):
        return torch.cat([part(x) for part in self.parts], dim=-1)


class FusedPart(nn.Module):
    """Output columns start..end of a fused module: what an unfused linear (q_proj, ...) of the model
    becomes once the runtime fused it (``RuntimeLayer.of``), so that its weights are held once."""

    def __init__(self, whole: nn.Module, start: int, end: int):
        super().__init__()
        self.whole, self.start, self.end = whole, start, end
        self.out_features = end - start

    def forward(self, x):
        return self.whole(x)[..., self.start:self.end]


def _fused(modules: list[nn.Module]) -> nn.Module:
    wholes = {id(m.whole) for m in modules if isinstance(m, FusedPart)}
    if len(wholes) == 1 and all(isinstance(m, FusedPart) for m in modules):  # fused by an earlier runtime
        whole, ends = modules[0].whole, [0] + [m.end for m in modules]
        if [m.start for m in modules] == ends[:-1] and ends[-1] == whole.out_features:
            return whole
    fused = fuse_linears(modules)
    if fused is None:
        return _Concat(modules)
    # the linears share their input: what each did to it before multiplying (W8A8's activation
    # quantization, quantkit.loading.quantize_activations) the fused one does once
    for hook in modules[0]._forward_pre_hooks.values():
        fused.register_forward_pre_hook(hook)
    return fused


def _release(parent: nn.Module, names: tuple[str, ...], fused: nn.Module) -> None:
    """Replace ``parent``'s linears ``names`` by their columns of ``fused`` (unless it only concatenates
    them): the model still computes what it did, and their weights are no longer held twice."""
    if isinstance(fused, _Concat) or all(isinstance(getattr(parent, name), FusedPart) for name in names):
        return
    start = 0
    for name in names:
        width = getattr(parent, name).out_features
        setattr(parent, name, FusedPart(fused, start, start + width))
        start += width


def fused_ops_and_kv_dtype(dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype | None = None):
    """(the fused CPU operators or None, the KV cache's dtype) for matmuls in ``dtype`` on ``device``: bf16 on
    the CPU with a bf16 cache runs a layer in the fused operators; by default the cache takes ``dtype``,
    except on the CPU without the fused operators, where PyTorch's attention for one query runs ~1.7x faster
    on float32 than on bf16 keys (measured)."""
    fusable = device.type == "cpu" and dtype == torch.bfloat16 and kv_dtype in (None, torch.bfloat16)
    ops = cpu_ops.load() if fusable else None
    if kv_dtype is None:
        kv_dtype = dtype if ops is not None or device.type != "cpu" else torch.float32
    return ops, kv_dtype


class DecoderRunner:
    """A MiniCPM decoder layer on the runtime's conventions (float32 residual, matmuls in ``dtype``, the
    cache in ``kv_dtype``): what the target model and an EAGLE-3 draft layer share."""

    def __init__(self, heads: tuple[int, int, int], eps: float, residual_scale: float, dtype: torch.dtype,
                 kv_dtype: torch.dtype, attention: Attention, ops=None):
        """``ops``: the fused CPU operators (quantkit/cpu_ops) for bf16 matmuls over a bf16 cache, or None."""
        self._heads, self.eps, self.residual_scale = heads, eps, residual_scale
        self.dtype, self.kv_dtype, self.attention = dtype, kv_dtype, attention
        self.scores_pre_rope = getattr(attention, "scores_pre_rope", False)
        # the fused RoPE + KV write keeps no pre-RoPE keys
        self._ops = ops if not self.scores_pre_rope else None

    def norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of the float32 stream, rounded to the matmuls' dtype (in the fused operator when there is one)."""
        if self._ops is not None:
            return self._ops.rms_norm_bf16(hidden, weight, self.eps)
        return rms_norm(hidden, weight, self.eps, self.dtype)

    def forward_attention(self, mask: torch.Tensor | None, length: int, cache: KVCache) -> Attention:
        """The attention every layer of a forward of ``length`` new positions runs: the runtime's own, or
        for a draft tree's ``mask`` [T, all keys] (True: attend) and for a few dense rows after a cache
        (a speculative round's verification), ``VerificationAttention``, made once for the forward."""
        visible = self.verification_mask(mask, length, cache)
        if visible is not None:
            return VerificationAttention(visible, cache.length, self._heads, self.kv_dtype)
        if mask is not None:
            return partial(self.attention, tree_mask=mask)  # InfLLM v2 (``sparse_tree_attention``)
        return self.attention

    def verification_mask(self, mask: torch.Tensor | None, length: int, cache: KVCache) -> torch.Tensor | None:
        """What each of ``length`` new positions after the cached ones attends, bool [T, all keys]: ``mask``
        (a draft tree's), or causal attention's when a dense attention runs a few rows after a cache (a
        speculative round's verification); None for the attention's own path (one row, a prefill chunk)
        and for InfLLM v2."""
        if not getattr(self.attention, "dense", False) or self.scores_pre_rope:
            return None
        if mask is None:
            if not 1 < length <= BIAS_MAX_ROWS or cache.length == 0:
                return None
            mask = causal_mask(cache.length, length, cache.device)
        return mask

    def layer_from_input(self, index, layer: "RuntimeLayer", attention_input, hidden, cos, signed_sin,
                         cache: KVCache, attention: Attention | None = None) -> torch.Tensor:
        """The layer given what its q/k/v read (the normed residual; in a draft head, the normed
        embedding beside the normed hidden state) and the residual ``hidden`` [T, H] it adds onto.
        ``attention``: the forward's (``forward_attention``), else the runtime's own."""
        attention = attention or self.attention
        if self._ops is not None:
            return self._fused_layer_from_input(index, layer, attention_input, hidden, cos, signed_sin, cache,
                                                attention)
        (q_heads, kv_heads, head_dim), length = self._heads, hidden.shape[0]
        qkv = layer.qkv(attention_input)
        qkv = qkv.view(length, -1, head_dim).transpose(0, 1)
        rotated = rotate(qkv[:q_heads + kv_heads], cos, signed_sin, self.kv_dtype)
        if self.scores_pre_rope:
            pre_rope = qkv[:q_heads + kv_heads].to(self.kv_dtype)
            keys, values = cache.append(index, rotated[q_heads:], qkv[q_heads + kv_heads:], pre_rope[q_heads:])
            mixed = attention(rotated[:q_heads], keys, values, index, cache, query_pre_rope=pre_rope[:q_heads])
        else:
            keys, values = cache.append(index, rotated[q_heads:], qkv[q_heads + kv_heads:])
            mixed = attention(rotated[:q_heads], keys, values, index, cache)
        mixed = mixed.to(self.dtype).transpose(0, 1).reshape(length, -1)
        hidden = torch.add(hidden, layer.o_proj(mixed), alpha=self.residual_scale)
        gate, up = layer.gate_up(rms_norm(hidden, layer.post_norm, self.eps, self.dtype)).chunk(2, dim=-1)
        return torch.add(hidden, layer.down_proj(F.silu(gate) * up), alpha=self.residual_scale)

    def _fused_layer_from_input(self, index, layer: "RuntimeLayer", attention_input, hidden, cos, signed_sin,
                                cache: KVCache, attention: Attention) -> torch.Tensor:
        """``layer_from_input`` with its glue in the fused CPU operators (quantkit/cpu_ops)."""
        ops, (q_heads, kv_heads, head_dim), length = self._ops, self._heads, hidden.shape[0]
        qkv = layer.qkv(attention_input).contiguous()
        end = cache.length + length
        key_buffer, value_buffer = cache.buffers(index, end)
        query = ops.rope_and_store(qkv, cos, signed_sin, key_buffer, value_buffer, cache.length, q_heads, kv_heads)
        if (attention is self.attention and length == 1 and getattr(attention, "dense", False)
                and end * (q_heads // kv_heads) <= FUSED_ATTENTION_MAX_SCORES):
            mixed = ops.decode_attention(query, key_buffer, value_buffer, end, head_dim ** -0.5)
        else:
            mixed = attention(query.to(self.kv_dtype), key_buffer[:, :end], value_buffer[:, :end], index, cache)
            mixed = mixed.to(self.dtype).transpose(0, 1).reshape(length, -1)
        hidden = torch.add(hidden, layer.o_proj(mixed), alpha=self.residual_scale)
        gate_up = layer.gate_up(ops.rms_norm_bf16(hidden, layer.post_norm, self.eps)).contiguous()
        return torch.add(hidden, layer.down_proj(ops.silu_mul(gate_up)), alpha=self.residual_scale)


class RuntimeModel(DecoderRunner):
    """Inference view of a MiniCPM model (its linears may be quantized modules, see
    ``quantkit.kernels.load``); ``attention`` is dense or InfLLM v2 (``quantkit.kernels.attention``).
    Matmuls run in the embeddings' dtype; the residual stream stays float32, which also makes the
    norms ~2x cheaper per token here. q/k/v and gate/up are fused into one matmul each."""

    def __init__(self, model: MiniCPMSkeleton, attention: Attention, kv_dtype: torch.dtype | None = None):
        """``kv_dtype``: the KV cache's (and attention's) dtype; by default ``fused_ops_and_kv_dtype``'s."""
        self.model = model.eval()
        self.config = config = model.config
        embeddings = model.model.embed_tokens.weight
        dtype, self.device = embeddings.dtype, embeddings.device
        ops, kv_dtype = fused_ops_and_kv_dtype(dtype, self.device, kv_dtype)
        super().__init__((config.num_attention_heads, config.num_key_value_heads, config.head_dim),
                         config.rms_norm_eps, config.residual_scale, dtype, kv_dtype, attention, ops)
        self._rope = RopeTables(model.model.rotary_emb)
        self.final_norm = model.model.norm.weight.float()
        self.layers = [RuntimeLayer.of(layer, release=True) for layer in model.model.layers]
        self.lm_head = prepacked(model.lm_head)

    def new_cache(self, compressed_keys=None) -> KVCache:
        config = self.config
        return KVCache(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, self.kv_dtype,
                       self.device, compressed_keys, pre_rope_keys=self.scores_pre_rope)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """tokens [T] at positions cache.length.. -> float32 logits of the last token [V] (or of
        every token [T, V]); the cache grows by T."""
        hidden = self._residual_stream(tokens, cache, {})
        return self._logits(hidden if all_logits else hidden[-1])

    @torch.inference_mode()
    def forward_capturing(self, tokens: torch.Tensor, cache: KVCache, layers: tuple[int, ...],
                          tree: tuple[torch.Tensor, torch.Tensor] | None = None, last_only: bool = False
                          ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``forward`` with every token's logits [T, V] (the last one's [1, V] with ``last_only``), and the
        float32 residual states [T, H] entering each of ``layers`` (what an EAGLE-3 draft head reads).
        ``tree`` = (positions [T], mask [T, cache length + T]): tokens of a draft tree, each at its own
        position, attending what its mask row allows (the cached context, its ancestors, itself) instead
        of everything before it."""
        captured = {layer: None for layer in layers}
        hidden = self._residual_stream(tokens, cache, captured, tree)
        return self._logits(hidden[-1:] if last_only else hidden), captured

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``MiniCPMForCausalLM.logits_from_hidden`` of the normed stream, on the runtime's LM head."""
        normed = rms_norm(hidden, self.final_norm, self.eps, self.dtype)
        return self.lm_head(normed / self.config.logit_divisor).float()

    def _residual_stream(self, tokens: torch.Tensor, cache: KVCache, captured: dict,
                         tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The float32 residual stream after the last layer [T, H]; fills ``captured``'s keys (layer
        indices) with the stream entering those layers."""
        positions, mask = tree if tree is not None else (
            torch.arange(cache.length, cache.length + tokens.shape[0], device=self.device), None)
        attention = self.forward_attention(mask, tokens.shape[0], cache)
        hidden = self.model.model.embed_tokens(tokens).float() * self.config.scale_emb
        cos, signed_sin = self._rope(positions)
        for index, layer in enumerate(self.layers):
            if index in captured:
                captured[index] = hidden
            hidden = self._layer(index, layer, hidden, cos, signed_sin, cache, attention)
        cache.advance(tokens.shape[0])
        return hidden

    def _layer(self, index, layer: "RuntimeLayer", hidden, cos, signed_sin, cache: KVCache,
               attention: Attention) -> torch.Tensor:
        return self.layer_from_input(index, layer, self.norm(hidden, layer.input_norm), hidden, cos, signed_sin, cache,
                                     attention)


class RuntimeLayer:
    """A decoder layer's modules as the runtime calls them: q/k/v and gate/up fused, bf16 CPU linears
    prepacked for oneDNN (``quantkit.kernels.linear.prepacked``)."""

    QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")

    @classmethod
    def of(cls, layer: nn.Module, release: bool = False, linear=prepacked) -> RuntimeLayer:
        """From a MiniCPM decoder layer (or an EAGLE-3 midlayer: the same module names). ``release``: the
        layer's q/k/v and gate/up become views of the fused modules (``FusedPart``), which then hold the
        only copy of their weights (the runtime's model; a draft head being trained keeps its own).
        ``linear``: how each (fused) linear runs, module -> module."""
        attention, mlp = layer.self_attn, layer.mlp
        made = cls(layer, _fused([getattr(attention, name) for name in cls.QKV]),
                   _fused([getattr(mlp, name) for name in cls.GATE_UP]), linear)
        if release:
            _release(attention, cls.QKV, made.qkv)
            _release(mlp, cls.GATE_UP, made.gate_up)
        return made

    def __init__(self, layer, qkv: nn.Module, gate_up: nn.Module, linear=prepacked):
        self.qkv, self.gate_up = linear(qkv), linear(gate_up)
        self.o_proj, self.down_proj = linear(layer.self_attn.o_proj), linear(layer.mlp.down_proj)
        self.input_norm = layer.input_layernorm.weight.float()
        self.post_norm = layer.post_attention_layernorm.weight.float()
