"""``sparse_attention``: InfLLM v2 for prefill, chunked prefill and decode (docs/model.md, "InfLLM v2").

One call attends the last T positions of one sequence, head-major like the runtime's KV cache:

    out = sparse_attention(q, k, v, config)                 # q [Hq, T, d]; k, v [Hkv, S, d] -> [Hq, T, d]
    cache = CompressedKeyCache(config)
    out = sparse_attention(q, k, v, config, cache=cache)    # the same, keeping the compressed keys
    out = sparse_attention(q_t, k, v, config, cache=cache)  # decode: T == 1, compressed keys extended

k and v hold every key and value so far (post-RoPE). Below ``config.dense_len`` keys the call is
ordinary causal attention and the cache is left alone; the first sparse call pools the whole history
into the cache, later calls only the windows completed since.
"""
from __future__ import annotations

import torch

from quantkit.kernels.infllm import cpu
from quantkit.kernels.infllm.cache import CompressedKeyCache
from quantkit.kernels.infllm.reference import check_inputs, compress_keys, query_positions
from quantkit.models.sparse_attention import SparseAttentionConfig

BACKENDS = ("cpu", "triton")


def sparse_attention(q, k, v, config: SparseAttentionConfig, cache: CompressedKeyCache | None = None, *,
                     q_nope=None, k_nope=None, backend: str = "cpu") -> torch.Tensor:
    """InfLLM v2 attention of the last T positions -> [Hq, T, d] in q's dtype.

    With ``config.use_nope`` pass the pre-RoPE ``q_nope`` / ``k_nope`` (same shapes): they score the
    blocks (and fill the cache) while q and k attend. ``backend="triton"`` runs stage 1 (scoring) and
    stage 2 (block-sparse attention) as Triton kernels (CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1); block pooling and top-k are tensor code shared by both backends. On the
    ``cpu`` backend over bf16 caches, the fused kernels of quantkit/cpu_ops run a decode step whole and
    a prefill chunk's block-sparse attention (see ``cpu.fused_ops``).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_inputs(q, k, v, config, q_nope, k_nope)
    if cache is not None and cache.config != config:
        raise ValueError("the cache was built for a different sparse_config")
    num_keys = k.shape[1]
    if config.is_dense(num_keys):
        return cpu.causal_attention_of_last_positions(q, k, v)
    score_q, score_k = (q_nope, k_nope) if config.use_nope else (q, k)
    if cache is not None:
        fine, coarse = cache.update(score_k)
    else:
        fine = compress_keys(score_k, config.kernel_size, config.kernel_stride)
        coarse = compress_keys(score_k, config.coarse_kernel_size, config.coarse_kernel_stride)
    positions = query_positions(q.shape[1], num_keys, q.device)
    if backend == "triton":
        from quantkit.kernels.infllm import triton_attention, triton_stage1

        scores = triton_stage1.stage1_scores(score_q, fine, coarse, positions, config)
        block_idx = cpu.select_blocks(cpu.block_scores(scores, positions, num_keys, config), positions, config)
        return triton_attention.block_sparse_attention(q, k, v, block_idx, positions, config.block_size)
    ops = cpu.fused_ops(q, k, v)
    if ops is not None and cpu.fused_decode_applies(score_q, fine, coarse):
        return cpu.fused_decode(ops, q, score_q, k, v, fine, coarse, config)
    scores = cpu.stage1_scores(score_q, fine, coarse, positions, config)
    block_idx = cpu.select_blocks(cpu.block_scores(scores, positions, num_keys, config), positions, config)
    if ops is not None:
        return cpu.fused_block_attention(ops, q, k, v, block_idx, config.block_size)
    return cpu.block_sparse_attention(q, k, v, block_idx, positions, config.block_size)
