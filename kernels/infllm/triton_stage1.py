"""InfLLM v2 stage 1 as a Triton kernel: block-relevance scores of the fine compressed keys.

One program per (KV head, query token): a first pass over the visible coarse keys gives each query
head's log-sum-exp (the LSE approximation), a second pass scores the visible fine keys,
exp(q·k/√d − lse), summed over the query heads of the group (the official kernel's group
reduction). Output [Hkv, T, n1] float32, equal to ``reference.stage1_scores`` including its +inf for
queries that see no coarse key yet. Proven under TRITON_INTERPRET=1 (tests/test_triton.py).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from quantkit.kernels.infllm.triton_attention import MIN_DOT, group_queries
from quantkit.models.sparse_attention import SparseAttentionConfig

KEYS_PER_STEP = 64


@triton.jit
def _stage1_kernel(q_ptr, fine_ptr, coarse_ptr, positions_ptr, out_ptr, T, N_FINE, N_COARSE, GROUP, scale,
                   FINE_SIZE, FINE_STRIDE, COARSE_SIZE, COARSE_STRIDE,
                   HEADS: tl.constexpr, DIM: tl.constexpr, STEP: tl.constexpr):
    kv_head, token, head_ok, q_rows, q, position = group_queries(q_ptr, positions_ptr, T, GROUP, HEADS, DIM)
    dims = tl.arange(0, DIM)
    best = tl.full((HEADS,), -1.0e30, dtype=tl.float32)
    total = tl.zeros((HEADS,), dtype=tl.float32)
    for c0 in range(0, N_COARSE, STEP):
        index = c0 + tl.arange(0, STEP)
        visible = (index < N_COARSE) & (index * COARSE_STRIDE + COARSE_SIZE - 1 <= position)
        keys = tl.load(coarse_ptr + (kv_head * N_COARSE + index[:, None]) * DIM + dims[None, :],
                       mask=visible[:, None], other=0.0).to(tl.float32)
        scores = tl.where(visible[None, :], tl.dot(q, tl.trans(keys)) * scale, -1.0e30)
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        total = total * tl.exp(best - new_best) + tl.sum(tl.where(visible[None, :],
                                                                  tl.exp(scores - new_best[:, None]), 0.0), axis=1)
        best = new_best
    sees_coarse = total > 0
    lse = tl.where(sees_coarse, best + tl.log(tl.where(sees_coarse, total, 1.0)), 0.0)  # 0: no overflow below
    for f0 in range(0, N_FINE, STEP):
        index = f0 + tl.arange(0, STEP)
        in_range = index < N_FINE
        visible = in_range & (index * FINE_STRIDE + FINE_SIZE - 1 <= position)
        keys = tl.load(fine_ptr + (kv_head * N_FINE + index[:, None]) * DIM + dims[None, :],
                       mask=visible[:, None], other=0.0).to(tl.float32)
        p = tl.exp(tl.dot(q, tl.trans(keys)) * scale - lse[:, None])
        p = tl.where(head_ok[:, None] & visible[None, :], p, 0.0)
        summed = tl.sum(p, axis=0)
        no_lse = tl.sum(tl.where(head_ok & sees_coarse, 1, 0), axis=0) == 0
        summed = tl.where(visible & no_lse, float("inf"), summed)
        tl.store(out_ptr + (kv_head * T + token) * N_FINE + index, summed, mask=in_range)


def stage1_scores(q, fine, coarse, positions, config: SparseAttentionConfig) -> torch.Tensor:
    """As ``reference.stage1_scores``: q [Hq, T, d], fine [Hkv, n1, d], coarse [Hkv, n2, d] -> [Hkv, T, n1]."""
    (Hq, T, d), (Hkv, n1, _), n2 = q.shape, fine.shape, coarse.shape[1]
    group = Hq // Hkv
    out = torch.zeros(Hkv, T, n1, dtype=torch.float32, device=q.device)
    if n1 == 0:
        return out
    _stage1_kernel[(Hkv, T)](
        q.contiguous(), fine.contiguous(), coarse.contiguous(), positions.contiguous(), out, T, n1, n2, group,
        1 / math.sqrt(d), config.kernel_size, config.kernel_stride, config.coarse_kernel_size,
        config.coarse_kernel_stride, HEADS=max(MIN_DOT, triton.next_power_of_2(group)), DIM=d, STEP=KEYS_PER_STEP)
    return out
