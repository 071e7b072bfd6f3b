"""The MLX format against mlx and mlx-lm themselves (installed by the test extra).

- quantkit's RTN recipe writes the files ``mlx_lm.convert -q`` writes, bit for bit;
- ``mlx_lm.load`` of quantkit's MLX artifacts computes quantkit's logits and greedy continuation, and
  the command line ``mlx_lm.generate --model DIR`` runs on them;
- a decoder written from MLX's documented layout (and ``mx.dequantize``) reads quantkit's tensors as
  the exact weights quantkit means, at every bit width;
- GPTQ on MLX's grid beats RTN on it; bad shapes are refused before any work.

The tiny checkpoints use identical LongRoPE long and short factors, as the shipped MiniCPM4.1 configs
do: mlx-lm applies the long factors at every length (docs/formats.md, "MLX").
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from quantkit.algorithms.gptq import gptq_quantize
from quantkit.checkpoint import MANIFEST_FILE
from quantkit.engine import quantize
from quantkit.formats import FORMATS
from quantkit.formats.mlx import mlx_grid, mlx_tensors, read_mlx_tensors
from quantkit.loading import load_model
from quantkit.quant import FLOAT_BIAS_BITS, rtn_quantize
from quantkit.reader import ArtifactReader
from quantkit.recipe import RecipeError

from helpers import small_recipe

MLX = FORMATS["mlx"]
# fp32 logits of mlx-lm and of quantkit's dequantized model differ only by summation order
LOGIT_TOLERANCE = 1e-4
PROMPT_IDS = [1, 50, 60, 70, 80, 90, 100, 11, 12, 200, 201, 202]


def _grid(bits: int, group_size: int, dtype=torch.float32):
    return mlx_grid({"bits": bits, "group_size": group_size, "sym": False, "ternary": False}, dtype)


@pytest.fixture(scope="module")
def mlx_checkpoint(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(same_rope_factors=True, seed=3)


@pytest.fixture(scope="module")
def mlx_checkpoint_bf16(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(same_rope_factors=True, seed=3, dtype=torch.bfloat16)


def _quantized(checkpoint: Path, recipe: str, tmp_path_factory, name: str) -> Path:
    out = tmp_path_factory.mktemp(name) / name
    quantize(checkpoint, small_recipe(recipe, out.parent), out, progress=False)
    return out


@pytest.fixture(scope="module")
def rtn_artifact(mlx_checkpoint, tmp_path_factory):
    return _quantized(mlx_checkpoint, "mlx-rtn-w4g64", tmp_path_factory, "rtn")


@pytest.fixture(scope="module")
def gptq_artifact(mlx_checkpoint, tmp_path_factory):
    return _quantized(mlx_checkpoint, "mlx-s-gptq-w4g64", tmp_path_factory, "gptq")


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("model*.safetensors")):
        tensors |= load_file(str(path))
    return tensors


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """uint32 words as numpy uint32, floats (bfloat16 included) as float32."""
    return tensor.view(torch.int32).numpy().view(np.uint32) if tensor.dtype == torch.uint32 else tensor.float().numpy()


# --- conformance anchor: the RTN recipe is mlx_lm.convert -q ---------------------------------------


@pytest.mark.parametrize("dtype, bits, group_size", [
    ("float32", 4, 64), ("bfloat16", 4, 64), ("float32", 3, 32), ("bfloat16", 6, 128), ("bfloat16", 8, 64),
])
def test_rtn_recipe_writes_mlx_lm_converts_files(dtype, bits, group_size, mlx_checkpoint, mlx_checkpoint_bf16,
                                                 tmp_path):
    from mlx_lm.convert import convert  # the function `mlx_lm.convert -q` runs

    source = mlx_checkpoint if dtype == "float32" else mlx_checkpoint_bf16
    convert(str(source), str(tmp_path / "mlx-lm"), quantize=True, q_bits=bits, q_group_size=group_size)
    recipe = small_recipe("mlx-rtn-w4g64", tmp_path, quant={"bits": bits, "group_size": group_size})
    quantize(source, recipe, tmp_path / "quantkit", progress=False)

    theirs, ours = _safetensors(tmp_path / "mlx-lm"), _safetensors(tmp_path / "quantkit")
    assert sorted(ours) == sorted(theirs)
    assert "lm_head.scales" in ours and "model.embed_tokens.biases" in ours  # mlx-lm's defaults, followed
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert ours[name].view(torch.uint8).numpy().tobytes() == tensor.view(torch.uint8).numpy().tobytes(), name
    config = json.loads((tmp_path / "quantkit" / "config.json").read_text())
    expected = {"group_size": group_size, "bits": bits, "mode": "affine"}
    assert config["quantization"] == config["quantization_config"] == expected
    converted = ArtifactReader(tmp_path / "mlx-lm")  # quantkit reads mlx-lm's own output as format mlx
    assert converted.format.name == "mlx" and converted.qconfig.bits == bits


@pytest.fixture(scope="module")
def eight_layers(tiny_checkpoint_factory):
    """Eight layers: the mixed predicates' first and last eighth and every third layer between all differ."""
    return tiny_checkpoint_factory(same_rope_factors=True, seed=3, num_hidden_layers=8)


@pytest.fixture(scope="module")
def mixed_artifact(eight_layers, tmp_path_factory):
    return _quantized(eight_layers, "mlx-rtn-mixed-4-6", tmp_path_factory, "mixed")


def test_mixed_rtn_recipe_writes_mlx_lm_converts_files(eight_layers, mixed_artifact, tmp_path):
    from mlx_lm.convert import convert

    convert(str(eight_layers), str(tmp_path / "mlx-lm"), quantize=True, q_bits=4, q_group_size=64,
            quant_predicate="mixed_4_6")
    theirs, ours = _safetensors(tmp_path / "mlx-lm"), _safetensors(mixed_artifact)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert ours[name].view(torch.uint8).numpy().tobytes() == tensor.view(torch.uint8).numpy().tobytes(), name
    expected = json.loads((tmp_path / "mlx-lm" / "config.json").read_text())["quantization"]
    config = json.loads((mixed_artifact / "config.json").read_text())
    assert config["quantization"] == config["quantization_config"] == expected
    six = sorted(path for path, entry in expected.items() if isinstance(entry, dict) and entry["bits"] == 6)
    # layers 0 and 7 (first and last eighth), 3 and 6 (every third between): v_proj and down_proj
    assert six == ["lm_head", *(f"model.layers.{i}.{linear}" for i in (0, 3, 6, 7)
                               for linear in ("mlp.down_proj", "self_attn.v_proj"))]
    assert ours["model.layers.3.mlp.down_proj.weight"].shape[1] == 512 * 6 // 32  # K = 512 codes of 6 bits


def test_mlx_lm_load_matches_quantkit_on_a_mixed_artifact(mixed_artifact):
    from mlx_lm import load

    with torch.no_grad():
        expected = load_model(mixed_artifact)(torch.tensor([PROMPT_IDS])).logits[0].double().numpy()
    model, _ = load(str(mixed_artifact))
    assert model.model.layers[3].mlp.down_proj.bits == 6 and model.model.layers[4].mlp.down_proj.bits == 4
    logits = np.array(model(mx.array([PROMPT_IDS]))[0].astype(mx.float32)).astype(np.float64)
    assert np.abs(logits - expected).max() <= LOGIT_TOLERANCE


def test_mixed_gptq_solves_each_linear_on_its_own_grid(eight_layers, tmp_path):
    """One solver, one grid per linear: layer 0's 4-bit q_proj is the uniform W4 run's, its 6-bit v_proj
    GPTQ's on 6 bits (far below the W4 run's error), and the 6-bit linears are exactly the predicate's."""
    runs = {}
    for recipe in ("mlx-s-gptq-mixed-4-6", "mlx-s-gptq-w4g64"):
        quantize(eight_layers, small_recipe(recipe, tmp_path, smooth={"grid": 2}), tmp_path / recipe, progress=False)
        runs[recipe] = ArtifactReader(tmp_path / recipe)
    mixed, uniform = runs["mlx-s-gptq-mixed-4-6"], runs["mlx-s-gptq-w4g64"]
    records = {name: record for i in range(mixed.num_layers) for name, record in mixed.layer(i)[1].items()}
    six = sorted(name for name, record in records.items() if record.config.bits == 6)
    assert six == [f"model.layers.{i}.{linear}.weight" for i in (0, 3, 6, 7)
                   for linear in ("mlp.down_proj", "self_attn.v_proj")]
    assert all(record.config.bits == 4 for name, record in records.items() if name not in six)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(records[q_proj].codes, uniform.layer(0)[1][q_proj].codes)

    def errors(recipe):
        return json.loads((tmp_path / recipe / "quantkit.json").read_text())["layer_errors"][0]["errors"]

    assert errors("mlx-s-gptq-mixed-4-6")["self_attn.v_proj"] < errors("mlx-s-gptq-w4g64")["self_attn.v_proj"] / 4


def test_reader_round_trips_per_module_overrides():
    from quantkit.formats.mlx import parse_quantization_config, quantization_config

    written = {"group_size": 64, "bits": 4, "mode": "affine", "model.layers.0.mlp.down_proj":
               {"group_size": 32, "bits": 6, "mode": "affine"}, "model.layers.1.self_attn.v_proj": False}
    grid = parse_quantization_config(written)
    down = grid.module("model.layers.0.mlp.down_proj")
    assert (down.bits, down.group_size) == (6, 32) and grid.module("model.layers.1.self_attn.v_proj") is None
    assert grid.module("model.layers.1.mlp.down_proj").bits == 4
    assert quantization_config(grid) == written
    assert parse_quantization_config({**written, "lm_head": True}).module("lm_head").bits == 4  # mlx-lm's "defaults"


def test_reader_keeps_a_linear_left_unquantized(mixed_artifact, tmp_path):
    """An entry `false`, as mlx-lm writes for a module it did not quantize: the float weight is read as stored."""
    from safetensors.torch import save_file

    copy = tmp_path / "copy"
    shutil.copytree(mixed_artifact, copy, ignore=shutil.ignore_patterns(MANIFEST_FILE))  # as mlx-lm writes it
    module, weight = "model.layers.2.mlp.down_proj", torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    for path in copy.glob("model*.safetensors"):
        tensors = load_file(str(path))
        if f"{module}.scales" in tensors:
            del tensors[f"{module}.scales"], tensors[f"{module}.biases"]
            tensors[f"{module}.weight"] = weight
            save_file(tensors, str(path), metadata={"format": "mlx"})
    for name in ("config.json", "config.5.0.0.json"):  # transformers >= 5 reads the second
        config = json.loads((copy / name).read_text())
        config["quantization"][module] = config["quantization_config"][module] = False
        (copy / name).write_text(json.dumps(config))
    plain, records = ArtifactReader(copy).layer(2)
    assert f"{module}.weight" not in records and len(records) == 6
    assert torch.equal(plain[f"{module}.weight"], weight)
    assert torch.equal(ArtifactReader(copy).dequantized_layer(2)[f"{module}.weight"], weight)


@pytest.mark.parametrize("entry, message", [
    ({"group_size": 64, "bits": 7}, r"entry for module 'model.layers.0.mlp.down_proj': bits 7 not in"),
    ({"bits": 6}, r"entry for module 'model.layers.0.mlp.down_proj': group_size None not in"),
    ({"group_size": 64, "bits": 6, "mode": "mxfp4"}, r"'model.layers.0.mlp.down_proj': mode 'mxfp4'"),
    ({"group_size": 64, "bits": 6, "scale": 1}, r"'model.layers.0.mlp.down_proj': keys \['scale'\]"),
    (6, r"entry for module 'model.layers.0.mlp.down_proj' must be a dict"),
])
def test_reader_refuses_a_malformed_override_naming_the_module(entry, message):
    from quantkit.formats.mlx import parse_quantization_config

    with pytest.raises(ValueError, match=message):
        parse_quantization_config({"group_size": 64, "bits": 4, "model.layers.0.mlp.down_proj": entry})


def test_transformers_config_only_where_rope_theta_is_the_default():
    from quantkit.formats.mlx import config_files

    longrope = {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "longrope"}, "quantization_config": {}}
    files = config_files(longrope)
    assert files["config.json"]["configuration_files"] == ["config.5.0.0.json"]
    assert "rope_theta" not in files["config.5.0.0.json"] and files["config.json"]["rope_theta"] == 10000.0
    assert set(config_files({**longrope, "rope_theta": 5e5})) == {"config.json"}
    assert set(config_files({**longrope, "rope_scaling": None})) == {"config.json"}


# --- mlx-lm computes what quantkit means ---------------------------------------------------------


def _greedy_quantkit(model, ids: list[int], steps: int, eos: set[int]) -> list[int]:
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(torch.tensor([tokens])).logits[0, -1].argmax())
            if token in eos:
                break
            tokens.append(token)
    return tokens[len(ids):]


@pytest.mark.parametrize("artifact", ["rtn_artifact", "gptq_artifact"])
def test_mlx_lm_load_matches_quantkit(artifact, request):
    from mlx_lm import load, stream_generate

    directory = request.getfixturevalue(artifact)
    reference = load_model(directory)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT_IDS])).logits[0].double().numpy()
    model, tokenizer = load(str(directory))
    logits = np.array(model(mx.array([PROMPT_IDS]))[0].astype(mx.float32)).astype(np.float64)
    assert np.abs(logits - expected).max() <= LOGIT_TOLERANCE
    assert (logits.argmax(-1) == expected.argmax(-1)).all()

    theirs = [r.token for r in stream_generate(model, tokenizer, mx.array(PROMPT_IDS), max_tokens=12)]
    ours = _greedy_quantkit(reference, PROMPT_IDS, 12, set(tokenizer.eos_token_ids))
    assert theirs[:len(ours)] == ours and len(ours) >= 1


def test_mlx_lm_generate_command_runs_on_the_artifact(rtn_artifact):
    """The command mlx-lm's README gives, in a process that never imports quantkit; its text is the
    library's greedy continuation of the chat-templated prompt."""
    from mlx_lm import generate, load

    command = [str(Path(sys.executable).parent / "mlx_lm.generate"), "--model", str(rtn_artifact),
               "--prompt", "What is 12 + 30?", "--max-tokens", "12"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = result.stdout.split("==========")[1].strip("\n")

    model, tokenizer = load(str(rtn_artifact))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)  # as the command encodes a templated prompt
    assert printed == generate(model, tokenizer, ids, max_tokens=12)


def test_generate_command_needs_the_transformers_config(rtn_artifact, tmp_path):
    """Without config.5.0.0.json the same command hits transformers' LongRoPE crash for an unknown model_type."""
    bare = tmp_path / "bare"
    shutil.copytree(rtn_artifact, bare)
    (bare / "config.5.0.0.json").unlink()
    config = json.loads((bare / "config.json").read_text())
    del config["configuration_files"]
    (bare / "config.json").write_text(json.dumps(config))
    command = [str(Path(sys.executable).parent / "mlx_lm.generate"), "--model", str(bare), "--prompt", "hi",
               "--max-tokens", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "max_position_embeddings" in result.stderr


# --- the layout, decoded independently ------------------------------------------------------------


def _decode_mlx(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> np.ndarray:
    """MLX's documented affine layout: row r's codes are one little-endian bit stream over its uint32
    words, code k at bits [k·bits, (k+1)·bits); w = scale · q + bias per group of input channels."""
    words = weight.astype(np.uint64)
    k = words.shape[1] * 32 // bits
    codes = np.empty((words.shape[0], k), dtype=np.uint64)
    for index in range(k):
        word, shift = divmod(index * bits, 32)
        value = words[:, word] >> np.uint64(shift)
        if shift + bits > 32:
            value |= words[:, word + 1] << np.uint64(32 - shift)
        codes[:, index] = value & np.uint64((1 << bits) - 1)
    group = k // scales.shape[1]
    scale = np.repeat(scales.astype(np.float32), group, axis=1)
    bias = np.repeat(biases.astype(np.float32), group, axis=1)
    return codes.astype(np.float32) * scale + bias


def _ragged_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Heavy-tailed rows, with one group per row whose values are all equal (the scale's floor)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) ** 3
    w[0, :32] = 0.25
    return w


@pytest.mark.parametrize("bits", FLOAT_BIAS_BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_independent_decoding_equals_quantkits_weights(bits, dtype):
    weight = _ragged_weight(24, 128, seed=bits)
    config = _grid(bits, 32, dtype)
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(7))
    for record in (rtn_quantize(weight, config), gptq_quantize(weight, x.T @ x, config, clip_search=True)):
        codes = record.codes
        assert bool((codes == 0).any()) and bool((codes == config.maxq).any())  # both ends of the grid
        tensors = mlx_tensors(record, "layer")
        numpy = {name: _numpy(t) for name, t in tensors.items()}
        decoded = _decode_mlx(numpy["layer.weight"], numpy["layer.scales"], numpy["layer.biases"], bits)
        assert np.array_equal(decoded, record.dequantize(torch.float32).numpy())
        mlx_decoded = mx.dequantize(mx.array(numpy["layer.weight"]), mx.array(numpy["layer.scales"]),
                                    mx.array(numpy["layer.biases"]), group_size=32, bits=bits)
        assert np.array_equal(np.array(mlx_decoded), decoded)
        again = read_mlx_tensors(tensors, "layer", record.config, record.shape)
        assert torch.equal(again.codes, codes) and torch.equal(again.scales, record.scales)
        assert torch.equal(again.biases, record.biases)


def test_artifact_files_decode_to_quantkits_weights(gptq_artifact):
    tensors = {name: _numpy(t) for name, t in _safetensors(gptq_artifact).items()}
    reader = ArtifactReader(gptq_artifact)
    for index in range(reader.num_layers):
        for name, weight in reader.dequantized_layer(index).items():
            if name.endswith("_proj.weight"):
                module = name.removesuffix(".weight")
                decoded = _decode_mlx(tensors[name], tensors[f"{module}.scales"], tensors[f"{module}.biases"], 4)
                assert np.array_equal(decoded, weight.numpy()), name
    outside = reader.other_tensors()
    decoded = _decode_mlx(tensors["lm_head.weight"], tensors["lm_head.scales"], tensors["lm_head.biases"], 4)
    assert np.array_equal(decoded, outside["lm_head.weight"].numpy())


def test_rtn_is_mx_quantize():
    weight = _ragged_weight(16, 256, seed=1)
    for dtype, mx_dtype in ((torch.float32, mx.float32), (torch.bfloat16, mx.bfloat16)):
        record = rtn_quantize(weight.to(dtype), _grid(4, 64, dtype))
        packed, scales, biases = mx.quantize(mx.array(weight.to(dtype).float().numpy()).astype(mx_dtype),
                                             group_size=64, bits=4)
        ours = mlx_tensors(record, "m")
        assert np.array_equal(_numpy(ours["m.weight"]), np.array(packed))
        assert np.array_equal(ours["m.scales"].float().numpy(), np.array(scales.astype(mx.float32)))
        assert np.array_equal(ours["m.biases"].float().numpy(), np.array(biases.astype(mx.float32)))


# --- solvers on the grid ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_on_mlx_grid_beats_rtn(bits):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=gen)
    mixing = torch.randn(256, 256, generator=gen) / 16
    x = torch.randn(2048, 256, generator=gen) @ (torch.eye(256) + mixing)
    hessian = x.T @ x / x.shape[0]
    config = _grid(bits, 64, torch.bfloat16)

    def output_error(record):
        delta = record.dequantize(torch.float32) - weight
        return float(((delta @ hessian) * delta).sum())

    rtn = output_error(rtn_quantize(weight, config))
    gptq = output_error(gptq_quantize(weight, hessian, config, damp_percent=0.01, clip_search=True))
    assert gptq < 0.8 * rtn


def test_gptq_artifact_errors_below_rtn(rtn_artifact, gptq_artifact):
    def mean_error(directory):
        layers = json.loads((directory / "quantkit.json").read_text())["layer_errors"]
        errors = [e for layer in layers for e in layer["errors"].values()]
        return sum(errors) / len(errors)

    assert mean_error(gptq_artifact) < mean_error(rtn_artifact)


# --- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, k, message", [
    ({"bits": 4, "group_size": 64}, 96, "K a whole number of groups"),
    ({"bits": 4, "group_size": 256}, 512, "group_size in"),
    ({"bits": 4, "group_size": -1}, 512, "group_size in"),
])
def test_check_refuses_shapes_naming_the_tensor(config, k, message):
    grid = _grid(config["bits"], config["group_size"])
    with pytest.raises(ValueError, match=rf"model\.layers\.3\.mlp\.down_proj: cannot use the MLX format: .*{message}"):
        MLX.check(grid, k, 64, False, "model.layers.3.mlp.down_proj")


def test_recipes_refuse_what_mlx_cannot_store(tmp_path):
    with pytest.raises(RecipeError, match="quant.sym: false"):
        small_recipe("mlx-rtn-w4g64", tmp_path, quant={"sym": True})
    with pytest.raises(RecipeError, match="is not one of"):
        small_recipe("mlx-rtn-w4g64", tmp_path, quant={"bits": 7})
    with pytest.raises(RecipeError, match="bits must be one of"):  # 5 bits: MLX's grid only
        small_recipe("rtn-w4g128", tmp_path, quant={"bits": 5})


def test_tied_checkpoints_are_refused_as_mlx_lm_cannot_load_them(tiny_checkpoint_factory, tmp_path):
    from mlx_lm.convert import convert

    tied = tiny_checkpoint_factory(same_rope_factors=True, tied=True)
    with pytest.raises(ValueError, match="parameters not in model"):  # mlx-lm itself, unquantized
        convert(str(tied), str(tmp_path / "mlx-lm"))
    with pytest.raises(ValueError, match="mlx-lm's MiniCPM cannot load a tied checkpoint"):
        quantize(tied, small_recipe("mlx-rtn-w4g64", tmp_path), tmp_path / "out", progress=False)


def test_engine_refuses_before_any_work(tiny_checkpoint_factory, tmp_path):
    odd = tiny_checkpoint_factory(same_rope_factors=True, intermediate_size=352)  # down_proj K = 352
    with pytest.raises(ValueError, match="mlp.down_proj: cannot use the MLX format"):
        quantize(odd, small_recipe("mlx-rtn-w4g64", tmp_path), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


# --- other quantkit artifacts in mlx-lm -------------------------------------------------------------


@pytest.fixture(scope="module")
def awq_artifact(mlx_checkpoint, tmp_path_factory):
    return _quantized(mlx_checkpoint, "awq-w4g128", tmp_path_factory, "awq")


def _mlx_lm_weights(directory: Path) -> dict[str, np.ndarray]:
    """Every quantized linear of ``directory`` as mlx-lm loads it, dequantized by mlx itself."""
    import mlx.nn as nn
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(directory))
    return {f"{name}.weight": np.array(mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
                                       .astype(mx.float32))
            for name, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}


def _quantkit_weights(directory: Path) -> dict[str, np.ndarray]:
    reader = ArtifactReader(directory)
    return {name: weight.numpy() for index in range(reader.num_layers)
            for name, weight in reader.dequantized_layer(index).items() if name.endswith("_proj.weight")}


def test_awq_artifact_means_the_same_weights_in_mlx_lm(awq_artifact):
    """mlx-lm reads AutoAWQ itself, storing bias = −zero · scale in the scales' float16: the same
    weights up to that rounding (exactly the same through `quantkit export mlx`, below)."""
    theirs, ours = _mlx_lm_weights(awq_artifact), _quantkit_weights(awq_artifact)
    assert sorted(theirs) == sorted(ours) and len(ours) == 14
    for name, weight in ours.items():
        # float16 roundings of the bias (|bias| <= a group's range <= 2 max|w|) and of the result
        assert np.abs(theirs[name] - weight).max() <= 2**-9 * np.abs(weight).max(), name
        assert not np.array_equal(theirs[name], weight)  # not exact: hence `quantkit export mlx`


@pytest.mark.parametrize("recipe, changes", [
    ("awq-w4g128", {}),
    ("gptq-w4g128", {"quant": {"group_size": 64}}),
    ("gptq-w4g128", {"quant": {"bits": 8, "sym": False}, "format": "gptq-v2"}),
    ("s-gptq-w4a16-ct", {"quant": {"group_size": 64, "sym": False}}),
])
def test_export_mlx_keeps_the_artifacts_weights(recipe, changes, mlx_checkpoint, awq_artifact, tmp_path):
    from mlx_lm import load

    from quantkit.mlx_export import export_mlx

    source = awq_artifact
    if recipe != "awq-w4g128" or changes:
        source = tmp_path / "source"
        quantize(mlx_checkpoint, small_recipe(recipe, tmp_path, **changes), source, progress=False)
    report = export_mlx(source, tmp_path / "mlx")
    assert report.dtype == "float32" and report.linears == 14
    ours = _quantkit_weights(source)
    for weights in (_mlx_lm_weights(tmp_path / "mlx"), _quantkit_weights(tmp_path / "mlx")):
        assert sorted(weights) == sorted(ours) and all(np.array_equal(weights[name], ours[name]) for name in ours)

    model, _ = load(str(tmp_path / "mlx"))
    with torch.no_grad():
        expected = load_model(source)(torch.tensor([PROMPT_IDS])).logits[0].double().numpy()
    logits = np.array(model(mx.array([PROMPT_IDS]))[0].astype(mx.float32)).astype(np.float64)
    assert np.abs(logits - expected).max() <= LOGIT_TOLERANCE


def test_export_mlx_in_float16_only_where_exact(mlx_checkpoint, awq_artifact, tmp_path):
    from quantkit.mlx_export import export_mlx

    symmetric = tmp_path / "sym"
    quantize(mlx_checkpoint, small_recipe("gptq-w4g128", tmp_path), symmetric, progress=False)
    export_mlx(symmetric, tmp_path / "mlx", dtype="float16")  # −8 · scale is exact in float16
    ours, back = _quantkit_weights(symmetric), _quantkit_weights(tmp_path / "mlx")
    assert all(np.array_equal(back[name], ours[name]) for name in ours)
    with pytest.raises(ValueError, match="not exact in torch.float16; export with --dtype float32"):
        export_mlx(awq_artifact, tmp_path / "awq-mlx", dtype="float16")  # −zero · scale is not


@pytest.mark.parametrize("changes, message", [
    ({"quant": {"group_size": -1}}, "group_size in"),
    ({"gptq": {"desc_act": True, "group_aware": False}}, "MLX stores no g_idx"),
])
def test_export_mlx_refuses_grids_mlx_cannot_hold(changes, message, mlx_checkpoint, tmp_path):
    from quantkit.mlx_export import export_mlx

    source = tmp_path / "source"
    quantize(mlx_checkpoint, small_recipe("gptq-w4g128", tmp_path, **changes), source, progress=False)
    with pytest.raises(ValueError, match=rf"model\.layers\.0\.self_attn\.q_proj: .*{message}"):
        export_mlx(source, tmp_path / "mlx")
    assert not (tmp_path / "mlx").exists() and not (tmp_path / "mlx.partial").exists()
    with pytest.raises(ValueError, match="not quantized"):
        export_mlx(mlx_checkpoint, tmp_path / "plain")


def test_conformance_check_reads_mlx_artifacts(gptq_artifact, mlx_checkpoint_bf16, tmp_path):
    from quantkit.eval.conformance import check_conformance

    bf16 = tmp_path / "bf16"
    quantize(mlx_checkpoint_bf16, small_recipe("mlx-s-gptq-w4g64", tmp_path, quant={"bits": 5}), bf16, progress=False)
    for artifact in (gptq_artifact, bf16):
        report = check_conformance(artifact)
        assert report.passed and report.checks[0].linears == 14


def test_cli_export_mlx(awq_artifact, tmp_path):
    from click.testing import CliRunner

    from quantkit.cli import main

    result = CliRunner().invoke(main, ["export", "mlx", "--model", str(awq_artifact), "--out", str(tmp_path / "mlx"),
                                       "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["dtype"] == "float32"
    assert (tmp_path / "mlx" / "config.5.0.0.json").is_file()


def test_quantkit_runtime_runs_mlx_artifacts(rtn_artifact):
    """The runtime takes the dequantized embedding and LM head, and runs float-bias linears dequantized."""
    from quantkit.kernels.attention import make_attention
    from quantkit.kernels.load import load_runtime_model
    from quantkit.kernels.model import RuntimeModel

    runtime = RuntimeModel(load_runtime_model(rtn_artifact, dtype=torch.float32), make_attention(None))
    logits = runtime.forward(torch.tensor(PROMPT_IDS), runtime.new_cache(), all_logits=True)
    with torch.no_grad():
        reference = load_model(rtn_artifact)(torch.tensor([PROMPT_IDS])).logits[0]
    assert torch.allclose(logits, reference, atol=LOGIT_TOLERANCE)
