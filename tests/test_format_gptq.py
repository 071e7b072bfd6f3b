import json

import numpy as np
import pytest
import torch

from quantkit.formats.gptq import (
    gptq_tensors,
    pack_cols,
    pack_rows,
    parse_quantization_config,
    quantization_config,
    read_gptq_tensors,
    storable_grid,
    unpack_cols,
    unpack_rows,
)
from quantkit.quant import QuantConfig, default_g_idx, rtn_quantize

from helpers import random_record

PREFIX = "model.layers.0.mlp.down_proj"
RUN = {2: 16, 3: 32, 4: 8, 8: 4}  # values per whole run of int32 words


def _words(tensor):
    return tensor.numpy().view(np.uint32)


# --- independent NumPy decoder, written from the layout tables in docs/formats.md, "GPTQ" ---------------

def _np_unpack_rows(words, bits):
    w = words.view(np.uint32).astype(np.int64)
    if bits != 3:
        per_word = 32 // bits
        fields = [(w >> (bits * i)) & (2**bits - 1) for i in range(per_word)]
        return np.stack(fields, 1).reshape(-1, w.shape[1])
    w0, w1, w2 = w[0::3], w[1::3], w[2::3]
    values = [(w0 >> (3 * j)) & 7 for j in range(10)]
    values.append(((w0 >> 30) & 3) | ((w1 & 1) << 2))
    values += [(w1 >> (3 * j + 1)) & 7 for j in range(10)]
    values.append(((w1 >> 31) & 1) | ((w2 & 3) << 1))
    values += [(w2 >> (3 * j + 2)) & 7 for j in range(10)]
    return np.stack(values, 1).reshape(-1, w.shape[1])


def _np_reference_dequant(tensors, bits, prefix=PREFIX):
    """docs/formats.md, "GPTQ zero points": W = (q - ((z + 1) & maxq)[g_idx]) * scales[g_idx], transposed to [N, K]."""
    maxq = 2**bits - 1
    get = lambda name: tensors[f"{prefix}.{name}" if prefix else name].numpy()  # noqa: E731
    q = _np_unpack_rows(get("qweight"), bits)
    z = _np_unpack_rows(np.ascontiguousarray(get("qzeros").T), bits).T
    z = (z + 1) & maxq
    g = get("g_idx")
    s = get("scales").astype(np.float32)
    return ((q.astype(np.float32) - z[g].astype(np.float32)) * s[g]).T


def _assert_same_record(a, b):
    for field in ("codes", "scales", "zeros", "g_idx"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert a.config == b.config


# --- bit packing --------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("runs, cols", [(1, 1), (3, 7), (5, 13)])
def test_pack_unpack_bit_exact(bits, runs, cols):
    gen = torch.Generator().manual_seed(bits * 100 + cols)
    values = torch.randint(0, 2**bits, (RUN[bits] * runs, cols), generator=gen, dtype=torch.uint8)
    words = pack_rows(values, bits)
    assert words.dtype == torch.int32 and words.shape == (RUN[bits] * runs * bits // 32, cols)
    assert torch.equal(unpack_rows(words, bits), values)
    assert np.array_equal(_np_unpack_rows(words.numpy(), bits), values.numpy())
    cols_words = pack_cols(values.T.contiguous(), bits)
    assert cols_words.is_contiguous() and torch.equal(cols_words, words.T)
    assert torch.equal(unpack_cols(cols_words, bits), values.T)


def test_hand_computed_words():
    assert _words(pack_rows(torch.arange(8).reshape(8, 1), 4)).tolist() == [[0x76543210]]
    assert _words(pack_rows(torch.tensor([[1], [2], [3], [0]] * 4), 2)).tolist() == [[0x39393939]]
    assert _words(pack_rows(torch.tensor([[0x12], [0x34], [0x56], [0xF8]]), 8)).tolist() == [[0xF8563412]]
    # 3-bit: v10 = 0b101 straddles word 0 (bits 30-31 hold 0b01) and word 1 (bit 0 holds 0b1).
    v = torch.zeros(32, 1, dtype=torch.int64)
    v[10] = 0b101
    assert _words(pack_rows(v, 3)).ravel().tolist() == [0x40000000, 0x00000001, 0x00000000]
    v[:] = 7
    assert _words(pack_rows(v, 3)).ravel().tolist() == [0xFFFFFFFF] * 3


def test_fields_are_masked():
    # A value of -1 (what a v1 zero of 0 would be) becomes one all-ones field, leaving its neighbours.
    z = torch.tensor([[-1, 0, 5, 0, 0, 0, 0, 0]])
    assert _words(pack_cols(z, 4)).tolist() == [[0x0000050F]]
    z3 = torch.zeros(1, 32, dtype=torch.int64)
    z3[0, 10] = -1
    assert _words(pack_cols(z3, 3)).ravel().tolist() == [0xC0000000, 0x00000001, 0x00000000]


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_rows(torch.zeros(12, 2), 4)
    with pytest.raises(ValueError, match="bits must be one of"):
        pack_rows(torch.zeros(8, 2), 5)
    with pytest.raises(ValueError, match="int32"):
        unpack_rows(torch.zeros(3, 2, dtype=torch.int64), 3)


# --- QuantizedTensor <-> GPTQ tensors -------------------------------------------------------------

def test_sym_v1_qzeros_word():
    qt = rtn_quantize(torch.randn(16, 64, generator=torch.Generator().manual_seed(0)), QuantConfig(4, 32, True))
    tensors = gptq_tensors(qt, PREFIX)
    assert (_words(tensors[f"{PREFIX}.qzeros"]) == 0x77777777).all()
    qt8 = rtn_quantize(torch.randn(8, 64), QuantConfig(8, 64, True))
    assert (_words(gptq_tensors(qt8, PREFIX)[f"{PREFIX}.qzeros"]) == 0x7F7F7F7F).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_rtn_round_trip_and_reference_dequant(bits, group_size, sym):
    gen = torch.Generator().manual_seed(bits * 1000 + group_size)
    w = torch.randn(64, 576, generator=gen)  # K = 576: a ragged last group at g128
    w[0] = w[0].abs()   # all positive: asym zero 0 on the full grid, 1 on v1's
    w[1] = -w[1].abs()  # all negative: asym zero maxq
    config = storable_grid(QuantConfig(bits, group_size, sym), "gptq")
    qt = rtn_quantize(w, config)
    if not sym:
        assert (qt.zeros[:, 0] == 1).all() and (qt.zeros[:, 1] == config.maxq).all()
        assert (qt.zeros >= 1).all()
        # the widened grid still covers row 0: no weight is clipped, each is within half a step
        step = qt.scales[qt.g_idx.long(), 0].float()
        assert ((qt.dequantize()[0] - w[0]).abs() <= step / 2 + 1e-6).all()
    tensors = gptq_tensors(qt, PREFIX)
    groups = config.num_groups(576)
    expected = {
        "qweight": (torch.int32, (576 * bits // 32, 64)),
        "qzeros": (torch.int32, (groups, 64 * bits // 32)),
        "scales": (torch.float16, (groups, 64)),
        "g_idx": (torch.int32, (576,)),
    }
    assert set(tensors) == {f"{PREFIX}.{name}" for name in expected}
    for name, (dtype, shape) in expected.items():
        tensor = tensors[f"{PREFIX}.{name}"]
        assert tensor.dtype == dtype and tuple(tensor.shape) == shape and tensor.is_contiguous(), name
    back = read_gptq_tensors(tensors, PREFIX, config)
    _assert_same_record(qt, back)
    reference = _np_reference_dequant(tensors, bits)
    assert np.array_equal(reference, back.dequantize().numpy())
    assert np.array_equal(reference, qt.dequantize().numpy())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_random_record_with_act_order_g_idx_round_trips(bits):
    config = QuantConfig(bits, 32, False, min_zero=1)
    g_idx = default_g_idx(96, 32)[torch.randperm(96, generator=torch.Generator().manual_seed(bits))]
    qt = random_record(config, n=32, k=96, seed=bits, g_idx=g_idx)
    tensors = gptq_tensors(qt, "")
    assert set(tensors) == {"qweight", "qzeros", "scales", "g_idx"}
    back = read_gptq_tensors(tensors, "", config)
    _assert_same_record(qt, back)
    assert np.array_equal(_np_reference_dequant(tensors, bits, prefix=""), qt.dequantize().numpy())


def test_unpackable_shapes_rejected():
    qt = random_record(QuantConfig(3, 32, True), n=40, k=64, seed=0)
    with pytest.raises(ValueError, match=f"{PREFIX}: out_features N = 40 is not a multiple of 32"):
        gptq_tensors(qt, PREFIX)
    qt = random_record(QuantConfig(4, -1, True), n=8, k=36, seed=0)
    with pytest.raises(ValueError, match="in_features K = 36 is not a multiple of 8"):
        gptq_tensors(qt, PREFIX)
    with pytest.raises(ValueError, match="trailing dot"):
        gptq_tensors(random_record(QuantConfig(4, 32, True), 8, 64, 0), PREFIX + ".")


def _valid_tensors():
    config = QuantConfig(4, 32, True)
    return config, gptq_tensors(random_record(config, n=16, k=64, seed=1), PREFIX)


@pytest.mark.parametrize("name, corrupt, error, message", [
    ("qweight", None, KeyError, "qweight' is missing"),
    ("qzeros", None, KeyError, "qzeros' is missing"),
    ("scales", lambda t: t.float(), ValueError, "scales' must be torch.float16"),
    ("scales", lambda t: t[:1], ValueError, r"scales' must have shape \(2, 16\)"),
    ("qzeros", lambda t: t[:, :1], ValueError, r"qzeros' must have shape \(2, 2\)"),
    ("g_idx", lambda t: t.long(), ValueError, "g_idx' must be torch.int32"),
    ("g_idx", lambda t: t[:-1], ValueError, r"g_idx' must have shape \(64,\)"),
    ("qweight", lambda t: t[:, :12], ValueError, "out_features 12 is not a multiple of 8"),
])
def test_read_validates_each_tensor(name, corrupt, error, message):
    config, tensors = _valid_tensors()
    key = f"{PREFIX}.{name}"
    if corrupt is None:
        del tensors[key]
    else:
        tensors[key] = corrupt(tensors[key])
    with pytest.raises(error, match=message):
        read_gptq_tensors(tensors, PREFIX, config)


def test_read_with_wrong_bits_fails_clearly():
    _, tensors = _valid_tensors()  # 4-bit: qweight has 8 rows
    with pytest.raises(ValueError, match=r"qzeros' must have shape"):
        read_gptq_tensors(tensors, PREFIX, QuantConfig(8, 32, True))


# --- quantization_config ------------------------------------------------------------------------

def test_quantization_config_contents_and_parse():
    d = quantization_config(QuantConfig(4, 128, True), damp_percent=0.01, quantizer="quantkit:test")
    assert d == {
        "bits": 4, "group_size": 128, "desc_act": False, "sym": True, "lm_head": False,
        "quant_method": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32",
        "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
        "meta": {"quantizer": ["quantkit:test"]},
    }
    assert json.loads(json.dumps(d)) == d
    assert parse_quantization_config(d) == (QuantConfig(4, 128, True), False)
    rtn = quantization_config(QuantConfig(3, -1, False), desc_act=True)
    assert "damp_percent" not in rtn and rtn["meta"]["quantizer"] == ["quantkit:0.1.0"]
    assert parse_quantization_config(rtn) == (QuantConfig(3, -1, False, min_zero=1), True)
    v2 = quantization_config(QuantConfig(4, 32, False), checkpoint_format="gptq_v2")
    assert v2["checkpoint_format"] == "gptq_v2"
    assert parse_quantization_config(v2) == (QuantConfig(4, 32, False), False)


def test_v1_refuses_a_zero_point_of_zero():
    record = random_record(QuantConfig(4, 32, False), n=16, k=64, seed=3)
    record.zeros[1, 5] = 0
    with pytest.raises(ValueError, match=f"{PREFIX}: a zero point of 0 cannot be stored in checkpoint_format 'gptq'"):
        gptq_tensors(record, PREFIX)
    back = read_gptq_tensors(gptq_tensors(record, PREFIX, "gptq_v2"), PREFIX, record.config, "gptq_v2")
    _assert_same_record(record, back)  # v2 stores the full grid [0, maxq]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_v1_reader_refuses_an_all_ones_zero_field_as_ambiguous(bits):
    config = QuantConfig(bits, 32, False, min_zero=1)
    tensors = gptq_tensors(random_record(config, n=32, k=64, seed=bits), PREFIX)
    assert (unpack_cols(tensors[f"{PREFIX}.qzeros"], bits) < 2**bits - 1).all()  # v1 never writes one
    zeros = unpack_cols(tensors[f"{PREFIX}.qzeros"], bits).to(torch.int64)
    zeros[1, 7] = 2**bits - 1  # what a zero of 0 looks like in a v1 file another tool wrote
    tensors[f"{PREFIX}.qzeros"] = pack_cols(zeros, bits)
    with pytest.raises(ValueError, match=r"qzeros'.*1 group\(s\) store a zero field of all ones.*ambiguous"):
        read_gptq_tensors(tensors, PREFIX, config)


def test_storable_grid():
    assert storable_grid(QuantConfig(4, 128, False), "gptq") == QuantConfig(4, 128, False, min_zero=1)
    assert storable_grid(QuantConfig(4, 128, False), "gptq_v2") == QuantConfig(4, 128, False)
    assert storable_grid(QuantConfig(4, 128, True), "gptq") == QuantConfig(4, 128, True)


def test_parse_accepts_old_autogptq_file():
    old = {"bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": False, "static_groups": False,
           "sym": True, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": None}
    assert parse_quantization_config(old) == (QuantConfig(4, 128, True), False)


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"is_marlin_format": True}, "Marlin"),
    ({"pack_dtype": "int16"}, "pack_dtype 'int16'"),
    ({"lm_head": True}, "lm_head"),
    ({"dynamic": {"-:.*down_proj": {}}}, "dynamic"),
    ({"bits": 5}, "bits must be one of"),
    ({"group_size": 100}, "group_size must be one of"),
    ({"desc_act": "no"}, "desc_act must be a bool"),
])
def test_parse_rejects_unsupported(change, message):
    d = {**quantization_config(QuantConfig(4, 128, True)), **change}
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(d)


def test_parse_names_missing_keys():
    d = quantization_config(QuantConfig(4, 128, True))
    del d["sym"], d["desc_act"]
    with pytest.raises(ValueError, match="sym, desc_act"):
        parse_quantization_config(d)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bytewise_packing_equals_the_word_by_word_layout(bits):
    """2/4/8-bit packing by bytes and a view is the word-by-word packing, negative (v1 zero -1) values included."""
    from quantkit.formats.gptq import _pack_rows_wordwise, pack_rows, unpack_rows

    generator = torch.Generator().manual_seed(bits)
    values = torch.randint(-1, 2**bits, (64, 24), generator=generator)
    packed = pack_rows(values, bits)
    assert packed.dtype == torch.int32 and torch.equal(packed, _pack_rows_wordwise(values, bits))
    assert torch.equal(unpack_rows(packed, bits), (values & (2**bits - 1)).to(torch.uint8))
