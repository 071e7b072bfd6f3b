"""Distilled scales and biases (DWQ, `quantkit qat dwq`, recipe mlx-dwq-w4g64) on tiny random MiniCPMs: the
codes stay, only scales and biases train, zero steps are RTN, the KL to the FP model falls, --init keeps an
artifact's codes, resumption, refusals, and mlx-lm reading the result."""
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from test_qat import STEP_TOKENS, overrides

from quantkit import calib
from quantkit.cli import main
from quantkit.engine import quantize
from quantkit.eval.kld import kl_divergence
from quantkit.eval.ppl import perplexity
from quantkit.formats.mlx import mlx_grid
from quantkit.loading import load_model
from quantkit.qat import run_qat
from quantkit.qat.trainer import CHECKPOINT_DIR, train
from quantkit.qat.write import write_outputs
from quantkit.reader import ArtifactReader
from quantkit.recipe import RecipeError, load_recipe
from quantkit.run import RunError
from quantkit.tokenizer import load_tokenizer
from quantkit.training import state
from quantkit.training.fake_quant import AffineLinear, grid_weight, quantized_record

from helpers import small_recipe

pytestmark = pytest.mark.usefixtures("private_cache")

STEPS = 12
# The tiny model's vocabulary is 384 tokens: a top-k of all of them makes the distillation loss the full KL.
DWQ_SETTINGS = {"qat.learning_rate": 1e-4, "qat.top_k": 384}
CONFIG_FILES = ("config.json", "config.5.0.0.json", "quantize_config.json")


@pytest.fixture(scope="module")
def model(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(same_rope_factors=True, seed=3)  # as tests/test_format_mlx.py: mlx-lm reads it


def dwq_settings(training_text, **settings) -> dict:
    return overrides(training_text, **{**DWQ_SETTINGS, **settings})


def dwq_recipe(training_text, **settings):
    return load_recipe("mlx-dwq-w4g64", dwq_settings(training_text, **settings))


def _tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("model*.safetensors")):
        tensors |= load_file(path)
    return tensors


def _records(directory) -> dict:
    reader = ArtifactReader(directory)
    return {name: record for index in range(reader.num_layers) for name, record in reader.layer(index)[1].items()}


@pytest.fixture(scope="module")
def rtn(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("rtn") / "rtn"
    quantize(model, load_recipe("mlx-rtn-w4g64", {"calibration.n_samples": 2, "calibration.seq_len": 32}), out,
             progress=False)
    return out


@pytest.fixture(scope="module")
def uninterrupted(model, training_text, tmp_path_factory):
    """A short DWQ run, through the command line."""
    out = tmp_path_factory.mktemp("dwq-run") / "out"
    sets = [arg for key, value in dwq_settings(training_text).items() for arg in ("--set", f"{key}={value}")]
    result = CliRunner().invoke(main, ["qat", "dwq", "--model", str(model), "--out", str(out), "--tokens",
                                       str(STEPS * STEP_TOKENS), "--no-progress", "--json", *sets])
    assert result.exit_code == 0, result.output
    return out, json.loads(result.output)


# --- the module ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_training_grid_on_mlx_is_rtns_grid_bit_for_bit(dtype):
    """QAT of weights on MLX's grid rounds as RTN (mx.quantize) does: codes from the float32 grid."""
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(2)) * 0.02
    config = mlx_grid({"bits": 4, "group_size": 64, "sym": False}, dtype)
    assert torch.equal(grid_weight(weight, config), quantized_record(weight, config).dequantize())


def test_forward_weight_is_exactly_the_written_record():
    """The forward rounds the fp32 scales and biases to the stored dtype: it computes what is written."""
    linear = torch.nn.Linear(128, 16, bias=False)
    config = mlx_grid({"bits": 4, "group_size": 64, "sym": False}, torch.bfloat16)
    module = AffineLinear(linear, config)
    with torch.no_grad():
        module.scales.mul_(1 + 1e-3 * torch.randn_like(module.scales))
        module.biases.add_(1e-5)
    assert not torch.equal(module.scales, module.scales.to(torch.bfloat16).float())  # not on bf16 values
    assert torch.equal(module.weight(), module.record().dequantize())
    x = torch.randn(3, 128)
    module(x).sum().backward()
    assert module.scales.grad is not None and module.biases.grad is not None and linear.weight.grad is None


# --- runs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_steps_write_exactly_the_rtn_recipe(tiny_checkpoint_factory, training_text, tmp_path, dtype):
    source = tiny_checkpoint_factory(same_rope_factors=True, seed=3, dtype=dtype)
    reference = tmp_path / "rtn"
    quantize(source, load_recipe("mlx-rtn-w4g64", {"calibration.n_samples": 2, "calibration.seq_len": 32}),
             reference, progress=False)
    settings = dwq_recipe(training_text)
    trained = train(source, settings, tmp_path / "dwq", perplexity=perplexity, tokens=STEP_TOKENS,
                    stop_after_steps=0, progress=False)
    write_outputs(trained, source, settings)
    ours, theirs = _tensors(tmp_path / "dwq"), _tensors(reference)
    assert sorted(ours) == sorted(theirs) and "lm_head.scales" in ours
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name].view(torch.uint8),
                                                                 tensor.view(torch.uint8)), name
    for name in CONFIG_FILES:
        assert (tmp_path / "dwq" / name).read_text() == (reference / name).read_text(), name


def test_only_scales_and_biases_change(uninterrupted, rtn):
    out, report = uninterrupted
    assert report["steps"] == STEPS
    trained, start = _records(out), _records(rtn)
    assert sorted(trained) == sorted(start) and len(trained) == 14
    assert all(torch.equal(trained[name].codes, record.codes) for name, record in start.items())
    changed = [name for name, record in start.items() if not torch.equal(trained[name].scales, record.scales)]
    assert len(changed) == len(start)  # every linear's scales moved
    ours, theirs = _tensors(out), _tensors(rtn)
    outside = [name for name in theirs if not name.startswith("model.layers.")]
    assert all(torch.equal(ours[name], theirs[name]) for name in outside)  # embedding, LM head, final norm
    norms = [name for name in theirs if "layernorm" in name]
    assert norms and all(torch.equal(ours[name], theirs[name]) for name in norms)


def test_kl_to_the_fp_model_falls_on_held_out_text(uninterrupted, rtn, model):
    fp = load_model(model)
    tokens = calib.heldout_tokens(load_tokenizer(model), "austen", max_tokens=1024)
    before = kl_divergence(load_model(rtn), fp, tokens, window=256).mean_kl
    after = kl_divergence(load_model(uninterrupted[0]), fp, tokens, window=256).mean_kl
    assert after < 0.85 * before, (before, after)  # measured: 0.00144 -> 0.00102


def test_resumed_run_ends_with_the_uninterrupted_bytes(model, training_text, uninterrupted, tmp_path):
    out = tmp_path / "out"
    settings = dwq_recipe(training_text)
    train(model, settings, out, perplexity=perplexity, tokens=STEPS * STEP_TOKENS, stop_after_steps=7,
          progress=False)
    assert state.record(out.with_name("out.partial") / CHECKPOINT_DIR)["step"] == 7
    report = run_qat(model, settings, out, perplexity=perplexity, tokens=STEPS * STEP_TOKENS, resume=True,
                     progress=False)
    assert report.resumed_from_step == 7
    reference = uninterrupted[0]
    shards = sorted(p.name for p in reference.glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in out.glob("*.safetensors"))
    for shard in shards:
        assert (reference / shard).read_bytes() == (out / shard).read_bytes(), shard


def test_init_keeps_a_gptq_artifacts_codes(model, training_text, tmp_path):
    gptq = tmp_path / "gptq"
    quantize(model, small_recipe("mlx-s-gptq-w4g64", tmp_path), gptq, progress=False)
    settings = dwq_recipe(training_text)
    run_qat(model, settings, tmp_path / "dwq", perplexity=perplexity, tokens=2 * STEP_TOKENS, init=gptq,
            progress=False)
    trained, start = _records(tmp_path / "dwq"), _records(gptq)
    assert all(torch.equal(trained[name].codes, record.codes) for name, record in start.items())
    assert any(not torch.equal(trained[name].scales, record.scales) for name, record in start.items())
    rtn_codes = quantized_record(load_model(model).model.layers[0].mlp.down_proj.weight, trained[
        "model.layers.0.mlp.down_proj.weight"].config).codes
    assert not torch.equal(trained["model.layers.0.mlp.down_proj.weight"].codes, rtn_codes)  # not RTN's codes
    manifest = json.loads((tmp_path / "dwq" / "quantkit.json").read_text())
    assert manifest["qat"]["init"] == str(gptq) and manifest["format"] == "mlx"


# --- refusals ----------------------------------------------------------------------------------------


def test_dwq_command_refuses_a_recipe_that_does_not_train_scales(model, tmp_path):
    for recipe, trains in (("qat-ternary-g32", "'weights'"), ("mlx-rtn-w4g64", "None")):
        result = CliRunner().invoke(main, ["qat", "dwq", "--model", str(model), "--out", str(tmp_path / "out"),
                                           "--recipe", recipe, "--no-progress"])
        assert result.exit_code == 1 and result.output.count("Error") == 1, result.output
        assert f"recipe {recipe} does not train scales and biases (qat.trains is {trains}" in result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_scales_need_a_float_bias_grid_and_quantize_names_the_command(model, tmp_path):
    with pytest.raises(RecipeError, match="needs a float-bias grid \\(format: mlx\\), not format 'gptq'"):
        load_recipe("mlx-dwq-w4g64", {"format": "gptq"})
    with pytest.raises(RunError, match="`quantkit qat dwq --recipe mlx-dwq-w4g64`"):
        quantize(model, load_recipe("mlx-dwq-w4g64"), tmp_path / "out", progress=False)


def test_init_on_another_grid_is_refused_before_any_work(model, training_text, tmp_path):
    other = tmp_path / "w3"
    quantize(model, small_recipe("mlx-rtn-w4g64", tmp_path, quant={"bits": 3}), other, progress=False)
    with pytest.raises(RunError, match=r"artifact's grid \(3 bits, group size 64\) is not the recipe's \(4 bits"):
        train(model, dwq_recipe(training_text), tmp_path / "out", perplexity=perplexity, init=other, progress=False)
    assert not (tmp_path / "out.partial").exists()


# --- mlx-lm ------------------------------------------------------------------------------------------


def test_mlx_lm_loads_the_dwq_artifact_and_computes_quantkits_logits(uninterrupted):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import load_model as mlx_load_model
    from test_format_mlx import LOGIT_TOLERANCE, PROMPT_IDS

    out = uninterrupted[0]
    with torch.no_grad():
        expected = load_model(out)(torch.tensor([PROMPT_IDS])).logits[0].double().numpy()
    mlx_model, _ = mlx_load_model(out)
    logits = np.array(mlx_model(mx.array([PROMPT_IDS]))[0].astype(mx.float32)).astype(np.float64)
    assert np.abs(logits - expected).max() <= LOGIT_TOLERANCE
