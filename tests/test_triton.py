"""Triton kernels in Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py) on CPU tensors,
against float references: the W4A16 GEMV/GEMM over the GPTQ and AWQ layouts, the triton backend
on Marlin and AWQ artifacts, and InfLLM v2's block-sparse attention, at small shapes and at
MiniCPM4.1-8B's."""
from __future__ import annotations

import os

import pytest
import torch

from quantkit.kernels.linear.int4 import Int4Linear
from quantkit.kernels.linear.triton_marlin import TritonMarlinLinear
from quantkit.kernels.linear.triton_w4a16 import LAUNCH_CONFIGS, TritonW4A16Linear, launch_config
from quantkit.quant import QuantConfig, QuantizedTensor, default_g_idx

assert os.environ.get("TRITON_INTERPRET") == "1", "these tests prove kernels in the interpreter"


def random_record(n, k, group_size, act_order=False, seed=0) -> QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    config = QuantConfig(bits=4, group_size=group_size, sym=False)
    groups = config.num_groups(k)
    g_idx = default_g_idx(k, group_size)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    return QuantizedTensor(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                           (torch.rand(groups, n, generator=g) * 0.02 + 0.005).half(),
                           torch.randint(0, 16, (groups, n), generator=g, dtype=torch.uint8), g_idx.int(), config)


# float32 accumulation of the same products in another order: relative error ~1e-6 of |x|·|W| sums
def assert_matches(got, want):
    scale = want.abs().max()
    assert ((got - want).abs().max() / scale) < 1e-5


@pytest.mark.parametrize("n, k, group_size, act_order, rows", [
    (192, 576, 128, False, 1),     # default model k_proj: ragged last group
    (576, 1536, 64, True, 3),      # act-order
    (1536, 576, -1, False, 17),    # per-channel, GEMM
    (4096, 4096, 128, False, 1),   # MiniCPM4.1-8B q_proj / o_proj, decode
    (256, 4096, 128, True, 64),    # MiniCPM4.1-8B k_proj (2 KV heads x 128), prefill chunk
])
def test_w4a16_kernels_match_the_dequantized_reference(n, k, group_size, act_order, rows):
    record = random_record(n, k, group_size, act_order)
    x = torch.randn(rows, k)
    want = x.double() @ record.dequantize(torch.float64).T
    got = TritonW4A16Linear.from_record(record)(x)
    assert_matches(got.double(), want)


@pytest.mark.slow
def test_w4a16_kernels_over_minicpm41_down_proj_reduction():
    """down_proj's K = 16,384, the 8B model's longest reduction (128 groups, 16 prefill rows), on 512 of its
    4,096 output rows: every program of the grid runs the same K loop, so the full N adds only interpreter
    time (gate/up's K = 4,096 is the q_proj case above)."""
    n, k, rows = 512, 16384, 16
    record = random_record(n, k, 128, seed=1)
    x = torch.randn(rows, k)
    assert_matches(TritonW4A16Linear.from_record(record)(x).double(), x.double() @ record.dequantize(torch.float64).T)


@pytest.mark.parametrize("n, k, group_size, rows", [
    (192, 512, 128, 1),       # small, decode
    (1536, 576, 64, 17),      # default model's gate/up at AWQ-legal g64, GEMM
    (4096, 4096, 128, 1),     # MiniCPM4.1-8B q_proj / o_proj, decode
    (256, 4096, -1, 64),      # MiniCPM4.1-8B k_proj, per-channel, prefill chunk
])
def test_w4a16_kernels_read_autoawq_tensors_as_stored(n, k, group_size, rows):
    """The kernels on an AutoAWQ checkpoint's qweight/qzeros/scales (nibble-interleaved along N),
    against the float64 weight the AWQ reader decodes from the same tensors."""
    from quantkit.formats.awq import awq_tensors, read_awq_tensors

    record = random_record(n, k, group_size, seed=3)
    tensors = awq_tensors(record, "linear")
    decoded = read_awq_tensors(tensors, "linear", record.config, k, n)
    linear = TritonW4A16Linear.from_awq_tensors(tensors["linear.qweight"], tensors["linear.qzeros"],
                                                tensors["linear.scales"], k, group_size)
    x = torch.randn(rows, k)
    assert_matches(linear(x).double(), x.double() @ decoded.dequantize(torch.float64).T)
    assert torch.equal(linear.qweight, tensors["linear.qweight"])  # used as stored, not repacked


@pytest.mark.parametrize("fmt, module", [("marlin", TritonMarlinLinear), ("awq", TritonW4A16Linear)])
def test_triton_backend_runs_marlin_and_awq_artifacts_from_their_stored_tensors(tiny_checkpoint_factory, tmp_path,
                                                                                 fmt, module):
    """load_linears(artifact, "triton") hands the kernels the file's own tensors; they agree with the
    reference backend (the format reader's float32 weight), for decode and for a prefill chunk."""
    from quantkit.engine import quantize
    from quantkit.kernels.linear import load_linears
    from quantkit.recipe import load_recipe

    out = tmp_path / fmt
    recipe = load_recipe("rtn-w4g128", {"format": fmt, "calibration.n_samples": 2, "calibration.seq_len": 32})
    quantize(tiny_checkpoint_factory(num_key_value_heads=4), recipe, out, progress=False)
    reference, triton_linears = load_linears(out, "reference"), load_linears(out, "triton")
    assert set(triton_linears) == set(reference)
    assert all(type(m) is module and getattr(m, "awq", False) == (fmt == "awq") for m in triton_linears.values())
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        rows = torch.randn(6, reference[name].in_features, generator=torch.Generator().manual_seed(2))
        for batch in (rows[:1], rows):  # GEMV and GEMM
            assert_matches(triton_linears[name](batch).double(), reference[name](batch).double())


def test_triton_and_cpu_paths_agree_in_bf16():
    record = random_record(960, 576, 128, seed=2)
    x = torch.randn(2, 576).bfloat16()
    triton_out = TritonW4A16Linear.from_record(record)(x).float()
    cpu_out = Int4Linear.from_record(record)(x).float()
    # both bf16 outputs; the CPU kernel also rounds scales to bf16 (relative 2^-8 per group)
    assert ((triton_out - cpu_out).abs().max() / cpu_out.abs().max()) < 2e-2


def test_launch_configs_per_gpu():
    assert launch_config((8, 9), "gemv") == LAUNCH_CONFIGS[(8, 9)]["gemv"]
    assert launch_config((8, 7), "gemm") == LAUNCH_CONFIGS[(8, 7)]["gemm"]
    assert launch_config((8, 6), "gemv") == LAUNCH_CONFIGS[(8, 9)]["gemv"]  # untuned Ampere: the 4090's tiles
    assert launch_config((8, 7), "gemv").block_n < launch_config((8, 9), "gemv").block_n  # 16 SMs vs 128
    with pytest.raises(RuntimeError, match="compute capability 7.5"):
        launch_config((7, 5), "gemv")


@pytest.mark.parametrize("heads_q, heads_kv, dim, length, queries", [
    (8, 2, 32, 1000, 1),        # decode, a KV group of 4 heads padded to 16 in the kernel
    (8, 2, 32, 1000, 24),       # a prefill chunk: causal inside the query's own block
    (32, 2, 128, 2048, 1),      # MiniCPM4.1-8B's attention shape, decode
])
def test_block_sparse_attention_kernel_matches_the_cpu_path(heads_q, heads_kv, dim, length, queries):
    from quantkit.kernels.infllm import SparseAttentionConfig, sparse_attention

    config = SparseAttentionConfig(window_size=128, topk=4, dense_len=-1)
    g = torch.Generator().manual_seed(length + queries)
    q = torch.randn(heads_q, queries, dim, generator=g)
    k, v = torch.randn(2, heads_kv, length, dim, generator=g)
    want = sparse_attention(q, k, v, config, backend="cpu")
    got = sparse_attention(q, k, v, config, backend="triton")
    assert (got - want).abs().max() < 1e-5  # float32 online softmax vs SDPA: reordered sums only


@pytest.mark.parametrize("heads_q, heads_kv, dim, length, queries", [(8, 2, 32, 1000, 40), (32, 2, 128, 2048, 2)])
def test_stage1_kernel_matches_the_reference_scores(heads_q, heads_kv, dim, length, queries):
    from quantkit.kernels.infllm import SparseAttentionConfig, reference
    from quantkit.kernels.infllm.triton_stage1 import stage1_scores

    config = SparseAttentionConfig(window_size=128, topk=4, dense_len=-1)
    g = torch.Generator().manual_seed(queries)
    q = torch.randn(heads_q, queries, dim, generator=g)
    k = torch.randn(heads_kv, length, dim, generator=g)
    fine = reference.compress_keys(k, config.kernel_size, config.kernel_stride)
    coarse = reference.compress_keys(k, config.coarse_kernel_size, config.coarse_kernel_stride)
    for positions in (reference.query_positions(queries, length), torch.arange(queries)):  # late and early tokens
        want = reference.stage1_scores(q, fine, coarse, positions, config)
        # +inf where a token sees fine keys but no coarse key yet, in both; float32 sums reordered
        torch.testing.assert_close(stage1_scores(q, fine, coarse, positions, config), want, rtol=1e-4, atol=1e-7)
