import pytest
import torch

from quantkit.quant import QuantConfig, fake_quantize, find_group_params, group_slices, rtn_quantize


def _gaussian(n=128, k=576, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def _mse(weight, config):
    return torch.mean((rtn_quantize(weight, config).dequantize() - weight) ** 2).item()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [-1, 128])
def test_error_within_half_step_inside_clamp_range(bits, sym, group_size):
    w = _gaussian()
    qt = rtn_quantize(w, QuantConfig(bits, group_size, sym))
    g = qt.g_idx.long()
    scale = qt.scales[g].T.float()
    zero = qt.zeros[g].T.float()
    position = w / scale + zero  # where each weight falls on the integer grid before clamping
    inside = (position >= -0.5) & (position <= qt.config.maxq + 0.5)
    assert inside.float().mean().item() > 0.99  # only a group's extreme positive value may clip (sym)
    error = (qt.dequantize() - w).abs()
    assert bool((error[inside] <= scale[inside] * (0.5 + 1e-6)).all())


def test_ragged_groups_k576_g128():
    qt = rtn_quantize(_gaussian(), QuantConfig(4, 128, True))
    assert qt.scales.shape == (5, 128) and qt.zeros.shape == (5, 128)
    last = _gaussian()[:, 512:]
    params = find_group_params(last, qt.config)
    assert torch.equal(qt.scales[4], params.scale.half())
    assert torch.equal(qt.dequantize()[:, 512:], fake_quantize(last, params, 15))


def test_dequantize_reproduces_fake_quant_bit_for_bit():
    w = _gaussian(seed=4)
    cfg = QuantConfig(3, 64, False)
    fake = torch.cat(
        [fake_quantize(w[:, cols], find_group_params(w[:, cols], cfg), cfg.maxq) for cols in group_slices(576, 64)],
        dim=1,
    )
    assert torch.equal(rtn_quantize(w, cfg).dequantize(), fake)


def test_error_decreases_with_bits():
    w = _gaussian(256, 512, seed=1)
    errors = [_mse(w, QuantConfig(bits, 128, True)) for bits in (8, 4, 3, 2)]
    assert errors == sorted(errors) and len(set(errors)) == 4
    assert errors[0] < 1e-3 * errors[-1]  # ~(3/255)^2: step ratio of 8-bit to 2-bit, squared


def test_asym_beats_sym_on_skewed_weights():
    w = _gaussian(256, 512, seed=2) * 0.5 + 1.5  # mostly positive
    sym, asym = _mse(w, QuantConfig(4, 128, True)), _mse(w, QuantConfig(4, 128, False))
    assert asym < 0.5 * sym


def test_deterministic_and_float32_math_for_any_dtype():
    w = _gaussian(seed=3).to(torch.bfloat16)
    cfg = QuantConfig(4, 32, False)
    first, second, upcast = rtn_quantize(w, cfg), rtn_quantize(w, cfg), rtn_quantize(w.float(), cfg)
    for field in ("codes", "scales", "zeros", "g_idx"):
        assert torch.equal(getattr(first, field), getattr(second, field))
        assert torch.equal(getattr(first, field), getattr(upcast, field))


def test_rejects_nan_and_bad_shape():
    w = _gaussian()
    w[3, 300] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        rtn_quantize(w, QuantConfig(4, 128, True))
    with pytest.raises(ValueError, match=r"shape \(576,\)"):
        rtn_quantize(torch.randn(576), QuantConfig(4, 128, True))
