"""InfLLM v2 sparse attention, readable PyTorch: the specification the fast paths are tested against.

Follows docs/model.md, "InfLLM v2" (the HF / infllmv2_cuda_impl path of MiniCPM4.1) step by step,
in float32, for one sequence. Layout is head-major, as in the model's attention and KV cache
([B, H, T, d] without the batch): ``q [Hq, T, d]`` are the queries of the *last* T positions of a
sequence whose keys and values are ``k, v [Hkv, S, d]`` (T == S: prefill; T == 1: a decode step; in
between: a prefill chunk after a cache). Query i sits at absolute position ``S - T + i``; every rule
below is written in absolute
positions, which makes prefill and decode one computation (docs/model.md, "InfLLM v2": in decode
"the kernel that ends at the current token is already usable", the same rule as prefill's
``16c + 31 <= r``).
"""
from __future__ import annotations

import math

import torch

from quantkit.models.sparse_attention import SparseAttentionConfig


def check_inputs(q, k, v, config: SparseAttentionConfig, q_nope=None, k_nope=None) -> None:
    """Clear errors for shapes the algorithm does not define."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"expected q [Hq, T, d], k and v [Hkv, S, d]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    (Hq, T, d), (Hkv, S, _) = q.shape, k.shape
    if k.shape[2] != d:
        raise ValueError(f"head dim of q ({d}) and k ({k.shape[2]}) differ")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if not 1 <= T <= S:
        raise ValueError(f"the {T} queries must be the last positions of the {S} keys (1 <= T <= S)")
    if config.use_nope:
        if q_nope is None or k_nope is None:
            raise ValueError("sparse_config.use_nope is true: pass q_nope and k_nope (pre-RoPE q and k)")
        if q_nope.shape != q.shape or k_nope.shape != k.shape:
            raise ValueError(f"q_nope {tuple(q_nope.shape)} / k_nope {tuple(k_nope.shape)} must match "
                             f"q {tuple(q.shape)} / k {tuple(k.shape)}")


def query_positions(num_queries: int, num_keys: int, device=None) -> torch.Tensor:
    """Absolute positions of the queries: the last ``num_queries`` of ``num_keys``."""
    return torch.arange(num_keys - num_queries, num_keys, device=device)


def num_windows(length: int, size: int, stride: int) -> int:
    """Complete windows ``[stride*c, stride*c + size)`` inside ``length`` tokens (n1 = (L-32)//16 + 1)."""
    return 0 if length < size else (length - size) // stride + 1


def compress_keys(keys: torch.Tensor, size: int, stride: int) -> torch.Tensor:
    """CompressK: the mean of every complete window of ``size`` keys, windows ``stride`` apart.

    keys [Hkv, L, d] -> [Hkv, n, d] in keys' dtype (the official cache holds them in the model
    dtype); the mean accumulates in float32. Parameter-free: InfLLM v2 adds no weights.
    """
    if keys.shape[1] < size:
        return keys.new_zeros((keys.shape[0], 0, keys.shape[2]))
    return keys.unfold(1, size, stride).mean(-1, dtype=torch.float32).to(keys.dtype)


def kernel_visible(positions: torch.Tensor, count: int, size: int, stride: int) -> torch.Tensor:
    """[T, count] bool: compressed key c is visible to a query at position r iff its window ends at
    or before r, ``stride*c + size - 1 <= r`` (infllmv2 mask.h apply_mask_stage1)."""
    ends = torch.arange(count, device=positions.device) * stride + size - 1
    return ends[None, :] <= positions[:, None]


def stage1_scores(q, fine, coarse, positions, config: SparseAttentionConfig) -> torch.Tensor:
    """Relevance of every fine compressed key to every query token, per KV group (stage 1).

    q [Hq, T, d]; fine [Hkv, n1, d]; coarse [Hkv, n2, d] -> score [Hkv, T, n1] float32:
    ``score[g, t, c] = sum over the heads h of group g of exp(s_h(t, c) - lse_h(t))`` where
    ``s_h = q_h . fine_c / sqrt(d)`` and ``lse_h`` is the log-sum-exp over the *coarse* keys (the LSE
    approximation, IV2 §3.4), so a row need not sum to 1: only the ranking matters. Summing over the
    group (kernel ``hdim16_reduce``) makes the 16 heads of a KV group share one selection. Keys a
    query cannot see contribute 0. A query that sees no coarse key yet (r < 127) gets lse = -inf,
    hence +inf for every visible fine key: only forced blocks exist that early, so it is harmless.
    """
    Hq, T, d = q.shape
    Hkv = fine.shape[0]
    qg = q.float().reshape(Hkv, Hq // Hkv, T, d)
    scale = d ** -0.5
    s_fine = torch.einsum("ghtd,gcd->ghtc", qg, fine.float()) * scale          # [Hkv, G, T, n1]
    s_coarse = torch.einsum("ghtd,gcd->ghtc", qg, coarse.float()) * scale      # [Hkv, G, T, n2]
    return group_scores(s_fine, s_coarse, positions, config)


def group_scores(s_fine, s_coarse, positions, config: SparseAttentionConfig) -> torch.Tensor:
    """Stage 1 from the scaled logits [Hkv, G, T, n1] and [Hkv, G, T, n2] of compressed keys in window
    order: exp(s - lse over the visible coarse keys), 0 where a fine key is not visible, summed over
    the group -> [Hkv, T, n1]."""
    sees_fine = kernel_visible(positions, s_fine.shape[-1], config.kernel_size, config.kernel_stride)
    sees_coarse = kernel_visible(positions, s_coarse.shape[-1], config.coarse_kernel_size,
                                 config.coarse_kernel_stride)
    lse = s_coarse.masked_fill(~sees_coarse, -math.inf).logsumexp(-1, keepdim=True)
    p = (s_fine - lse).exp().masked_fill(~sees_fine, 0.0)
    return p.sum(1)


def block_scores(scores, positions, num_keys: int, config: SparseAttentionConfig) -> torch.Tensor:
    """Max-pool kernel scores onto blocks and force the initial and local blocks (infllmv2 max_pooling_1d).

    scores [Hkv, T, n1] -> [Hkv, T, nb], nb = ceil(num_keys / block_size). Block j takes the max over
    kernels ``[4j-1, 4j+4)`` (pooling stride block/kernel_stride = 4, window 5, padding 1): the 32-token
    kernels that overlap tokens ``[64j, 64j+64)`` (TR eq. 1); -inf when no such kernel exists yet.
    Blocks ``j < init_blocks`` and ``qb - local_blocks <= j <= qb`` (qb: the query's own block) get
    +inf, so they are always selected: 1 + 33 blocks for MiniCPM4.1.
    """
    Hkv, T, n1 = scores.shape
    nb = math.ceil(num_keys / config.block_size)
    stride = config.pool_stride
    pooled = torch.full((Hkv, T, nb), -math.inf, device=scores.device)
    for j in range(nb):
        lo, hi = max(stride * j - 1, 0), min(stride * j + stride, n1)
        if hi > lo:
            pooled[..., j] = scores[..., lo:hi].amax(-1)
    return pooled.masked_fill(forced_blocks(positions, nb, config)[None], math.inf)


def forced_blocks(positions, num_blocks: int, config: SparseAttentionConfig) -> torch.Tensor:
    """[T, nb] bool: the initial blocks and the local window (including the query's own block)."""
    j = torch.arange(num_blocks, device=positions.device)[None, :]
    qb = (positions // config.block_size)[:, None]
    return (j < config.init_blocks) | ((j <= qb) & (j >= qb - config.local_blocks))


def select_blocks(pooled, positions, config: SparseAttentionConfig) -> torch.Tensor:
    """Top-k blocks per (KV group, token) (top-k): ``min(topk + local_blocks, nb)`` best blocks,
    sorted ascending, then every block after the query's own block replaced by -1 (so fewer than the
    budget remain early in a sequence). -> [Hkv, T, k] int64, -1 = no block.

    Equal scores are common, not an accident: adjacent blocks share their boundary kernel (4j+3 is
    4(j+1)-1), so both take its score whenever it is the larger one's maximum. The official
    ``torch.topk`` leaves the order of equal values unspecified (on the CPU it changes with the
    number of blocks, so a decode step and a prefill of the same tokens could choose differently);
    here ties go to the earlier block (a stable descending sort), the same at every length.
    """
    k = min(config.selected_blocks, pooled.shape[-1])
    idx = pooled.sort(dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values
    qb = positions // config.block_size
    return idx.masked_fill(idx > qb[None, :, None], -1)


def selected_token_mask(block_idx, positions, num_keys: int, block_size: int) -> torch.Tensor:
    """[Hkv, T, S] bool: key m is attended by query t iff m's block was selected and m <= position(t)."""
    Hkv, T, _ = block_idx.shape
    nb = math.ceil(num_keys / block_size)
    chosen = torch.zeros(Hkv, T, nb + 1, dtype=torch.bool, device=block_idx.device)
    chosen.scatter_(2, torch.where(block_idx < 0, nb, block_idx), True)  # -1 -> spare column nb
    keys = torch.arange(num_keys, device=block_idx.device)
    return chosen[..., keys // block_size] & (keys[None, None, :] <= positions[None, :, None])


def block_sparse_attention(q, k, v, block_idx, positions, block_size: int) -> torch.Tensor:
    """Stage 2 (infllmv2_attn_varlen_func): softmax attention over the selected blocks only,
    token-level causal inside them, scale 1/sqrt(d); the heads of a KV group share its blocks.
    -> [Hq, T, d] in q's dtype."""
    return masked_attention(q, k, v, selected_token_mask(block_idx, positions, k.shape[1], block_size))


def dense_causal_attention(q, k, v) -> torch.Tensor:
    """Ordinary causal attention (the ``dense_len`` fallback), queries at the last T positions."""
    S = k.shape[1]
    keys = torch.arange(S, device=q.device)
    causal = keys[None, :] <= query_positions(q.shape[1], S, q.device)[:, None]
    return masked_attention(q, k, v, causal.expand(k.shape[0], -1, -1))


def masked_attention(q, k, v, allowed) -> torch.Tensor:
    """Float32 softmax attention of q [Hq, T, d] over k, v [Hkv, S, d] where allowed [Hkv, T, S]."""
    Hq, T, d = q.shape
    Hkv = k.shape[0]
    qg = q.float().reshape(Hkv, Hq // Hkv, T, d)
    logits = torch.einsum("ghtd,gsd->ghts", qg, k.float()) * d ** -0.5            # [Hkv, G, T, S]
    weights = logits.masked_fill(~allowed[:, None], -math.inf).softmax(-1)
    return torch.einsum("ghts,gsd->ghtd", weights, v.float()).reshape(Hq, T, d).to(q.dtype)


def reference_block_selection(q, k, config: SparseAttentionConfig) -> torch.Tensor:
    """Stage 1, block scores and top-k for the last T positions; q, k are the scoring q/k (post-RoPE,
    or pre-RoPE with use_nope). -> [Hkv, T, k] as :func:`select_blocks`."""
    S = k.shape[1]
    positions = query_positions(q.shape[1], S, q.device)
    fine = compress_keys(k, config.kernel_size, config.kernel_stride)
    coarse = compress_keys(k, config.coarse_kernel_size, config.coarse_kernel_stride)
    scores = stage1_scores(q, fine, coarse, positions, config)
    return select_blocks(block_scores(scores, positions, S, config), positions, config)


def sparse_attention_reference(q, k, v, config: SparseAttentionConfig, q_nope=None, k_nope=None) -> torch.Tensor:
    """InfLLM v2 attention of the last T positions: dense below ``dense_len`` keys, else stage 1 on
    compressed keys, block selection, and block-sparse stage 2 (docs/model.md, "InfLLM v2"). ``use_nope``: blocks are
    scored with the pre-RoPE ``q_nope``/``k_nope``; stage 2 still uses the RoPE'd q and k.

    HF repeats query heads when a KV group has fewer than 16 (a tensor-core constraint) and averages
    the copies back: that scales every group score by the same factor and leaves outputs unchanged,
    so it is not reproduced here.
    """
    check_inputs(q, k, v, config, q_nope, k_nope)
    if config.is_dense(k.shape[1]):
        return dense_causal_attention(q, k, v)
    score_q, score_k = (q_nope, k_nope) if config.use_nope else (q, k)
    block_idx = reference_block_selection(score_q, score_k, config)
    positions = query_positions(q.shape[1], k.shape[1], q.device)
    return block_sparse_attention(q, k, v, block_idx, positions, config.block_size)
