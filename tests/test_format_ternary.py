"""The ternary bit-plane format and BitCPM4's absmean grid: bit-exact round trips, the plane layout
against an element-by-element reference, the grid against BitCPM-CANN's formula, clear refusals,
and the runtime's ternary kernel against float64."""
import numpy as np
import pytest
import torch

from quantkit.formats.ternary import (
    pack_planes,
    parse_quantization_config,
    quantization_config,
    read_ternary_tensors,
    ternary_tensors,
    unpack_planes,
)
from quantkit.quant import QuantConfig, QuantizedTensor, rtn_quantize, search_group_params
from quantkit.recipe import RecipeError, load_recipe

from helpers import built_cpu_ops

PREFIX = "model.layers.0.mlp.down_proj"
TERNARY_G32 = QuantConfig(2, 32, sym=False, ternary=True)


def _trits(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(-1, 2, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


def _reference_planes(trits: np.ndarray) -> np.ndarray:
    """Word w of a row: bit j set when channel 16w + j is +1, bit 16 + j when it is -1 (uint32)."""
    rows, cols = trits.shape
    words = np.zeros((rows, cols // 16), dtype=np.uint32)
    for r in range(rows):
        for c in range(cols):
            if trits[r, c] == 1:
                words[r, c // 16] |= np.uint32(1) << np.uint32(c % 16)
            elif trits[r, c] == -1:
                words[r, c // 16] |= np.uint32(1) << np.uint32(16 + c % 16)
    return words


def test_planes_match_the_documented_layout_and_unpack_exactly():
    trits = _trits(5, 64)
    packed = pack_planes(trits)
    assert packed.dtype == torch.int32 and packed.shape == (5, 4)
    assert np.array_equal(packed.numpy().view(np.uint32), _reference_planes(trits.numpy()))
    assert (packed < 0).any()  # bit 31 (channel 15 at -1) wraps to a negative int32 and back
    assert torch.equal(unpack_planes(packed), trits)


def test_absmean_grid_is_bitcpm_quantizer():
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(1))
    record = rtn_quantize(w, TERNARY_G32)
    groups = w.reshape(24, 3, 32)
    scale = groups.abs().mean(-1, keepdim=True).half().float()  # stored as float16
    want = (groups / scale).round().clamp(-1, 1) * scale
    assert torch.equal(record.dequantize(), want.reshape(24, 96))
    assert int(record.codes.max()) == 2 and bool((record.zeros == 1).all())
    with pytest.raises(ValueError, match="no range to clip"):
        search_group_params(w[:, :32], TERNARY_G32)


@pytest.mark.parametrize("shape,group_size", [((24, 96), 32), ((40, 320), 128), ((16, 64), -1)])
def test_write_then_read_is_bit_exact(shape, group_size):
    config = QuantConfig(2, group_size, sym=False, ternary=True)
    record = rtn_quantize(torch.randn(*shape, generator=torch.Generator().manual_seed(2)), config)
    tensors = ternary_tensors(record, PREFIX)
    assert tensors[f"{PREFIX}.scales"].shape == (shape[0], config.num_groups(shape[1]))
    back = read_ternary_tensors(tensors, PREFIX, config, shape[1], shape[0])
    for part in ("codes", "scales", "zeros", "g_idx"):
        assert torch.equal(getattr(back, part), getattr(record, part)), part
    assert parse_quantization_config(quantization_config(config)) == config


def test_refusals_name_the_problem():
    record = rtn_quantize(torch.randn(16, 64), TERNARY_G32)
    tensors = ternary_tensors(record, PREFIX)
    with pytest.raises(ValueError, match="a ternary grid"):
        ternary_tensors(rtn_quantize(torch.randn(16, 64), QuantConfig(2, 32, False)), PREFIX)
    with pytest.raises(ValueError, match="K % 16"):
        read_ternary_tensors(tensors, PREFIX, TERNARY_G32, 72, 16)
    shuffled = QuantizedTensor(record.codes, record.scales, record.zeros, record.g_idx.flip(0), TERNARY_G32)
    with pytest.raises(ValueError, match="act-order"):
        ternary_tensors(shuffled, PREFIX)
    with pytest.raises(KeyError, match="scales"):
        read_ternary_tensors({f"{PREFIX}.qweight": tensors[f"{PREFIX}.qweight"]}, PREFIX, TERNARY_G32, 64, 16)
    corrupt = dict(tensors)
    corrupt[f"{PREFIX}.qweight"] = tensors[f"{PREFIX}.qweight"] | 0x00010001  # channel 0 both +1 and -1
    with pytest.raises(ValueError, match="corrupt"):
        read_ternary_tensors(corrupt, PREFIX, TERNARY_G32, 64, 16)
    with pytest.raises(ValueError, match="bits=2 and sym=False"):
        QuantConfig(2, 32, sym=True, ternary=True)
    with pytest.raises(RecipeError, match="clip"):
        load_recipe("rtn-ternary-g32", {"algorithm": "gptq", "gptq.clip_search": True})


# Every group size the runtime meets, K not a multiple of the group (576, 320, 480 and 80 end in a
# short group) and N not a multiple of the kernel's 4 or 2 output rows per block (the tail path).
@pytest.mark.parametrize("n,k,group_size", [(4096, 4096, 32), (13, 80, 32), (45, 480, 64), (66, 576, 128),
                                            (97, 320, 128), (31, 64, -1)])
def test_ternary_kernel_matches_float64(n, k, group_size):
    from quantkit.kernels.linear.ternary import TernaryLinear

    ops = built_cpu_ops()
    g = torch.Generator().manual_seed(n)
    record = rtn_quantize(torch.randn(n, k, generator=g), QuantConfig(2, group_size, False, ternary=True))
    module = TernaryLinear.from_record(record)
    weight = record.dequantize(torch.float64)
    for rows in (1, 2, 3, 4):  # every ROWS instantiation
        x = torch.randn(rows, k, generator=g)
        want = x.double() @ weight.T
        got = ops.ternary_gemv(x, module.planes, module.scales, group_size).double()
        assert ((got - want).abs().max() / want.abs().max()) < 1e-5  # float32 sums of exact ±x terms
        assert torch.allclose(module(x).double(), got)  # the module's decode rows use the kernel
    prefill = torch.randn(16, k, generator=g)
    assert torch.allclose(module(prefill).double(), prefill.double() @ weight.T, rtol=1e-4, atol=1e-4)
