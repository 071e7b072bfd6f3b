"""The vertical slice on real weights: default model -> RTN / GPTQ W4 g128 GPTQ checkpoints ->
perplexity and KL against the unquantized model."""
import json

import pytest
from transformers import AutoTokenizer

from quantkit import calib
from quantkit.engine import quantize
from quantkit.eval.kld import kl_divergence
from quantkit.eval.ppl import perplexity
from quantkit.loading import load_model
from quantkit.models.layers import LINEARS
from quantkit.recipe import load_recipe

pytestmark = pytest.mark.slow
CALIBRATION = {"calibration.n_samples": 16, "calibration.seq_len": 512}


@pytest.fixture(scope="module")
def runs(default_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    return {name: (quantize(default_model, load_recipe(name, CALIBRATION), out / name, progress=False), out / name)
            for name in ("rtn-w4g128", "gptq-w4g128")}


@pytest.fixture(scope="module")
def scored(default_model):
    # 2,048 tokens: the margins below hold with room (KL 0.476 vs 0.272 here, 0.473 vs 0.274 on 4,096)
    tokens = calib.heldout_tokens(AutoTokenizer.from_pretrained(default_model), name="austen", max_tokens=2048)
    reference = load_model(default_model)
    return tokens, reference, perplexity(reference, tokens, window=1024)


@pytest.fixture(scope="module")
def divergence(runs, scored):
    """Each artifact's KL to the unquantized model on the held-out tokens, computed once per module."""
    tokens, reference, _ = scored
    return {name: kl_divergence(load_model(out), reference, tokens, window=1024) for name, (_, out) in runs.items()}


def test_rtn_w4g128_artifact_and_accuracy_loss(runs, scored, divergence):
    report, out = runs["rtn-w4g128"]
    assert len(report.layers) == 30
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["group_size"] == 128 and config["scale_emb"] == 12
    # hidden 576 = 4.5 x 128: five groups per row, the last one 64 wide
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "model.layers.29.self_attn.q_proj.g_idx" in index["weight_map"]

    fp, kl = scored[2], divergence["rtn-w4g128"]
    assert 10 < fp.perplexity < 40  # 19.66 on these 2,048 tokens; 23.65 on docs/results.md's 16,384 ("Conventions")
    assert kl.reference_perplexity == pytest.approx(fp.perplexity, rel=1e-9)
    # The GGUF weights already lie on a group-32 4-bit grid; re-rounding at group 128 costs real
    # accuracy (measured: +48 % perplexity, KL 0.47, top-1 60 % at 16 x 512 calibration tokens)
    # but must not destroy the model.
    assert 1.1 < kl.perplexity / fp.perplexity < 2.0
    assert 0.1 < kl.mean_kl < 0.8 and kl.top1_agreement > 0.5


def test_gptq_beats_rtn_on_every_linear_and_end_to_end(runs, divergence):
    rtn, gptq = runs["rtn-w4g128"][0], runs["gptq-w4g128"][0]
    for r, g in zip(rtn.layers, gptq.layers):
        for name in LINEARS:
            assert g.errors[name] < r.errors[name], (r.index, name, g.errors[name], r.errors[name])
    kl_rtn, kl_gptq = divergence["rtn-w4g128"], divergence["gptq-w4g128"]
    # Measured with 16 x 512 tokens of the default (bilingual) mix, scored on 2,048 English tokens: KL 0.272
    # vs 0.476, top-1 0.696 vs 0.593 (the recipe's clip search and group-aware order at work).
    assert kl_gptq.mean_kl < kl_rtn.mean_kl and kl_gptq.top1_agreement > kl_rtn.top1_agreement
