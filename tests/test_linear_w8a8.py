"""INT8 W8A8 on the CPU's integer dot products (``W8A8Linear``): the kernel's own per-token quantization
of each row is the scheme's, and its product is the dequantized weight's on the quantized input."""
from __future__ import annotations

import pytest
import torch

from quantkit import cpu_ops
from quantkit.activation_quant import ActivationGrid
from quantkit.formats.compressed_tensors import CompressedTensorsGrid
from quantkit.kernels.linear import panel
from quantkit.kernels.linear.w8a8 import W8A8Linear, runs_on_integer_kernel
from quantkit.quant import QuantConfig, rtn_quantize

DYNAMIC = ActivationGrid("int8")


def _record(n, k, scale_dtype=torch.bfloat16, seed=0, group_size=-1):
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    grid = CompressedTensorsGrid(8, group_size, True, scale_dtype=scale_dtype, activations="int8-dynamic")
    return rtn_quantize(weight, grid)


def _reference(record, x):
    """What the artifact means: the per-token quantized input times the dequantized weight, in float32."""
    return DYNAMIC.fake_quantize(x.float()) @ record.dequantize(torch.float32).T


# the integer sums are exact; float32 scaling in another order: 1e-5 of the largest output. bf16 rows
# add the output's one rounding, half a bf16 step: 2^-8 of the value
TOLERANCE = {torch.float32: 0.0, torch.bfloat16: 2 ** -8}


@pytest.mark.parametrize("n, k, rows, scale_dtype, dtype", [
    (96, 256, 1, torch.bfloat16, torch.bfloat16),
    (192, 576, 3, torch.float16, torch.float32),   # the default model's width; a float32 model's float16 scales
    (100, 1000, 17, torch.bfloat16, torch.bfloat16),  # rows not a panel multiple, K not a multiple of 8; prefill
])
def test_integer_product_is_the_scheme_on_the_dequantized_weight(n, k, rows, scale_dtype, dtype, monkeypatch):
    assert cpu_ops.load() is not None, "the compiled CPU operators must build here"
    record = _record(n, k, scale_dtype)
    module = W8A8Linear.from_record(record)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    x[0, :5] *= 40  # an outlier channel: the token's scale follows it
    want = _reference(record, x)
    # the kernel quantizes the raw row itself and the already quantized one (what the runtime hands it)
    # to the same codes
    for given in (x, DYNAMIC.fake_quantize(x)):
        got = module._integer_product(given).float()
        assert ((got - want).abs() <= TOLERANCE[dtype] * want.abs() + 1e-5 * want.abs().max()).all()
    # decode rows, and prefill rows where prefill_kernel() is "int8" (no AMX), run on the kernel; with AMX the
    # prefill rows go to oneDNN on the dequantized weight, the route test_qlinear checks for every panel linear
    monkeypatch.setattr(panel, "prefill_kernel", lambda: "int8")
    assert torch.equal(module(x), module._integer_product(x))
    monkeypatch.setattr(panel, "prefill_kernel", lambda: "bf16")
    quantized = DYNAMIC.fake_quantize(x)  # what the runtime hands the module: the dense route multiplies it as given
    sums = quantized.float().abs() @ record.dequantize(torch.float32).abs().T
    # the dense route's bf16 roundings (of the weight, of the output): each under 2^-8 of sum |x w|
    assert ((module(quantized).float() - want).abs() <= 2 ** -7 * sums + 1e-5 * want.abs().max()).all()
    assert torch.equal(module.dequantized(torch.float32)[:, :k], record.dequantize(torch.float32))


def test_fused_modules_compute_their_parts():
    parts = [W8A8Linear.from_record(_record(n, 576, seed=seed), bias=torch.full((n,), 0.5))
             for seed, n in enumerate((64, 32, 32))]
    fused = W8A8Linear.fuse(parts)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(fused(x), torch.cat([part(x) for part in parts], dim=-1))
    assert W8A8Linear.fuse([parts[0], W8A8Linear.from_record(_record(64, 256))]) is None  # other widths


def test_only_what_the_kernel_computes_exactly_runs_on_it():
    channel = _record(64, 256)
    assert runs_on_integer_kernel(channel, DYNAMIC)
    assert not runs_on_integer_kernel(channel, ActivationGrid("int8", dynamic=False))  # its scale is stored
    assert not runs_on_integer_kernel(channel, ActivationGrid("fp8"))
    assert not runs_on_integer_kernel(channel, None)  # weight-only
    assert not runs_on_integer_kernel(_record(64, 256, group_size=128), DYNAMIC)
    asym = rtn_quantize(torch.randn(64, 256), QuantConfig(bits=8, group_size=-1, sym=False))
    assert not runs_on_integer_kernel(asym, DYNAMIC)
    with pytest.raises(ValueError, match="8-bit symmetric per-channel"):
        W8A8Linear.from_record(asym)
