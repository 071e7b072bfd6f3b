"""An EAGLE-3 head drafting for the runtime's target (``quantkit.kernels.speculative.Drafter``).

The head (``quantkit.models.eagle3``) pairs the target's residual states at position t with the token
at t + 1 and predicts the token at t + 2. With a ``window`` the head attends only the last ``window``
verified positions (CPM.cu's --spec-window-size, after TriForce): in long contexts its attention stays
cheap, and it drafts better from recent context. The drafter keeps one KV cache for the head's single layer:
positions whose target states are known ("observed") stay; the entries a proposal adds on top (each
draft step feeds the head its own previous output) are dropped at the next ``observe``, which then
appends the verified positions computed from the target's real states.
"""
from __future__ import annotations

import torch
from torch import nn

from quantkit.kernels.infllm import causal_attention_of_last_positions
from quantkit.kernels.kv_cache import KVCache
from quantkit.kernels.linear.prepacked import prepacked
from quantkit.kernels.model import DecoderRunner, RopeTables, RuntimeLayer, causal_mask, fused_ops_and_kv_dtype
from quantkit.kernels.sampling import Sampler
from quantkit.kernels.speculative import DraftTree, TreeShape, draft_children, grow_tree, tree_attention_mask
from quantkit.models.eagle3 import Eagle3Head


def drafting_linear(module: nn.Module) -> nn.Module:
    """One of the head's linears as drafting runs it: a bf16 one on the CPU as int8 codes per group of 128
    columns (``Int8Linear``, what a quantized target's own LM head runs as), else as it is (prepacked for
    oneDNN where that applies). The target's forward evicts the head's weights from the caches every
    round, so each round reads them from memory again (24 MB of bf16 on the default model, 14 MB of it
    the 12,288-row LM head every draft token reads); int8 halves that. A draft's precision can only
    change which tokens are proposed: the target's verification decides the output."""
    from quantkit.kernels.linear.int8 import Int8Linear

    if (type(module) is nn.Linear and module.bias is None and module.weight.dtype == torch.bfloat16
            and module.weight.device.type == "cpu"):  # a quantized head's linears have no ``weight``
        return Int8Linear(module.weight)
    return prepacked(module)


class _DenseAttention:
    dense = True  # draft trees may pass their own mask

    def __call__(self, query, keys, values, layer, cache):
        return causal_attention_of_last_positions(query, keys, values)


class Eagle3Drafter(DecoderRunner):
    def __init__(self, head: Eagle3Head, embedding: nn.Embedding, window: int | None = None):
        config = head.config
        dtype = embedding.weight.dtype
        ops, kv_dtype = fused_ops_and_kv_dtype(dtype, embedding.weight.device)  # as the target's runtime
        super().__init__((config.num_attention_heads, config.num_key_value_heads, config.head_dim),
                         config.rms_norm_eps, head.midlayer.residual_scale, dtype, kv_dtype, _DenseAttention(), ops)
        self.head = head.to(dtype).eval()
        self.aux_layers = head.aux_layers
        self._embedding, self._scale_emb = embedding, head.target.scale_emb
        midlayer = head.midlayer
        self._layer = RuntimeLayer.of(midlayer, linear=drafting_linear)
        self._rope = RopeTables(head.rotary_emb)
        self._fc, self._lm_head = drafting_linear(head.fc), drafting_linear(head.lm_head)
        self._final_norm = head.norm.weight.float()
        self._embedding_norm = midlayer.input_layernorm.weight.float()
        self._hidden_norm = midlayer.hidden_norm.weight.float()
        self._device = embedding.weight.device
        if window is not None and window < 1:
            raise ValueError(f"the draft's window must be >= 1 position, got {window}")
        self.window = window
        self.crop(0)

    def crop(self, length: int) -> None:
        """``Drafter.crop``. The entry at position p read the token at p + 1, so a caller continuing a
        sequence keeps only positions whose next token is unchanged (``ChatSession``)."""
        if length == 0:
            config = self.head.config
            self._cache = KVCache(1, config.num_key_value_heads, config.head_dim, self.kv_dtype, self._device)
        elif length > self._observed:
            raise ValueError(f"the draft head has observed {self._observed} positions, not {length}")
        self._cache.crop(length)
        self._observed = length
        self._last: torch.Tensor | None = None  # the head's output at the last observed position [1, H]

    @torch.inference_mode()
    def observe(self, tokens: torch.Tensor, states: dict[int, torch.Tensor], next_tokens: torch.Tensor) -> None:
        """Verified context (``Drafter.observe``); the head reads the states and the next tokens."""
        self._cache.crop(self._observed)
        hidden = self._fc(self.head.aux_from_states(states).to(self.dtype)).float()  # the head's ``project``
        hidden = self._step(hidden, next_tokens, verified=self._cache.length + len(next_tokens))
        self._observed, self._last = self._cache.length, hidden[-1:]

    @torch.inference_mode()
    def propose(self, count: int, sampler: Sampler) -> tuple[list[int], list[torch.Tensor] | None]:
        """``Drafter.propose``: target ids; a sampled draft's distribution is zero outside the draft vocabulary."""
        if self._last is None:
            raise RuntimeError("observe the prompt before proposing")
        greedy = sampler.settings.temperature == 0
        tokens, distributions, hidden = [], [], self._last
        for step in range(count):
            logits = self._logits(hidden)[-1]
            if greedy:
                draft_id = int(logits.argmax())
            else:
                draft = torch.softmax(logits.double() / sampler.settings.temperature, dim=-1)
                draft_id = sampler.draw(draft)
                distributions.append(self._over_target(draft))
            tokens.append(int(self.head.target_ids(torch.tensor(draft_id))))
            if step + 1 < count:
                hidden = self._step(hidden, torch.tensor(tokens[-1:], device=self._device))
        return tokens, None if greedy else distributions

    @torch.inference_mode()
    def propose_tree(self, shape: TreeShape, sampler: Sampler) -> DraftTree:
        """``Drafter.propose_tree``: a node at depth d runs at position (observed − 1) + d on its parent's
        output, attending the verified context and its own lineage."""
        outputs, slots = {}, {}  # node -> the head's output [1, H]; node -> its cache slot

        def children_of(frontier: list[int], tree: DraftTree):
            if frontier == [-1]:
                hidden = self._last
            else:
                start = self._cache.length
                parents = torch.cat([outputs.get(tree.parents[node], self._last) for node in frontier])
                positions = torch.tensor([self._observed - 1 + tree.depth(node) for node in frontier],
                                         device=self._device)
                hidden = self._step(parents, torch.tensor([tree.tokens[n] for n in frontier], device=self._device),
                                    positions, tree_attention_mask(tree, frontier, slots, self._observed, start))
                for row, node in enumerate(frontier):
                    outputs[node], slots[node] = hidden[row:row + 1], start + row
            return [(log_probs, self.head.target_ids(ids), None if q is None else self._over_target(q))
                    for log_probs, ids, q in draft_children(self._logits(hidden), shape.topk, sampler)]

        tree = grow_tree(shape, children_of, sampled=sampler.settings.temperature > 0)
        self._cache.crop(self._observed)
        return tree

    def _over_target(self, draft: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft vocabulary as one over the target's (zero outside the draft's)."""
        return (torch.zeros(self.head.config.vocab_size, dtype=draft.dtype, device=draft.device)
                .index_put_((self.head.target_ids(torch.arange(draft.numel(), device=draft.device)),), draft))

    def _windowed(self, positions: torch.Tensor, mask: torch.Tensor | None, verified: int | None) -> torch.Tensor:
        """``mask`` (or causal attention) without the verified positions more than ``window`` back. Other
        entries (draft tokens) are the query's own chain or lineage: always within reach."""
        slots = torch.arange(self._cache.length + len(positions), device=self._device)
        if mask is None:
            mask = causal_mask(self._cache.length, len(positions), self._device)
        old = slots[None, :] < (self._observed if verified is None else verified)
        return mask & ~(old & (slots[None, :] <= positions[:, None] - self.window))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._lm_head(self.norm(hidden, self._final_norm)).float()

    def _step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor | None = None,
              mask: torch.Tensor | None = None, verified: int | None = None) -> torch.Tensor:
        """One pass of the head's layer: hidden [T, H] float32 and the tokens that follow [T], at the next
        positions (or ``positions``, under ``mask`` over every cached entry and these) -> the layer's
        output [T, H] float32 (before the head's final norm). ``verified``: how many cache slots (these
        included) hold verified positions, whose slot is their position (default: those observed)."""
        if positions is None:
            positions = torch.arange(self._cache.length, self._cache.length + tokens.shape[0], device=self._device)
        if self.window is not None:
            mask = self._windowed(positions, mask, verified)
        cos, signed_sin = self._rope(positions)
        embeds = self._embedding(tokens).float() * self._scale_emb
        both = torch.cat([self.norm(embeds, self._embedding_norm), self.norm(hidden, self._hidden_norm)], dim=-1)
        attention = self.forward_attention(mask, tokens.shape[0], self._cache)
        hidden = self.layer_from_input(0, self._layer, both, hidden, cos, signed_sin, self._cache, attention)
        self._cache.advance(tokens.shape[0])
        return hidden
