import pytest
import torch

from quantkit.formats.cpmcu import PACKED_MODULES, cpmcu_layer_tensors, read_cpmcu_layer
from quantkit.formats.marlin import marlin_shapes, read_marlin_tensors
from quantkit.models.layers import DOWN, GATE, LINEARS, O_PROJ, UP, K, Q, V, layer_prefix
from quantkit.quant import QuantConfig, QuantizedTensor, default_g_idx

PREFIX = layer_prefix(3)
W4G128 = QuantConfig(4, 128, True)

# (out_features, in_features) per linear.
MINICPM_8B = {Q: (4096, 4096), K: (256, 4096), V: (256, 4096), O_PROJ: (4096, 4096),
              GATE: (16384, 4096), UP: (16384, 4096), DOWN: (4096, 16384)}
# The same structure scaled down (hidden 256, 2 KV heads of 32, intermediate 512).
SMALL = {Q: (256, 256), K: (64, 256), V: (64, 256), O_PROJ: (256, 256),
         GATE: (512, 256), UP: (512, 256), DOWN: (256, 512)}

# docs/formats.md, "CPM.cu": model_gptq.safetensors tensors of one MiniCPM4.1-8B decoder layer.
CPMCU_8B_TENSORS = {
    "self_attn.qkv_proj.qweight": (torch.int32, (256, 9216)), "self_attn.qkv_proj.scales": (torch.float16, (32, 4608)),
    "self_attn.o_proj.qweight": (torch.int32, (256, 8192)), "self_attn.o_proj.scales": (torch.float16, (32, 4096)),
    "mlp.gate_up_proj.qweight": (torch.int32, (256, 65536)), "mlp.gate_up_proj.scales": (torch.float16, (32, 32768)),
    "mlp.down_proj.qweight": (torch.int32, (1024, 8192)), "mlp.down_proj.scales": (torch.float16, (128, 4096)),
}


def _random_layer(shapes, config=W4G128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layer = {}
    for name, (n, k) in shapes.items():
        groups = config.num_groups(k)
        layer[name] = QuantizedTensor(
            codes=torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
            scales=torch.randint(1, 0x7C00, (groups, n), generator=gen, dtype=torch.int16).view(torch.float16),
            zeros=torch.full((groups, n), 8, dtype=torch.uint8),
            g_idx=default_g_idx(k, config.group_size),
            config=config,
        )
    return layer


def _assert_layer_round_trip(shapes, config):
    layer = _random_layer(shapes, config, seed=len(shapes) + config.group_size)
    tensors = cpmcu_layer_tensors(layer, PREFIX)
    back = read_cpmcu_layer(tensors, PREFIX, shapes, group_size=config.group_size)
    assert list(back) == [name for parts in PACKED_MODULES.values() for name in parts]
    for name, qt in layer.items():
        codes, scales = back[name]
        assert torch.equal(codes, qt.codes), name
        assert torch.equal(scales.view(torch.int16), qt.scales.view(torch.int16)), name
    return layer, tensors


def test_packed_modules_follow_the_fusion_table():
    assert PACKED_MODULES == {"self_attn.qkv_proj": (Q, K, V), O_PROJ: (O_PROJ,),
                              "mlp.gate_up_proj": (GATE, UP), DOWN: (DOWN,)}
    assert sorted(name for parts in PACKED_MODULES.values() for name in parts) == sorted(LINEARS)


def test_minicpm_8b_layer_shapes():
    expected = {}
    for module, parts in PACKED_MODULES.items():
        k = MINICPM_8B[parts[0]][1]
        n = sum(MINICPM_8B[name][0] for name in parts)
        expected.update({f"{module}.{t}": shape for t, shape in marlin_shapes(k, n, 128).items()})
    assert expected == {name: shape for name, (_, shape) in CPMCU_8B_TENSORS.items()}


@pytest.mark.parametrize("config", [W4G128, QuantConfig(4, -1, True)], ids=["g128", "g-1"])
def test_small_layer_round_trip(config):
    layer, tensors = _assert_layer_round_trip(SMALL, config)
    assert sorted(tensors) == sorted(f"{PREFIX}{m}.{t}" for m in PACKED_MODULES for t in ("qweight", "scales"))
    groups = config.num_groups(256)
    assert tensors[f"{PREFIX}self_attn.qkv_proj.qweight"].shape == (16, 2 * 384)
    assert tensors[f"{PREFIX}self_attn.qkv_proj.scales"].shape == (groups, 384)
    assert tensors[f"{PREFIX}mlp.down_proj.qweight"].shape == (32, 512)
    # Fusion order: a fused module is the plain Marlin packing of the parts stacked q, k, v / gate, up.
    for module, parts in (("self_attn.qkv_proj", (Q, K, V)), ("mlp.gate_up_proj", (GATE, UP))):
        n = sum(SMALL[name][0] for name in parts)
        codes, scales = read_marlin_tensors(tensors, PREFIX + module, 256, n, config.group_size)
        assert torch.equal(codes, torch.cat([layer[name].codes for name in parts]))
        assert torch.equal(scales, torch.cat([layer[name].scales for name in parts], dim=1))


@pytest.mark.slow
def test_minicpm_8b_layer_round_trip():
    _, tensors = _assert_layer_round_trip(MINICPM_8B, W4G128)
    assert {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()} == {
        PREFIX + name: spec for name, spec in CPMCU_8B_TENSORS.items()}


def test_refuses_incomplete_layer_and_bad_prefix():
    layer = _random_layer(SMALL)
    with pytest.raises(ValueError, match=r"missing \['mlp.down_proj'\], unexpected \[\]"):
        cpmcu_layer_tensors({name: qt for name, qt in layer.items() if name != DOWN}, PREFIX)
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['mlp.extra_proj'\]"):
        cpmcu_layer_tensors({**layer, "mlp.extra_proj": layer[DOWN]}, PREFIX)
    with pytest.raises(ValueError, match="trailing dot"):
        cpmcu_layer_tensors(layer, "model.layers.3")


def test_refuses_parts_that_cannot_fuse():
    layer = _random_layer(SMALL)
    layer[K] = _random_layer({K: SMALL[K]}, QuantConfig(4, -1, True))[K]
    with pytest.raises(ValueError, match=r"self_attn.qkv_proj: cannot fuse self_attn.k_proj .*must agree"):
        cpmcu_layer_tensors(layer, PREFIX)


def test_fused_output_size_must_be_marlin_legal():
    shapes = {**SMALL, K: (16, 256), V: (16, 256)}  # q+k+v = 288 rows: not a multiple of 64
    with pytest.raises(ValueError, match=r"model.layers.3.self_attn.qkv_proj: .*N % 64 == 0 \(out_features N=288\)"):
        cpmcu_layer_tensors(_random_layer(shapes), PREFIX)


def test_read_validates_shapes_and_tensors():
    tensors = cpmcu_layer_tensors(_random_layer(SMALL), PREFIX)
    with pytest.raises(ValueError, match=r"missing \['mlp.up_proj'\]"):
        read_cpmcu_layer(tensors, PREFIX, {name: s for name, s in SMALL.items() if name != UP})
    with pytest.raises(ValueError, match="mlp.gate_up_proj: fused parts .* must share in_features"):
        read_cpmcu_layer(tensors, PREFIX, {**SMALL, UP: (512, 512)})
    with pytest.raises(ValueError, match=r"self_attn.qkv_proj.qweight' must be torch.int32 \(16, 896\)"):
        read_cpmcu_layer(tensors, PREFIX, {**SMALL, V: (128, 256)})
    del tensors[f"{PREFIX}mlp.down_proj.scales"]
    with pytest.raises(KeyError, match="mlp.down_proj.scales' is missing"):
        read_cpmcu_layer(tensors, PREFIX, SMALL)
