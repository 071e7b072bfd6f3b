"""FP8 (E4M3) in compressed-tensors float-quantized: the grid's rounding against the bit layout, the
package (compressed-tensors 0.19, what vLLM parses configs with) decompressing quantkit's tensors bit for
bit and writing its config field for field (llm-compressor's FP8_DYNAMIC preset), GPTQ on the E4M3 grid
against round-to-nearest, activations cast to E4M3 per token as vLLM does, a whole artifact read by
transformers with the same logits, and what cannot be stored refused."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

from quantkit.algorithms.gptq import gptq_quantize
from quantkit.engine import quantize
from quantkit.eval.conformance import E4M3_VALUES, check_conformance
from quantkit.formats.compressed_tensors import (
    ACTIVATIONS,
    CompressedTensorsGrid,
    packed_tensors,
    parse_quantization_config,
    quantization_config,
    read_packed_tensors,
)
from quantkit.fp8 import E4M3, E4M3_MAX, FloatGrid, FP8Solver, FP8Tensor, to_e4m3
from quantkit.reader import ArtifactReader
from quantkit.recipe import RecipeError, load_recipe

from helpers import small_recipe

MODULE = "model.layers.0.mlp.down_proj"
FINITE = np.sort(np.unique(E4M3_VALUES[np.isfinite(E4M3_VALUES)]))


def _grid(strategy="channel", activations="fp8-dynamic"):
    return CompressedTensorsGrid(8, -1, True, weights="fp8" if strategy == "channel" else "fp8-tensor",
                                 activations=activations)


def _nearest_even(values: np.ndarray) -> np.ndarray:
    """Each value's nearest finite E4M3 value, ties to the one whose byte is even, saturating: from the
    bit layout's 256 values (conformance's table), not from torch's cast."""
    codes = np.arange(256)
    finite = np.isfinite(E4M3_VALUES)
    clipped = np.clip(values, -E4M3_MAX, E4M3_MAX)
    distance = np.abs(E4M3_VALUES[finite][None, :] - clipped[:, None])
    best = distance.min(axis=1, keepdims=True)
    candidates = (distance == best) & ~((E4M3_VALUES[finite] == 0) & (codes[finite] == 0x80))[None, :]
    even = candidates & (codes[finite] % 2 == 0)[None, :]
    chosen = np.where(even.any(axis=1), even.argmax(axis=1), candidates.argmax(axis=1))
    return E4M3_VALUES[finite][chosen]


def test_e4m3_rounding_is_nearest_even_and_saturates():
    """Midpoints between neighbours (ties), random values across the range, subnormals and beyond 448."""
    midpoints = (FINITE[1:] + FINITE[:-1]) / 2
    gen = np.random.default_rng(0)
    values = np.concatenate([midpoints, gen.normal(0, 40, 4000), gen.normal(0, 2.0 ** -8, 500),
                             [500.0, -1e6, 464.0, 0.0]]).astype(np.float32)
    got = to_e4m3(torch.from_numpy(values)).float().numpy()
    assert np.array_equal(got, _nearest_even(values))
    assert got.max() == E4M3_MAX and got.min() == -E4M3_MAX


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compressed_tensors_decompresses_to_quantkits_weights(strategy, dtype):
    """The package's float-quantized decompressor, given quantkit's tensors and config, gives the record's
    weight in float32 exactly, rounded once to the model's dtype; quantkit reads its tensors back."""
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 1, 96)[:, None]
    record = FP8Tensor.quantize(weight, FloatGrid(strategy))
    tensors = packed_tensors(record, MODULE)
    scale_shape = (96, 1) if strategy == "channel" else (1,)
    assert {key: (t.dtype, tuple(t.shape)) for key, t in tensors.items()} == {
        f"{MODULE}.weight": (E4M3, (96, 256)), f"{MODULE}.weight_scale": (torch.float32, scale_shape)}
    config = quantization_config(_grid(strategy))
    scheme = QuantizationConfig.model_validate(config).config_groups["group_0"]
    local = {key.rsplit(".", 1)[1]: tensor for key, tensor in tensors.items()}
    theirs = FloatQuantizationCompressor.decompress(local, scheme)["weight"]
    assert torch.equal(theirs.to(dtype), record.dequantize(dtype))
    back = read_packed_tensors(tensors, MODULE, parse_quantization_config(config), (96, 256))
    assert back.values.view(torch.uint8).equal(record.values.view(torch.uint8)) and back.scale.equal(record.scale)


def test_quantkit_reads_what_compressed_tensors_compresses():
    """A weight the package compresses (E4M3 under scales from the same min/max rule) reads back as what the
    package decompresses, and equals quantkit's own round-to-nearest bit for bit."""
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    record = FP8Tensor.quantize(weight, FloatGrid("channel"))
    config = quantization_config(_grid())
    scheme = QuantizationConfig.model_validate(config).config_groups["group_0"]
    compressed = FloatQuantizationCompressor.compress({"weight": weight, "weight_scale": record.scale}, scheme)
    assert compressed["weight"].dtype == E4M3
    assert torch.equal(compressed["weight"].view(torch.uint8), record.values.view(torch.uint8))
    theirs = FloatQuantizationCompressor.decompress(dict(compressed), scheme)["weight"]
    ours = read_packed_tensors({f"{MODULE}.{k}": t for k, t in compressed.items()}, MODULE,
                               parse_quantization_config(config), (64, 256))
    assert torch.equal(ours.dequantize(), theirs)


def test_config_is_llm_compressors_fp8_dynamic_and_what_compressed_tensors_writes(tmp_path):
    config = quantization_config(_grid())
    preset = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]).model_dump()
    group = config["config_groups"]["group_0"]
    assert {key: group[key] for key in preset if key != "format"} == {k: v for k, v in preset.items() if k != "format"}
    assert group["format"] == config["format"] == "float-quantized"
    for grid in (_grid(), _grid("tensor"), _grid(activations="16-bit")):
        ours = quantization_config(grid)
        (tmp_path / "config.json").write_text("{}")
        ModelCompressor(quantization_config=QuantizationConfig.model_validate(ours)).update_config(str(tmp_path))
        theirs = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
        assert theirs == json.loads(json.dumps(ours)) and parse_quantization_config(theirs) == grid


# config.json's quantization_config from llm-compressor 0.14.0.1's FP8_DYNAMIC on the default model
# (`make bench-ct`'s FP8 peer): the same fields but the observer that chose its weight scales
LLM_COMPRESSOR_FP8 = {
    "config_groups": {"group_0": {
        "format": "float-quantized", "output_activations": None, "targets": ["Linear"],
        "input_activations": {"actorder": None, "block_structure": None, "dynamic": True, "group_size": None,
                              "num_bits": 8, "observer": None, "observer_kwargs": {}, "scale_dtype": None,
                              "strategy": "token", "symmetric": True, "type": "float", "zp_dtype": None},
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
                    "observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": None,
                    "strategy": "channel", "symmetric": True, "type": "float", "zp_dtype": None}}},
    "format": "float-quantized", "global_compression_ratio": None, "ignore": ["lm_head"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
    "transform_config": {}, "version": "0.19.0"}


def test_llm_compressors_own_fp8_config_is_read():
    assert parse_quantization_config(LLM_COMPRESSOR_FP8) == _grid()
    # bfloat16 scales, as llm-compressor writes for a bfloat16 model, are exact in float32
    tensors = {f"{MODULE}.weight": torch.zeros(4, 32, dtype=E4M3),
               f"{MODULE}.weight_scale": torch.full((4, 1), 0.00123, dtype=torch.bfloat16)}
    record = read_packed_tensors(tensors, MODULE, _grid(), (4, 32))
    assert record.scale.dtype == torch.float32 and record.scale.equal(tensors[f"{MODULE}.weight_scale"].float())


@pytest.mark.parametrize("change, message", [
    (lambda c: c["config_groups"]["group_0"]["weights"].update(symmetric=False), "weights.symmetric: False"),
    (lambda c: c["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128),
     "weights.strategy: 'group'"),
    (lambda c: c["config_groups"]["group_0"]["weights"].update(type="int"), "weights.type: 'int' with 'float-"),
    (lambda c: c["config_groups"]["group_0"]["input_activations"].update(type="int"), "input_activations"),
    (lambda c: c.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
], ids=["asymmetric", "groups", "int-weights", "int8-activations", "kv-cache"])
def test_fp8_configs_quantkit_does_not_read_are_refused_naming_the_setting(change, message):
    config = json.loads(json.dumps(LLM_COMPRESSOR_FP8))
    change(config)
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(config)


def test_gptq_on_the_e4m3_grid_beats_round_to_nearest():
    """The same weights and Hessian (correlated inputs, a few loud channels): GPTQ's output error
    tr(ΔW H ΔWᵀ) at most 0.9x round-to-nearest's, per channel and per tensor (measured 0.82x and 0.83x)."""
    gen = torch.Generator().manual_seed(0)
    n, k = 192, 384
    weight = torch.randn(n, k, generator=gen)
    mixing = torch.eye(k) + 0.3 * torch.randn(k, k, generator=gen) / k ** 0.5
    inputs = torch.randn(4096, k, generator=gen) @ mixing
    inputs[:, :8] *= 6
    hessian = 2 * inputs.T @ inputs / inputs.shape[0]

    def error(record):
        delta = weight - record.dequantize()
        return float(torch.einsum("nk,kl,nl->", delta, hessian, delta))

    for strategy in ("channel", "tensor"):
        grid = FloatGrid(strategy)
        solved = gptq_quantize(weight, hessian, grid, damp_percent=0.01, group_aware=True)
        assert solved.values.dtype == E4M3 and solved.scale.equal(grid.scales(weight))
        assert error(solved) <= 0.9 * error(FP8Tensor.quantize(weight, grid))


def test_edge_rows_zero_underflowing_and_saturating():
    """An all-zero row keeps scale 1 and zeros; a row whose absmax / 448 is no normal float32 gets the
    smallest normal scale and stays finite; values the solver pushes beyond 448 · s saturate."""
    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    weight[1] = 0
    weight[2] *= 1e-40
    weight[[0, 3], 0] = weight[[0, 3]].abs().amax(dim=1)
    record = FP8Tensor.quantize(weight, FloatGrid("channel"))
    assert record.scale[1].item() == 1.0 and (record.dequantize()[1] == 0).all()
    assert record.scale[2].item() == torch.finfo(torch.float32).tiny and torch.isfinite(record.dequantize()).all()
    solver = FP8Solver(FloatGrid("channel"), weight)
    scale = solver.scale.reshape(-1)
    column = weight[:, 0] * 10  # rows 0 and 3: far past their largest |w|, as compensation could push them
    codes, fake = solver.round(0, column[None, :])
    assert codes.dtype == torch.uint8
    assert torch.equal(fake[[0, 3]].abs(), E4M3_MAX * scale[[0, 3]]) and (fake[1] == 0).all()


def test_fp8_activations_are_cast_per_token_as_vllms_kernel_does():
    """Per token: scale = max(absmax / 448, 1 / (448 · 512)), x · (1 / scale) saturated and cast to E4M3,
    nearest even (vLLM's dynamic_per_token_scaled_fp8_quant), written here from the bit layout."""
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(4)) * 3
    x[2] = 0
    x[4] *= 1e-9  # below the floor: the scale stays 1 / (448 · 512)
    got = ACTIVATIONS["fp8-dynamic"][0].fake_quantize(x)
    values = x.numpy().astype(np.float32)
    scale = np.maximum(np.abs(values).max(axis=1, keepdims=True) / np.float32(448), np.float32(1 / (448 * 512)))
    want = _nearest_even((values * (np.float32(1) / scale)).ravel()).reshape(values.shape) * scale
    assert np.array_equal(got.numpy(), want.astype(np.float32)) and (got[2] == 0).all()
    assert ACTIVATIONS["fp8-dynamic"][0].fake_quantize(x.bfloat16()).dtype == torch.bfloat16


@pytest.fixture(scope="module")
def fp8_artifact(tiny_checkpoint_factory, tmp_path_factory):
    """The fp8-w8a8 recipe on a bfloat16 tiny checkpoint."""
    source = tiny_checkpoint_factory(dtype=torch.bfloat16)
    out = tmp_path_factory.mktemp("fp8") / "artifact"
    quantize(source, small_recipe("fp8-w8a8", out.parent), out, progress=False)
    return out


def test_fp8_artifact_is_read_decoded_and_inspected(fp8_artifact):
    from quantkit.inspect import describe

    reader = ArtifactReader(fp8_artifact)
    assert reader.qconfig == _grid()
    assert check_conformance(fp8_artifact).passed
    assert describe(fp8_artifact)["quantization"] == ("compressed-tensors float-quantized 8-bit float channel sym, "
                                                      "activations 8-bit float token sym dynamic")


def test_roofline_reads_fp8_weights_at_one_byte(fp8_artifact):
    """The decode ceiling counts each E4M3 weight as the byte the kernel reads, float scales and the
    rest at the runtime's bf16."""
    from quantkit.checkpoint import CheckpointReader
    from quantkit.kernels.roofline import weight_bytes_per_token

    reader = CheckpointReader(fp8_artifact)
    expected = sum(math.prod(reader.shape(name)) * (1 if reader.dtype(name) == E4M3 else 2)
                   for name in reader.names if name != "model.embed_tokens.weight")
    assert weight_bytes_per_token(fp8_artifact) == expected


def test_transformers_runs_the_fp8_artifact_as_quantkit_scores_it(fp8_artifact):
    """transformers' compressed-tensors integration decompresses the E4M3 weights and casts each linear's
    input to E4M3 per token: its logits equal quantkit's scoring model (activations quantized by the same
    rule) within 1e-5 of their scale; without the activation cast they differ."""
    from transformers import AutoModelForCausalLM

    from quantkit.loading import load_model

    ids = torch.tensor([[1, 17, 33, 250, 7, 99, 3]])
    theirs = AutoModelForCausalLM.from_pretrained(fp8_artifact, dtype=torch.float32)
    ours = load_model(fp8_artifact, dtype=torch.float32)
    with torch.no_grad():
        got, want = theirs(ids).logits.float(), ours(ids).logits.float()
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        for module in ours.modules():
            module._forward_pre_hooks.clear()
        assert not torch.allclose(ours(ids).logits.float(), got)


def test_runtime_runs_fp8_artifacts_as_they_are_scored(fp8_artifact, tiny_checkpoint_factory, tmp_path):
    """W8A8: the runtime's fused q/k/v (one matmul) casts its input to E4M3 per token as the scoring model's
    three linears do, within 1e-6 of their outputs' scale, and its logits pick the same tokens (logits of
    a W8A8 model move by several percent between float32 and float64 arithmetic: a cast that flips one
    value moves the next layer's input). W8A16 (weights: fp8, 16-bit activations) runs dequantized:
    its logits within 1e-5 of the reference's."""
    from quantkit.kernels.attention import make_attention
    from quantkit.kernels.load import load_runtime_model
    from quantkit.kernels.model import RuntimeModel
    from quantkit.loading import load_model

    ids = [1, 17, 33, 250, 7, 99, 3]
    runtime = RuntimeModel(load_runtime_model(fp8_artifact, dtype=torch.float32), make_attention(None))
    reference = load_model(fp8_artifact)
    x = torch.randn(5, reference.config.hidden_size, generator=torch.Generator().manual_seed(5))
    attention = reference.model.layers[0].self_attn
    with torch.no_grad():
        want = torch.cat([getattr(attention, name)(x) for name in ("q_proj", "k_proj", "v_proj")], dim=-1)
        got = runtime.layers[0].qkv(x)
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()
        logits = runtime.forward(torch.tensor(ids), runtime.new_cache(), all_logits=True)
        assert torch.equal(logits.argmax(-1), reference(torch.tensor([ids])).logits[0].argmax(-1))

    source = tiny_checkpoint_factory(dtype=torch.bfloat16)
    weights_only = tmp_path / "w8a16"
    quantize(source, small_recipe("fp8-w8a8", tmp_path, **{"compressed-tensors": {"activations": "16-bit"}}),
             weights_only, progress=False)
    assert parse_quantization_config(json.loads((weights_only / "config.json").read_text())["quantization_config"]
                                     ) == _grid(activations="16-bit")
    runtime = RuntimeModel(load_runtime_model(weights_only, dtype=torch.float32), make_attention(None))
    logits = runtime.forward(torch.tensor(ids), runtime.new_cache(), all_logits=True)
    with torch.no_grad():
        want = load_model(weights_only)(torch.tensor([ids])).logits[0]
    assert (logits - want).abs().max() <= 1e-5 * want.abs().max()


def test_an_fp8_artifact_is_refused_on_a_gpu_without_fp8_before_its_weights_are_read(fp8_artifact, monkeypatch):
    """A Jetson Orin (sm_87) has INT8 but no FP8 tensor cores: loading an FP8 W8A8 artifact for it fails at
    once naming what the GPU needs (the capability is faked: no GPU here)."""
    from quantkit.kernels.linear import triton_w8a8
    from quantkit.kernels.load import load_runtime_model

    monkeypatch.setattr(triton_w8a8, "device_capability", lambda device: (8, 7))
    with pytest.raises(RuntimeError, match="compute capability 8.7; FP8 .* needs 8.9"):
        load_runtime_model(fp8_artifact, linear_backend="triton", device="cuda")


def test_static_activation_configs_are_llm_compressors_presets(tmp_path):
    """fp8-tensor weights with fp8-static activations are the FP8 preset, but for the observer the preset
    names for calibrating (static min/max, which quantkit's scales are); both static schemes round-trip
    through the package's ModelCompressor; the stored scale maps the largest calibration |x| to 448 or 127."""
    config = quantization_config(_grid("tensor", activations="fp8-static"))
    preset = preset_name_to_scheme("FP8", ["Linear"]).model_dump()
    preset["input_activations"]["observer"] = None
    group = config["config_groups"]["group_0"]
    assert {key: group[key] for key in preset if key != "format"} == {k: v for k, v in preset.items() if k != "format"}
    for grid in (_grid(activations="fp8-static"), CompressedTensorsGrid(8, -1, True, activations="int8-static")):
        ours = quantization_config(grid)
        (tmp_path / "config.json").write_text("{}")
        ModelCompressor(quantization_config=QuantizationConfig.model_validate(ours)).update_config(str(tmp_path))
        theirs = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
        assert theirs == json.loads(json.dumps(ours)) and parse_quantization_config(theirs) == grid
    abs_max = torch.tensor([0.5, 89.6, 3.0])
    assert ACTIVATIONS["fp8-static"][0].static_scale(abs_max).item() == pytest.approx(0.2, rel=1e-6)
    assert ACTIVATIONS["int8-static"][0].static_scale(torch.zeros(3)).tolist() == [1.0]


@pytest.mark.parametrize("recipe, activations", [("fp8-w8a8", "fp8-static"), ("int8-w8a8", "int8-static")])
def test_static_activation_scales_are_calibrated_stored_and_applied(recipe, activations, tiny_checkpoint_factory,
                                                                   tmp_path):
    """Every quantized linear stores input_scale (float32 [1]) from its calibration inputs; transformers
    (which applies it as vLLM does) gives the logits quantkit scores; a missing scale is refused by name."""
    from transformers import AutoModelForCausalLM

    from quantkit.checkpoint import CheckpointError
    from quantkit.loading import load_model

    source = tiny_checkpoint_factory(dtype=torch.bfloat16)
    out = tmp_path / "static"
    quantize(source, small_recipe(recipe, tmp_path, **{"compressed-tensors": {"activations": activations}}), out,
             progress=False)
    reader = ArtifactReader(out)
    scales = {name: reader.tensors.get(name) for name in reader.tensors.names if name.endswith(".input_scale")}
    assert len(scales) == reader.num_layers * len(reader.shapes)
    assert all(t.dtype == torch.float32 and tuple(t.shape) == (1,) and t.item() > 0 for t in scales.values())
    from quantkit.inspect import describe

    kind = {"fp8-static": "float", "int8-static": "int"}[activations]
    assert describe(out)["quantization"].endswith(f"activations 8-bit {kind} tensor sym static")
    ids = torch.tensor([[1, 17, 33, 250, 7, 99, 3]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits.float()
        want = load_model(out)(ids).logits.float()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()

    from safetensors.torch import load_file, save_file

    shard = next(out.glob("*.safetensors"))
    tensors = load_file(shard)
    missing = next(name for name in tensors if name.endswith(".input_scale"))
    del tensors[missing]
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in out.iterdir():
        if path != shard and path.name != "quantkit.json":
            (broken / path.name).write_bytes(path.read_bytes())
    save_file(tensors, broken / shard.name)
    with pytest.raises(CheckpointError, match=f"{missing} is missing"):
        load_model(broken)


@pytest.mark.parametrize("settings, message", [
    ({"compressed-tensors.activations": "int8-dynamic"}, "set 'compressed-tensors.weights: int'"),
    ({"quant.group_size": 128}, "set quant.bits: 8, quant.group_size: -1, quant.sym: true"),
    ({"algorithm": "awq"}, "is solved on FP8 E4M3 per channel, which 'awq' cannot do"),
    ({"smooth.enabled": True}, "set smooth.enabled: false"),
    ({"gptq.clip_search": True}, "set gptq.clip_search: false"),
], ids=["int8-activations", "groups", "awq", "smoothing", "clip-search"])
def test_fp8_recipes_that_cannot_be_stored_are_refused(settings, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe("fp8-w8a8", settings)
