"""AutoAWQ GEMM layout: bit-exact round trips, the nibble order against an element-by-element
reference written from docs/formats.md, "AutoAWQ GEMM", the documented dequantization, and clear refusals."""
import numpy as np
import pytest
import torch

from quantkit.formats.awq import (
    awq_tensors,
    check_awq,
    pack_awq,
    parse_quantization_config,
    quantization_config,
    read_awq_tensors,
    unpack_awq,
)
from quantkit.quant import QuantConfig, default_g_idx

from helpers import random_record

PREFIX = "model.layers.0.mlp.down_proj"
W4G128_ASYM = QuantConfig(4, 128, False)


def _reference_pack(values: np.ndarray) -> np.ndarray:
    """Nibble i of word c holds column 8c + [0,2,4,6,1,3,5,7][i] (uint32 result)."""
    rows, cols = values.shape
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    words = np.zeros((rows, cols // 8), dtype=np.uint32)
    for r in range(rows):
        for c in range(cols // 8):
            for i in range(8):
                words[r, c] |= np.uint32(values[r, 8 * c + order[i]]) << np.uint32(4 * i)
    return words


def test_pack_matches_the_documented_nibble_order():
    values = torch.randint(0, 16, (6, 48), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_awq(values)
    assert packed.dtype == torch.int32 and packed.shape == (6, 6)
    assert np.array_equal(packed.numpy().view(np.uint32), _reference_pack(values.numpy()))
    assert torch.equal(unpack_awq(packed), values)

    one_hot = torch.zeros(1, 8, dtype=torch.uint8)
    one_hot[0, 2] = 0xF  # docs/formats.md, "AutoAWQ GEMM": nibble 1 of word 0 holds column 2
    assert pack_awq(one_hot).item() == 0xF << 4


@pytest.mark.parametrize("config", [W4G128_ASYM, QuantConfig(4, 64, True), QuantConfig(4, -1, False)],
                         ids=["g128-asym", "g64-sym", "channel"])
def test_round_trip_is_bit_exact_and_dequantizes_as_documented(config):
    n, k = 96, 256
    qt = random_record(config, n, k, seed=1)
    tensors = awq_tensors(qt, PREFIX)
    groups = config.num_groups(k)
    assert {key: (t.dtype, tuple(t.shape)) for key, t in tensors.items()} == {
        f"{PREFIX}.qweight": (torch.int32, (k, n // 8)),
        f"{PREFIX}.qzeros": (torch.int32, (groups, n // 8)),
        f"{PREFIX}.scales": (torch.float16, (groups, n)),
    }
    back = read_awq_tensors(tensors, PREFIX, config, k, n)
    for field in ("codes", "scales", "zeros", "g_idx"):
        assert torch.equal(getattr(back, field), getattr(qt, field)), field

    # docs/formats.md, "AutoAWQ GEMM": W = (unpack(qweight) - repeat(unpack(qzeros), gs)) * repeat(scales, gs), [K, N]
    width = k if config.group_size == -1 else config.group_size
    q = unpack_awq(tensors[f"{PREFIX}.qweight"]).float()
    z = unpack_awq(tensors[f"{PREFIX}.qzeros"]).float().repeat_interleave(width, 0)
    s = tensors[f"{PREFIX}.scales"].float().repeat_interleave(width, 0)
    assert torch.equal((q - z) * s, qt.dequantize(torch.float32).T)


def test_zero_points_are_stored_without_the_gptq_offset():
    qt = random_record(W4G128_ASYM, 8, 128, seed=2)
    qt.zeros.fill_(5)
    assert (unpack_awq(awq_tensors(qt, PREFIX)[f"{PREFIX}.qzeros"]) == 5).all()


@pytest.mark.parametrize("config, k, n, desc_act, message", [
    (QuantConfig(4, 128, False), 576, 64, False, "K a whole number of groups"),
    (QuantConfig(3, 128, False), 256, 64, False, "4-bit only"),
    (QuantConfig(4, 128, False), 256, 60, False, "N % 8 == 0"),
    (QuantConfig(4, 128, False), 256, 64, True, "no act-order"),
])
def test_unpackable_shapes_are_refused_with_the_rule(config, k, n, desc_act, message):
    with pytest.raises(ValueError, match=f"{PREFIX}: cannot use the AWQ GEMM format: .*{message}"):
        check_awq(config, k, n, desc_act, PREFIX)


def test_act_order_records_and_damaged_tensors_are_refused():
    qt = random_record(W4G128_ASYM, 16, 256, seed=3, g_idx=default_g_idx(256, 128).flip(0))
    with pytest.raises(ValueError, match="act-order"):
        awq_tensors(qt, PREFIX)
    tensors = awq_tensors(random_record(W4G128_ASYM, 16, 256, seed=3), PREFIX)
    with pytest.raises(KeyError, match="qzeros"):
        read_awq_tensors({k: v for k, v in tensors.items() if not k.endswith("qzeros")}, PREFIX, W4G128_ASYM, 256, 16)
    with pytest.raises(ValueError, match="scales"):
        read_awq_tensors({**tensors, f"{PREFIX}.scales": tensors[f"{PREFIX}.scales"].float()}, PREFIX,
                         W4G128_ASYM, 256, 16)


def test_quantization_config_round_trip_and_autoawq_spelling():
    d = quantization_config(W4G128_ASYM, quantizer="quantkit:test")
    assert {k: d[k] for k in ("quant_method", "version", "bits", "group_size", "zero_point")} == {
        "quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 128, "zero_point": True}
    assert parse_quantization_config(d) == W4G128_ASYM
    assert parse_quantization_config(quantization_config(QuantConfig(4, 64, True))) == QuantConfig(4, 64, True)
    autoawq = {"quant_method": "awq", "zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}
    assert parse_quantization_config(autoawq) == W4G128_ASYM
    with pytest.raises(ValueError, match="gemv"):
        parse_quantization_config({**autoawq, "version": "gemv"})
    with pytest.raises(ValueError, match="zero_point"):
        parse_quantization_config({"quant_method": "awq", "bits": 4, "group_size": 128})
