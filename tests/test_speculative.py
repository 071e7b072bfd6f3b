"""Speculative decoding in the runtime: an oracle draft gives τ = k + 1; greedy output equals plain
greedy output (FP and quantized targets, EAGLE-3 head or partly wrong drafts); the cache after
rejected drafts equals a fresh prefill; speculative sampling keeps the target's distribution."""
from __future__ import annotations

import json
import math

import pytest
import torch

from quantkit.engine import quantize
from quantkit.kernels.attention import make_attention
from quantkit.kernels.eagle3 import Eagle3Drafter
from quantkit.kernels.generate import TextGenerator, load_text_generator
from quantkit.kernels.infllm import SparseAttentionConfig
from quantkit.kernels.load import load_runtime_model
from quantkit.kernels.model import RuntimeModel
from quantkit.kernels.sampling import Sampler, Sampling
from quantkit.kernels.speculative import (
    RETIME_EVERY,
    Acceptance,
    AutoChain,
    DraftTree,
    ModelDrafter,
    TreeShape,
    chain_verification,
    draft_children,
    grow_tree,
    tree_attention_mask,
    verify_sampled,
    verify_tree_sampled,
)
from quantkit.reader import load_head
from quantkit.synthetic import write_tiny_eagle3_head

from helpers import small_recipe

PROMPT = [5, 17, 99, 3, 250, 41, 7, 8, 9, 10, 11]


def _runtime(model_dir) -> RuntimeModel:
    return RuntimeModel(load_runtime_model(model_dir, torch.float32), make_attention(None))


class CorruptingDrafter(ModelDrafter):
    """The target drafting for itself, with every ``wrong_every``-th draft of a round replaced by another
    token (so that verification rejects it)."""

    def __init__(self, runtime, wrong_every: int):
        super().__init__(runtime, runtime.config.vocab_size)
        self.wrong_every = wrong_every

    def propose(self, count, sampler):
        drafts, _ = super().propose(count, sampler)
        vocab = self.runtime.config.vocab_size
        return [(t + 1) % vocab if (i + 1) % self.wrong_every == 0 else t for i, t in enumerate(drafts)], None


@pytest.fixture(scope="module")
def target_dir(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(num_hidden_layers=8)


def _plain_greedy(model_dir, tokens=40):
    generator = TextGenerator(_runtime(model_dir), tokenizer=None, stop_tokens=set(), prefill_chunk=4)
    return list(generator.tokens(PROMPT, max_new_tokens=tokens))


@pytest.mark.parametrize("draft_tokens", [1, 3, 5])
def test_an_oracle_draft_is_always_accepted(target_dir, draft_tokens):
    runtime = _runtime(target_dir)
    generator = TextGenerator(runtime, None, set(), prefill_chunk=4,
                              drafter=ModelDrafter(runtime, runtime.config.vocab_size), draft_tokens=draft_tokens)
    timings = {}
    tokens = list(generator.tokens(PROMPT, max_new_tokens=1 + 4 * (draft_tokens + 1), timings=timings))
    assert tokens == _plain_greedy(target_dir, len(tokens))
    acceptance = timings["acceptance"]
    assert acceptance.rounds == 4 and acceptance.tau == draft_tokens + 1
    assert acceptance.position_rates == [1.0] * draft_tokens


def _simulated_rounds(rate: float, seconds_of, rounds: int = 160, seed: int = 0) -> AutoChain:
    """AutoChain driven by rounds of a simulated target: each draft kept with probability ``rate`` while
    those before it were, a round of k drafts taking ``seconds_of(k)``."""
    import random

    draws, chain = random.Random(seed), AutoChain(Acceptance(5))
    for _ in range(rounds):
        drafted = chain.next(budget=100)
        kept = 0
        while kept < drafted and draws.random() < rate:
            kept += 1
        if drafted:
            chain.acceptance.add_round(drafted, kept)
        chain.record(drafted, seconds_of(drafted))
    return chain


def _tokens_a_second(rate: float, seconds_of, length: int) -> float:
    return sum(rate ** j for j in range(length + 1)) / seconds_of(length)


@pytest.mark.parametrize("rate, seconds_of", [
    (1.0, lambda k: 1 + 0.1 * k),   # every draft kept, verification cheap: the longest chain
    (0.0, lambda k: 1 + 0.1 * k),   # nothing kept: plain steps
    (0.8, lambda k: 1 + 0.5 * k),   # 1, 1.2, 1.22, 1.18, 1.12, 1.05 tokens a second for k = 0..5: a flat top
    (0.8, lambda k: 1.0 if k <= 3 else 4.0),  # the cost jumps past 4 rows, not a line: 3
    (0.5, lambda k: 1 + 0.05 * k),  # 1, 1.43, 1.59, 1.63, 1.60, 1.57
])
def test_auto_chain_drafts_the_length_that_commits_the_most_tokens_a_second(rate, seconds_of):
    """The rounds' lengths give, on average, at least 95 % of the best length's expected tokens a second
    (timing every length, re-timing each in turn, and learning the acceptance included; near the top the
    curve is flat, so neighbours of the best are fair choices); a fixed chain of 3 would give 77 % with
    nothing accepted and with everything."""
    chain = _simulated_rounds(rate, seconds_of)
    rates = [_tokens_a_second(rate, seconds_of, length) for length in range(6)]
    achieved = sum(count * rates[length] for length, count in chain.chosen.items()) / 160
    assert achieved >= 0.95 * max(rates), (achieved, rates, chain.chosen)
    assert set(chain.chosen) == set(range(6))  # every length timed
    assert sum(chain.chosen.values()) - max(chain.chosen.values()) >= 160 // RETIME_EVERY  # re-timed in turn


def test_auto_chain_keeps_greedy_output_exact_and_times_every_length(target_dir):
    """--draft-tokens auto with an oracle draft (the target itself): plain greedy's tokens, every chain length
    tried once before the first choice, every drafted round fully accepted."""
    runtime = _runtime(target_dir)
    generator = TextGenerator(runtime, None, set(), prefill_chunk=4,
                              drafter=ModelDrafter(runtime, runtime.config.vocab_size), draft_tokens="auto")
    timings = {}
    tokens = list(generator.tokens(PROMPT, max_new_tokens=40, timings=timings))
    assert tokens == _plain_greedy(target_dir, 40)
    assert set(timings["chain_lengths"]) >= set(range(6))
    assert timings["acceptance"].position_rates == [1.0] * 5
    with pytest.raises(ValueError, match="draft_tokens must be >= 1 or 'auto'"):
        TextGenerator(runtime, None, set(), drafter=ModelDrafter(runtime, runtime.config.vocab_size), draft_tokens=0)


def test_generate_draft_tokens_auto_reports_its_rounds_per_length(target_dir):
    from click.testing import CliRunner

    from quantkit.cli import main

    run = CliRunner().invoke(main, ["generate", "--model", str(target_dir), "--draft", str(target_dir), "--raw",
                                    "--prompt", "hello", "--max-new-tokens", "30", "--draft-tokens", "auto", "--json"])
    assert run.exit_code == 0, run.output
    speculative = json.loads(run.stdout)["speculative"]
    lengths = {int(length): count for length, count in speculative["rounds_per_chain_length"].items()}
    assert set(lengths) <= set(range(6)) and sum(lengths.values()) >= speculative["rounds"]
    assert speculative["position_rates"][0] > 0.8  # the target drafting for itself (bf16: rows round apart)


def test_rejected_drafts_leave_the_cache_as_a_fresh_prefill(target_dir):
    """Every other draft is wrong: rounds keep 1 of 3; the output and the cache are plain greedy's."""
    runtime = _runtime(target_dir)
    generator = TextGenerator(runtime, None, set(), prefill_chunk=4, drafter=CorruptingDrafter(runtime, 2),
                              draft_tokens=3)
    cache, timings = runtime.new_cache(), {}
    tokens = list(generator.tokens(PROMPT, max_new_tokens=30, cache=cache, timings=timings))
    assert tokens == _plain_greedy(target_dir, 30)
    acceptance = timings["acceptance"]
    assert acceptance.tau == 2.0  # each round: the good first draft, then the target's own token
    assert acceptance.position_rates == [1.0, 0.0, 0.0] and acceptance.reached[2] == 0
    fresh = runtime.new_cache()
    runtime.forward(torch.tensor(PROMPT + tokens[:-1]), fresh)
    assert cache.length == fresh.length
    for layer in range(runtime.config.num_hidden_layers):
        for got, want in zip(cache.buffers(layer, cache.length), fresh.buffers(layer, fresh.length)):
            torch.testing.assert_close(got[:, :cache.length], want[:, :fresh.length], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def w4_target(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("w4") / "rtn"
    quantize(target_dir, small_recipe("rtn-w4g128", tmp_path_factory.mktemp("recipe")), out, progress=False)
    return out


@pytest.mark.parametrize("target", ["fp", "w4"])
def test_greedy_with_an_eagle3_head_equals_plain_greedy(target_dir, w4_target, tmp_path, target):
    model_dir = target_dir if target == "fp" else w4_target
    head = write_tiny_eagle3_head(tmp_path / "head", target_dir, draft_vocab_size=200)
    plain = load_text_generator(model_dir, dtype=torch.float32)
    speculative = load_text_generator(model_dir, dtype=torch.float32, draft=head, draft_tokens=4)
    want = plain.generate(PROMPT, max_new_tokens=32)
    got = speculative.generate(PROMPT, max_new_tokens=32)
    assert got.tokens == want.tokens
    assert got.acceptance["rounds"] >= 32 // 5 and 1.0 <= got.acceptance["tau"] <= 5.0


def test_eagle3_drafter_in_bf16_runs_its_layer_in_the_fused_operators(target_dir, tmp_path):
    """In bf16 on the CPU (how `quantkit generate` runs a head) the midlayer runs in the fused operators
    over a bf16 cache, as the target's layers do: within bf16 rounding of the same head on PyTorch's
    operators over a float32 cache, observing and drafting."""
    from torch import nn

    from quantkit import cpu_ops

    runtime = _runtime(target_dir)
    head = load_head(write_tiny_eagle3_head(tmp_path / "head", target_dir), runtime.config)
    embedding = nn.Embedding.from_pretrained(runtime.model.model.embed_tokens.weight.bfloat16())
    fused, reference = Eagle3Drafter(head, embedding), Eagle3Drafter(head, embedding)
    assert cpu_ops.load() is not None and fused._ops is not None and fused.kv_dtype == torch.bfloat16
    reference._ops, reference.kv_dtype = None, torch.float32
    reference.crop(0)
    logits, states = runtime.forward_capturing(torch.tensor(PROMPT), runtime.new_cache(), fused.aux_layers)
    next_tokens = torch.tensor(PROMPT[1:] + [int(logits[-1].argmax())])

    def relative(a, b):
        return float((a - b).norm() / b.norm())

    for drafter in (fused, reference):
        drafter.observe(torch.tensor(PROMPT), states, next_tokens)
    assert relative(fused._last, reference._last) < 1e-2
    ours, theirs = fused._last, reference._last
    # Each draft step feeds the next, so bf16 rounding compounds: 0.7 %, 1.0 %, 1.1 % after steps 1-3 on a
    # Xeon with AMX, the same with the fused operators built without AMX (QUANTKIT_CPU_MARCH=cooperlake),
    # while on AMD Zen 4 all three stayed under 1 %; a wrong kernel (layout, mask, scale) is off by tens of %.
    with torch.inference_mode():
        for token in (3, 7, 11):
            ours, theirs = fused._step(ours, torch.tensor([token])), reference._step(theirs, torch.tensor([token]))
            assert relative(ours, theirs) < 2e-2
    assert fused._cache.length == reference._cache.length == len(PROMPT) + 3


def test_a_bf16_head_drafts_from_int8_codes(target_dir, tmp_path):
    """In bf16 on the CPU every linear of the head drafts from int8 codes (``drafting_linear``): fc, the
    midlayer's and the LM head, each within int8 rounding of the bf16 product (0.5 % here; a wrong code
    layout or scale is off by 100 %); a float32 head, the evaluation's, keeps its own."""
    from quantkit.kernels.eagle3 import drafting_linear
    from quantkit.kernels.linear.int8 import Int8Linear

    head = load_head(write_tiny_eagle3_head(tmp_path / "head", target_dir), _runtime(target_dir).config)
    lm_head = head.lm_head
    assert drafting_linear(lm_head) is lm_head
    lm_head = lm_head.to(torch.bfloat16)
    drafting = drafting_linear(lm_head)
    assert isinstance(drafting, Int8Linear)
    hidden = torch.randn(3, lm_head.in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        got, want = drafting(hidden).float(), lm_head(hidden).float()
    assert float((got - want).norm() / want.norm()) < 2e-2
    runtime = load_runtime_model(target_dir, torch.bfloat16)
    drafter = Eagle3Drafter(head, runtime.model.embed_tokens)
    layer = drafter._layer
    assert all(isinstance(linear, Int8Linear) for linear in (drafter._fc, drafter._lm_head, layer.qkv, layer.gate_up,
                                                                layer.o_proj, layer.down_proj))


def test_eagle3_drafter_observes_verified_positions_only(target_dir, tmp_path):
    """Proposing grows the head's cache; the next observation drops those entries first."""
    head = load_head(write_tiny_eagle3_head(tmp_path / "head", target_dir), _runtime(target_dir).config)
    runtime = _runtime(target_dir)
    drafter = Eagle3Drafter(head, runtime.model.model.embed_tokens)
    logits, states = runtime.forward_capturing(torch.tensor(PROMPT), runtime.new_cache(), drafter.aux_layers)
    drafter.observe(torch.tensor(PROMPT), states, torch.tensor(PROMPT[1:] + [int(logits[-1].argmax())]))
    assert drafter._cache.length == len(PROMPT)
    drafts, _ = drafter.propose(4, Sampler(Sampling()))
    assert len(drafts) == 4 and drafter._cache.length == len(PROMPT) + 3
    drafter.observe(torch.tensor([1]), {layer: state[:1] for layer, state in states.items()}, torch.tensor([1]))
    assert drafter._cache.length == len(PROMPT) + 1


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of ``counts`` against ``probs`` (bins expecting fewer than 5 merged): the chi-square
    survival function is the regularised upper incomplete gamma Q(df/2, x/2)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed, expected = counts[~small].double(), expected[~small]
    if small.any():
        observed = torch.cat([observed, counts[small].sum()[None].double()])
        expected = torch.cat([expected, (probs[small].sum() * counts.sum())[None].double()])
    statistic = ((observed - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2, dtype=torch.float64), statistic / 2))


def test_speculative_sampling_keeps_the_target_distribution():
    """A chain of two drafts from q; the first committed token must follow p (level 0.001, 20,000 draws),
    and the drafts themselves, which follow q, must fail the same test."""
    generator = torch.Generator().manual_seed(0)
    vocab, draws = 12, 20_000
    target_logits = torch.randn(3, vocab, generator=generator) * 1.5
    q = [torch.softmax(torch.randn(vocab, generator=generator, dtype=torch.float64) * 1.5, -1) for _ in range(2)]
    settings = Sampling(temperature=0.8, seed=1)
    sampler = Sampler(settings)
    p = sampler.probabilities(target_logits[0])
    committed, drafted = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(draws):
        drafts = [sampler.draw(q[0]), sampler.draw(q[1])]
        kept, after = verify_sampled(drafts, q, target_logits, sampler)
        committed[drafts[0] if kept else after] += 1
        drafted[drafts[0]] += 1
    assert _chi_square_p_value(committed, p) > 1e-3
    assert _chi_square_p_value(drafted, p) < 1e-3
    assert math.isclose(float(committed.sum()), draws)


def test_recursive_rejection_sampling_down_a_tree_keeps_the_target_distribution():
    """A tree of depth 2 drawn from q without replacement (3 children at the root, 2 under each), verified
    by recursive rejection sampling: the first two committed tokens (t1, t2) must follow the target's
    p(t1)·p(t2 | t1) (level 0.001, 20,000 trees over 64 bins); the first drafted child alone, which
    follows q, must fail the same test."""
    generator = torch.Generator().manual_seed(0)
    vocab, draws = 8, 20_000
    target = torch.randn(vocab + 1, vocab, generator=generator) * 1.5  # row 0: the root; row 1 + t: after t
    draft = torch.randn(vocab + 1, vocab, generator=generator) * 1.5
    sampler = Sampler(Sampling(temperature=0.8, seed=1))
    first = sampler.probabilities(target[0])
    joint = torch.stack([first[t] * sampler.probabilities(target[1 + t]) for t in range(vocab)]).flatten()
    committed, drafted = torch.zeros(vocab * vocab), torch.zeros(vocab)

    def children_of(frontier, tree):
        rows = [0 if node < 0 else 1 + tree.tokens[node] for node in frontier]
        return draft_children(draft[rows], 3 if frontier == [-1] else 2, sampler)

    for _ in range(draws):
        tree = grow_tree(TreeShape(2, 3, 9), children_of, sampled=True)
        assert len(tree.tokens) == 9 and len(tree.drafts) == 4  # every family kept: the root's and 3 more
        logits = torch.stack([target[0]] + [target[1 + t] for t in tree.tokens])
        path, after = verify_tree_sampled(tree, logits, sampler)
        tokens = [tree.tokens[node] for node in path] + [after]
        if len(tokens) == 1:  # the next round's own token after t1
            tokens.append(sampler(target[1 + tokens[0]]))
        committed[tokens[0] * vocab + tokens[1]] += 1
        drafted[tree.tokens[0]] += 1
    assert _chi_square_p_value(committed, joint) > 1e-3
    assert _chi_square_p_value(drafted, first) < 1e-3


def test_a_sampled_tree_keeps_or_drops_whole_families_shallow_first():
    tree = DraftTree(tokens=[1, 2, 3, 4, 5, 6, 7], parents=[-1, -1, 0, 0, 1, 1, 2],
                     scores=[-1.0, -0.5, -1.5, -3.0, -0.6, -0.7, -1.6],
                     drafts={node: torch.full((8,), node + 2.0) for node in (-1, 0, 1, 2)})
    kept = tree.best_families(4)  # the root's family, then node 1's (its parent scores higher than node 0)
    assert kept.tokens == [1, 2, 5, 6] and kept.parents == [-1, -1, 1, 1]
    assert sorted(kept.drafts) == [-1, 1] and torch.equal(kept.drafts[1], tree.drafts[1])
    assert tree.best_families(7).tokens == [1, 2, 3, 4, 5, 6, 7]
    assert tree.best_families(1).tokens == []  # the root's family does not fit: no drafts


@pytest.mark.parametrize("tree", [None, TreeShape(2, 2, 6)])
def test_sampled_speculative_generation_keeps_the_targets_distribution(target_dir, tiny_checkpoint_factory, tree):
    """End to end at T = 0.1 (where the random models' distributions are peaked but overlap) with another
    model drafting: the second generated token (the first a round commits) against its exact marginal
    Σ p(t₁)·p(t₂ | t₁) under the target (level 0.001, 400 runs): the wiring of the rule into the generator;
    the rule's own power is shown by test_speculative_sampling_keeps_the_target_distribution."""
    runtime = _runtime(target_dir)
    draft = _runtime(tiny_checkpoint_factory(num_hidden_layers=8, seed=11))
    generator = TextGenerator(runtime, None, set(), drafter=ModelDrafter(draft, runtime.config.vocab_size),
                              draft_tokens=2, draft_tree=tree)
    temperature = 0.1
    with torch.no_grad():
        first = torch.softmax(runtime.forward(torch.tensor(PROMPT), runtime.new_cache()).double() / temperature, -1)
        second = torch.zeros_like(first)
        for token in range(len(first)):
            logits = runtime.forward(torch.tensor(PROMPT + [token]), runtime.new_cache())
            second += first[token] * torch.softmax(logits.double() / temperature, -1)
    counts, rounds = torch.zeros_like(first), []
    length = 2 + (tree.depth if tree else 1)  # the prefill's token, then one round (a tree needs depth left)
    for seed in range(400):
        timings = {}
        tokens = list(generator.tokens(PROMPT, max_new_tokens=length, sampling=Sampling(temperature, seed=seed),
                                    timings=timings))
        counts[tokens[1]] += 1
        rounds.append(timings["acceptance"].committed - 1)  # drafts kept in the first round
    # both the acceptance and the resampling path ran (a tree's two candidates are seldom both rejected at
    # T = 0.1: its rejection paths are shown by test_recursive_rejection_sampling_down_a_tree_...)
    assert any(rounds) and (tree is not None or 0 in rounds)
    assert _chi_square_p_value(counts, second) > 1e-3


def test_greedy_chains_across_dense_len_equal_plain_greedy(target_dir):
    """A verification forward crossing InfLLM v2's dense_len: its rows before dense_len attend densely,
    as the decode steps there do (a whole forward run sparse chose otherwise at some of these lengths)."""
    sparse = SparseAttentionConfig(dense_len=96, window_size=16, topk=2, kernel_size=16, kernel_stride=8, block_size=16)

    def runtime():
        return RuntimeModel(load_runtime_model(target_dir, torch.float32), make_attention(sparse))

    target = runtime()
    for length in range(86, 95):
        prompt = [(7 * i) % 300 + 5 for i in range(length)]
        want = list(TextGenerator(target, None, set()).tokens(prompt, max_new_tokens=12))
        generator = TextGenerator(target, None, set(), drafter=ModelDrafter(runtime(), target.config.vocab_size),
                                  draft_tokens=5)
        timings = {}
        assert list(generator.tokens(prompt, max_new_tokens=12, timings=timings)) == want, length
        acceptance = timings["acceptance"]  # the target drafting for itself, through its sparse attention
        assert acceptance.accepted_at == acceptance.reached, length


def test_greedy_with_a_sparse_infllm_target_equals_plain_greedy(target_dir, tmp_path):
    """InfLLM v2 past dense_len: cropping rejected drafts keeps the compressed keys of kept positions."""
    sparse = {"dense_len": 64, "window_size": 32, "topk": 2, "kernel_size": 16, "kernel_stride": 8, "block_size": 16}
    prompt = [(7 * i) % 300 + 5 for i in range(90)]
    plain = load_text_generator(target_dir, dtype=torch.float32, sparse="on", sparse_overrides=sparse)
    speculative = load_text_generator(target_dir, dtype=torch.float32, sparse="on", sparse_overrides=sparse,
                                      draft=write_tiny_eagle3_head(tmp_path / "head", target_dir), draft_tokens=3)
    speculative.drafter = CorruptingDrafter(speculative.runtime, 3)  # keeps 2 of 3: crops every round
    got = speculative.generate(prompt, max_new_tokens=24)
    assert got.tokens == plain.generate(prompt, max_new_tokens=24).tokens
    assert got.acceptance["tau"] == 3.0


@pytest.mark.parametrize("prompt_length", [90, 60])
def test_greedy_with_a_draft_tree_on_a_sparse_infllm_target_equals_plain_greedy(target_dir, tmp_path, prompt_length):
    """Past dense_len (and crossing it: a 60-token prompt), each tree node attends as a decode step at its
    position would (``sparse_tree_attention``): the target drafting for itself through trees, and an
    EAGLE-3 head's trees, give plain greedy output."""
    sparse = {"dense_len": 64, "window_size": 32, "topk": 2, "kernel_size": 16, "kernel_stride": 8, "block_size": 16}
    prompt = [(7 * i) % 300 + 5 for i in range(prompt_length)]
    tree = TreeShape(3, 2, 10)  # unpruned: every grown node verified

    def runtime():
        attention = make_attention(SparseAttentionConfig(**sparse))
        return RuntimeModel(load_runtime_model(target_dir, torch.float32), attention)

    target = runtime()
    want = list(TextGenerator(target, None, set()).tokens(prompt, max_new_tokens=25))
    oracle = TextGenerator(target, None, set(), drafter=ModelDrafter(runtime(), target.config.vocab_size),
                           draft_tree=tree)
    timings = {}
    assert list(oracle.tokens(prompt, max_new_tokens=25, timings=timings)) == want
    # its first level always holds the target's token; deeper, EAGLE-2's growth by cumulative score can
    # leave the greedy branch out of a tiny random model's flat distributions
    assert timings["acceptance"].position_rates[0] == 1.0 and timings["acceptance"].tau > tree.depth
    plain = load_text_generator(target_dir, dtype=torch.float32, sparse="on", sparse_overrides=sparse)
    head = load_text_generator(target_dir, dtype=torch.float32, sparse="on", sparse_overrides=sparse,
                               draft=write_tiny_eagle3_head(tmp_path / "head", target_dir),
                               draft_tree=TreeShape(3, 4, 12))
    assert head.generate(prompt, max_new_tokens=25).tokens == plain.generate(prompt, max_new_tokens=25).tokens


def test_cli_generate_and_chat_with_a_draft(target_dir, tmp_path):
    from click.testing import CliRunner

    from quantkit.cli import main

    runner = CliRunner()
    common = ["--model", str(target_dir), "--prompt", "hello", "--raw", "--max-new-tokens", "9", "--json"]
    plain = json.loads(runner.invoke(main, ["generate", *common]).output)
    result = runner.invoke(main, ["generate", *common, "--draft", str(target_dir), "--draft-tokens", "3"])
    assert result.exit_code == 0, result.output
    speculative = json.loads(result.output)
    assert speculative["tokens"] == plain["tokens"] and plain["speculative"] is None
    if len(speculative["tokens"]) == 9:  # no stop token: 1 + 2 rounds of 4
        assert speculative["speculative"]["tau"] == 4.0
    head = write_tiny_eagle3_head(tmp_path / "head", target_dir)
    result = runner.invoke(main, ["chat", "--model", str(target_dir), "--max-new-tokens", "4", "--draft", str(head)],
                           input="hello\nagain\n/exit\n")
    assert result.exit_code == 0, result.output
    assert result.output.count("model> ") == 2


def test_the_tree_mask_equals_verifying_each_branch_separately(target_dir):
    """Every node's logits from one tree forward equal a plain forward of the prefix and its branch."""
    runtime = _runtime(target_dir)
    tree = DraftTree(tokens=[30, 31, 40, 41, 42, 50], parents=[-1, -1, 0, 0, 1, 3], scores=[0.0] * 6)
    cache = runtime.new_cache()
    runtime.forward(torch.tensor(PROMPT[:-1]), cache)
    start = cache.length
    logits, _ = runtime.forward_capturing(torch.tensor([PROMPT[-1], *tree.tokens]), cache, (),
                                          tree=tree.verification(start))
    for node in range(-1, len(tree.tokens)):
        branch = PROMPT + [tree.tokens[n] for n in tree.lineage(node)]
        want = runtime.forward(torch.tensor(branch), runtime.new_cache())
        torch.testing.assert_close(logits[node + 1], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", ["3x2x10", "2x4x20"])
def test_greedy_with_a_draft_tree_equals_plain_greedy(target_dir, tmp_path, shape):
    """The target drafting for itself through an unpruned tree (size = every node grown) keeps its top
    branch: tau = depth + 1, and the cache, compacted to that branch every round, equals a fresh
    prefill. A pruned tree from an EAGLE-3 head gives plain greedy output too."""
    tree = TreeShape.parse(shape)
    runtime = _runtime(target_dir)
    generator = TextGenerator(runtime, None, set(),
                              drafter=ModelDrafter(_runtime(target_dir), runtime.config.vocab_size), draft_tree=tree)
    cache, timings = runtime.new_cache(), {}
    tokens = list(generator.tokens(PROMPT, max_new_tokens=1 + 4 * (tree.depth + 1), cache=cache, timings=timings))
    assert tokens == _plain_greedy(target_dir, len(tokens))
    assert timings["acceptance"].tau == tree.depth + 1
    fresh = runtime.new_cache()
    runtime.forward(torch.tensor(PROMPT + tokens[:-1]), fresh)
    for layer in range(runtime.config.num_hidden_layers):
        for got, want in zip(cache.buffers(layer, cache.length), fresh.buffers(layer, fresh.length)):
            torch.testing.assert_close(got[:, :cache.length], want[:, :fresh.length], rtol=1e-5, atol=1e-5)
    head = load_text_generator(target_dir, dtype=torch.float32,
                               draft=write_tiny_eagle3_head(tmp_path / "head", target_dir),
                               draft_tree=TreeShape(tree.depth, tree.topk, tree.size // 2))
    assert head.generate(PROMPT, max_new_tokens=20).tokens == _plain_greedy(target_dir, 20)[:20]


def test_tree_shapes_are_checked():
    assert TreeShape.parse("3x4x12") == TreeShape(3, 4, 12)
    with pytest.raises(ValueError, match="DEPTHxTOPKxSIZE"):
        TreeShape.parse("3x4")
    with pytest.raises(ValueError, match="at most 6 nodes"):
        TreeShape(2, 2, 7)


def test_the_drafts_window_hides_old_positions_and_keeps_greedy_output(target_dir, tmp_path):
    """--draft-window: the head attends the last W verified positions; its own draft entries stay visible.
    A window wider than the text changes nothing; any window keeps the target's greedy output."""
    head_dir = write_tiny_eagle3_head(tmp_path / "head", target_dir)
    runtime = _runtime(target_dir)
    head = load_head(head_dir, runtime.config)
    drafter = Eagle3Drafter(head, runtime.model.model.embed_tokens, window=2)
    logits, states = runtime.forward_capturing(torch.tensor(PROMPT), runtime.new_cache(), drafter.aux_layers)
    drafter.observe(torch.tensor(PROMPT), states, torch.tensor(PROMPT[1:] + [int(logits[-1].argmax())]))
    mask = drafter._windowed(torch.tensor([11, 12]), None, None)  # two draft steps after 11 verified slots
    assert torch.nonzero(mask[0]).flatten().tolist() == [10, 11]  # verified 10 (11 - 2 < 10), its own entry
    assert torch.nonzero(mask[1]).flatten().tolist() == [11, 12]  # the chain's earlier entry stays visible
    want = _plain_greedy(target_dir, 24)
    proposals = {}
    for window in (None, 1, 4, 1000):
        generator = load_text_generator(target_dir, dtype=torch.float32, draft=head_dir, draft_window=window)
        result = generator.generate(PROMPT, max_new_tokens=24)
        assert result.tokens == want[:len(result.tokens)]
        proposals[window] = generator.drafter.propose(3, Sampler(Sampling()))
    assert proposals[1000] == proposals[None]


def test_tree_masks_follow_each_nodes_lineage():
    """The vectorised masks mark exactly each node's lineage: the target's verification (cache, root,
    lineage; a node at its depth) and a drafter's (its context, its ancestors' slots, its own entry)."""
    tree = DraftTree(tokens=[30, 31, 40, 41, 42, 50], parents=[-1, -1, 0, 0, 1, 3], scores=[0.0] * 6)
    positions, mask = tree.verification(5)
    assert positions.tolist() == [5, 6, 6, 7, 7, 7, 8]
    assert mask[:, :6].all()
    for node in range(len(tree.tokens)):
        assert mask[1 + node, 6:].nonzero().flatten().tolist() == tree.lineage(node)
    slots = {0: 20, 1: 21, 2: 22, 3: 23, 4: 24}
    drafter_mask = tree_attention_mask(tree, [5, 2], slots, 8, 25)
    assert drafter_mask[0].nonzero().flatten().tolist() == [*range(8), 20, 23, 25]  # nodes 0, 3, then 5 itself
    assert drafter_mask[1].nonzero().flatten().tolist() == [*range(8), 20, 26]


@pytest.mark.parametrize("drafts", [0, 1, 3, 5])
def test_a_chains_verification_is_its_one_branch_trees(drafts):
    """A chain round's positions and mask, made directly, equal those of the chain as a draft tree."""
    chain = DraftTree(list(range(drafts)), list(range(-1, drafts - 1)), [0.0] * drafts)
    for got, want in zip(chain_verification(7, drafts), chain.verification(7)):
        assert torch.equal(got, want)


def test_a_chat_keeps_the_drafts_context_across_turns(target_dir, tmp_path):
    """Turn two continues the draft head's cache as the target's: its context then equals a fresh head's
    that saw the whole conversation at once (and the replies stay plain greedy's)."""
    from quantkit.kernels.chat import ChatSession

    head = write_tiny_eagle3_head(tmp_path / "head", target_dir)
    generator = load_text_generator(target_dir, dtype=torch.float32, draft=head, draft_tokens=3)
    session = ChatSession(generator)
    for text in ("hello", "and again"):
        "".join(session.reply(text, max_new_tokens=6))
    second_prompt = generator.chat_prompt(session.messages[:3], enable_thinking=session.enable_thinking)
    fresh = load_text_generator(target_dir, dtype=torch.float32, draft=head, draft_tokens=3)
    answer = list(fresh.tokens(second_prompt, max_new_tokens=6))
    assert generator.tokenizer.decode(answer, skip_special_tokens=True) == session.messages[3]["content"]
    kept, whole = generator.drafter, fresh.drafter
    assert kept._observed == whole._observed == session.cache.length > len(second_prompt)
    for got, want in zip(kept._cache.buffers(0, kept._observed), whole._cache.buffers(0, whole._observed)):
        torch.testing.assert_close(got[:, :kept._observed], want[:, :whole._observed], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kept._last, whole._last, rtol=1e-5, atol=1e-5)
