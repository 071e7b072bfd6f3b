"""AWQ: the output-error clipping search never loses to RTN and finds the exhaustive optimum's error;
smoothing + clipping beats RTN on every scaling group; the pipeline writes AutoAWQ GEMM checkpoints
(and Marlin ones when symmetric) that read back as the algorithm's result."""
from __future__ import annotations

import json

import pytest
import torch

from quantkit.algorithms.awq import awq_quantize
from quantkit.algorithms.smooth import search_scale
from quantkit.atomic import staging_dir
from quantkit.engine import quantize
from quantkit.loading import load_model
from quantkit.models.layers import LINEARS
from quantkit.quant import CLIP_STEPS, QuantConfig, fake_quantize, find_group_params, rtn_quantize, search_group_params
from quantkit.stats import InputStats

from helpers import small_recipe

CONFIG = QuantConfig(4, 64, False)


def _inputs(tokens=512, features=256, seed=0) -> torch.Tensor:
    """Correlated activations with 8 channels 20x larger, the case AWQ is for."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, features, generator=g) @ (torch.eye(features) + torch.randn(features, features, generator=g)
                                                      / features**0.5)
    x[:, :8] *= 20
    return x


def _stats(x: torch.Tensor) -> InputStats:
    stats = InputStats(x.shape[1])
    stats.add(x[None])
    return stats


def _weight(rows=96, features=256, seed=1) -> torch.Tensor:
    return torch.randn(rows, features, generator=torch.Generator().manual_seed(seed)) * 0.02


def _output_error(weight, approx, x) -> torch.Tensor:
    """‖(Ŵ − W) xᵀ‖² per output row, float64, from the raw inputs."""
    return ((x.double() @ (approx - weight).double().T) ** 2).sum(dim=0)


def test_clip_search_minimises_the_hessian_error_of_each_row():
    x, w = _inputs(features=64), _weight(features=64)
    h = _stats(x).hessian

    def error(params):
        delta = fake_quantize(w, params, CONFIG.maxq) - w
        return ((delta.double() @ h.double()) * delta.double()).sum(dim=1)

    chosen = error(search_group_params(w, CONFIG, h))
    extremes = torch.stack([w.amin(dim=1), w.amax(dim=1)], dim=1)
    exhaustive = torch.stack([error(find_group_params((1 - step / 100) * extremes, CONFIG))
                              for step in range(CLIP_STEPS)]).amin(dim=0)
    rtn = error(find_group_params(w, CONFIG))
    assert bool((chosen <= rtn * (1 + 1e-6)).all())
    # Coarse-to-fine can miss a row's optimum (by up to 41 % here), but in total it stays within
    # 0.4-1.3 % of the exhaustive search (measured, three seeds) at 30 % of the cost.
    assert chosen.sum() <= 1.02 * exhaustive.sum()
    assert chosen.sum() < 0.6 * rtn.sum()  # measured 0.53x


def test_awq_output_error_is_below_rtn_for_every_row_and_group():
    x, w = _inputs(), _weight()
    awq = awq_quantize(w, _stats(x).hessian, CONFIG).dequantize()
    rtn = rtn_quantize(w, CONFIG).dequantize()
    for columns in (slice(0, 64), slice(64, 128), slice(128, 192), slice(192, 256)):
        a, r = _output_error(w[:, columns], awq[:, columns], x[:, columns]), _output_error(
            w[:, columns], rtn[:, columns], x[:, columns])
        assert bool((a <= r * (1 + 1e-5)).all())
    assert _output_error(w, awq, x).sum() < 0.7 * _output_error(w, rtn, x).sum()  # measured 0.55x


def test_smoothing_then_clipping_beats_rtn_on_a_scaling_group():
    """Two linears sharing one input (a gate/up pair): AWQ's error in the original space."""
    x, weights = _inputs(), [_weight(seed=2), _weight(seed=3)]
    stats = _stats(x)
    search = search_scale(weights, stats, CONFIG)
    scaled_h = stats.hessian / search.scale[:, None] / search.scale[None, :]  # inputs x / s
    awq = sum(_output_error(w, awq_quantize(w * search.scale, scaled_h, CONFIG).dequantize() / search.scale, x).sum()
              for w in weights)
    rtn = sum(_output_error(w, rtn_quantize(w, CONFIG).dequantize(), x).sum() for w in weights)
    smoothed_rtn = sum(_output_error(w, rtn_quantize(w * search.scale, CONFIG).dequantize() / search.scale, x).sum()
                       for w in weights)
    # measured: smoothing alone 0.49x RTN's error, smoothing then clipping 0.45x
    assert search.alpha > 0 and awq < smoothed_rtn < 0.6 * rtn


def test_awq_recipe_error_is_below_rtn_for_every_linear(marlin_legal, tmp_path):
    recipe = small_recipe("awq-w4g128", tmp_path)
    awq = quantize(marlin_legal, recipe, tmp_path / "a", progress=False)
    rtn = quantize(marlin_legal, small_recipe("rtn-w4g128", tmp_path, quant={"sym": False}), tmp_path / "r",
                   progress=False)
    for a, r in zip(awq.layers, rtn.layers):
        for name in LINEARS:
            assert a.errors[name] < r.errors[name], (a.index, name, a.errors[name], r.errors[name])
    config = json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]
    assert {k: config[k] for k in ("quant_method", "version", "zero_point")} == {
        "quant_method": "awq", "version": "gemm", "zero_point": True}


@pytest.mark.parametrize("fmt, sym", [("awq", False), ("awq", True), ("marlin", True)])
def test_awq_artifacts_read_back_as_the_gptq_format_result(marlin_legal, tmp_path, fmt, sym):
    packed = quantize(marlin_legal, small_recipe("awq-w4g128", tmp_path, format=fmt, quant={"sym": sym}),
                      tmp_path / "p", progress=False)
    reference = quantize(marlin_legal, small_recipe("awq-w4g128", tmp_path, format="gptq", quant={"sym": sym}),
                         tmp_path / "g", progress=False)
    assert [r.errors for r in packed.layers] == [r.errors for r in reference.layers]
    a, b = load_model(tmp_path / "p").state_dict(), load_model(tmp_path / "g").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unpackable_model_is_refused_before_any_work(tiny_checkpoint_factory, tmp_path):
    model = tiny_checkpoint_factory(num_hidden_layers=1, hidden_size=192, num_attention_heads=12)
    out = tmp_path / "a"
    with pytest.raises(ValueError, match="K a whole number of groups.*quant.group_size=64"):
        quantize(model, small_recipe("awq-w4g128", tmp_path), out, progress=False)
    assert not out.exists() and not staging_dir(out).exists()
