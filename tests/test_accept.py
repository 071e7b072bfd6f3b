"""`quantkit eval accept` and `eval report --draft`: τ of whole-model drafts and EAGLE-3 heads, measured
in the runtime, checked where the answer is known (a target drafting for itself, an unrelated model)."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.eval.accept import acceptance, prompt_rows
from quantkit.kernels.generate import load_text_generator
from quantkit.synthetic import write_tiny_eagle3_head

PROMPTS = torch.tensor([[5, 17, 42, 8, 99, 3, 250, 7], [9, 8, 7, 6, 5, 4, 3, 2]])


@pytest.fixture(scope="module")
def model(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(num_hidden_layers=4)


@pytest.fixture(scope="module")
def generator(model):
    return load_text_generator(model, dtype=torch.float32)


@pytest.mark.parametrize("k", [1, 3])
def test_self_draft_commits_k_plus_one_per_forward(generator, model, k):
    stats = acceptance(generator, model, PROMPTS, k, max_new_tokens=1 + 3 * (k + 1))
    assert stats.tau == k + 1 and stats.position_rates == [1.0] * k and stats.rounds == 6


def test_unrelated_draft_commits_about_one_token(generator, tiny_checkpoint_factory):
    unrelated = tiny_checkpoint_factory(num_hidden_layers=4, seed=11)
    stats = acceptance(generator, unrelated, PROMPTS, 4, max_new_tokens=32)
    # two random models agree on an argmax about once in vocab_size (384) tries
    assert 1.0 <= stats.tau < 1.2 and stats.position_rates[0] < 0.2


def test_sampled_runs_are_reproducible_and_depend_on_the_seed(generator, tiny_checkpoint_factory):
    draft = tiny_checkpoint_factory(num_hidden_layers=4, seed=11)
    runs = [acceptance(generator, draft, PROMPTS, 3, 16, temperature=1.0, seed=seed).to_dict() for seed in (5, 5, 6)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_a_draft_with_another_vocabulary_is_refused(generator, tiny_checkpoint_factory):
    with pytest.raises(ValueError, match="vocabularies differ"):
        acceptance(generator, tiny_checkpoint_factory(num_hidden_layers=1, vocab_size=512), PROMPTS, 2, 4)


def test_prompt_rows_need_enough_tokens():
    assert prompt_rows(torch.arange(10), 2, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="need 12 tokens"):
        prompt_rows(torch.arange(10), 3, 4)


def test_cli_matrix_with_a_model_and_an_eagle3_head(model, tiny_checkpoint_factory, tmp_path):
    head = write_tiny_eagle3_head(tmp_path / "head", model, draft_vocab_size=100)
    result = CliRunner().invoke(main, ["eval", "accept", "--target", str(model), "--draft", str(model), "--draft",
                                       str(head), "--k", "3", "--tree", "3x2x10", "--prompts", "2", "--prompt-tokens",
                                       "16", "--max-new-tokens", "13", "--json"])  # 1 + 3 rounds of 4
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["pairs"]
    assert [(r["draft"], r["shape"]) for r in rows] == [(str(model), "chain of 3"), (str(model), "tree 3x2x10"),
                                                        (str(head), "chain of 3"), (str(head), "tree 3x2x10")]
    assert rows[0]["tau"] == rows[1]["tau"] == 4.0  # the target drafting for itself, chain or unpruned tree
    assert 1.0 <= rows[2]["tau"] < 1.5  # a random head
    missing = CliRunner().invoke(main, ["eval", "accept", "--target", str(tmp_path / "nope"), "--draft", str(model)])
    assert missing.exit_code != 0
