import json

import numpy as np
import pytest
import torch

from quantkit.formats.marlin import (
    WEIGHT_PERM,
    check_marlin,
    marlin_tensors,
    pack_codes,
    permute_scales,
    quantization_config,
    read_marlin_tensors,
)
from quantkit.quant import QuantConfig, QuantizedTensor, default_g_idx, rtn_quantize

PREFIX = "model.layers.0.self_attn.q_proj"
W4G128 = QuantConfig(4, 128, True)
W4_CHANNEL = QuantConfig(4, -1, True)


# --- independent reference, element by element from docs/formats.md, "Marlin" ---------------------------
# Word c of tiled row kt, nibble s, holds position P = 8c + s of the permuted row. P lies in run
# P // 1024 (four tiles side by side); inside the run, thread t = p // 32 owns positions
# [32t, 32t + 32), 8 per tile j; the 8 are interleaved [0,2,4,6,1,3,5,7] and entry e of a
# fragment is row (2(t%4), +1, +8, +9)[e % 4] of tile column t//4 + 8·(e // 4).

_INTERLEAVE = np.array([0, 2, 4, 6, 1, 3, 5, 7])
_FRAGMENT_ROW_OFFSET = np.array([0, 1, 8, 9])


def _reference_qweight(codes):
    """codes uint8 [N, K] -> Marlin qweight as uint32 [K/16, 2N]."""
    n, k = codes.shape
    kt, c, s = np.meshgrid(np.arange(k // 16), np.arange(2 * n), np.arange(8), indexing="ij")
    run, p = np.divmod(8 * c + s, 1024)
    thread, tile = np.divmod(p // 8, 4)
    half, entry = np.divmod(_INTERLEAVE[s], 4)
    k_index = 16 * kt + 2 * (thread % 4) + _FRAGMENT_ROW_OFFSET[entry]
    n_index = 16 * (4 * run + tile) + thread // 4 + 8 * half
    nibbles = codes[n_index, k_index].astype(np.uint32) << (4 * s).astype(np.uint32)
    return np.bitwise_or.reduce(nibbles, axis=2)


def _reference_scales(scales):
    """scales [G, N] -> Marlin order: 8x8 transposes of 64-runs (G > 1), else the 32-run pair order."""
    g, n = scales.shape
    col = np.arange(n)
    if g > 1:
        p = col % 64
        source = col - p + p // 8 + 8 * (p % 8)
    else:
        p = col % 32
        source = col - p + 2 * (p // 8) + np.array([0, 1, 8, 9, 16, 17, 24, 25])[p % 8]
    return scales[:, source]


def _random_record(n, k, config=W4G128, seed=0):
    """Random codes and arbitrary positive finite fp16 scale bit patterns."""
    gen = torch.Generator().manual_seed(seed)
    groups = config.num_groups(k)
    bits = torch.randint(1, 0x7C00, (groups, n), generator=gen, dtype=torch.int16)
    return QuantizedTensor(
        codes=torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
        scales=bits.view(torch.float16),
        zeros=torch.full((groups, n), 8, dtype=torch.uint8),
        g_idx=default_g_idx(k, config.group_size),
        config=config,
    )


def _round_trip(qt):
    n, k = qt.shape
    tensors = marlin_tensors(qt, PREFIX)
    groups = qt.config.num_groups(k)
    assert set(tensors) == {f"{PREFIX}.qweight", f"{PREFIX}.scales"}
    qweight, scales = tensors[f"{PREFIX}.qweight"], tensors[f"{PREFIX}.scales"]
    assert qweight.dtype == torch.int32 and tuple(qweight.shape) == (k // 16, 2 * n)
    assert scales.dtype == torch.float16 and tuple(scales.shape) == (groups, n)
    codes, back_scales = read_marlin_tensors(tensors, PREFIX, k, n, qt.config.group_size)
    assert torch.equal(codes, qt.codes)
    assert torch.equal(back_scales.view(torch.int16), qt.scales.view(torch.int16))  # bit for bit
    return tensors


# --- permutations -------------------------------------------------------------------------------

def test_weight_perm_anchor_and_bijection():
    assert WEIGHT_PERM[:16].tolist() == [0, 128, 8, 136, 16, 144, 24, 152, 256, 384, 264, 392, 272, 400, 280, 408]
    assert sorted(WEIGHT_PERM.tolist()) == list(range(1024))


def test_hand_computed_first_word():
    # Word 0 holds (k, n) = (0,0) (8,0) (0,8) (8,8) (1,0) (9,0) (1,8) (9,8) in nibbles 0..7.
    k_codes = (torch.arange(128) % 16).to(torch.uint8).expand(64, 128)
    n_codes = (torch.arange(64) % 16).to(torch.uint8)[:, None].expand(64, 128)
    assert pack_codes(k_codes)[0, 0].item() == np.int32(np.uint32(0x91918080))
    assert pack_codes(n_codes)[0, 0].item() == np.int32(np.uint32(0x88008800))


@pytest.mark.parametrize("n, k", [(64, 128), (128, 256), (192, 384), (256, 4096)])
def test_weight_layout_matches_reference(n, k):
    codes = _random_record(n, k, seed=n + k).codes
    assert np.array_equal(pack_codes(codes).numpy().view(np.uint32), _reference_qweight(codes.numpy()))


@pytest.mark.parametrize("groups, n", [(1, 64), (1, 4608), (2, 64), (32, 4096)])
def test_scale_layout_matches_reference(groups, n):
    scales = torch.rand(groups, n, generator=torch.Generator().manual_seed(n)).half()
    assert torch.equal(permute_scales(scales), torch.from_numpy(_reference_scales(scales.numpy())))


def test_group_size_selects_scale_permutation():
    qt128, qt_channel = _random_record(64, 256, W4G128, seed=1), _random_record(64, 256, W4_CHANNEL, seed=1)
    s128 = marlin_tensors(qt128, PREFIX)[f"{PREFIX}.scales"]
    s_channel = marlin_tensors(qt_channel, PREFIX)[f"{PREFIX}.scales"]
    assert s128.shape == (2, 64) and s_channel.shape == (1, 64)
    assert s128[0, :8].tolist() == qt128.scales[0, [0, 8, 16, 24, 32, 40, 48, 56]].tolist()
    assert s_channel[0, :8].tolist() == qt_channel.scales[0, [0, 1, 8, 9, 16, 17, 24, 25]].tolist()
    # K == 128 at group 128 is a single group: the kernels' group_size < K test picks the single order.
    qt_one_group = _random_record(64, 128, W4G128, seed=2)
    s_one = marlin_tensors(qt_one_group, PREFIX)[f"{PREFIX}.scales"]
    assert s_one[0, :8].tolist() == qt_one_group.scales[0, [0, 1, 8, 9, 16, 17, 24, 25]].tolist()
    _round_trip(qt_one_group)


# --- round trips --------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [W4G128, W4_CHANNEL], ids=["g128", "g-1"])
@pytest.mark.parametrize("n, k", [(64, 128), (192, 512), (4096, 4096), (256, 4096)])
def test_round_trip_bit_exact(config, n, k):
    _round_trip(_random_record(n, k, config, seed=n * 7 + k))


@pytest.mark.slow
@pytest.mark.parametrize("n, k", [(16384, 4096), (4096, 16384)])  # MiniCPM4.1-8B gate/up and down
def test_round_trip_bit_exact_large(n, k):
    _round_trip(_random_record(n, k, seed=3))


def test_rtn_record_dequantizes_identically():
    weight = torch.randn(128, 512, generator=torch.Generator().manual_seed(5))
    qt = rtn_quantize(weight, W4G128)
    codes, scales = read_marlin_tensors(marlin_tensors(qt, PREFIX), PREFIX, 512, 128, 128)
    g = default_g_idx(512, 128).long()
    marlin_weight = (codes.float() - 8) * scales[g].T.float()  # uint4b8: w = (q - 8) * s
    assert torch.equal(marlin_weight, qt.dequantize())


# --- rules --------------------------------------------------------------------------------------

RULES = ("symmetric quantization only", "4-bit only", "group size 128 or -1", "no act-order",
         "K % 128 == 0", "N % 64 == 0")


@pytest.mark.parametrize("config, k, n, desc_act, rule, found", [
    (QuantConfig(4, 128, False), 4096, 4096, False, "symmetric quantization only", "sym=False"),
    (QuantConfig(3, 128, True), 4096, 4096, False, "4-bit only", "bits=3"),
    (QuantConfig(4, 64, True), 4096, 4096, False, "group size 128 or -1", "group_size=64"),
    (W4G128, 4096, 4096, True, "no act-order", "desc_act=True"),
    (W4G128, 576, 576, False, "K % 128 == 0", "in_features K=576"),
    (W4G128, 4096, 100, False, "N % 64 == 0", "out_features N=100"),
])
def test_each_rule_rejected_by_name(config, k, n, desc_act, rule, found):
    with pytest.raises(ValueError) as error:
        check_marlin(config, k, n, desc_act=desc_act, name=PREFIX)
    message = str(error.value)
    assert message.startswith(f"{PREFIX}: cannot use the Marlin format: ")
    assert f"{rule} ({found})" in message
    assert [r for r in RULES if r in message] == [rule]


def test_all_broken_rules_reported_together():
    with pytest.raises(ValueError, match=r"4-bit only \(bits=8\); K % 128 == 0 \(in_features K=576\); "
                                         r"N % 64 == 0 \(out_features N=100\)"):
        check_marlin(QuantConfig(8, 128, True), 576, 100, name="mlp.up_proj")


@pytest.mark.parametrize("n, k", [(4096, 4096), (256, 4096), (16384, 4096), (4096, 16384)])
@pytest.mark.parametrize("config", [W4G128, W4_CHANNEL])
def test_minicpm_8b_shapes_accepted(config, n, k):
    assert check_marlin(config, k, n, name=PREFIX) is None


def test_marlin_tensors_refuses_what_it_cannot_store():
    with pytest.raises(ValueError, match="symmetric quantization only"):
        marlin_tensors(rtn_quantize(torch.randn(64, 128), QuantConfig(4, 128, False)), PREFIX)
    act_order = _random_record(64, 256, seed=4)
    act_order.g_idx = act_order.g_idx.flip(0)
    with pytest.raises(ValueError, match=f"{PREFIX}: Marlin needs g_idx in natural order"):
        marlin_tensors(act_order, PREFIX)
    odd_zero = _random_record(64, 256, seed=4)
    odd_zero.zeros[1, 3] = 7
    with pytest.raises(ValueError, match="every zero point to be 8"):
        marlin_tensors(odd_zero, PREFIX)


@pytest.mark.parametrize("name, corrupt, error, message", [
    ("qweight", None, KeyError, "qweight' is missing"),
    ("scales", None, KeyError, "scales' is missing"),
    ("scales", lambda t: t.float(), ValueError, r"scales' must be torch.float16 \(2, 64\)"),
    ("qweight", lambda t: t[:-1], ValueError, r"qweight' must be torch.int32 \(16, 128\), got torch.int32 \(15, 128\)"),
])
def test_read_validates_each_tensor(name, corrupt, error, message):
    tensors = marlin_tensors(_random_record(64, 256, seed=6), PREFIX)
    key = f"{PREFIX}.{name}"
    if corrupt is None:
        del tensors[key]
    else:
        tensors[key] = corrupt(tensors[key])
    with pytest.raises(error, match=message):
        read_marlin_tensors(tensors, PREFIX, 256, 64, 128)


def test_read_refuses_illegal_shape_arguments():
    tensors = marlin_tensors(_random_record(64, 256, seed=6), PREFIX)
    with pytest.raises(ValueError, match=r"N % 64 == 0 \(out_features N=32\)"):
        read_marlin_tensors(tensors, PREFIX, 256, 32, 128)


# --- quantization_config ------------------------------------------------------------------------

def test_quantization_config_is_what_cpmcu_expects():
    config = quantization_config(W4G128, quantizer="quantkit:test")
    assert json.loads(json.dumps(config)) == config
    expected = {"bits": 4, "group_size": 128, "sym": True, "desc_act": False, "static_groups": True,
                "lm_head": False, "quant_method": "gptq", "checkpoint_format": "gptq"}
    assert {key: config[key] for key in expected} == expected
    assert quantization_config(W4_CHANNEL)["group_size"] == -1
    with pytest.raises(ValueError, match=r"quantization_config: .*symmetric quantization only \(sym=False\)"):
        quantization_config(QuantConfig(4, 128, False))
