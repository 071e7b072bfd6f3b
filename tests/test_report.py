"""The reference log-prob cache (KL against it equals the direct computation when it keeps every
token, bounds it from below when it keeps fewer) and the multi-variant report."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner

from quantkit.eval.kld import kl_divergence
from quantkit.eval.refcache import cached_reference, compute_reference, kl_against_reference
from quantkit.loading import load_model


@pytest.fixture(scope="module")
def models(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(num_hidden_layers=2)
    reference = load_model(path)
    perturbed = copy.deepcopy(reference)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return path, reference, perturbed


@pytest.fixture(scope="module")
def tokens(models):
    return torch.randint(0, models[1].config.vocab_size, (200,), generator=torch.Generator().manual_seed(7))


def test_full_cache_gives_the_exact_kl(models, tokens):
    _, reference, perturbed = models
    exact = kl_divergence(perturbed, reference, tokens, window=64, stride=48)
    cached = kl_against_reference(perturbed, compute_reference(reference, tokens, 64, 48, top_k=10**6), tokens)
    # log p is stored in float32: relative error ~1e-7 per term
    assert cached.mean_kl == pytest.approx(exact.mean_kl, rel=1e-5) and exact.mean_kl > 1e-4
    assert cached.max_kl == pytest.approx(exact.max_kl, rel=1e-5)
    assert (cached.top1_agreement, cached.tokens) == (exact.top1_agreement, exact.tokens)
    assert cached.perplexity == pytest.approx(exact.perplexity, rel=1e-12)
    assert cached.reference_perplexity == pytest.approx(exact.reference_perplexity, rel=1e-12)
    itself = kl_against_reference(reference, compute_reference(reference, tokens, 64, 48, top_k=16), tokens)
    assert abs(itself.mean_kl) < 1e-6 and itself.top1_agreement == 1.0


def test_sampled_tail_estimates_the_kl_without_bias(models, tokens):
    """With few top tokens most of the KL is in the sampled rest; the estimate stays within a few
    per cent (measured spread over seeds below), where lumping the rest would lose most of it."""
    _, reference, perturbed = models
    exact = kl_divergence(perturbed, reference, tokens, window=64).mean_kl
    for top_k in (4, 32):
        estimate = kl_against_reference(perturbed, compute_reference(reference, tokens, 64, None, top_k), tokens)
        assert estimate.mean_kl == pytest.approx(exact, rel=0.05), top_k


def test_cache_is_computed_once_and_keyed_by_its_inputs(models, tokens, tmp_path, monkeypatch):
    path = models[0]
    first, file = cached_reference(path, tokens, 64, None, 32, tmp_path)
    monkeypatch.setattr("quantkit.loading.load_model", lambda *_: pytest.fail("the cached reference was recomputed"))
    again, same_file = cached_reference(path, tokens, 64, None, 32, tmp_path)
    assert same_file == file and torch.equal(first.top_ids, again.top_ids)
    assert torch.equal(first.top_log_probs, again.top_log_probs)
    monkeypatch.undo()
    _, other = cached_reference(path, tokens[:-1], 64, None, 32, tmp_path)
    assert other != file and len(list(tmp_path.glob("*.safetensors"))) == 2
    assert not list(tmp_path.glob("*.tmp"))
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(ValueError, match="not a readable reference cache"):
        cached_reference(path, tokens, 64, None, 32, tmp_path)


def test_report_scores_every_variant_and_repeats_exactly(tiny_checkpoint, tmp_path):
    from quantkit.cli import main

    runner = CliRunner()
    artifact = tmp_path / "rtn"
    assert runner.invoke(main, ["quantize", "--recipe", "rtn-w4g128", "--model", str(tiny_checkpoint), "--out",
                                str(artifact), "--no-progress", "--set", "calibration.n_samples=4"]).exit_code == 0
    args = ["eval", "report", "--ref", str(tiny_checkpoint), "--variants", str(artifact), "--max-tokens", "300",
            "--window", "128", "--cache-dir", str(tmp_path / "cache"), "--tasks", "family", "--task-limit", "3",
            "--draft", str(tiny_checkpoint), "--accept-k", "2", "--json"]
    runs = []
    for name in ("a", "b"):
        result = runner.invoke(main, [*args, "--out", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        runs.append(json.loads((tmp_path / name / "report.json").read_text()))
    assert runs[0] == runs[1]
    reference, variant = runs[0]["variants"]
    assert reference["mean_kl"] == pytest.approx(0, abs=1e-8) and reference["layer_errors"] == []
    assert variant["mean_kl"] > 1e-4 and variant["delta_ppl_pct"] != 0 and len(variant["layer_errors"]) == 2
    assert variant["bits_per_parameter"] < 0.5 * reference["bits_per_parameter"]  # 4-bit linears vs float32
    assert reference["tau"] == 3.0 and 1.0 <= variant["tau"] <= 3.0  # the reference drafts for itself: k + 1
    assert 0 <= variant["tasks"]["family"] <= 1 and set(reference["tasks"]) == {"family"}
    setup = runs[0]["setup"]
    assert setup["tokens"] == 300 and len(setup["tokens_sha256"]) == 64 and "torch" in setup["packages"]
    for png in ("kl_vs_bits.png", "layer_error.png"):
        assert (tmp_path / "a" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (tmp_path / "a" / "report.md").read_text()
    assert "rtn" in markdown and "Δ family" in markdown
    again = runner.invoke(main, [*args, "--out", str(tmp_path / "a")])
    assert again.exit_code != 0 and "already exists" in again.output


def test_a_report_spread_over_two_ranks_is_the_one_process_report(tiny_checkpoint, tmp_path):
    """Under torchrun, rank 0 fills the reference cache, each rank scores its share of the 3 models (the
    reference and two artifacts: 2 on rank 0, 1 on rank 1) and rank 0 writes the report: every number is the
    one process's, bit for bit (each variant is scored whole, on one thread either way)."""
    from quantkit.cli import main
    from quantkit.device import torch_threads

    from helpers import torchrun

    runner = CliRunner()
    artifacts = []
    for recipe in ("rtn-w4g128", "rtn-ternary-g32"):
        artifacts.append(tmp_path / recipe)
        assert runner.invoke(main, ["quantize", "--recipe", recipe, "--model", str(tiny_checkpoint), "--out",
                                    str(artifacts[-1]), "--no-progress", "--set", "calibration.n_samples=4"]
                             ).exit_code == 0
    args = ["eval", "report", "--ref", str(tiny_checkpoint), "--variants", ",".join(map(str, artifacts)),
            "--max-tokens", "300", "--window", "128", "--cache-dir", str(tmp_path / "cache"), "--json"]
    torchrun(2, "-m", "quantkit.cli", *args, "--out", str(tmp_path / "two-ranks"))
    with torch_threads(1):
        assert runner.invoke(main, [*args, "--out", str(tmp_path / "one")]).exit_code == 0
    spread, alone = (json.loads((tmp_path / name / "report.json").read_text()) for name in ("two-ranks", "one"))
    names = [f"{tiny_checkpoint.name} (reference)", "rtn-w4g128", "rtn-ternary-g32"]
    assert [variant["name"] for variant in spread["variants"]] == names
    assert spread["variants"] == alone["variants"]
    assert (spread["setup"]["world_size"], spread["setup"]["backend"]) == (2, "gloo")
    assert (alone["setup"]["world_size"], alone["setup"]["backend"]) == (1, None)
