"""Speculative acceptance length, checked where the answer is known: a target drafting for itself,
an unrelated draft, the greedy output unchanged, and the sampler's output distribution."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from quantkit.eval.accept import _Stepper, accept_or_resample, speculative_generate

from quantkit.loading import load_model


@pytest.fixture(scope="module")
def target(tiny_checkpoint_factory):
    return load_model(tiny_checkpoint_factory(num_hidden_layers=2))


@pytest.fixture(scope="module")
def unrelated(tiny_checkpoint_factory):
    return load_model(tiny_checkpoint_factory(num_hidden_layers=2, seed=11))


@pytest.fixture(scope="module")
def perturbed(target):
    """The target with noise on every linear: it agrees with the target often, not always."""
    model = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("proj.weight"):
                parameter.add_(torch.randn(parameter.shape, generator=generator) * parameter.std() * 0.5)
    return model


PROMPT = torch.tensor([5, 17, 42, 8, 99, 3, 250, 7])
# Pearson chi-square critical value at alpha = 0.001 (Wilson-Hilferty; within 0.3 % of tables for df >= 3).
# Every test is seeded, so it always passes or always fails; alpha says how unlikely a lucky pass was.


def chi_square_critical(df: int) -> float:
    return df * (1 - 2 / (9 * df) + 3.090 * (2 / (9 * df)) ** 0.5) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_cache_cut_back_after_a_rejected_draft_gives_full_recompute_logits(target):
    stepper = _Stepper(target, torch.tensor([5, 6]))
    stepper.feed(torch.tensor([7, 8, 9, 10]))         # a chain the target then rejects after token 7
    stepper.rollback(3, torch.tensor([11]))            # keep 5 6 7; 11 is committed, not yet fed
    logits = stepper.feed(torch.tensor([12]))
    with torch.no_grad():
        full = target(torch.tensor([[5, 6, 7, 11, 12]])).logits[0, -2:]
    assert stepper.cache.get_seq_length() == 5
    torch.testing.assert_close(logits, full, rtol=0, atol=1e-4)  # float32, cached vs recomputed order


def test_perturbed_draft_exercises_acceptance_and_correction_and_keeps_greedy_output(target, perturbed):
    tokens, stats = speculative_generate(target, perturbed, PROMPT, 3, max_new_tokens=32)
    assert tokens == target.generate(PROMPT[None], max_new_tokens=32, do_sample=False)[0, len(PROMPT):].tolist()
    assert 1.0 < stats.tau < 4.0  # some rounds accept drafts, some are corrected


def test_sampled_runs_are_reproducible_and_depend_on_the_seed(target, perturbed):
    runs = [speculative_generate(target, perturbed, PROMPT, 3, 16, temperature=1.0,
                                 generator=torch.Generator().manual_seed(seed)) for seed in (5, 5, 6)]
    assert runs[0][0] == runs[1][0] and runs[0][1].tau == runs[1][1].tau
    assert runs[0][0] != runs[2][0]


def test_speculative_sampling_with_models_draws_from_the_target(target, unrelated):
    """First committed token of single-step runs on the models themselves, at T = 0.3 where target and
    draft overlap partly (both the acceptance and the correction path run), against the target's
    softmax: chi-square with tokens of < 5 expected counts pooled. The draft's own distribution is the
    control that the test can fail."""
    prompt, temperature, trials = PROMPT[:6], 0.3, 600
    with torch.no_grad():
        p = torch.softmax(target(prompt[None]).logits[0, -1].double() / temperature, -1)
        q = torch.softmax(unrelated(prompt[None]).logits[0, -1].double() / temperature, -1)
    generator = torch.Generator().manual_seed(1)
    counts, accepted = torch.zeros_like(p), 0
    for _ in range(trials):
        tokens, stats = speculative_generate(target, unrelated, prompt, 2, max_new_tokens=1,
                                             temperature=temperature, generator=generator)
        counts[tokens[0]] += 1
        accepted += stats.position_rates[0] > 0
    assert 0 < accepted < trials
    cells = p * trials >= 5
    assert cells.sum() >= 5

    def pooled(values):
        return torch.cat([values[cells], values[~cells].sum(0, keepdim=True)])

    critical = chi_square_critical(int(cells.sum()))
    assert chi_square(pooled(counts), pooled(p)) < critical
    assert chi_square(pooled(q) * trials, pooled(p)) > critical  # what sampling from the draft would give


@pytest.mark.parametrize("k", [1, 3, 5])
def test_self_draft_commits_k_plus_one_per_forward_and_keeps_greedy_output(target, k):
    tokens, stats = speculative_generate(target, target, PROMPT, k, max_new_tokens=24)
    assert stats.tau == k + 1 and stats.position_rates == [1.0] * k
    plain = target.generate(PROMPT[None], max_new_tokens=24, do_sample=False)[0, len(PROMPT):].tolist()
    assert tokens == plain


def test_unrelated_draft_commits_about_one_token_and_output_is_still_the_targets(target, unrelated):
    tokens, stats = speculative_generate(target, unrelated, PROMPT, 4, max_new_tokens=32)
    # two random models agree on an argmax about once in vocab_size (384) tries
    assert 1.0 <= stats.tau < 1.2 and stats.position_rates[0] < 0.2
    assert tokens == target.generate(PROMPT[None], max_new_tokens=32, do_sample=False)[0, len(PROMPT):].tolist()


def test_sampled_self_draft_accepts_everything(target):
    _, stats = speculative_generate(target, target, PROMPT, 3, max_new_tokens=24, temperature=0.8,
                                    generator=torch.Generator().manual_seed(1))
    # p/q = 1 up to float rounding between one-token and (k+1)-token forwards
    assert stats.tau > 3.9 and min(stats.position_rates) > 0.95


def test_speculative_sampling_reproduces_the_target_distribution():
    """accept-or-resample after a draw from q yields exactly p (20,000 draws, 5 tokens: 4.5 sigma bound)."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3], dtype=torch.float64)
    counts = torch.zeros(5, dtype=torch.float64)
    trials = 20_000
    for _ in range(trials):
        token = int(torch.multinomial(q, 1, generator=generator))
        counts[accept_or_resample(p, q, token, generator)[1]] += 1
    sigma = (p * (1 - p) / trials).sqrt()
    assert ((counts / trials - p).abs() < 4.5 * sigma).all(), counts / trials


def test_bad_input_is_refused(target, tiny_checkpoint_factory):
    with pytest.raises(ValueError, match="k must be"):
        speculative_generate(target, target, PROMPT, 0, 4)
    other_vocab = load_model(tiny_checkpoint_factory(num_hidden_layers=1, vocab_size=512))
    with pytest.raises(ValueError, match="vocabularies differ"):
        speculative_generate(target, other_vocab, PROMPT, 2, 4)


def test_cli_matrix_and_json(tiny_checkpoint_factory, tmp_path):
    from quantkit.cli import main

    model, draft = tiny_checkpoint_factory(num_hidden_layers=2), tiny_checkpoint_factory(num_hidden_layers=2, seed=11)
    result = CliRunner().invoke(main, ["eval", "accept", "--target", str(model), "--draft", str(model), "--draft",
                                       str(draft), "--k", "3", "--prompts", "2", "--prompt-tokens", "16",
                                       "--max-new-tokens", "12", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["pairs"]
    assert [(r["draft"], r["tau"]) for r in rows][0] == (str(model), 4.0) and rows[1]["tau"] < 1.5
    missing = CliRunner().invoke(main, ["eval", "accept", "--target", str(tmp_path / "nope"), "--draft", str(model)])
    assert missing.exit_code != 0
