"""The Marlin-layout W4A16 GEMV/GEMM in Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py)
on CPU tensors, against the float64 weight that ``read_marlin_tensors`` reads back from the same
tensors: the kernels must undo the tile and scale permutations themselves."""
from __future__ import annotations

import os

import pytest
import torch

from quantkit.formats.marlin import ZERO_POINT, marlin_tensors, read_marlin_tensors, unpermute_scales
from quantkit.kernels.linear.triton_marlin import TritonMarlinLinear, marlin_matmul
from quantkit.kernels.linear.triton_w4a16 import launch_config
from quantkit.quant import QuantConfig, QuantizedTensor, default_g_idx

assert os.environ.get("TRITON_INTERPRET") == "1", "these tests prove kernels in the interpreter"

PREFIX = "model.layers.0.self_attn.q_proj"


def marlin_checkpoint(k, n, group_size, seed=0):
    """(B, s) as a Marlin checkpoint stores them, and the float64 W [N, K] they read back as."""
    g = torch.Generator().manual_seed(seed)
    config = QuantConfig(bits=4, group_size=group_size, sym=True)
    groups = config.num_groups(k)
    record = QuantizedTensor(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                             (torch.rand(groups, n, generator=g) * 0.02 + 0.005).half(),
                             torch.full((groups, n), ZERO_POINT, dtype=torch.uint8), default_g_idx(k, group_size),
                             config)
    tensors = marlin_tensors(record, PREFIX)
    codes, scales = read_marlin_tensors(tensors, PREFIX, k, n, group_size)
    read_back = QuantizedTensor(codes, scales, record.zeros, record.g_idx, config)
    return tensors[f"{PREFIX}.qweight"], tensors[f"{PREFIX}.scales"], read_back.dequantize(torch.float64)


# float32 accumulation of the same products in another order: relative error ~1e-6 of |x|·|W| sums
def relative_error(got, want):
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("rows", [1, 3, 17])  # 1: the GEMV; 3 and 17: the GEMM, one partial row tile
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("k, n", [(256, 64), (512, 128), (1024, 256)])
def test_marlin_kernels_match_the_read_back_weight(k, n, group_size, rows):
    B, s, weight = marlin_checkpoint(k, n, group_size)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = TritonMarlinLinear.from_marlin_tensors(B, s, k, n, group_size)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert relative_error(got, x.double() @ weight.T) < 1e-5


@pytest.mark.parametrize("k, group_size", [(256, 128), (256, -1), (128, 128)])
def test_every_weight_is_decoded_exactly(k, group_size):
    """x = I through the GEMM returns W^T: each output is one fp16-exact product, so no tolerance."""
    B, s, weight = marlin_checkpoint(k, 64, group_size, seed=5)
    got = TritonMarlinLinear.from_marlin_tensors(B, s, k, 64, group_size)(torch.eye(k))
    assert torch.equal(got.double(), weight.T)
    assert not torch.equal(marlin_matmul(torch.eye(k), B, unpermute_scales(s), group_size).double(), weight.T)


@pytest.mark.parametrize("rows", [1, 5])
def test_group_128_spanning_all_of_k_uses_the_single_group_scale_order(rows):
    B, s, weight = marlin_checkpoint(128, 64, 128, seed=3)  # one group although group_size is 128
    x = torch.randn(rows, 128)
    assert relative_error(TritonMarlinLinear.from_marlin_tensors(B, s, 128, 64, 128)(x), x.double() @ weight.T) < 1e-5


@pytest.mark.parametrize("rows", [1, 17])
def test_jetson_orin_tiles(rows):
    """(8, 7)'s narrower tiles: several column programs, and in the GEMM a K tile of 64 inside a group."""
    B, s, weight = marlin_checkpoint(512, 256, 128, seed=4)
    x = torch.randn(rows, 512)
    got = marlin_matmul(x, B, s, 128, launch_config((8, 7), "gemv" if rows == 1 else "gemm"))
    assert relative_error(got, x.double() @ weight.T) < 1e-5


@pytest.mark.parametrize("group_size", [128, -1])
def test_marlin_gemv_at_minicpm41_q_proj(group_size):
    B, s, weight = marlin_checkpoint(4096, 4096, group_size, seed=1)
    x = torch.randn(1, 4096)
    assert relative_error(TritonMarlinLinear.from_marlin_tensors(B, s, 4096, 4096, group_size)(x),
                          x.double() @ weight.T) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_activations_leading_dims_and_bias(dtype):
    B, s, weight = marlin_checkpoint(256, 128, 128, seed=2)
    bias = torch.randn(128)
    x = torch.randn(2, 3, 256).to(dtype)
    got = TritonMarlinLinear.from_marlin_tensors(B, s, 256, 128, 128, bias)(x)
    assert got.dtype == dtype and got.shape == (2, 3, 128)
    want = x.double() @ weight.T + bias.double()
    # exact fp32 sums, then one rounding of the output to fp16 (2^-11) or bf16 (2^-8)
    assert relative_error(got, want) < {torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]


def test_wrong_shapes_are_refused():
    B, s, _ = marlin_checkpoint(256, 64, 128)
    with pytest.raises(ValueError, match=r"B must be torch.int32 \(16, 128\), got torch.int32 \(128, 16\)"):
        TritonMarlinLinear.from_marlin_tensors(B.T.contiguous(), s, 256, 64, 128)
    with pytest.raises(ValueError, match=r"s must be torch.float16 \(2, 64\), got torch.float16 \(1, 64\)"):
        TritonMarlinLinear.from_marlin_tensors(B, s[:1], 256, 64, 128)  # per-channel scales for a g128 weight
    with pytest.raises(ValueError, match=r"s must be torch.float16 \(2, 64\), got torch.float32 \(2, 64\)"):
        TritonMarlinLinear.from_marlin_tensors(B, s.float(), 256, 64, 128)
    with pytest.raises(ValueError, match="N % 64 == 0"):
        TritonMarlinLinear.from_marlin_tensors(B, s, 256, 32, 128)
    with pytest.raises(ValueError, match=r"bias must have shape \(64,\)"):
        TritonMarlinLinear.from_marlin_tensors(B, s, 256, 64, 128, torch.zeros(128))
