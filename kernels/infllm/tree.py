"""InfLLM v2 for a draft tree's verification: every node attends as a decode step at its position would.

A verified tree holds the root (the last committed token, at position ``start``, slot ``start``) and
its nodes in slots ``start + 1 ..`` in drafting order, a node at position ``start + depth``; a drafter
growing a tree runs each level's nodes after the earlier levels' slots. The cache order is not a
sequence, so the rules of ``sparse_attention`` (windows pooled from the keys before a position,
blocks by position) are applied per node to its branch, the shared context followed by its lineage:

- compressed keys: the context's (pooled once, into the layer's cache, shared by every node) plus the
  few windows that end on the branch after ``start`` (at most a coarse window's worth of context and
  the lineage), pooled per node from the branch's own keys exactly as ``compress_keys`` pools them;
- block scores and selection as in ``sparse_attention``, at the node's position;
- attention over the context positions of its chosen blocks and the lineage positions in them;
- a node whose branch is shorter than ``dense_len`` attends its whole branch, as a decode step there
  would, even when other nodes of the tree are past it.

So greedy decoding with trees equals plain greedy decoding on a sparse target, as with chains
(tests/test_speculative.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.kernels.infllm import cpu
from quantkit.kernels.infllm.cache import CompressedKeyCache
from quantkit.kernels.infllm.reference import compress_keys, group_scores, num_windows
from quantkit.models.sparse_attention import SparseAttentionConfig


def _branch_slots(context: int, extra: torch.Tensor, first: int) -> torch.Tensor:
    """[T, context + max extras - first]: per row, the cache slot holding each branch position from
    ``first`` on: context positions are their own slots, then the row's extra slots in ascending order
    (a position past the row's own is never read, and is left at slot 0)."""
    last = context + int(extra.sum(1).max())
    slots = torch.arange(first, last).repeat(extra.shape[0], 1)
    slots[:, max(context - first, 0):] = 0
    rows, columns = extra.nonzero(as_tuple=True)
    rank = extra.cumsum(1) - 1  # an extra slot's place on its row's branch
    slots[rows, context + rank[rows, columns] - first] = context + columns
    return slots


def _branch_windows(keys: torch.Tensor, context: int, extra: torch.Tensor, size: int,
                    stride: int) -> torch.Tensor:
    """Each row's windows that end past the context on its branch [Hkv, T, E, d], in window order."""
    first = num_windows(context, size, stride)
    count = num_windows(context + int(extra.sum(1).max()), size, stride) - first
    heads, _, dim = keys.shape
    if count == 0:
        return keys.new_zeros(heads, extra.shape[0], 0, dim)
    slots = _branch_slots(context, extra, stride * first)
    branch = keys[:, slots.flatten()].view(heads * extra.shape[0], slots.shape[1], dim)
    return compress_keys(branch, size, stride)[:, :count].view(heads, extra.shape[0], count, dim)


def _scores(q: torch.Tensor, shared: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """q [Hkv, G, T, d] against the shared compressed keys [Hkv, n, d] and each row's own [Hkv, T, E, d]
    -> [Hkv, G, T, n + E], scaled."""
    scale = q.shape[-1] ** -0.5
    return torch.cat([torch.einsum("ghtd,gcd->ghtc", q, shared.float()),
                      torch.einsum("ghtd,gtcd->ghtc", q, own.float())], dim=-1) * scale


def _context_windows(score_k, context: int, config, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared context's fine and coarse compressed keys, from the layer's cache (extended by the context's
    windows; the tree's slots are not pooled into it) or pooled here."""
    shared = score_k[:, :context]
    if cache is not None:
        return cache.update(shared)
    return (compress_keys(shared, config.kernel_size, config.kernel_stride),
            compress_keys(shared, config.coarse_kernel_size, config.coarse_kernel_stride))


def _select(score_q, score_k, context: int, extra, positions, config, fine, coarse) -> torch.Tensor:
    """Each row's chosen blocks [Hkv, T, k] (-1: none), as ``sparse_attention`` chooses them."""
    own_fine = _branch_windows(score_k, context, extra, config.kernel_size, config.kernel_stride)
    own_coarse = _branch_windows(score_k, context, extra, config.coarse_kernel_size, config.coarse_kernel_stride)
    heads, dim = fine.shape[0], score_q.shape[-1]
    rows = score_q.float().reshape(heads, -1, len(positions), dim)
    scores = group_scores(_scores(rows, fine, own_fine), _scores(rows, coarse, own_coarse), positions, config)
    num_keys = int(positions.max()) + 1
    return cpu.select_blocks(cpu.block_scores(scores, positions, num_keys, config), positions, config)


def _chain_windows(score_k, context: int, end: int, compressed, size: int, stride: int) -> torch.Tensor:
    """The context's compressed keys followed by those of the windows that end on a chain of positions up to
    ``end``: the keys the decode step at ``end - 1`` holds, of which an earlier row sees a prefix."""
    first = num_windows(context, size, stride)
    completed = compress_keys(score_k[:, first * stride:end], size, stride)
    return torch.cat([compressed, completed], 1) if completed.shape[1] else compressed


def _chain_as_decode_steps(ops, q, score_q, k, v, score_k, fine, coarse, context: int, dense, config) -> torch.Tensor:
    """A chain's rows -> [Hq, T, d], each computed as the decode step at its position computes it, over the keys
    up to it (row t attends the context and rows 1..t: ``context + t`` keys): below ``dense_len`` dense, above
    it the fused stage 1, selection and attention reading its blocks in place."""
    end = k.shape[1]  # the last row's keys
    fine = _chain_windows(score_k, context, end, fine, config.kernel_size, config.kernel_stride)
    coarse = _chain_windows(score_k, context, end, coarse, config.coarse_kernel_size, config.coarse_kernel_stride)
    steps = []
    for row, dense_row in enumerate(dense.tolist()):
        keys = context + row
        if dense_row:
            steps.append(cpu.causal_attention_of_last_positions(q[:, row:row + 1], k[:, :keys], v[:, :keys]))
            continue
        steps.append(cpu.fused_decode(
            ops, q[:, row:row + 1], score_q[:, row:row + 1], k[:, :keys], v[:, :keys],
            fine[:, :num_windows(keys, config.kernel_size, config.kernel_stride)],
            coarse[:, :num_windows(keys, config.coarse_kernel_size, config.coarse_kernel_stride)], config))
    return torch.cat(steps, 1)


def sparse_tree_attention(q, k, v, config: SparseAttentionConfig, cache: CompressedKeyCache | None, mask: torch.Tensor,
                          *, q_nope=None, k_nope=None) -> torch.Tensor:
    """q [Hq, T, d] of T tree rows, k/v [Hkv, S, d] every slot, ``mask`` [T, S] (True: the row attends the
    slot) -> [Hq, T, d]. The slots every row attends, from slot 0 on, are the shared context (in a
    verification: the verified tokens and the root); each row's other attended slots, in ascending order,
    are the rest of its branch (its lineage, itself last). ``cache``: the layer's compressed keys,
    extended by the context's (None: pooled here). ``config.use_nope``: ``q_nope``/``k_nope`` score the
    blocks, as in sparse_attention."""
    (q_heads, rows, dim), kv_heads = q.shape, k.shape[0]
    shared = mask.all(0)
    context = int(shared.long().cumprod(0).sum())  # the leading slots every row attends
    extra = mask[:, context:]
    positions = context - 1 + extra.sum(1).to(q.device)  # a row with no extra slot is the context's last
    dense = torch.tensor([config.is_dense(int(p) + 1) for p in positions])
    if not dense.all():
        score_q, score_k = (q_nope, k_nope) if config.use_nope else (q, k)
        fine, coarse = _context_windows(score_k, context, config, cache)
        ops = cpu.fused_ops(q, k, v)
        if (ops is not None and cpu.block_kernel_beats_sdpa(ops) and _is_chain(extra)
                and cpu.fused_decode_applies(score_q[:, :1], fine, coarse)):
            # a chain's rows are decode steps, and with AVX-512 cheapest run as such (MiniCPM4.1-8B's shape,
            # 8K keys, 2 threads: 4 rows 2.2 ms a layer against 2.7 below); built without it the block kernel
            # is plain loops, and one masked SDPA over the rows' blocks is cheaper (6.0 against 8.5 ms)
            return _chain_as_decode_steps(ops, q, score_q, k, v, score_k, fine, coarse, context, dense, config)
    out = q.new_empty(kv_heads, rows, q_heads // kv_heads, dim)
    queries = q.reshape(kv_heads, q_heads // kv_heads, rows, dim).transpose(1, 2)  # [Hkv, T, G, d]
    if dense.any():
        count = int(dense.sum())
        out[:, dense] = F.scaled_dot_product_attention(
            queries[:, dense], k[:, None].expand(-1, count, -1, -1), v[:, None].expand(-1, count, -1, -1),
            attn_mask=mask[None, dense, None, :])
    if dense.all():
        return out.transpose(1, 2).reshape(q_heads, rows, dim)
    blocks = _select(score_q, score_k, context, extra, positions, config, fine, coarse)
    sparse = ~dense
    keys, values, allowed = _union_of_chosen(k, v, blocks[:, sparse], context, extra[sparse], config.block_size)
    # each KV head's sparse rows and query heads as the rows of one problem: [Hkv, Ts * G, d]
    heads_per_kv, sparse_rows = q_heads // kv_heads, int(sparse.sum())
    folded = queries[:, sparse].reshape(kv_heads, sparse_rows * heads_per_kv, dim)
    mask = allowed[:, :, None, :].expand(-1, -1, heads_per_kv, -1).reshape(kv_heads, sparse_rows * heads_per_kv, -1)
    out[:, sparse] = F.scaled_dot_product_attention(folded[None], keys[None], values[None], attn_mask=mask[None]).view(
        kv_heads, sparse_rows, heads_per_kv, dim)  # 4-D: SDPA's flash kernel (3-D runs its math path)
    return out.transpose(1, 2).reshape(q_heads, rows, dim)


def _is_chain(extra: torch.Tensor) -> bool:
    """Whether the rows after the shared context are a chain: row t attends the t slots after it, each the
    child of the one before (slot order is position order, as in a prefill chunk)."""
    rows = extra.shape[0]
    return extra.shape[1] == rows - 1 and torch.equal(extra, torch.ones_like(extra).tril(-1))


def _union_of_chosen(k, v, blocks, context: int, extra, size: int):
    """The keys and values every sparse row of every KV head may attend: the context blocks any of them chose
    (ascending), gathered once, then the slots after the context, or, where those blocks are most of the
    context, the whole cache in place; and which of them each row attends [Hkv, T, L] (its own chosen blocks'
    context positions, and its branch's slots whose block it chose).
    Gathering each row's blocks apart copied the cache once per row: at MiniCPM4.1-8B's shape and 8K of context,
    a chain's 4 rows spent more on those copies than on the attention."""
    union = torch.unique(blocks[blocks >= 0])  # sorted
    in_place = len(union) * size * 2 >= context  # most of the context: all of it, attended in place
    if in_place:
        union = torch.arange(-(-context // size), device=k.device)
    tokens = (union[:, None] * size + torch.arange(size, device=k.device)).flatten()
    chose = (blocks[..., None] == union).any(-2)  # [Hkv, T, U]
    context_allowed = chose.repeat_interleave(size, -1) & (tokens < context)  # a partial last block's tail: masked
    extra_blocks = (context + extra.cumsum(1) - 1).to(k.device) // size  # the block of each extra slot's position
    chosen_extra = (blocks[..., None] == extra_blocks[None, :, None, :]).any(-2)  # [Hkv, T, S - context]
    extra_allowed = extra[None] & chosen_extra
    if in_place:
        return k, v, torch.cat([context_allowed[..., :context], extra_allowed], -1)
    slots = tokens.clamp(max=context - 1)
    keys, values = (torch.cat([x[:, slots], x[:, context:]], 1) for x in (k, v))
    return keys, values, torch.cat([context_allowed, extra_allowed], -1)
