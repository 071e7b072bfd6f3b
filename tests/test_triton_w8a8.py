"""The W8A8 Triton kernels (INT8 and FP8 E4M3) in Triton's interpreter (TRITON_INTERPRET=1, set in
conftest.py) on CPU tensors: the activation kernel against ``ActivationGrid``'s quantization bit for bit,
and the linear against the quantized input times the dequantized weight, at small ragged shapes and at
MiniCPM4.1-8B's."""
from __future__ import annotations

import os

import pytest
import torch

from quantkit.activation_quant import ActivationGrid
from quantkit.fp8 import FloatGrid, FP8Tensor, to_e4m3
from quantkit.kernels.linear import triton_w8a8
from quantkit.kernels.linear.triton_w8a8 import (
    LAUNCH_CONFIGS,
    TritonW8A8Linear,
    launch_config,
    quantize_rows,
    w8a8_matmul,
)
from quantkit.quant import QuantConfig, rtn_quantize

from helpers import small_recipe

assert os.environ.get("TRITON_INTERPRET") == "1", "these tests prove kernels in the interpreter"


def int8_record(n, k, seed=0, scale_dtype=torch.float16):
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return rtn_quantize(weight, QuantConfig(bits=8, group_size=-1, sym=True, scale_dtype=scale_dtype))


def fp8_record(n, k, seed=0, strategy="channel"):
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return FP8Tensor.quantize(weight, FloatGrid(strategy))


def inputs(rows, k, dtype=torch.float32, seed=1):
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 2
    x[0, :3] *= 30  # outlier channels: the token's scale follows them, a static scale saturates them
    return x.to(dtype)


def static_scale(grid, k, seed=2):
    """A calibration scale from other inputs, as llm-compressor's static observer stores it."""
    return grid.static_scale(inputs(8, k, seed=seed).abs().amax(dim=0))


def linear(kind, record, grid, scale, bias=None):
    build = TritonW8A8Linear.from_int8_record if kind == "int8" else TritonW8A8Linear.from_fp8_record
    return build(record, bias, grid, scale)


def reference(record, x, grid, scale, bias=None):
    """What the artifact means, in float64: the quantized input times the dequantized weight (+ bias).
    The input is quantized from x.float(): ``fake_quantize`` would round q · s to x's dtype, which the
    kernel never does (it multiplies the codes and scales the float32 sums)."""
    out = grid.fake_quantize(x.float(), scale).double() @ record.dequantize(torch.float32).double().T
    return out if bias is None else out + bias.double()


# The INT8 sums are exact (int32); E4M3 products are exact in float32 and summed in another order than
# the reference's; both are scaled in float32: 1e-5 of the largest |out|. A 16-bit output adds its one
# rounding: half an fp16 step (2^-11 of the value), and for bf16 a whole step (2^-7), since the
# interpreter truncates float32 -> bf16 stores (a GPU rounds to nearest).
OUTPUT_STEP = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -7}


def assert_matches(got, want):
    error = (got.double() - want).abs()
    assert (error <= OUTPUT_STEP[got.dtype] * want.abs() + 1e-5 * want.abs().max()).all(), float(error.max())


def expected_codes(x, grid, scale):
    """The codes and scales ``ActivationGrid.fake_quantize`` multiplies, spelled out (torch's rounding)."""
    values = x.float()
    absmax = values.abs().amax(dim=1, keepdim=True)
    if not grid.dynamic:
        scale = scale.expand(values.shape[0], 1)
    elif grid.kind == "int8":
        scale = absmax / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    else:
        scale = (absmax / 448).clamp(min=1 / (448 * 512))
    if grid.kind == "fp8":
        return to_e4m3(values * (1.0 / scale)), scale.reshape(-1)
    if grid.dynamic:  # vLLM's dynamic INT8: times 127 / max|x| (IEEE quotient), 0 where that is not finite
        multiplier = torch.full_like(absmax, 127.0) / absmax
        scaled = values * torch.where(multiplier.isfinite(), multiplier, torch.zeros_like(multiplier))
    else:
        scaled = values / scale
    return scaled.round().clamp(-128, 127).to(torch.int8), scale.reshape(-1)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")  # numpy's, for row 5
def test_activation_codes_are_the_grids_bit_for_bit(kind, dynamic, dtype):
    grid = ActivationGrid(kind, dynamic)
    x = inputs(6, 1100, dtype)  # K over one step of the kernel, not a multiple of it
    x[1] = 0.0  # an all-zero token: scale 1 (INT8) or the floor 1/(448·512) (FP8)
    x[2] *= 1e-6  # a near-silent token: FP8's floor keeps its values in range
    # 127 / max|x| overflows float32: INT8 codes 0. Normal floats only: the interpreter decodes subnormal
    # bf16 wrongly (measured: 1e-39 -> 4.4e-39), which a GPU does not
    x[5] = (x[5].float().sign() * (x[5].float().abs() + 1) * 2e-38).to(dtype)
    # ties at scale 1: a token whose largest |x| is the grid's largest value
    largest = grid.largest
    ties = [2.5, -3.5, 0.5, -0.5, 126.5] if kind == "int8" else [17.0, 19.0, -17.0, 1.5 * 2 ** -9, 2 ** -10, -0.0]
    x[3] = 0.0
    x[3, 0] = largest
    x[3, 1:1 + len(ties)] = torch.tensor(ties).to(dtype)
    scale = None if dynamic else static_scale(grid, 1100)
    if not dynamic:
        x[4, :4] = torch.tensor([1e4, -1e4, 500.0, -460.0])  # saturate at 127 / −128 or ±448
    codes, scales = quantize_rows(x, grid, scale)
    want_codes, want_scales = expected_codes(x, grid, scale)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))  # E4M3 bytes: −0 included
    assert torch.equal(codes.float() * scales[:, None], grid.fake_quantize(x.float(), scale))
    if dynamic:
        expected_ties = [2, -4, 0, 0, 126] if kind == "int8" else [16.0, 20.0, -16.0, 2 ** -8, 0.0, -0.0]
        assert codes[3, 1:1 + len(ties)].float().tolist() == expected_ties


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dynamic_int8_multiplies_by_127_over_the_token_max(dtype):
    """Tokens where x · (127 / max|x|) and x / (max|x| / 127) round to different codes (in these, x / scale
    is a tie that x · quotient misses): the kernel takes vLLM's product, as ``fake_quantize`` does."""
    grid = ActivationGrid("int8")
    # values with bf16's 8 significant bits, where such ties are common
    x = (torch.randn(64, 520, generator=torch.Generator().manual_seed(0)) * 2).bfloat16().to(dtype)
    codes, scales = quantize_rows(x, grid)
    divided = (x.float() / scales[:, None]).round().clamp(-128, 127)
    assert (divided != codes.float()).sum() > 0  # the data holds such ties
    assert torch.equal(codes, expected_codes(x, grid, None)[0])
    assert torch.equal(codes.float() * scales[:, None], grid.fake_quantize(x.float()))


@pytest.mark.parametrize("kind, dynamic, n, k, rows, dtype, with_bias", [
    ("int8", True, 70, 300, 1, torch.float32, False),     # N, K ragged against every tile; decode
    ("int8", False, 130, 200, 3, torch.float16, True),
    ("int8", True, 96, 520, 17, torch.bfloat16, True),    # 17 rows: prefill tiles
    ("int8", False, 200, 136, 17, torch.float32, False),
    ("fp8", True, 70, 300, 1, torch.bfloat16, True),
    ("fp8", False, 130, 200, 3, torch.float32, False),
    ("fp8", True, 96, 520, 17, torch.float16, False),
    ("fp8", False, 200, 136, 17, torch.bfloat16, True),
])
def test_w8a8_linear_matches_the_quantized_reference(kind, dynamic, n, k, rows, dtype, with_bias):
    grid = ActivationGrid(kind, dynamic)
    record = int8_record(n, k) if kind == "int8" else fp8_record(n, k)
    scale = None if dynamic else static_scale(grid, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4)) if with_bias else None
    x = inputs(rows, k, dtype)
    got = linear(kind, record, grid, scale, bias)(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert_matches(got, reference(record, x, grid, scale, bias))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("n, k, rows", [
    (4096, 4096, 1),   # MiniCPM4.1-8B q_proj / o_proj, decode
    (256, 4096, 64),   # MiniCPM4.1-8B k_proj (2 KV heads x 128), a prefill chunk
])
def test_w8a8_linear_at_minicpm41_shapes(kind, n, k, rows):
    grid = ActivationGrid(kind)
    record = int8_record(n, k, seed=5) if kind == "int8" else fp8_record(n, k, seed=5)
    x = inputs(rows, k, torch.bfloat16)
    assert_matches(linear(kind, record, grid, None)(x), reference(record, x, grid, None))


@pytest.mark.parametrize("rows", [2, 40])
def test_orin_tiles(rows):
    """Jetson Orin's decode and prefill tiles (INT8 only: sm_87 has no FP8 tensor cores)."""
    record = int8_record(150, 330, seed=6)
    module = TritonW8A8Linear.from_int8_record(record)
    x = inputs(rows, 330)
    config = launch_config((8, 7), "decode" if rows <= triton_w8a8.DECODE_MAX_ROWS else "prefill")
    got = w8a8_matmul(x, module.weight, module.weight_scale, module.activations, config=config)
    assert_matches(got, reference(record, x, module.activations, None))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_zero_rows_give_zeros_or_the_bias(kind, dynamic):
    grid = ActivationGrid(kind, dynamic)
    record = int8_record(40, 96) if kind == "int8" else fp8_record(40, 96)
    scale = None if dynamic else static_scale(grid, 96)
    x = inputs(3, 96)
    x[1] = 0.0
    assert torch.equal(linear(kind, record, grid, scale)(x)[1], torch.zeros(40))
    bias = torch.randn(40)
    assert torch.equal(linear(kind, record, grid, scale, bias)(x)[1], bias)


def test_tensor_scale_fp8_and_batched_shapes():
    record = fp8_record(48, 160, strategy="tensor")
    module = TritonW8A8Linear.from_fp8_record(record)
    assert module.weight_scale.shape == (48,) and bool((module.weight_scale == record.scale).all())
    x = inputs(6, 160, torch.float16).view(2, 3, 160)
    got = module(x)
    assert got.shape == (2, 3, 48)
    assert_matches(got.view(6, 48), reference(record, x.view(6, 160), module.activations, None))
    assert module(x[:0]).shape == (0, 3, 48)


def test_weight_bytes_and_stored_codes():
    record = int8_record(64, 256)
    module = TritonW8A8Linear.from_int8_record(record)
    assert module.weight_bytes == 64 * 256 + 64 * 4
    assert module.weight.dtype == torch.int8
    assert torch.equal(module.weight.float() * module.weight_scale[:, None], record.dequantize(torch.float32))
    fp8 = TritonW8A8Linear.from_fp8_record(fp8_record(64, 256))
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight_bytes == 64 * 256 + 64 * 4


@pytest.mark.parametrize("capability", [(8, 7), (8, 6), (8, 0)])
def test_fp8_refused_below_sm89(monkeypatch, capability):
    module = TritonW8A8Linear.from_fp8_record(fp8_record(32, 64))  # the CPU: the interpreter runs it
    monkeypatch.setattr(triton_w8a8, "device_capability", lambda device: capability)
    message = f"compute capability {capability[0]}.{capability[1]}; FP8"
    with pytest.raises(RuntimeError, match=message):
        TritonW8A8Linear.from_fp8_record(fp8_record(32, 64))
    with pytest.raises(RuntimeError, match=message):
        module(torch.randn(1, 64))
    TritonW8A8Linear.from_int8_record(int8_record(32, 64))  # INT8 tensor cores exist there
    monkeypatch.setattr(triton_w8a8, "device_capability", lambda device: (8, 9))
    TritonW8A8Linear.from_fp8_record(fp8_record(32, 64))


def test_int8_refused_below_ampere(monkeypatch):
    monkeypatch.setattr(triton_w8a8, "device_capability", lambda device: (7, 5))
    with pytest.raises(RuntimeError, match="compute capability 7.5"):
        TritonW8A8Linear.from_int8_record(int8_record(32, 64))


@pytest.mark.parametrize("config, setting", [
    (QuantConfig(bits=4, group_size=-1, sym=True), "bits=8"),
    (QuantConfig(bits=8, group_size=-1, sym=False), "sym=True"),
    (QuantConfig(bits=8, group_size=128, sym=True), "group_size=-1"),
])
def test_other_integer_records_refused(config, setting):
    record = rtn_quantize(torch.randn(32, 256, generator=torch.Generator().manual_seed(0)), config)
    with pytest.raises(ValueError, match=setting):
        TritonW8A8Linear.from_int8_record(record)


def test_inconsistent_activation_settings_refused():
    record = int8_record(32, 64)
    with pytest.raises(ValueError, match="int8 activations"):
        TritonW8A8Linear.from_fp8_record(fp8_record(32, 64), None, ActivationGrid("int8"))
    with pytest.raises(ValueError, match="needs its one stored input_scale"):
        TritonW8A8Linear.from_int8_record(record, None, ActivationGrid("int8", dynamic=False))
    with pytest.raises(ValueError, match="takes no input_scale"):
        TritonW8A8Linear.from_int8_record(record, None, ActivationGrid("int8"), torch.ones(1))
    with pytest.raises(ValueError, match="positive finite"):
        TritonW8A8Linear.from_int8_record(record, None, ActivationGrid("int8", dynamic=False), torch.zeros(1))


def test_launch_configs_per_gpu():
    assert launch_config((8, 9), "decode") == LAUNCH_CONFIGS[(8, 9)]["decode"]
    assert launch_config((8, 7), "prefill") == LAUNCH_CONFIGS[(8, 7)]["prefill"]
    assert launch_config((8, 6), "decode") == LAUNCH_CONFIGS[(8, 9)]["decode"]  # untuned Ampere: the 4090's tiles
    assert all(c.block_k % 32 == 0 and c.block_m >= 16 for table in LAUNCH_CONFIGS.values() for c in table.values())
    with pytest.raises(RuntimeError, match="compute capability 7.5"):
        launch_config((7, 5), "decode")


@pytest.mark.parametrize("recipe, activations", [("int8-w8a8", "int8-static"), ("fp8-w8a8", "fp8-dynamic")])
def test_triton_backend_runs_w8a8_artifacts(tiny_checkpoint_factory, tmp_path, recipe, activations):
    """The runtime's triton backend puts every linear of a W8A8 artifact on these kernels (a static scheme
    with its stored input_scale) and computes what the artifact means: the reference model's logits within
    float32 sums in other orders (1e-4 of their largest)."""
    from quantkit.engine import quantize
    from quantkit.kernels.attention import make_attention
    from quantkit.kernels.load import load_runtime_model
    from quantkit.kernels.model import RuntimeModel
    from quantkit.loading import load_model

    out = tmp_path / recipe
    quantize(tiny_checkpoint_factory(), small_recipe(recipe, tmp_path, **{"compressed-tensors": {
        "activations": activations}}), out, progress=False)
    runtime = load_runtime_model(out, dtype=torch.float32, linear_backend="triton")
    assert isinstance(runtime.get_submodule("model.layers.0.mlp.down_proj"), TritonW8A8Linear)
    ids = [1, 17, 33, 250, 7, 99, 3]
    runner = RuntimeModel(runtime, make_attention(None))
    got = runner.forward(torch.tensor(ids), runner.new_cache(), all_logits=True)
    with torch.no_grad():
        want = load_model(out)(torch.tensor([ids])).logits[0]
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
