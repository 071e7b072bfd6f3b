"""InfLLM v2: the readable reference against dense attention, the fast CPU path against the
reference (outputs and block choices), the incremental compressed-key cache, and the runtime's
sparse decode against the reference step by step."""
from __future__ import annotations

import math

import pytest
import torch

from quantkit.kernels.infllm import CompressedKeyCache, SparseAttentionConfig, cpu, reference, sparse_attention
from quantkit.kernels.infllm.reference import (
    compress_keys,
    dense_causal_attention,
    query_positions,
    reference_block_selection,
    sparse_attention_reference,
)

from helpers import built_cpu_ops

# Scaled-down MiniCPM4.1 settings: same kernel/stride/block, a 128-token window and top-4, always sparse.
SMALL = SparseAttentionConfig(window_size=128, topk=4, dense_len=-1)
# float32 outputs of two orderings of the same sums (SDPA vs einsum): ~1e-6; 1e-5 leaves margin.
FP32_TOL = 1e-5


def qkv(heads_q, heads_kv, length, dim, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(h, length, dim, generator=g).to(dtype)  # noqa: E731
    return make(heads_q), make(heads_kv), make(heads_kv)


def test_reference_equals_dense_attention_when_every_block_is_selected():
    q, k, v = qkv(8, 2, 700, 32)
    every_block = SparseAttentionConfig(window_size=0, topk=64, dense_len=-1)  # 11 blocks < topk
    got = sparse_attention_reference(q, k, v, every_block)
    assert (got - dense_causal_attention(q, k, v)).abs().max() < FP32_TOL
    # and it is really sparse with MiniCPM4.1-like budgets: far-away blocks are dropped
    assert (sparse_attention_reference(q, k, v, SMALL) - dense_causal_attention(q, k, v)).abs().max() > 1e-2


@pytest.mark.parametrize("queries", [1000, 37, 1])  # prefill, a later chunk, decode
def test_cpu_path_equals_reference(queries):
    q, k, v = qkv(8, 2, 1000, 32, seed=queries)
    q = q[:, -queries:]
    want = sparse_attention_reference(q, k, v, SMALL)
    assert (sparse_attention(q, k, v, SMALL) - want).abs().max() < FP32_TOL
    positions = query_positions(queries, 1000)
    fine = compress_keys(k, SMALL.kernel_size, SMALL.kernel_stride)
    coarse = compress_keys(k, SMALL.coarse_kernel_size, SMALL.coarse_kernel_stride)
    scores = cpu.stage1_scores(q, fine, coarse, positions, SMALL)
    # early tokens see no coarse key yet: +inf scores in both (only forced blocks exist then)
    torch.testing.assert_close(scores, reference.stage1_scores(q, fine, coarse, positions, SMALL), rtol=1e-4, atol=1e-6)
    chosen = reference.select_blocks(cpu.block_scores(scores, positions, 1000, SMALL), positions, SMALL)
    assert torch.equal(chosen, reference_block_selection(q, k, SMALL))


def test_cpu_selection_equals_the_reference_stable_sort_on_ties_infinities_and_signed_zeros():
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, 1.0, 0.5, math.inf, -math.inf, 2.0, 1e-30, -1.0])
    for trial in range(100):
        blocks, queries = int(torch.randint(2, 300, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        picks = special[torch.randint(0, len(special), (2, queries, blocks), generator=g)]
        pooled = torch.where(torch.rand(2, queries, blocks, generator=g) < 0.5, picks,
                             torch.rand(2, queries, blocks, generator=g))
        config = SparseAttentionConfig(topk=int(torch.randint(2, 40, (1,), generator=g)), window_size=128,
                                       dense_len=-1)
        positions = query_positions(queries, blocks * 64)
        want = reference.select_blocks(pooled, positions, config)
        assert torch.equal(cpu.select_blocks(pooled, positions, config), want), trial


def test_cpu_path_with_minicpm41_head_shape_and_bf16():
    """32 query heads, 2 KV heads, head dim 128 (MiniCPM4.1-8B), 4096 keys, sparse from 1024 on."""
    config = SparseAttentionConfig(window_size=512, topk=16, dense_len=1024)
    q, k, v = qkv(32, 2, 4096, 128, seed=3)
    for queries in (1, 64):
        want = sparse_attention_reference(q[:, -queries:], k, v, config)
        assert (sparse_attention(q[:, -queries:], k, v, config) - want).abs().max() < FP32_TOL
    qb, kb, vb = (t.bfloat16() for t in (q[:, -1:], k, v))
    # bf16 inputs: float32 accumulation in both; the output is rounded to bf16 (relative 2^-8)
    want = sparse_attention_reference(qb, kb, vb, config).float()
    assert (sparse_attention(qb, kb, vb, config).float() - want).abs().max() < 2e-2


# (query heads, KV heads, head dim, keys): MiniCPM4.1-8B's group of 16 with a partial last block, the
# default model's 3 x 3 at d 64, a group of 1; these run on AMX tiles where the CPU has them, otherwise
# on AVX-512-BF16 dot products. A group of 20 at d 32 runs the dot products even with AMX (head chunks
# 8 + 8 + 4, probabilities 16 + 4); test_fused_kernels_built_without_avx512_bf16_compute_the_same runs
# these shapes on float32 FMAs.
FUSED_SHAPES = [(32, 2, 128, 5037), (9, 3, 64, 3000), (2, 2, 64, 2048), (20, 1, 32, 2111)]


def fused_tolerance(v) -> float:
    """The AMX path rounds the attention probabilities to bf16 (relative error <= 2^-9 each, as PyTorch's
    bf16 attention does), which moves an output by at most 2^-9 max|v|; plus float32 reordering."""
    return 2 ** -9 * float(v.float().abs().max()) + FP32_TOL


@pytest.mark.parametrize("heads_q, heads_kv, dim, length", FUSED_SHAPES)
def test_fused_decode_kernels_equal_the_pytorch_path(heads_q, heads_kv, dim, length):
    """The three fused decode kernels (quantkit/cpu_ops/infllm_ops.cpp) against this package's PyTorch
    functions for one query: stage-1 scores, the chosen blocks (exactly) and the attention output."""
    ops, config = built_cpu_ops(), SparseAttentionConfig(window_size=256, topk=8, dense_len=1024)
    q, k, v = (t.bfloat16() for t in qkv(heads_q, heads_kv, length, dim, seed=length))
    q = q[:, -1:]
    fine, coarse = compress_keys(k, 32, 16), compress_keys(k, 128, 64)
    positions = query_positions(1, length)
    scores = ops.infllm_decode_scores(q[:, 0], fine, coarse, dim ** -0.5)
    # float32 sums in another order: relative ~1e-7 of the largest score
    torch.testing.assert_close(scores[:, None], cpu.stage1_scores(q, fine, coarse, positions, config),
                               rtol=1e-5, atol=1e-6 * float(scores.max()))
    blocks = ops.infllm_decode_select(scores, math.ceil(length / 64), config.pool_stride, config.init_blocks,
                                      config.local_blocks, config.selected_blocks)
    want_blocks = cpu.select_blocks(cpu.block_scores(scores[:, None], positions, length, config), positions, config)
    assert torch.equal(blocks, want_blocks[:, 0])
    out = ops.infllm_block_attention(q, k, v, blocks[:, None], length - 1, 64, dim ** -0.5)
    want = reference.block_sparse_attention(q.float(), k.float(), v.float(), want_blocks, positions, 64)
    assert (out - want).abs().max() < fused_tolerance(v)
    # and the entry point takes this path for a bf16 decode step, within bf16 rounding of the reference
    assert cpu.fused_ops(q, k, v) is not None and cpu.fused_decode_applies(q, fine, coarse)
    got = sparse_attention(q, k, v, config).float()
    assert (got - sparse_attention_reference(q, k, v, config).float()).abs().max() < 2e-2


@pytest.mark.parametrize("heads_q, heads_kv, dim, length", [(9, 3, 64, 1000), (32, 2, 128, 5037)])
def test_dense_decode_runs_the_block_kernel_within_bf16_rounding_of_sdpa(heads_q, heads_kv, dim, length):
    """A decode step's dense attention over a bf16 cache (the block kernel over every block, where the
    kernels build with AVX-512) against SDPA's: both outputs bf16, so the probabilities' rounding plus
    an output rounding apart."""
    q, k, v = (t.bfloat16() for t in qkv(heads_q, heads_kv, length, dim, seed=length))
    q = q[:, -1:]
    want = cpu.sdpa_attention_of_last_positions(q, k, v).float()
    got = cpu.causal_attention_of_last_positions(q, k, v).float()
    assert got.dtype == want.dtype and got.shape == want.shape == (heads_q, 1, dim)
    assert (got - want).abs().max() < fused_tolerance(v) + 2 ** -7 * float(want.abs().max())


def test_fused_kernels_built_without_avx512_bf16_compute_the_same(tmp_path):
    """The float32 paths, as a CPU with AVX-512 but no BF16 runs them (QUANTKIT_CPU_MARCH=skylake-avx512,
    a process of its own) or, on a CPU without AVX-512 (which cannot execute that build), as its own
    portable build runs them, against the reference on every fused shape: a prefill chunk's block-sparse
    attention, and a speculative round's verification over the same cache (``verify_attention``: every
    cached key, and of the last 5 a tree's lineages) against SDPA with that mask."""
    import os
    import subprocess
    import sys

    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file

    from quantkit import cpu_ops
    from quantkit.eval.bench.common import cpu_flags

    march, isa = ("skylake-avx512", "avx512") if "avx512f" in cpu_flags() else ("native", "portable")

    config = SparseAttentionConfig(window_size=256, topk=8, dense_len=1024)
    inputs, wanted, limits = {}, {}, {}
    for i, (heads_q, heads_kv, dim, length) in enumerate(FUSED_SHAPES):
        q, k, v = (t.bfloat16() for t in qkv(heads_q, heads_kv, length, dim, seed=length + 2))
        blocks = reference_block_selection(q[:, -5:], k, config)
        visible = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                               dtype=torch.bool)
        inputs.update({f"q{i}": q[:, -5:].contiguous(), f"k{i}": k, f"v{i}": v, f"blocks{i}": blocks,
                       f"first{i}": torch.tensor(length - 5), f"visible{i}": visible})
        wanted[i] = reference.block_sparse_attention(q[:, -5:].float(), k.float(), v.float(), blocks,
                                                     query_positions(5, length), 64)
        mask = torch.cat([torch.ones(5, length - 5, dtype=torch.bool), visible], dim=1)
        group = heads_q // heads_kv
        wanted[f"verify{i}"] = F.scaled_dot_product_attention(
            q[None, :, -5:].float(), k.float().repeat_interleave(group, 0)[None],
            v.float().repeat_interleave(group, 0)[None], attn_mask=mask)[0]
        limits[i] = fused_tolerance(v)
    save_file(inputs, tmp_path / "inputs.safetensors")
    script = (f"import torch; from safetensors.torch import load_file, save_file; from quantkit import cpu_ops;"
              f"t = load_file({str(tmp_path / 'inputs.safetensors')!r}); ops = cpu_ops.load(); "
              f"assert ops.infllm_isa() == {isa!r}, ops.infllm_isa(); "
              f"out = {{f'out{{i}}': ops.infllm_block_attention(t[f'q{{i}}'], t[f'k{{i}}'], t[f'v{{i}}'], "
              f"t[f'blocks{{i}}'], int(t[f'first{{i}}']), 64, t[f'q{{i}}'].shape[-1] ** -0.5) "
              f"for i in range({len(FUSED_SHAPES)})}}; "
              f"out.update({{f'verify{{i}}': ops.verify_attention(t[f'q{{i}}'], t[f'k{{i}}'], t[f'v{{i}}'], "
              f"int(t[f'first{{i}}']), t[f'visible{{i}}'], 64, t[f'q{{i}}'].shape[-1] ** -0.5) "
              f"for i in range({len(FUSED_SHAPES)})}}); save_file(out, {str(tmp_path / 'out.safetensors')!r})")
    done = subprocess.run([sys.executable, "-c", script],
                          env={**os.environ, cpu_ops.MARCH_OVERRIDE: march},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    got = load_file(tmp_path / "out.safetensors")
    for i in range(len(FUSED_SHAPES)):
        assert (got[f"out{i}"] - wanted[i]).abs().max() < limits[i], FUSED_SHAPES[i]
        # float32 products throughout (no bf16 probabilities): float32 reordering apart
        assert (got[f"verify{i}"] - wanted[f"verify{i}"]).abs().max() < FP32_TOL, FUSED_SHAPES[i]


@pytest.mark.parametrize("heads_q, heads_kv, dim, length", FUSED_SHAPES)
def test_fused_block_attention_of_a_prefill_chunk_equals_the_reference(heads_q, heads_kv, dim, length):
    """A chunk of 37 queries: per-token blocks with unused (-1) slots early on, token-level causality
    inside each token's own block."""
    ops, config = built_cpu_ops(), SparseAttentionConfig(window_size=256, topk=8, dense_len=1024)
    q, k, v = (t.bfloat16() for t in qkv(heads_q, heads_kv, length, dim, seed=length + 1))
    positions = query_positions(37, length)
    blocks = reference_block_selection(q[:, -37:], k, config)
    out = ops.infllm_block_attention(q[:, -37:], k, v, blocks, length - 37, 64, dim ** -0.5)
    want = reference.block_sparse_attention(q[:, -37:].float(), k.float(), v.float(), blocks, positions, 64)
    assert (out - want).abs().max() < fused_tolerance(v)
    got = sparse_attention(q[:, -37:], k, v, config).float()
    assert (got - sparse_attention_reference(q[:, -37:], k, v, config).float()).abs().max() < 2e-2


def test_fused_selection_equals_the_pytorch_path_on_ties_infinities_and_signed_zeros():
    ops = built_cpu_ops()
    g = torch.Generator().manual_seed(1)
    special = torch.tensor([0.0, -0.0, 1.0, 0.5, math.inf, 2.0, 1e-30, 3.0])
    for trial in range(100):
        length = int(torch.randint(300, 20000, (1,), generator=g))
        n1 = (length - 32) // 16 + 1
        picks = special[torch.randint(0, len(special), (2, n1), generator=g)]
        scores = torch.where(torch.rand(2, n1, generator=g) < 0.7, picks, torch.rand(2, n1, generator=g))
        config = SparseAttentionConfig(topk=int(torch.randint(2, 40, (1,), generator=g)), window_size=128,
                                       dense_len=-1)
        positions = query_positions(1, length)
        num_blocks = math.ceil(length / 64)
        want = cpu.select_blocks(cpu.block_scores(scores[:, None], positions, length, config), positions, config)
        got = ops.infllm_decode_select(scores, num_blocks, config.pool_stride, config.init_blocks,
                                       config.local_blocks, min(config.selected_blocks, num_blocks))
        assert torch.equal(got, want[:, 0]), trial


def test_fused_decode_refuses_bad_blocks_and_is_skipped_where_it_does_not_apply():
    ops = built_cpu_ops()
    q, k, v = (t.bfloat16() for t in qkv(4, 2, 1000, 64))
    with pytest.raises(RuntimeError, match="outside blocks 0..15 of token 999"):
        ops.infllm_block_attention(q[:, -1:], k, v, torch.tensor([[[0, 16]], [[1, 2]]]), 999, 64, 0.125)
    with pytest.raises(RuntimeError, match="outside blocks 0..14 of token 959"):  # the next token's block
        ops.infllm_block_attention(q[:, -2:], k, v, torch.tensor([[[15], [15]], [[1], [2]]]), 959, 64, 0.125)
    fine, coarse = compress_keys(k, 32, 16), compress_keys(k, 128, 64)
    assert cpu.fused_ops(q, k, v) is not None and cpu.fused_decode_applies(q[:, -1:], fine, coarse)
    assert not cpu.fused_decode_applies(q[:, -2:], fine, coarse)                       # two queries
    assert not cpu.fused_decode_applies(q[:, -1:], fine.float(), coarse)               # float32 compressed keys
    assert not cpu.fused_decode_applies(q[:, -1:], fine, coarse[:, :0])                # no coarse key
    assert cpu.fused_ops(q, k.float(), v) is None                                       # float32 keys
    assert cpu.fused_ops(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, ) is None  # d not contiguous
    assert cpu.fused_ops(q[..., :48], k[..., :48], v[..., :48]) is None                 # d % 32


def test_compressed_key_cache_grows_incrementally_and_decode_matches_reference():
    q, k, v = qkv(4, 2, 900, 16, seed=7)
    cache = CompressedKeyCache(SMALL)
    sparse_attention(q[:, :700], k[:, :700], v[:, :700], SMALL, cache)  # prefill of 700
    for end in range(701, 901, 13):  # decode steps, some completing a window, some not
        got = sparse_attention(q[:, end - 1:end], k[:, :end], v[:, :end], SMALL, cache)
        want = sparse_attention_reference(q[:, end - 1:end], k[:, :end], v[:, :end], SMALL)
        assert (got - want).abs().max() < FP32_TOL
    fine, coarse = cache.update(k[:, :end])
    assert torch.equal(fine, compress_keys(k[:, :end], 32, 16))
    assert torch.equal(coarse, compress_keys(k[:, :end], 128, 64))
    with pytest.raises(ValueError, match="only grows"):
        cache.update(k[:, :100])


@pytest.mark.parametrize("kept", [700, 703, 704, 767, 768, 1])
def test_a_cropped_compressed_key_cache_equals_one_built_from_the_kept_keys(kept):
    """Cropping keeps the windows pooled from kept keys only; the next update pools the rest from the
    new keys, exactly as a cache that never saw the dropped ones (window ends at 16c + 31, 64c + 127)."""
    _, k, _ = qkv(4, 2, 900, 16, seed=8)
    replaced = k.clone()
    replaced[:, kept:] = torch.randn_like(k[:, kept:])
    cache = CompressedKeyCache(SMALL)
    cache.update(k[:, :850])
    cache.crop(kept)
    assert cache.num_keys == kept
    fine, coarse = cache.update(replaced[:, :900])
    assert torch.equal(fine, compress_keys(replaced, 32, 16)) and torch.equal(coarse, compress_keys(replaced, 128, 64))


def test_runtime_sparse_decode_equals_reference_attention_per_layer(tiny_checkpoint):
    """The engine's InfLLM v2 path (KV cache, compressed-key caches, chunked prefill, decode)
    gives the logits of a model whose every layer calls the readable reference on the full history."""
    from quantkit.kernels.attention import InfLLMv2Attention
    from quantkit.kernels.load import load_runtime_model
    from quantkit.kernels.model import RuntimeModel

    config = SparseAttentionConfig(window_size=64, topk=3, dense_len=128)
    tokens = torch.randint(0, 300, (420,), generator=torch.Generator().manual_seed(2))
    fast = RuntimeModel(load_runtime_model(tiny_checkpoint, torch.float32), InfLLMv2Attention(config))
    slow = RuntimeModel(load_runtime_model(tiny_checkpoint, torch.float32),
                        lambda q, k, v, layer, cache: sparse_attention_reference(q, k, v, config))
    cache_fast, cache_slow = fast.new_cache(fast.attention.compressed_keys), slow.new_cache()
    for begin, end in [(0, 100), (100, 300)] + [(i, i + 1) for i in range(300, 420)]:
        got = fast.forward(tokens[begin:end], cache_fast, all_logits=True)
        want = slow.forward(tokens[begin:end], cache_slow, all_logits=True)
        assert (got - want).abs().max() < 1e-4, (begin, end)


def test_runtime_use_nope_scores_blocks_with_pre_rope_queries_and_keys(tiny_checkpoint):
    """With use_nope the engine keeps pre-RoPE keys and scores blocks with them. The reference here
    recovers them independently, by inverting RoPE on the post-RoPE q and k it is handed; the same
    runtime without use_nope picks other blocks, so the test tells the two apart."""
    from quantkit.kernels.attention import InfLLMv2Attention
    from quantkit.kernels.load import load_runtime_model
    from quantkit.kernels.model import RuntimeModel

    config = SparseAttentionConfig(window_size=64, topk=3, dense_len=128, use_nope=True)
    tokens = torch.randint(0, 300, (360,), generator=torch.Generator().manual_seed(3))
    model = load_runtime_model(tiny_checkpoint, torch.float32)
    rotary = model.model.rotary_emb

    def unrotate(states, first):  # RoPE is a scaled rotation per pair (i, i + d/2): undo it
        cos, sin = (t[0] for t in rotary(states, torch.arange(first, first + states.shape[1])[None]))
        half = states.shape[-1] // 2
        rotated_half = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
        return (states * cos - rotated_half * sin) / (cos * cos + sin * sin)

    def reference_nope(q, k, v, layer, cache):
        start = k.shape[1] - q.shape[1]
        return sparse_attention_reference(q, k, v, config, q_nope=unrotate(q, start), k_nope=unrotate(k, 0))

    nope = RuntimeModel(model, InfLLMv2Attention(config))
    rope = RuntimeModel(load_runtime_model(tiny_checkpoint, torch.float32),
                        InfLLMv2Attention(SparseAttentionConfig(window_size=64, topk=3, dense_len=128)))
    slow = RuntimeModel(load_runtime_model(tiny_checkpoint, torch.float32), reference_nope)
    caches = [m.new_cache(m.attention.compressed_keys) if isinstance(m.attention, InfLLMv2Attention)
              else m.new_cache() for m in (nope, rope, slow)]
    rope_differs = False
    for begin, end in [(0, 100), (100, 250)] + [(i, i + 1) for i in range(250, 360)]:
        got, without_nope, want = (m.forward(tokens[begin:end], c, all_logits=True)
                                   for m, c in zip((nope, rope, slow), caches))
        assert (got - want).abs().max() < 1e-4, (begin, end)
        rope_differs |= bool((without_nope - want).abs().max() > 1e-3)
    assert rope_differs
    assert caches[0].pre_rope_keys(0, 360).shape[1] == 360


@pytest.mark.parametrize("bad, message", [
    (dict(block_size=60), "multiple of kernel_stride"),
    (dict(kernel_size=48), "2 x kernel_stride"),
    (dict(topk=1), "must exceed init_blocks"),
    (dict(dense_len=-5), "dense_len"),
    (dict(use_nope=1), "true or false"),
])
def test_bad_sparse_configs_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SparseAttentionConfig(**bad)
    with pytest.raises(ValueError, match="unknown keys"):
        SparseAttentionConfig.from_dict({"topK": 3})


@pytest.mark.parametrize("start,dense_len", [(700, -1), (765, -1), (766, 768), (830, -1), (700, 800), (8000, -1)])
def test_a_tree_attends_as_each_branch_would_decoded_alone(start, dense_len):
    """Every node of a draft tree gets the reference's output for its branch (the context, then its
    lineage) decoded as one sequence: windows ending on the branch (767 ends a fine and a coarse one),
    a block boundary inside the tree (768, 832), and nodes on both sides of dense_len. Up to 830 the
    blocks the nodes chose are most of the context, attended in place; at 8000, 32 of 125, gathered."""
    from quantkit.kernels.infllm import sparse_tree_attention
    from quantkit.kernels.speculative import DraftTree

    config = SparseAttentionConfig(window_size=128, topk=4, dense_len=dense_len)
    tree = DraftTree(tokens=[0] * 7, parents=[-1, -1, 0, 0, 1, 3, 5], scores=[0.0] * 7)
    _, mask = tree.verification(start)
    q, k, v = qkv(4, 2, start + 8, 16, seed=9)
    cache = CompressedKeyCache(config)
    cache.update(k[:, :start - 40])  # what earlier steps pooled
    got = sparse_tree_attention(q[:, start:], k, v, config, cache, mask)
    for row in range(8):
        branch = [*range(start + 1), *(start + 1 + node for node in (tree.lineage(row - 1) if row else []))]
        want = sparse_attention_reference(q[:, start + row:start + row + 1], k[:, branch], v[:, branch], config)
        assert (got[:, row:row + 1] - want).abs().max() < FP32_TOL, row
    all_dense = config.is_dense(start + 4)  # the deepest node's branch
    assert cache.num_keys == (start - 40 if all_dense else start + 1)  # pooled: the context only, when sparse


@pytest.mark.parametrize("start,dense_len,sparse_rows", [(8000, -1, 4), (2000, 2003, 2), (8061, -1, 4)])
def test_a_chain_over_bf16_caches_runs_each_sparse_row_as_its_decode_step(start, dense_len, sparse_rows, monkeypatch):
    """A chain's verification over bf16 caches, where the block kernel is built with AVX-512: each row is the
    decode step at its position, bit for bit: the fused one past dense_len (all four rows, or the last two),
    dense attention before it (8061: a fine and a coarse window end on the chain, at 8063); built without it,
    the rows' blocks are attended in one call. Either way within bf16 rounding of the reference decoding
    each row's prefix."""
    from quantkit.kernels.infllm import sparse_tree_attention
    from quantkit.kernels.speculative import chain_verification

    as_decode_steps = cpu.block_kernel_beats_sdpa(built_cpu_ops())
    decode, decoded = cpu.fused_decode, []
    monkeypatch.setattr(cpu, "fused_decode", lambda ops, q, *rest: decoded.append(q.shape[1]) or decode(ops, q, *rest))
    config = SparseAttentionConfig(window_size=128, topk=4, dense_len=dense_len)
    _, mask = chain_verification(start, 3)
    q, k, v = (t.bfloat16() for t in qkv(4, 2, start + 4, 32, seed=11))
    cache = CompressedKeyCache(config)
    got = sparse_tree_attention(q[:, start:], k, v, config, cache, mask)
    assert decoded == [1] * sparse_rows * as_decode_steps
    assert cache.num_keys == start + 1  # the chain is not pooled into the cache
    for row in range(4):
        end = start + row + 1
        step = sparse_attention(q[:, end - 1:end], k[:, :end], v[:, :end], config, CompressedKeyCache(config))
        assert torch.equal(got[:, row:row + 1], step) or not as_decode_steps, row
        want = sparse_attention_reference(q[:, end - 1:end], k[:, :end], v[:, :end], config).float()
        assert (got[:, row:row + 1].float() - want).abs().max() < 2e-2, row
