"""EAGLE-3's training-time test: the head's draft chains from every position of a row, unrolled.

At inference a chain starting after position t runs the head once on the target's states (step 0,
position t), then feeds it its own output: step j sits at position t + j, reads the previous step's
output at t + j − 1 and the token at t + j + 1, and attends to the real context (step 0's keys at
positions ≤ t) plus the chain's own earlier steps (step i's key at t + i). Training unrolls every
chain of a row at once (Li et al., EAGLE-3, arXiv 2503.01840, §3.2): step j is one pass over all
positions p, with p − j as chain start, under the mask that lets p see exactly those keys. Tokens are
the text's (teacher forcing), so step j at position p predicts token p + 2 from the target's
distribution there. ``tests/test_draft.py`` checks each step against the runtime drafter's
incremental steps.
"""
from __future__ import annotations

import torch
from torch import Tensor

from quantkit.models.decoder import apply_rotary
from quantkit.models.eagle3 import Eagle3Head


def ttt_mask(length: int, step: int, device=None) -> Tensor:
    """Boolean [length, (step + 1)·length]: query position p of step ``step`` may attend step 0's keys
    at positions ≤ p − step and step i's key at position p − step + i (i = 1..step)."""
    positions = torch.arange(length, device=device)
    start = positions - step  # chain start of each query
    blocks = [positions[None, :] <= start[:, None]]
    for i in range(1, step + 1):
        blocks.append(positions[None, :] == (start + i)[:, None])
    return torch.cat(blocks, dim=1)


def unrolled_steps(head: Eagle3Head, aux: Tensor, embeds: Tensor, steps: int) -> list[Tensor]:
    """The head's outputs (before its final norm) at every step of every chain.

    ``aux`` [B, L, 3·Ht]: the target's states at positions 0..L−1; ``embeds`` [B, L, H]: the head's
    embedding of the tokens at positions 1..L (the token after each position; every step at position
    p reads token p + 1 and predicts token p + 2). Returns ``steps`` tensors [B, L, H]; entry p of
    step j belongs to the chain that starts at p − j (meaningless where p < j)."""
    batch, length, _ = aux.shape
    position_ids = torch.arange(length, device=aux.device)[None].expand(batch, -1)
    position_embeddings = head.rotary_emb(aux, position_ids)
    layer, attention = head.midlayer, head.midlayer.self_attn
    keys, values, outputs = [], [], []
    hidden = head.project(aux)
    for step in range(steps):
        if step:  # the previous step's output at p − 1 (zeros where no chain reaches p)
            hidden = torch.cat([torch.zeros_like(outputs[-1][:, :1]), outputs[-1][:, :-1]], dim=1)
        both = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        cos, sin = position_embeddings
        query = apply_rotary(attention._heads(attention.q_proj(both)), cos, sin)
        keys.append(apply_rotary(attention._heads(attention.k_proj(both)), cos, sin))
        values.append(attention._heads(attention.v_proj(both)))
        mask = ttt_mask(length, step, aux.device)
        mixed = attention.core(query, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask, attention.scaling)
        hidden = hidden + attention.o_proj(mixed.transpose(1, 2).flatten(2)) * layer.residual_scale
        outputs.append(hidden + layer.mlp(layer.post_attention_layernorm(hidden)) * layer.residual_scale)
    return outputs

