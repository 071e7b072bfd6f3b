"""compressed-tensors pack-quantized (W4A16, W8A16): the compressed-tensors package (the library vLLM parses
these checkpoints with, the version llm-compressor 0.14 pins) reads quantkit's configs and decompresses its
tensors to quantkit's weights bit for bit, quantkit reads what the package compresses, transformers loads
a whole artifact through its compressed-tensors integration, and what cannot be stored is refused."""
from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from safetensors.torch import load_file

from quantkit.engine import quantize
from quantkit.formats import FORMATS
from quantkit.formats.compressed_tensors import (
    ACTIVATIONS,
    KV_CACHE,
    KV_SCALES,
    VERSION,
    CompressedTensorsGrid,
    check_packed,
    packed_tensors,
    parse_quantization_config,
    quantization_config,
    read_packed_tensors,
)
from quantkit.models.decoder import sdpa_attention_core
from quantkit.quant import QuantConfig, default_g_idx, rtn_quantize
from quantkit.reader import ArtifactReader

from helpers import random_record, small_recipe

MODULE = "model.layers.0.mlp.down_proj"
GRIDS = [(4, 128, True, torch.bfloat16), (4, 64, False, torch.bfloat16), (8, -1, True, torch.float16),
         (8, 128, False, torch.float32), (4, -1, False, torch.float16)]
GRID_IDS = ["w4g128-sym-bf16", "w4g64-asym-bf16", "w8-channel-sym-fp16", "w8g128-asym-fp32", "w4-channel-asym-fp16"]


def _record(bits, group_size, sym, dtype, n=96, k=256, seed=0):
    return random_record(QuantConfig(bits, group_size, sym, scale_dtype=dtype), n, k, seed)


def _scheme(config: dict) -> QuantizationScheme:
    return QuantizationConfig.model_validate(config).config_groups["group_0"]


@pytest.mark.parametrize("bits, group_size, sym, dtype", GRIDS, ids=GRID_IDS)
def test_compressed_tensors_decompresses_to_quantkits_weights(bits, group_size, sym, dtype):
    """The package's own pack-quantized decompressor, given quantkit's tensors and config, gives exactly
    the record's dequantized weight in the scales' dtype; quantkit reads its own tensors back bit for bit."""
    record = _record(bits, group_size, sym, dtype)
    tensors = packed_tensors(record, MODULE)
    n, k = record.shape
    groups = record.config.num_groups(k)
    expected = {"weight_packed": (torch.int32, (n, k * bits // 32)), "weight_scale": (dtype, (n, groups)),
                "weight_shape": (torch.int64, (2,))}
    if not sym:
        expected["weight_zero_point"] = (torch.int32, (n * bits // 32, groups))
    assert {key: (t.dtype, tuple(t.shape)) for key, t in tensors.items()} == {
        f"{MODULE}.{name}": spec for name, spec in expected.items()}

    config = quantization_config(record.config)
    local = {key.rsplit(".", 1)[1]: tensor for key, tensor in tensors.items()}
    weight = PackedQuantizationCompressor.decompress(local, _scheme(config))["weight"]
    assert weight.dtype == dtype and torch.equal(weight, record.dequantize(dtype))

    back = read_packed_tensors(tensors, MODULE, parse_quantization_config(config), (n, k))
    for field in ("codes", "scales", "zeros", "g_idx"):
        assert torch.equal(getattr(back, field), getattr(record, field)), field
    assert back.config == record.config


@pytest.mark.parametrize("bits, group_size, sym, dtype", GRIDS, ids=GRID_IDS)
def test_quantkit_reads_what_compressed_tensors_compresses(bits, group_size, sym, dtype):
    """A weight quantized and packed by the package (on scales and zero points from quantkit's RTN grid;
    the package rounds in the weight's dtype) reads back as the weight the package decompresses."""
    config = QuantConfig(bits, group_size, sym, scale_dtype=dtype)
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(bits)).to(dtype)
    record = rtn_quantize(weight.float(), config)
    signed = 2 ** (bits - 1)
    state = {"weight": weight, "weight_scale": record.scales.T.contiguous()}
    if not sym:
        state["weight_zero_point"] = (record.zeros.T.to(torch.int16) - signed).to(torch.int8)
    scheme = _scheme(quantization_config(config))
    compressed = {f"{MODULE}.{name}": t for name, t in PackedQuantizationCompressor.compress(state, scheme).items()}
    theirs = PackedQuantizationCompressor.decompress({k.rsplit(".", 1)[1]: t for k, t in compressed.items()},
                                                     scheme)["weight"]
    ours = read_packed_tensors(compressed, MODULE, config, (64, 256))
    assert torch.equal(ours.dequantize(dtype), theirs)


@pytest.mark.parametrize("config", [QuantConfig(4, 128, True), QuantConfig(8, -1, False), QuantConfig(4, 32, False)],
                         ids=["w4g128-sym", "w8-channel-asym", "w4g32-asym"])
def test_config_is_what_compressed_tensors_writes(config, tmp_path):
    """The package's ``ModelCompressor`` writes config.json's ``quantization_config`` from the parsed
    config: field for field what quantkit wrote, and quantkit parses it back to the same grid."""
    ours = quantization_config(config)
    (tmp_path / "config.json").write_text("{}")
    ModelCompressor(quantization_config=QuantizationConfig.model_validate(ours)).update_config(str(tmp_path))
    theirs = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert theirs == json.loads(json.dumps(ours)) and theirs["version"] == VERSION
    assert parse_quantization_config(theirs) == config


# config.json's quantization_config from llm-compressor 0.14.0.1's GPTQModifier (W4A16, group 64) on the
# default model (`make bench-ct`'s peer): it records the act-order it solved with ("static", which keeps
# groups in place) and its observer, and keeps float32 scales for a model loaded in float32.
LLM_COMPRESSOR_GPTQ = {
    "config_groups": {"group_0": {
        "format": "pack-quantized", "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": "static", "block_structure": None, "dynamic": False, "group_size": 64, "num_bits": 4,
                    "observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": None, "strategy": "group",
                    "symmetric": True, "type": "int", "zp_dtype": None}}},
    "format": "pack-quantized", "global_compression_ratio": None, "ignore": ["lm_head"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
    "transform_config": {}, "version": "0.19.0"}


def test_llm_compressors_own_config_is_read():
    assert parse_quantization_config(LLM_COMPRESSOR_GPTQ) == QuantConfig(4, 64, True)
    ours = quantization_config(QuantConfig(4, 64, True))
    differs = {key for key, value in ours["config_groups"]["group_0"]["weights"].items()
               if LLM_COMPRESSOR_GPTQ["config_groups"]["group_0"]["weights"][key] != value}
    assert differs == {"actorder", "observer"}  # how each tool solved, not what is stored
    ours = quantization_config(QuantConfig(4, 64, True), desc_act=True, static_groups=True)
    assert ours["config_groups"]["group_0"]["weights"]["actorder"] == "static"  # its own act-order, recorded alike
    assert {key: value for key, value in ours.items() if key != "config_groups"} == {
        key: value for key, value in LLM_COMPRESSOR_GPTQ.items() if key != "config_groups"}


@pytest.mark.parametrize("config, k, n, desc_act, message", [
    (QuantConfig(4, 128, True), 576, 64, False, "groups that tile K"),
    (QuantConfig(3, 128, True), 256, 64, False, "bits in"),
    (QuantConfig(4, 64, False), 256, 60, False, "N a multiple of 8"),
    (QuantConfig(2, 64, False, ternary=True), 256, 64, False, "bits in"),
], ids=["ragged", "3-bit", "asym-ragged-n", "ternary"])
def test_what_the_format_cannot_hold_is_refused_naming_the_rule(config, k, n, desc_act, message):
    with pytest.raises(ValueError, match=f"{MODULE}: cannot use compressed-tensors pack-quantized: .*{message}"):
        check_packed(config, k, n, desc_act, MODULE)


def test_act_order_is_held_when_its_groups_stay_in_place(tmp_path):
    """compressed-tensors' act-order ("static"): columns in Hessian order, groups found up front on the
    natural groups; act-order whose groups follow the processing order needs a g_idx and is refused, by
    the recipe before any work and by the config writer."""
    from quantkit.recipe import RecipeError, load_recipe

    act_order = {"gptq.desc_act": True, "gptq.group_aware": False, "quant.group_size": 64}
    recipe = load_recipe("s-gptq-w4a16-ct", {**act_order, "gptq.static_groups": True})
    assert recipe["gptq"]["desc_act"] and recipe["gptq"]["static_groups"]
    with pytest.raises(RecipeError, match="gptq.desc_act: true' moves the groups .* set gptq.static_groups: true"):
        load_recipe("s-gptq-w4a16-ct", act_order)
    load_recipe("s-gptq-w4a16-ct", {**act_order, "quant.group_size": -1, "quant.bits": 8})  # per channel: none move
    with pytest.raises(ValueError, match="act-order on groups found up front"):
        quantization_config(QuantConfig(4, 64, True), desc_act=True)


def test_reader_refuses_tensors_that_disagree_with_the_config():
    record = _record(4, 64, False, torch.bfloat16)
    tensors = packed_tensors(record, MODULE)
    config = record.config
    with pytest.raises(ValueError, match="weight_shape.*says \\[96, 256\\].*\\[96, 512\\]"):
        read_packed_tensors(tensors, MODULE, config, (96, 512))
    with pytest.raises(KeyError, match="weight_zero_point"):
        read_packed_tensors({k: t for k, t in tensors.items() if "zero" not in k}, MODULE, config, (96, 256))
    with pytest.raises(ValueError, match="weight_zero_point.*config says symmetric"):
        sym = QuantConfig(4, 64, True)
        read_packed_tensors(tensors, MODULE, sym, (96, 256))
    with pytest.raises(ValueError, match=r"weight_packed.*must be torch.int32 \(96, 64\), got torch.int32 \(96, 32\)"):
        read_packed_tensors(tensors, MODULE, QuantConfig(8, 64, False), (96, 256))
    act_order = random_record(QuantConfig(4, 64, True), 8, 128, 0, g_idx=default_g_idx(128, 64).flip(0))
    with pytest.raises(ValueError, match="stores no g_idx"):
        packed_tensors(act_order, MODULE)


@pytest.mark.parametrize("change, message", [
    (lambda d: d["config_groups"]["group_0"].update(format="naive-quantized"), "format: 'naive-quantized'"),
    (lambda d: d["config_groups"]["group_0"].update(format="int-quantized", input_activations={
        **ACTIVATIONS["int8-dynamic"][1], "strategy": "group", "group_size": 128}),
     r"input_activations: .*'strategy': 'group'.* \(read with 'int-quantized': int8 per token, dynamic, or per "
     r"tensor, static\)"),
    (lambda d: d["config_groups"]["group_0"]["weights"].update(num_bits=2), "weights.num_bits: 2"),
    (lambda d: d["config_groups"]["group_0"]["weights"].update(actorder="group"), "weights.actorder"),
    (lambda d: d["config_groups"]["group_0"]["weights"].update(strategy="tensor"), "weights.strategy: 'tensor'"),
    (lambda d: d.update(ignore=["lm_head", "model.layers.0.mlp.down_proj"]), "ignore"),
    (lambda d: d.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    (lambda d: d["config_groups"].update(group_1=d["config_groups"]["group_0"]), "one config group is read, got 2"),
], ids=["naive", "group-activations", "2-bit", "g_idx", "tensor", "ignore", "kv-cache", "two-groups"])
def test_configs_quantkit_does_not_read_are_refused_naming_the_setting(change, message):
    config = quantization_config(QuantConfig(4, 128, True))
    change(config)
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(config)


@pytest.fixture(scope="module")
def artifacts(tiny_checkpoint_factory, tmp_path_factory):
    """GPTQ W4 g64 on a bfloat16 tiny checkpoint, in compressed-tensors: {symmetric: its folder}; the
    asymmetric one solved in act-order on groups found up front (the format's actorder "static")."""
    source = tiny_checkpoint_factory(dtype=torch.bfloat16)
    folders = {}
    for sym in (True, False):
        out = tmp_path_factory.mktemp("ct") / "artifact"
        act_order = {} if sym else {"desc_act": True, "static_groups": True, "group_aware": False}
        quantize(source, small_recipe("gptq-w4g128", out.parent, format="compressed-tensors", gptq=act_order,
                                      quant={"group_size": 64, "sym": sym}), out, progress=False)
        folders[sym] = out
    return folders


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_artifact_is_read_by_quantkit_and_by_compressed_tensors(artifacts, sym):
    artifact = artifacts[sym]
    reader = ArtifactReader(artifact)
    assert reader.format is FORMATS["compressed-tensors"]
    config = json.loads((artifact / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["weights"]["actorder"] == (None if sym else "static")
    scheme = _scheme(config)
    tensors = {}
    for shard in sorted(artifact.glob("*.safetensors")):
        tensors.update(load_file(shard))
    module = "model.layers.1.self_attn.q_proj"
    local = {name: tensors[f"{module}.{name}"] for name in ("weight_packed", "weight_scale", "weight_zero_point",
                                                             "weight_shape") if f"{module}.{name}" in tensors}
    weight = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
    record = reader.layer(1)[1][f"{module}.weight"]
    assert record.config.scale_dtype == torch.bfloat16 and torch.equal(weight, record.dequantize(torch.bfloat16))


def test_transformers_runs_the_artifact_as_quantkit_does(artifacts):
    """transformers' compressed-tensors integration decompresses on load; its logits on the CPU equal
    quantkit's reference forward of the same artifact in float32 within 1e-3 (the same weights, and
    float32 arithmetic in two orders). transformers 5.24 with compressed-tensors 0.19 cannot load an
    asymmetric pack-quantized checkpoint from anyone (it builds the empty model's zero points unpacked,
    [N, G], and reinitialises the packed ones it reads): compressed-tensors' own decompressor reads those
    (above), as vLLM does, so the symmetric artifact is the one transformers runs."""
    from transformers import AutoModelForCausalLM

    from quantkit.loading import load_model

    artifact = artifacts[True]

    ids = torch.tensor([[1, 17, 33, 250, 7, 99, 3]])
    theirs = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32)
    ours = load_model(artifact)
    with torch.no_grad():
        got, want = theirs(ids).logits.float(), ours(ids).logits.float()
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_conformance_decodes_the_artifact_as_quantkit_reads_it(artifacts, sym):
    from quantkit.eval.conformance import check_conformance

    report = check_conformance(artifacts[sym])
    assert report.passed and [check.linears for check in report.checks] == [14]


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_quantkit_runtime_runs_the_artifact(artifacts, sym):
    """The runtime's packed linears on the artifact's bfloat16 scales, in float32, against the reference
    forward of the dequantized weights (the 4-bit kernel folds an asymmetric zero point into a bfloat16
    offset per group, as for GPTQ: within 1 % of the logits' scale; symmetric within 1e-4)."""
    from quantkit.kernels.attention import make_attention
    from quantkit.kernels.load import load_runtime_model
    from quantkit.kernels.model import RuntimeModel
    from quantkit.loading import load_model

    ids = [1, 17, 33, 250, 7, 99, 3]
    runtime = RuntimeModel(load_runtime_model(artifacts[sym], dtype=torch.float32), make_attention(None))
    logits = runtime.forward(torch.tensor(ids), runtime.new_cache(), all_logits=True)
    with torch.no_grad():
        reference = load_model(artifacts[sym])(torch.tensor([ids])).logits[0]
    assert (logits - reference).abs().max() <= (1e-4 if sym else 1e-2) * reference.abs().max()


def test_inspect_names_the_scheme(artifacts):
    from quantkit.inspect import describe

    assert describe(artifacts[False])["quantization"] == "compressed-tensors pack-quantized 4-bit int group g64 asym"


def test_float32_models_get_float16_scales_and_mlx_export_refuses_float32_ones():
    """A float32 model's scales are float16, where (q − zero) · scale is exact in float32; MLX's
    scale · q + bias cannot reproduce it on float32 scales (another tool's), so export refuses them."""
    from quantkit.mlx_export import as_float_bias

    fmt = FORMATS["compressed-tensors"]
    assert fmt.grid({"bits": 4, "group_size": 64, "sym": True}, torch.float32).scale_dtype == torch.float16
    assert fmt.grid({"bits": 4, "group_size": 64, "sym": True}, torch.bfloat16).scale_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=f"{MODULE}: its scales are float32"):
        as_float_bias(_record(4, 64, False, torch.float32), torch.float32, MODULE)


# --- INT8 W8A8 (int-quantized): int8 weights per output channel, activations per token at run time ---

def _w8a8(dtype=torch.bfloat16, n=96, k=256, seed=0):
    return random_record(CompressedTensorsGrid(8, -1, True, scale_dtype=dtype, activations="int8-dynamic"), n, k, seed)


def test_int8_activations_are_quantized_as_vllms_kernel_does():
    """Per token: scale = absmax / 127, values times 127 / absmax, round to nearest even, saturate (vLLM's
    dynamic_scaled_int8_quant), written here in NumPy; an all-zero token stays zero."""
    import numpy as np

    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[2] = 0
    x[3, :2] = torch.tensor([2.54, -2.54]) * x[3].abs().max() / 127 / 0.02  # ties are rare: make one
    got = ACTIVATIONS["int8-dynamic"][0].fake_quantize(x)
    values = x.numpy().astype(np.float32)
    top = np.abs(values).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(top > 0, np.float32(127) / top, np.float32(0))
    scale = np.where(top > 0, top / np.float32(127), np.float32(1))
    want = np.clip(np.rint(values * inverse), -128, 127) * scale
    assert np.array_equal(got.numpy(), want.astype(np.float32))
    assert got.dtype == x.dtype and (got[2] == 0).all()
    assert ACTIVATIONS["int8-dynamic"][0].fake_quantize(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8a8_weights_decompress_and_config_is_llm_compressors_int8_scheme(dtype, tmp_path):
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    record = _w8a8(dtype)
    tensors = packed_tensors(record, MODULE)
    assert {key: (t.dtype, tuple(t.shape)) for key, t in tensors.items()} == {
        f"{MODULE}.weight": (torch.int8, (96, 256)), f"{MODULE}.weight_scale": (dtype, (96, 1))}
    config = quantization_config(record.config)
    local = {key.rsplit(".", 1)[1]: tensor for key, tensor in tensors.items()}
    weight = IntQuantizationCompressor.decompress(local, _scheme(config))["weight"]
    assert torch.equal(weight, record.dequantize(dtype))
    back = read_packed_tensors(tensors, MODULE, parse_quantization_config(config), (96, 256))
    assert all(torch.equal(getattr(back, f), getattr(record, f)) for f in ("codes", "scales", "zeros", "g_idx"))
    assert back.config == record.config

    preset = preset_name_to_scheme("INT8", ["Linear"]).model_dump()
    group = config["config_groups"]["group_0"]
    assert {key: group[key] for key in preset if key != "format"} == {k: v for k, v in preset.items() if k != "format"}
    assert group["format"] == config["format"] == "int-quantized"
    (tmp_path / "config.json").write_text("{}")
    ModelCompressor(quantization_config=QuantizationConfig.model_validate(config)).update_config(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"] == json.loads(json.dumps(config))


def test_w8a8_needs_8_bit_channel_symmetric_weights():
    with pytest.raises(ValueError, match="W8A8: 8-bit symmetric weights, one scale per output channel"):
        check_packed(CompressedTensorsGrid(8, 128, True, activations="int8-dynamic"), 256, 64, False, MODULE)
    from quantkit.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="set quant.bits: 8, quant.group_size: -1, quant.sym: true"):
        load_recipe("int8-w8a8", {"quant.group_size": 128})
    with pytest.raises(RecipeError,
                       match="'compressed-tensors' is a section of format compressed-tensors, not of 'gptq'"):
        load_recipe("int8-w8a8", {"format": "gptq"})


def test_w8a8_artifact_is_scored_with_its_activations_quantized(tiny_checkpoint_factory, tmp_path):
    """The reference model quantizes every quantized linear's input as the scheme says (the same weights
    without it give other logits); conformance decodes the int8 weights; the runtime quantizes them too."""
    from quantkit.eval.conformance import check_conformance
    from quantkit.kernels.load import load_runtime_model
    from quantkit.loading import load_model

    source = tiny_checkpoint_factory(dtype=torch.bfloat16)
    out = tmp_path / "w8a8"
    quantize(source, small_recipe("int8-w8a8", tmp_path), out, progress=False)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "int-quantized" and ArtifactReader(out).qconfig.activations == "int8-dynamic"
    assert check_conformance(out).passed
    from quantkit.inspect import describe

    assert describe(out)["quantization"] == ("compressed-tensors int-quantized 8-bit int channel sym, "
                                             "activations 8-bit int token sym dynamic")

    ids = torch.tensor([[1, 17, 33, 250, 7, 99, 3]])
    model = load_model(out)
    quantized_inputs = []
    for index, linear in ((0, "self_attn.q_proj"), (1, "mlp.down_proj")):
        module = model.get_submodule(f"model.layers.{index}.{linear}")
        module.register_forward_hook(lambda m, inputs, output: quantized_inputs.append(inputs[0]))
    with torch.no_grad():
        logits = model(ids).logits
    grid = ACTIVATIONS["int8-dynamic"][0]
    for seen in quantized_inputs:  # what each linear multiplied: already on the per-token INT8 grid
        assert torch.equal(grid.fake_quantize(seen), seen)
    weights_only = load_model(out)
    for module in weights_only.modules():
        module._forward_pre_hooks.clear()
    with torch.no_grad():
        assert not torch.allclose(weights_only(ids).logits, logits)
    runtime = load_runtime_model(out, dtype=torch.float32)  # the same rule on each (fused) linear's input
    assert all(len(runtime.get_submodule(f"model.layers.0.{linear}")._forward_pre_hooks) == 1
               for linear in ("self_attn.q_proj", "mlp.down_proj"))
    # on the CPU the linears multiply on integer dot products, and the model computes what the artifact means
    from quantkit.kernels.attention import make_attention
    from quantkit.kernels.linear.w8a8 import W8A8Linear
    from quantkit.kernels.model import RuntimeModel

    assert isinstance(runtime.get_submodule("model.layers.0.mlp.down_proj"), W8A8Linear)

    # transformers' compressed-tensors integration runs the same weights with the package's own simulation
    # of per-token INT8 (scale absmax / 127.5, not vLLM's kernel's 127): exactly that, and nothing else
    from transformers import AutoModelForCausalLM

    def simulated(x):
        values = x.float()
        scale = values.abs().amax(-1, keepdim=True) / 127.5
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (torch.clamp(torch.round(values / scale), -128, 127) * scale).to(x.dtype)

    for module in weights_only.modules():
        if isinstance(module, torch.nn.Linear) and module is not weights_only.lm_head:
            module.register_forward_pre_hook(lambda _, inputs: (simulated(inputs[0]),))
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
        assert torch.equal(theirs, weights_only(ids).logits)
    with torch.no_grad():
        runner = RuntimeModel(runtime, make_attention(None))
        got = runner.forward(ids[0], runner.new_cache(), all_logits=True)
    assert (got - logits[0]).abs().max() <= 1e-4 * logits.abs().max()  # float32 sums in other orders


def test_activations_are_read_by_what_they_say_not_by_the_observer_that_chose_them():
    config = quantization_config(CompressedTensorsGrid(8, -1, True, activations="int8-dynamic"))
    config["config_groups"]["group_0"]["input_activations"]["observer"] = "memoryless_minmax"
    assert parse_quantization_config(config).activations == "int8-dynamic"


# --- FP8 KV cache: one scale per layer for keys and one for values, from the calibration rows ---

def test_fp8_kv_cache_scales_are_calibrated_stated_and_scored(tiny_checkpoint_factory, tmp_path):
    """Each layer's k_scale / v_scale is max |K| (after RoPE) / 448 and max |V| / 448 over the calibration
    rows as the quantized model computes them (checked by running the artifact's own model on the same
    rows); the config states llm-compressor's kv_cache_scheme; the scored model attends to keys and values
    on the E4M3 grid under those scales, which changes its logits."""
    from quantkit import calib
    from quantkit.loading import load_model
    from quantkit.tokenizer import load_tokenizer

    source = tiny_checkpoint_factory(dtype=torch.float32)
    out = tmp_path / "kv"
    # calibration in float32, as the check below runs the model ("auto" is bf16 on a CPU with bf16 dot products,
    # whose keys differ from float32's by a bf16 step)
    recipe = small_recipe("gptq-w4g128", tmp_path, format="compressed-tensors", quant={"group_size": 64},
                          compute_dtype="float32", **{"compressed-tensors": {"kv_cache": "fp8"}})
    quantize(source, recipe, out, progress=False)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"] == {**KV_CACHE["fp8"][1]} and config["kv_cache_scheme"]["type"] == "float"
    assert ModelCompressor(quantization_config=QuantizationConfig.model_validate(config)).quantization_config
    reader = ArtifactReader(out)
    assert reader.qconfig.kv_cache == "fp8" and FORMATS["compressed-tensors"].kv_cache_grid(reader.qconfig)
    from quantkit.eval.conformance import check_conformance
    from quantkit.inspect import describe

    assert describe(out)["quantization"].endswith(", KV cache 8-bit float tensor sym")
    assert check_conformance(out).passed
    from quantkit.hub.publish import check, render_card
    from quantkit.hub.repo import RepoRef

    card = render_card(check(out, RepoRef("someone/kv")), RepoRef("someone/kv"), "openbmb/MiniCPM4.1-8B")
    assert "vllm serve someone/kv --trust-remote-code --kv-cache-dtype fp8_e4m3" in card  # else vLLM ignores them
    from quantkit.kernels.roofline import roofline

    shape = reader.config
    assert roofline(out, "orin", 1024, None).kv_bytes == (  # one byte per cached element, keys and values
        2 * 1024 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim)

    cal = recipe["calibration"]
    ids = calib.calibration_set(load_tokenizer(source), source=cal["source"], n_samples=cal["n_samples"],
                                seq_len=cal["seq_len"], seed=cal["seed"], chat=cal["chat"]).input_ids
    model = load_model(out)
    seen = {}
    for index, layer in enumerate(model.model.layers):  # calibration ran the layers with a 16-bit cache
        def observed(query, key, value, *rest, index=index):
            seen[index] = (key.abs().amax(), value.abs().amax())
            return sdpa_attention_core(query, key, value, *rest)

        layer.self_attn.core = observed
    with torch.no_grad():
        model(ids)
    for index, (key_max, value_max) in seen.items():
        for name, top in (("k_scale", key_max), ("v_scale", value_max)):
            scale = reader.tensors.get(f"model.layers.{index}.self_attn.{name}")
            assert scale.dtype == torch.float32 and scale.shape == (1,)
            assert torch.allclose(scale * 448, top, rtol=1e-5), (index, name)  # the same rows, the same model

    weights_only = load_model(out)
    for layer in weights_only.model.layers:  # the attention as the weights alone would run it
        layer.self_attn.core = sdpa_attention_core
    with torch.no_grad():
        assert not torch.allclose(weights_only(ids[:1]).logits, load_model(out)(ids[:1]).logits)

    # transformers' compressed-tensors integration reads the scales onto each attention (its own k_scale and
    # v_scale parameters) and runs the weights as quantkit does; its forward keeps a 16-bit cache
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for index, layer in enumerate(theirs.model.layers):
        for name in KV_SCALES:
            assert torch.equal(getattr(layer.self_attn, name).data, reader.tensors.get(
                f"model.layers.{index}.self_attn.{name}"))
    with torch.no_grad():
        got, want = theirs(ids[:1]).logits, weights_only(ids[:1]).logits
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
