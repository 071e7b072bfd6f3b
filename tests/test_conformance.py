"""Every format as its consumers read it (quantkit.eval.conformance): each consumer's decoding of
quantkit's files must equal quantkit's dequantized weights bit for bit, on edge-case records and on
artifacts the engine wrote; and a planted v1 zero point of 0 must be caught."""
import json

import numpy as np
import pytest
import torch

from quantkit.checkpoint import FILES_KEY, MANIFEST_FILE
from quantkit.engine import quantize
from quantkit.eval.conformance import (
    MARLIN_WEIGHT_PERM,
    autogptq_v1_zeros,
    check_conformance,
    gptqmodel_v1_zeros,
    rules_of,
    unpack_stream,
    vllm_v1_zeros,
)
from quantkit.file_hashes import sha256_file
from quantkit.formats import FORMATS, gptq
from quantkit.formats.gptq import pack_cols, storable_grid
from quantkit.models.layers import LINEARS
from quantkit.quant import QuantConfig, QuantizedTensor, default_g_idx
from quantkit.reader import ArtifactReader
from quantkit.recipe import load_recipe

from helpers import SMALL_CALIBRATION

PREFIX = "model.layers.0."


def edge_record(config: QuantConfig, n: int, k: int, seed: int, g_idx=None) -> QuantizedTensor:
    """Random codes with the edges every consumer must agree on: zero points at both ends of the
    grid, an all-zero row (codes at the zero point), a group whose scale is 0, and the largest code."""
    gen = torch.Generator().manual_seed(seed)
    groups = config.num_groups(k)
    low = config.min_zero
    if config.sym:
        zeros = torch.full((groups, n), (config.maxq + 1) // 2, dtype=torch.uint8)
    else:
        zeros = torch.randint(low, config.maxq + 1, (groups, n), generator=gen, dtype=torch.uint8)
        zeros[:, 0], zeros[:, 1] = low, config.maxq
    g_idx = default_g_idx(k, config.group_size) if g_idx is None else g_idx
    codes = torch.randint(0, config.maxq + 1, (n, k), generator=gen, dtype=torch.uint8)
    codes[2] = zeros[g_idx.long(), 2]  # an all-zero row
    codes[3, :3] = config.maxq
    scales = (torch.rand(groups, n, generator=gen) + 0.01).half()
    scales[0, 4] = 0.0
    return QuantizedTensor(codes, scales, zeros, g_idx, config)


def layer_of(config: QuantConfig, shapes: dict, seed: int, g_idx_for=None) -> dict[str, QuantizedTensor]:
    return {name: edge_record(config, n, k, seed + i, g_idx_for(k) if g_idx_for else None)
            for i, (name, (n, k)) in enumerate(shapes.items())}


def assert_consumers_agree(format_name: str, quant: dict, records: dict[str, QuantizedTensor], shapes: dict):
    tensors = FORMATS[format_name].write_layer(records, PREFIX)
    arrays = {key: t.numpy() for key, t in tensors.items()}
    rules = [rule for rule in rules_of(format_name, shapes) if rule.applies(quant)]
    assert rules
    for name, record in records.items():
        ours = record.dequantize(torch.float32).numpy()
        for rule in rules:
            theirs = rule.decode(arrays, PREFIX + name, quant, record.shape)
            assert theirs.dtype == np.float32 and np.array_equal(theirs, ours), (rule.name, name)
    return rules


SMALL_SHAPES = {name: (64, 160) for name in LINEARS}  # K = 160: a ragged last group at g64 and g128


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [-1, 32, 128])
def test_gptq_consumers_read_quantkit_records(checkpoint_format, bits, sym, group_size):
    format_name = "gptq" if checkpoint_format == "gptq" else "gptq-v2"
    config = storable_grid(QuantConfig(bits, group_size, sym), checkpoint_format)
    quant = FORMATS[format_name].quantization_config(config)
    consumers = assert_consumers_agree(format_name, quant, layer_of(config, SMALL_SHAPES, bits), SMALL_SHAPES)
    assert len(consumers) == {"gptq": 3, "gptq-v2": 1}[format_name] + (sym and bits in (4, 8))  # + gptq_marlin


@pytest.mark.parametrize("format_name", ["gptq", "gptq-v2"])
def test_gptq_consumers_read_act_order(format_name):
    config = storable_grid(QuantConfig(4, 32, False), "gptq" if format_name == "gptq" else "gptq_v2")
    quant = FORMATS[format_name].quantization_config(config, desc_act=True)
    permuted = lambda k: default_g_idx(k, 32)[torch.randperm(k, generator=torch.Generator().manual_seed(k))]  # noqa: E731
    assert_consumers_agree(format_name, quant, layer_of(config, SMALL_SHAPES, 7, permuted), SMALL_SHAPES)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [-1, 32, 64])
def test_awq_consumers_read_quantkit_records(sym, group_size):
    config = QuantConfig(4, group_size, sym)
    shapes = {name: (64, 128) for name in LINEARS}
    assert_consumers_agree("awq", FORMATS["awq"].quantization_config(config), layer_of(config, shapes, 11), shapes)


@pytest.mark.parametrize("format_name", ["marlin", "cpmcu"])
@pytest.mark.parametrize("group_size", [-1, 128])
def test_marlin_and_cpmcu_consumers_read_quantkit_records(format_name, group_size):
    config = QuantConfig(4, group_size, True)
    shapes = {"self_attn.q_proj": (128, 256), "self_attn.k_proj": (64, 256), "self_attn.v_proj": (64, 256),
              "self_attn.o_proj": (256, 128), "mlp.gate_proj": (192, 256), "mlp.up_proj": (192, 256),
              "mlp.down_proj": (256, 256)}
    quant = FORMATS[format_name].quantization_config(config)
    assert_consumers_agree(format_name, quant, layer_of(config, shapes, 13), shapes)


def test_ternary_planes_read_quantkit_records():
    config = QuantConfig(2, 32, False, ternary=True)
    shapes = {name: (48, 64) for name in LINEARS}
    records = {}
    for i, (name, (n, k)) in enumerate(shapes.items()):
        record = edge_record(config, n, k, 17 + i)
        record.zeros.fill_(1)  # ternary: codes t + 1 around a zero point of 1
        record.codes[2] = 1
        records[name] = record
    assert_consumers_agree("ternary", FORMATS["ternary"].quantization_config(config), records, shapes)


def test_independent_unpacking_and_marlin_permutation():
    words = np.array([[0x40000000], [0x00000001], [0x00000000]], dtype=np.uint32).view(np.int32)
    values = unpack_stream(words, 3, axis=0)
    assert values[10, 0] == 0b101 and values.sum() == 0b101  # value 10 straddles words 0 and 1
    assert MARLIN_WEIGHT_PERM[:8].tolist() == [0, 128, 8, 136, 16, 144, 24, 152]
    assert sorted(MARLIN_WEIGHT_PERM.tolist()) == list(range(1024))


def test_consumers_disagree_on_an_all_ones_v1_zero_field():
    """What a zero of 0 would look like in v1: AutoGPTQ reads 0, vLLM 16, GPTQModel carries into the
    neighbour. This is the misreading the v1 grid and the reader's refusal prevent."""
    stored = torch.tensor([[0xF, 7, 7, 7, 7, 7, 7, 7]])
    qzeros = pack_cols(stored, 4).numpy()
    assert autogptq_v1_zeros(qzeros, 4).tolist() == [[0, 8, 8, 8, 8, 8, 8, 8]]
    assert vllm_v1_zeros(qzeros, 4).tolist() == [[16, 8, 8, 8, 8, 8, 8, 8]]
    assert gptqmodel_v1_zeros(qzeros, 4).tolist() == [[0, 9, 8, 8, 8, 8, 8, 8]]


# --- artifacts written by the engine, read back by every consumer --------------------------------

def _quantize(recipe: str, checkpoint, out, **settings):
    settings = {"calibration": SMALL_CALIBRATION, **settings}
    quantize(checkpoint, load_recipe(recipe, dict(_flatten(settings))), out, progress=False)
    return out


def _flatten(settings: dict, prefix: str = ""):
    for key, value in settings.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.slow
@pytest.mark.parametrize("recipe, settings, checkpoint", [
    ("awq-w4g128", {"format": "gptq", "quant": {"group_size": 32}}, "tiny"),  # the command, asym v1
    ("awq-w4g128", {"format": "gptq-v2", "quant": {"group_size": 32}}, "tiny"),
    ("gptq-w4g128", {"quant": {"sym": False, "bits": 3}}, "marlin"),
    ("rtn-w4g128", {"quant": {"sym": False, "bits": 2, "group_size": 32}}, "tiny"),
    ("gptq-w4g128", {"gptq": {"desc_act": True, "group_aware": False}}, "tiny"),
    ("awq-w4g128", {"quant": {"group_size": 64}}, "tiny"),
    ("rtn-ternary-g32", {}, "tiny"),
    ("marlin", {}, "marlin"),
    ("cpmcu", {}, "marlin"),
])
def test_engine_artifacts_conform(recipe, settings, checkpoint, tiny_checkpoint, marlin_legal, tmp_path):
    source = {"tiny": tiny_checkpoint, "marlin": marlin_legal}[checkpoint]
    out = _quantize(recipe, source, tmp_path / "out", **settings)
    report = check_conformance(out)
    assert report.passed, report
    layers = ArtifactReader(out).num_layers
    assert all(check.linears == layers * len(LINEARS) for check in report.checks)


@pytest.mark.slow
def test_planted_zero_point_of_zero_is_caught(tiny_checkpoint, tmp_path):
    """Asymmetric v1 artifacts pass; the same artifact with one zero field set to all ones (a zero
    of 0 as another tool would have written it) is refused by quantkit and flagged by the check."""
    from click.testing import CliRunner

    from quantkit.cli import main

    out = _quantize("gptq-w4g128", tiny_checkpoint, tmp_path / "asym", quant={"sym": False, "group_size": 32})
    assert check_conformance(out).passed
    result = CliRunner().invoke(main, ["eval", "conformance", "--model", str(out)])
    assert result.exit_code == 0 and "vLLM gptq" in result.output and "no (" not in result.output
    from safetensors.torch import load_file, save_file

    shard = sorted(out.glob("model-00001-*.safetensors"))[0]
    tensors = load_file(str(shard))
    key = f"{PREFIX}mlp.down_proj.qzeros"
    zeros = gptq.unpack_cols(tensors[key], 4).to(torch.int64)
    zeros[0, 3] = 15
    tensors[key] = gptq.pack_cols(zeros, 4)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    manifest = json.loads((out / MANIFEST_FILE).read_text())  # as another tool's, whose hash it would hold
    manifest[FILES_KEY][shard.name] = {"size": shard.stat().st_size, "sha256": sha256_file(shard)}
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    report = check_conformance(out)
    assert not report.passed
    assert "ambiguous" in report.quantkit_error and "mlp.down_proj.qzeros" in report.quantkit_error
    mismatched = {check.consumer: check.mismatched for check in report.checks}
    assert mismatched["vLLM gptq"] == [f"{PREFIX}mlp.down_proj.weight"]
    assert mismatched["GPTQModel"] == [f"{PREFIX}mlp.down_proj.weight"]
    result = CliRunner().invoke(main, ["eval", "conformance", "--model", str(out), "--json"])
    assert result.exit_code == 1 and '"passed": false' in result.output
    with pytest.raises(ValueError, match="ambiguous"):
        from quantkit.loading import load_model

        load_model(out)


def test_ternary_kernel_computes_with_the_documented_planes():
    """The runtime's CPU kernel, fed the stored tensors, against x · Wᵀ with W decoded from the
    documented planes (not from quantkit's reader)."""
    from quantkit.eval.conformance import ternary_planes
    from quantkit.kernels.linear.ternary import TernaryLinear

    config = QuantConfig(2, 32, False, ternary=True)
    record = edge_record(config, 96, 320, 23)
    record.zeros.fill_(1)
    tensors = FORMATS["ternary"].write_layer({name: record for name in LINEARS}, PREFIX)
    name = PREFIX + "mlp.up_proj"
    weight = torch.from_numpy(ternary_planes({k: t.numpy() for k, t in tensors.items()}, name,
                                             {"group_size": 32}, record.shape)).double()
    module = TernaryLinear(tensors[f"{name}.qweight"], tensors[f"{name}.scales"], 32)
    x = torch.randn(3, 320, generator=torch.Generator().manual_seed(0))
    want = x.double() @ weight.T
    assert ((module(x).double() - want).abs().max() / want.abs().max()) < 1e-5  # float32 sums of exact ±x·s terms
