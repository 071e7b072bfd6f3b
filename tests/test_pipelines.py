"""Every built-in GPTQ-family recipe end to end on tiny random checkpoints: error below RTN,
prefix-aware statistics, smoothing, Marlin/CPM.cu packing read back exactly, refusals up front."""
import json

import pytest
import torch

from quantkit.atomic import staging_dir
from quantkit.engine import quantize
from quantkit.loading import load_model
from quantkit.models.layers import DOWN, LINEARS

from helpers import small_recipe


def _errors(out):
    return {(e["layer"], name): err for e in json.loads((out / "quantkit.json").read_text())["layer_errors"]
            for name, err in e["errors"].items()}


def test_gptq_error_is_below_rtn_for_every_linear(marlin_legal, tmp_path):
    for bits in (3, 4):
        rtn = quantize(marlin_legal, small_recipe("rtn-w4g128", tmp_path, quant={"bits": bits}), tmp_path / f"r{bits}",
                       progress=False)
        gptq = quantize(marlin_legal, small_recipe("gptq-w4g128", tmp_path, quant={"bits": bits}),
                        tmp_path / f"g{bits}", progress=False)
        for r, g in zip(rtn.layers, gptq.layers):
            for name in LINEARS:
                assert g.errors[name] < r.errors[name], (bits, r.index, name, g.errors[name], r.errors[name])


def test_smoothing_changes_weights_but_not_the_unquantized_function(marlin_legal, tmp_path):
    recipe = small_recipe("s-p-gptq-w4g128", tmp_path, quant={"bits": 8})
    out = tmp_path / "s"
    quantize(marlin_legal, recipe, out, progress=False)
    manifest = json.loads((out / "quantkit.json").read_text())
    alphas = [a for e in manifest["layer_errors"] for a in e["smoothing_alpha"].values()]
    assert len(alphas) == 2 * 3 and any(a > 0 for a in alphas)  # GQA: the v->o group does not apply
    # At 8 bits the quantized model must still track the original closely: smoothing was exact.
    ids = torch.arange(3, 60)[None]
    with torch.no_grad():
        ref, got = load_model(marlin_legal)(ids).logits, load_model(out)(ids).logits
    assert (ref - got).abs().max() < 0.02 * ref.abs().max()


@pytest.mark.parametrize("recipe_name, weights_file", [("marlin", "model.safetensors.index.json"),
                                                       ("cpmcu", "model_gptq.safetensors")])
def test_marlin_family_artifacts_read_back_as_the_gptq_result(marlin_legal, tmp_path, recipe_name, weights_file):
    marlin = quantize(marlin_legal, small_recipe(recipe_name, tmp_path), tmp_path / "m", progress=False)
    reference = quantize(marlin_legal, small_recipe(recipe_name, tmp_path, format="gptq"), tmp_path / "g",
                         progress=False)
    assert (tmp_path / "m" / weights_file).is_file()
    assert [r.errors for r in marlin.layers] == [r.errors for r in reference.layers]
    a, b = load_model(tmp_path / "m").state_dict(), load_model(tmp_path / "g").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_marlin_refuses_illegal_shapes_before_any_work(tmp_path):
    from quantkit.synthetic import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "tiny", num_hidden_layers=1)  # k/v_proj have N = 16
    out = tmp_path / "m"
    with pytest.raises(ValueError, match=r"N % 64 == 0"):
        quantize(model, small_recipe("marlin", tmp_path), out, progress=False)
    assert not out.exists() and not staging_dir(out).exists()


def test_prefix_tokens_change_the_result(marlin_legal, tmp_path):
    plain = quantize(marlin_legal, small_recipe("gptq-w4g128", tmp_path), tmp_path / "g", progress=False)
    prefix = quantize(marlin_legal, small_recipe("p-gptq-w4g128", tmp_path), tmp_path / "p", progress=False)
    assert plain.layers[0].errors != prefix.layers[0].errors
    # The cut on down_proj only: every other linear of the first layer sees what plain GPTQ saw.
    scoped = quantize(marlin_legal, small_recipe("gptq-w4g128", tmp_path, prefix_tokens=4, prefix_linears=[DOWN]),
                      tmp_path / "d", progress=False)
    errors = scoped.layers[0].errors
    assert errors[DOWN] != plain.layers[0].errors[DOWN]
    assert {n: e for n, e in errors.items() if n != DOWN} == {n: e for n, e in plain.layers[0].errors.items()
                                                             if n != DOWN}
