"""Perplexity and KL divergence against hand computations on a tiny model."""
import copy
import math

import pytest
import torch

from quantkit.eval.kld import kl_divergence
from quantkit.eval.ppl import Window, perplexity, windows
from quantkit.loading import load_model
from quantkit.synthetic import write_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", num_hidden_layers=2))


@pytest.fixture(scope="module")
def tokens(model):
    return torch.randint(0, model.config.vocab_size, (150,), generator=torch.Generator().manual_seed(3))


def test_windows_score_every_token_once():
    spans = list(windows(10, window=4, stride=3))
    assert spans == [Window(0, 4, 1), Window(3, 7, 4), Window(6, 10, 7)]
    assert list(windows(10, window=4)) == [Window(0, 4, 1), Window(4, 8, 5), Window(8, 10, 9)]
    with pytest.raises(ValueError, match="stride"):
        list(windows(10, window=4, stride=5))


def test_perplexity_equals_hand_computation(model, tokens):
    window, nll, count = 64, 0.0, 0
    with torch.no_grad():
        for begin in range(0, len(tokens), window):  # disjoint windows; each window's first token has no context
            chunk = tokens[begin:begin + window]
            logp = torch.log_softmax(model(chunk[None]).logits[0].double(), -1)
            nll -= sum(logp[p - 1, chunk[p]].item() for p in range(1, len(chunk)))
            count += len(chunk) - 1
    result = perplexity(model, tokens, window=window)
    assert result.tokens == count == 147
    assert result.mean_nll == pytest.approx(nll / count, rel=1e-12)
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-12)
    # A strided window scores the same tokens with more context: a different, finite figure.
    strided = perplexity(model, tokens, window=window, stride=32)
    assert strided.tokens == len(tokens) - 1 and strided.perplexity != result.perplexity


def test_kl_of_model_with_itself_is_zero(model, tokens):
    result = kl_divergence(model, model, tokens, window=64)
    assert result.mean_kl == 0.0 and result.top1_agreement == 1.0
    assert result.perplexity == result.reference_perplexity


PREFIX = 4


def test_reference_prefix_of_model_with_itself_is_zero_and_scores_the_later_positions(model, tokens):
    result = kl_divergence(model, model, tokens, window=64, reference_prefix=PREFIX)
    plain = kl_divergence(model, model, tokens, window=64)
    windows_used = len(list(windows(len(tokens), 64)))
    assert result.tokens == plain.tokens - PREFIX * windows_used
    # the cached continuation equals the whole-window forward up to float32 summation order
    assert result.mean_kl < 1e-9 and result.top1_agreement == 1.0
    with pytest.raises(ValueError, match="reference_prefix"):
        kl_divergence(model, model, tokens, window=64, reference_prefix=63)


@pytest.mark.parametrize("rows_per_chunk", [7, 4096])
def test_reference_prefix_changes_only_what_the_prefix_keys_and_values_change(model, tokens, rows_per_chunk,
                                                                             monkeypatch):
    """The last layer's MLP feeds no layer's K/V, so with it perturbed the reference's prefix cache is
    the model's own, and the result is the plain KL of the later positions. A first-layer k_proj
    perturbation reaches the prefix's keys, so there the stored prefix changes the result."""
    monkeypatch.setattr("quantkit.eval.ppl.ROWS_PER_CHUNK", rows_per_chunk)
    late = copy.deepcopy(model)
    with torch.no_grad():
        late.model.layers[-1].mlp.down_proj.weight.mul_(1.5)
        logp = torch.log_softmax(model(tokens[None]).logits[0, :-1].double(), -1)
        logq = torch.log_softmax(late(tokens[None]).logits[0, :-1].double(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)[PREFIX:]  # logits at p predict p + 1 >= PREFIX + 1
    result = kl_divergence(late, model, tokens, window=len(tokens), reference_prefix=PREFIX)
    assert result.tokens == len(kl)
    assert result.mean_kl == pytest.approx(kl.mean().item(), rel=1e-4)

    early = copy.deepcopy(model)
    with torch.no_grad():
        early.model.layers[0].self_attn.k_proj.weight.mul_(3.0)
        logq = torch.log_softmax(early(tokens[None]).logits[0, :-1].double(), -1)
    own_prefix = (logp.exp() * (logp - logq)).sum(-1)[PREFIX:]  # the same positions, own prefix K/V
    stored = kl_divergence(early, model, tokens, window=len(tokens), reference_prefix=PREFIX)
    assert stored.tokens == len(own_prefix)
    assert stored.mean_kl > 0
    assert abs(stored.mean_kl - own_prefix.mean().item()) > 1e-3 * own_prefix.mean().item()


@pytest.mark.parametrize("rows_per_chunk", [7, 4096])  # several chunks per window, and one
def test_kl_against_perturbed_copy_equals_direct_computation(model, tokens, rows_per_chunk, monkeypatch):
    monkeypatch.setattr("quantkit.eval.ppl.ROWS_PER_CHUNK", rows_per_chunk)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    result = kl_divergence(other, model, tokens, window=len(tokens))
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens[None]).logits[0, :-1].double(), -1)
        logq = torch.log_softmax(other(tokens[None]).logits[0, :-1].double(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    assert result.mean_kl > 0
    assert result.mean_kl == pytest.approx(kl.mean().item(), rel=1e-9)
    assert result.top1_agreement == pytest.approx((logp.argmax(-1) == logq.argmax(-1)).double().mean().item())
