"""InfLLM v2 on the CPU: the reference's computation, organised for speed.

- Stage 1 runs per chunk of query tokens as two batched float32 matmuls per KV group (coarse keys
  for the LSE, then fine keys), over only the compressed keys the chunk's last token can see.
- Block scores use one ``max_pool1d`` (window 5, stride 4, padding 1) instead of a loop over blocks,
  and selection one top-k on integer keys that reproduce the reference's stable sort exactly.
- Stage 2 gathers, per (KV group, token), only the selected 64-token blocks of K and V (whole-block
  row copies) and runs ``scaled_dot_product_attention`` on them (float32 accumulation, also for bf16
  inputs); the 16 query heads of a group are the rows of one small attention problem. Selections
  come sorted with the unused (-1) slots last, so each chunk is trimmed to its longest selection.
  A decode step needs no mask at all: every slot is used and only the last (current) block can be
  partial, so the gathered keys are cut to length instead.
- Over bf16 caches, when the fused kernels build (``fused_ops``, quantkit/cpu_ops/infllm_ops.cpp),
  stage 2 reads the selected blocks in place instead of gathering them, and a decode step runs
  stage 1 and the selection fused too, over the bf16 compressed keys. This module's PyTorch
  functions are their specification.

Block scoring and selection are plain tensor code and run on any device; the Triton path reuses them.
All tensors are head-major: q [Hq, T, d], k/v [Hkv, S, d] (each head's keys contiguous, as in the
model's KV cache, makes the block gathers row copies; other strides cost one copy of K and V).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from quantkit import cpu_ops
from quantkit.kernels.infllm.reference import forced_blocks
from quantkit.models.sparse_attention import SparseAttentionConfig

# Query tokens per stage-1 / stage-2 step: bounds the float32 score buffer (Hkv·G·chunk·n1) and the
# gathered K/V (Hkv·chunk·6144·d) to tens of MB at 64K keys.
STAGE1_CHUNK = 64
STAGE2_CHUNK = 16


# Keys a block of a decode step's dense attention by the fused block kernel (any size works; InfLLM v2's),
# the kernel's builds (``infllm_isa``) that run it faster than SDPA (built for a CPU without AVX-512 it is
# plain C++ loops), and the keys from which it does: below 256, SDPA's fixed cost is lower at
# MiniCPM4.1-8B's head shape (the default model's shorter contexts run the one-query operator anyway).
DENSE_DECODE_BLOCK = 64
DENSE_DECODE_ISAS = ("amx", "avx512_bf16", "avx512")
DENSE_DECODE_MIN_KEYS = 256


def causal_attention_of_last_positions(q, k, v) -> torch.Tensor:
    """Causal attention of the last T positions (dense attention, and InfLLM v2 below ``dense_len``).
    q [Hq, T, d], k/v [Hkv, S, d] -> [Hq, T, d]. A decode step over a bf16 cache runs the fused block
    kernel over every block (``fused_ops``, built with AVX-512): with AVX-512-BF16, 1.2-2.9x faster than
    SDPA from 256 keys on at the default model's head shape and from 384 on at MiniCPM4.1-8B's, as fast
    at 256 (``python -m quantkit.eval.bench.bench_decode_attention``); everything else, and fewer than
    ``DENSE_DECODE_MIN_KEYS`` keys, runs SDPA (``sdpa_attention_of_last_positions``)."""
    ops = fused_ops(q, k, v) if q.shape[1] == 1 and k.shape[1] >= DENSE_DECODE_MIN_KEYS else None
    if ops is None or not block_kernel_beats_sdpa(ops):
        return sdpa_attention_of_last_positions(q, k, v)
    return every_block_attention(ops, q, k, v)


@functools.cache
def block_kernel_beats_sdpa(ops) -> bool:
    """Whether the block kernel is built for AVX-512 (asked once per build, not in every layer of every step)."""
    return ops.infllm_isa() in DENSE_DECODE_ISAS


def every_block_attention(ops, q, k, v) -> torch.Tensor:
    """One query's attention over all S keys by the fused block kernel -> [Hq, 1, d] in q's dtype."""
    Hkv, S = k.shape[:2]
    every_block = torch.arange(math.ceil(S / DENSE_DECODE_BLOCK), device=q.device).expand(Hkv, 1, -1)
    return fused_block_attention(ops, q, k, v, every_block, DENSE_DECODE_BLOCK)


def verify_attention(q, k, v, visible) -> torch.Tensor | None:
    """A speculative round's dense attention by the fused kernel (``verify_attention``,
    quantkit/cpu_ops/infllm_ops.cpp): q [Hq, T, d], the T tokens being the last T of the bf16 caches k/v,
    each seeing every earlier key and those of the T that ``visible`` [T, T] (bool) allows -> [Hq, T, d]
    in q's dtype; None where the kernel does not apply or would not beat SDPA (``block_kernel_beats_sdpa``),
    for ``masked_attention`` (kernels/model.py), its specification."""
    ops = fused_ops(q, k, v)
    if ops is None or not block_kernel_beats_sdpa(ops):
        return None
    first = k.shape[1] - q.shape[1]
    return ops.verify_attention(q, k, v, first, visible, DENSE_DECODE_BLOCK, q.shape[-1] ** -0.5).to(q.dtype)


def sdpa_attention_of_last_positions(q, k, v) -> torch.Tensor:
    """``causal_attention_of_last_positions`` through SDPA (the fused kernel's specification and baseline).

    A decode step folds each KV group's query heads into the rows of one problem: SDPA's
    ``enable_gqa`` path measured 10x slower for a single query here (it expands K and V)."""
    (Hq, T, d), (Hkv, S, _) = q.shape, k.shape
    if T == 1:
        return F.scaled_dot_product_attention(q.reshape(1, Hkv, Hq // Hkv, d), k[None], v[None]).view(Hq, 1, d)
    mask = None
    if T < S:  # SDPA's is_causal aligns the first query with the first key; ours end together
        mask = torch.arange(S, device=q.device)[None, :] <= torch.arange(S - T, S, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=T == S,
                                          enable_gqa=Hq != Hkv)[0]


def visible_counts(positions, size: int, stride: int) -> torch.Tensor:
    """Compressed keys visible at each position: windows ending at or before it (a prefix)."""
    return ((positions + 1 - size).div(stride, rounding_mode="floor") + 1).clamp(min=0)


def stage1_scores(q, fine, coarse, positions, config: SparseAttentionConfig,
                  chunk: int = STAGE1_CHUNK) -> torch.Tensor:
    """As reference.stage1_scores: [Hkv, T, n1] float32 group-summed exp(s - lse_coarse)."""
    Hq, T, d = q.shape
    Hkv, n1, _ = fine.shape
    G = Hq // Hkv
    rows_all = (q.float() * d ** -0.5).reshape(Hkv, G, T, d)
    fine_t, coarse_t = fine.float().transpose(1, 2), coarse.float().transpose(1, 2)   # [Hkv, d, n]
    sees_fine = visible_counts(positions, config.kernel_size, config.kernel_stride).tolist()
    sees_coarse = visible_counts(positions, config.coarse_kernel_size, config.coarse_kernel_stride)
    out = torch.zeros(Hkv, T, n1, dtype=torch.float32, device=q.device)
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        width = sees_fine[t1 - 1]  # keys beyond the chunk's last token's view stay 0
        if width == 0:
            continue
        rows = rows_all[:, :, t0:t1].reshape(Hkv, G * (t1 - t0), d)
        lse = _masked_lse(rows @ coarse_t, sees_coarse[t0:t1])                     # [Hkv, G*C, 1]
        p = torch.exp_((rows @ fine_t[..., :width]).sub_(lse)).view(Hkv, G, t1 - t0, width)
        if sees_fine[t0] < width:
            hidden = torch.arange(width, device=q.device)[None, :] >= torch.tensor(
                sees_fine[t0:t1], device=q.device)[:, None]
            p.masked_fill_(hidden, 0.0)
        out[:, t0:t1, :width] = p.sum(1)
    return out


def _masked_lse(logits, sees) -> torch.Tensor:
    """logsumexp over each row's visible coarse keys; rows are (head, token), tokens fastest."""
    n2 = logits.shape[-1]
    if int(sees.min()) < n2:
        hidden = torch.arange(n2, device=logits.device)[None, :] >= sees[:, None]     # [C, n2]
        logits = logits.masked_fill(hidden.repeat(logits.shape[1] // len(sees), 1), -math.inf)
    return logits.logsumexp(-1, keepdim=True)


def block_scores(scores, positions, num_keys: int, config: SparseAttentionConfig) -> torch.Tensor:
    """As reference.block_scores, with one max_pool1d: padding 1 supplies the -inf that the
    official kernel's clipped window [4j-1, 4j+4) implies at the left edge."""
    Hkv, T, n1 = scores.shape
    nb = math.ceil(num_keys / config.block_size)
    stride = config.pool_stride
    padded = F.pad(scores, (0, stride * nb - n1), value=-math.inf)     # n1 <= stride*nb - 1 always
    pooled = F.max_pool1d(padded.view(Hkv * T, 1, -1), kernel_size=stride + 1, stride=stride, padding=1)
    pooled = pooled.view(Hkv, T, -1)[..., :nb]
    return pooled.masked_fill(forced_blocks(positions, nb, config)[None], math.inf)


def select_blocks(pooled, positions, config: SparseAttentionConfig) -> torch.Tensor:
    """As reference.select_blocks, with one top-k instead of a full stable sort (4x faster on 1,024
    blocks). Each score becomes a unique integer key that orders blocks exactly as the reference's
    stable descending sort: the float32 bits mapped to an order-preserving integer (negative floats
    have their magnitude bits flipped; adding 0.0 turns -0.0 into +0.0, which the sort treats as
    equal), times the block count, plus the block index reversed, so equal scores go to the earlier
    block."""
    nb = pooled.shape[-1]
    k = min(config.selected_blocks, nb)
    bits = (pooled.float() + 0.0).view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    keys = ordered * nb + torch.arange(nb - 1, -1, -1, device=pooled.device)
    idx = keys.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    return idx.masked_fill(idx > (positions // config.block_size)[None, :, None], -1)


def gather_blocks(x, blocks, block_size: int) -> torch.Tensor:
    """x [Hkv, S, d], blocks [Hkv, C, k] (valid indices) -> [Hkv, C, k*block_size, d]. A partial last
    block is padded with zeros (callers mask or cut those positions)."""
    Hkv, S, d = x.shape
    C, k = blocks.shape[1:]
    full = S // block_size
    if full == 0:
        gathered = x.new_zeros(Hkv, C, k, block_size, d)
    else:
        flat = x[:, : full * block_size].reshape(Hkv * full, block_size * d)
        rows = blocks.clamp(max=full - 1) + torch.arange(Hkv, device=x.device)[:, None, None] * full
        gathered = flat.index_select(0, rows.flatten()).view(Hkv, C, k, block_size, d)
    if full * block_size < S:
        # the partial last block: write it into the (few) slots that selected it, not a full-size select
        tail = x.new_zeros(Hkv, block_size, d)
        tail[:, : S - full * block_size] = x[:, full * block_size:]
        heads, rows, slots = (blocks == full).nonzero(as_tuple=True)
        gathered[heads, rows, slots] = tail[heads]
    return gathered.view(Hkv, C, k * block_size, d)


def block_sparse_attention(q, k, v, block_idx, positions, block_size: int,
                           chunk: int = STAGE2_CHUNK) -> torch.Tensor:
    """As reference.block_sparse_attention, gathering only the selected blocks. -> [Hq, T, d]."""
    Hq, T, d = q.shape
    Hkv, S, _ = k.shape
    G = Hq // Hkv
    rows_all = q.reshape(Hkv, G, T, d)
    if T == 1:  # decode: all slots used, the current block last (possibly partial), no mask needed
        length = block_idx.shape[-1] * block_size - (-S % block_size)
        keys = gather_blocks(k, block_idx, block_size)[:, :, :length]
        values = gather_blocks(v, block_idx, block_size)[:, :, :length]
        return F.scaled_dot_product_attention(rows_all.transpose(1, 2), keys, values).reshape(Hq, 1, d)
    used = (block_idx >= 0).sum(-1)                                       # [Hkv, T]: a prefix of slots
    offsets = torch.arange(block_size, device=q.device)
    out = q.new_empty(Hkv, T, G, d)
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        blocks = block_idx[:, t0:t1, : int(used[:, t0:t1].max())]          # [Hkv, C, kk]
        tokens = (blocks[..., None] * block_size + offsets).flatten(2)     # -1 slots give negatives
        allowed = (blocks >= 0).repeat_interleave(block_size, -1) & (tokens <= positions[None, t0:t1, None])
        blocks = blocks.clamp(min=0)
        out[:, t0:t1] = F.scaled_dot_product_attention(
            rows_all[:, :, t0:t1].transpose(1, 2), gather_blocks(k, blocks, block_size),
            gather_blocks(v, blocks, block_size), attn_mask=allowed[:, :, None, :])
    return out.transpose(1, 2).reshape(Hq, T, d)


def _bf16_rows(t, d: int) -> bool:
    return (t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.stride(2) == 1
            and (t.shape[1] <= 1 or t.stride(1) == d))


def fused_ops(q, k, v):
    """The fused kernels (quantkit/cpu_ops/infllm_ops.cpp) when they apply to these tensors, else None:
    bf16 keys and values on the CPU, each a stack of rows of d contiguous elements (the KV cache's
    layout), and a head dim that is a multiple of 32, at most 256."""
    d = q.shape[-1]
    applies = q.device.type == "cpu" and d % 32 == 0 and d <= 256 and _bf16_rows(k, d) and _bf16_rows(v, d)
    return cpu_ops.load() if applies else None


def fused_decode_applies(q, fine, coarse) -> bool:
    """Stage 1 and selection run fused too for one query over bf16 compressed keys, once a coarse key
    exists to take the log-sum-exp over."""
    d = q.shape[-1]
    return q.shape[1] == 1 and coarse.shape[1] > 0 and _bf16_rows(fine, d) and _bf16_rows(coarse, d)


def fused_block_attention(ops, q, k, v, block_idx, block_size: int) -> torch.Tensor:
    """``block_sparse_attention`` by the fused kernel, reading the selected blocks in place -> [Hq, T, d]
    in q's dtype."""
    out = ops.infllm_block_attention(q, k, v, block_idx, k.shape[1] - q.shape[1], block_size, q.shape[-1] ** -0.5)
    return out.to(q.dtype)


def fused_decode(ops, q, score_q, k, v, fine, coarse, config: SparseAttentionConfig) -> torch.Tensor:
    """One decode step by the fused kernels: stage 1, block selection and block-sparse attention, each
    held by the tests to this module's PyTorch functions for T = 1. score_q is q, or the pre-RoPE
    queries with use_nope. -> [Hq, 1, d] in q's dtype.
    Built without AVX-512 the block kernel is plain loops, and gathering the chosen blocks for SDPA is
    faster for one query (MiniCPM4.1-8B's shape, 8K keys, AVX2, 2 threads: 1.1 against 1.8 ms a layer;
    for a prefill chunk of 64 queries the kernel still wins, 124 against 233 ms)."""
    num_keys = k.shape[1]
    scores = ops.infllm_decode_scores(score_q[:, 0], fine, coarse, q.shape[-1] ** -0.5)
    num_blocks = math.ceil(num_keys / config.block_size)
    blocks = ops.infllm_decode_select(scores, num_blocks, config.pool_stride, config.init_blocks,
                                      config.local_blocks, min(config.selected_blocks, num_blocks))
    if block_kernel_beats_sdpa(ops):
        return fused_block_attention(ops, q, k, v, blocks[:, None], config.block_size)
    position = torch.tensor([num_keys - 1], device=q.device)
    return block_sparse_attention(q, k, v, blocks[:, None], position, config.block_size)
