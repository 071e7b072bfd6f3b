"""InfLLM v2 stage 2 as a Triton kernel: block-sparse attention for prefill chunks and decode.

One program per (KV head, query token) walks that pair's selected blocks (``block_idx`` [Hkv, T, k],
-1 = none) with an online softmax, computing all query heads of the KV group at once (they share the
selection, which is why the official kernel groups them too): one [heads, d] x [d, 64] product per
block. Token-level causality masks keys after the query's position inside its own block.
Proven against the CPU path under TRITON_INTERPRET=1 (tests/test_triton.py).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

MIN_DOT = 16  # tl.dot needs every dimension >= 16: small KV groups are padded with masked heads


@triton.jit
def group_queries(q_ptr, positions_ptr, T, GROUP, HEADS: tl.constexpr, DIM: tl.constexpr):
    """Where every InfLLM kernel starts: the program's KV head and token, its group's query rows
    (heads past GROUP are padding, masked), their queries as float32 [HEADS, DIM], the token's position."""
    kv_head = tl.program_id(0)
    token = tl.program_id(1)
    heads = tl.arange(0, HEADS)
    head_ok = heads < GROUP
    q_rows = (kv_head * GROUP + heads) * T + token
    q = tl.load(q_ptr + q_rows[:, None] * DIM + tl.arange(0, DIM)[None, :], mask=head_ok[:, None],
                other=0.0).to(tl.float32)
    return kv_head, token, head_ok, q_rows, q, tl.load(positions_ptr + token)


@triton.jit
def _block_sparse_kernel(q_ptr, k_ptr, v_ptr, blocks_ptr, positions_ptr, out_ptr,
                         T, S, NUM_SLOTS, GROUP, scale,
                         HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr):
    kv_head, token, head_ok, q_rows, q, position = group_queries(q_ptr, positions_ptr, T, GROUP, HEADS, DIM)
    dims = tl.arange(0, DIM)
    best = tl.full((HEADS,), -1.0e30, dtype=tl.float32)
    total = tl.zeros((HEADS,), dtype=tl.float32)
    acc = tl.zeros((HEADS, DIM), dtype=tl.float32)
    for slot in range(0, NUM_SLOTS):
        block = tl.load(blocks_ptr + (kv_head * T + token) * NUM_SLOTS + slot)
        keys_at = block * BLOCK + tl.arange(0, BLOCK)
        key_ok = (keys_at >= 0) & (keys_at <= position) & (keys_at < S)  # block -1: negative positions
        rows = kv_head * S + keys_at
        k = tl.load(k_ptr + rows[:, None] * DIM + dims[None, :], mask=key_ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows[:, None] * DIM + dims[None, :], mask=key_ok[:, None], other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(key_ok[None, :], scores, -1.0e30)
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        weights = tl.where(key_ok[None, :], tl.exp(scores - new_best[:, None]), 0.0)
        decay = tl.exp(best - new_best)
        total = total * decay + tl.sum(weights, axis=1)
        acc = acc * decay[:, None] + tl.dot(weights, v)
        best = new_best
    out = acc / total[:, None]
    tl.store(out_ptr + q_rows[:, None] * DIM + dims[None, :], out, mask=head_ok[:, None])


def block_sparse_attention(q, k, v, block_idx, positions, block_size: int) -> torch.Tensor:
    """As ``reference.block_sparse_attention``: q [Hq, T, d], k/v [Hkv, S, d] -> [Hq, T, d] in q's dtype."""
    (Hq, T, d), (Hkv, S, _) = q.shape, k.shape
    group = Hq // Hkv
    heads = max(MIN_DOT, triton.next_power_of_2(group))
    if d < MIN_DOT or d & (d - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two head dim >= {MIN_DOT}, got {d}")
    out = torch.empty(Hq, T, d, dtype=torch.float32, device=q.device)
    _block_sparse_kernel[(Hkv, T)](
        q.contiguous(), k.contiguous(), v.contiguous(), block_idx.contiguous(), positions.contiguous(), out,
        T, S, block_idx.shape[-1], group, 1 / math.sqrt(d), HEADS=heads, DIM=d, BLOCK=block_size)
    return out.to(q.dtype)
