"""Speculative decoding: a drafter proposes tokens, the target checks them all in one forward.

Each round the drafter proposes ``k`` tokens after the last committed one; the target runs on the
committed token and the ``k`` drafts (one forward, ``k + 1`` positions) and keeps the longest
acceptable prefix plus one token of its own, so a round commits between 1 and ``k + 1`` tokens. The
target's KV cache is cropped back to the kept positions and the drafter is shown the target's states
there.

- Greedy: a draft is kept while it equals the target's argmax, so the output is token for token
  the target's plain greedy output.
- Sampled: speculative sampling (Leviathan et al., ICML 2023, arXiv 2211.17192; Chen et al. 2023,
  arXiv 2302.01318): draft d, drawn from the draft's q, is kept with probability min(1, p(d)/q(d));
  at the first rejection the token is drawn from max(p − q, 0) renormalised. The committed tokens are
  distributed exactly as the target's own sampling (p after temperature and top-p) would give them.

The drafter can also draft a tree (EAGLE-2's dynamic tree, Li et al., arXiv 2406.16858): it expands
``topk`` continuations of a node ``depth`` times, keeping the ``topk`` best partial paths by
cumulative log-probability at each depth; the target verifies every branch in one forward under a
tree attention mask.

- Greedy: the ``topk`` most likely continuations; the ``size`` best nodes are sent, and the target
  keeps the longest branch that matches its own argmax.
- Sampled: each expanded node's ``topk`` children are drawn from the draft's q without replacement
  and verified by recursive rejection sampling (Jeon et al., "Recursive Speculative Decoding",
  arXiv 2402.14160; SpecInfer, Miao et al., arXiv 2305.09781): child i is kept with probability
  min(1, pᵢ(x)/qᵢ(x)); on rejection p ← max(pᵢ − qᵢ, 0) renormalised and x leaves q (renormalised);
  when every child is rejected the token is drawn from what p has become. The committed tokens
  follow the target's own sampling exactly, provided that whether a node's children are verified
  never depends on the children themselves: so a sampled tree keeps or drops each node's children
  as a whole (by the parent's score), never some of them by their own scores.

τ (the acceptance length) is the mean number of tokens a round commits, the target's own included,
as the EAGLE papers and vLLM report it.
"""
from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch

from quantkit.kernels.kv_cache import KVCache
from quantkit.kernels.model import RuntimeModel, causal_mask
from quantkit.kernels.sampling import Sampler


class Drafter(Protocol):
    aux_layers: tuple[int, ...]  # target layers whose entering residual states the drafter reads

    def crop(self, length: int) -> None:
        """Keep the context of the first ``length`` observed positions, where the target's cache continues
        (a chat's next turn); 0 starts a new sequence."""

    def observe(self, tokens: torch.Tensor, states: dict[int, torch.Tensor], next_tokens: torch.Tensor) -> None:
        """Verified context: the tokens [T] at the next T positions, the target's states there [T, Ht]
        (entering ``aux_layers``), and the token that follows each position [T]."""

    def propose(self, count: int, sampler: Sampler) -> tuple[list[int], list[torch.Tensor] | None]:
        """``count`` draft tokens after the observed context; when ``sampler`` samples, also each one's
        draft distribution over the target vocabulary (what verification needs)."""

    def propose_tree(self, shape: TreeShape, sampler: Sampler) -> DraftTree:
        """A draft tree after the observed context: greedy, or drawn with ``sampler`` (``draft_children``),
        each drawn family with its distribution over the target vocabulary."""


@dataclass(frozen=True)
class TreeShape:
    """EAGLE-2's dynamic tree: ``depth`` expansions of the ``topk`` best partial paths, ``size`` nodes
    kept (CPM.cu's --spec-num-iter, --spec-topk-per-iter, --spec-tree-size)."""

    depth: int = 3
    topk: int = 4
    size: int = 12

    def __post_init__(self):
        if min(self.depth, self.topk, self.size) < 1:
            raise ValueError(f"a draft tree needs depth, topk and size >= 1, got {self}")
        if self.size > self.topk + self.topk ** 2 * (self.depth - 1):
            raise ValueError(f"a tree of depth {self.depth} and topk {self.topk} has at most "
                             f"{self.topk + self.topk ** 2 * (self.depth - 1)} nodes, not {self.size}")

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """``DEPTHxTOPKxSIZE``, e.g. ``3x4x12``."""
        try:
            depth, topk, size = (int(part) for part in text.lower().split("x"))
        except ValueError as e:
            raise ValueError(f"a draft tree is DEPTHxTOPKxSIZE (e.g. 3x4x12), got {text!r}") from e
        return cls(depth, topk, size)


@dataclass
class DraftTree:
    """Draft tokens as a tree under the last committed token (the root, not a node): node i holds
    ``tokens[i]`` after node ``parents[i]`` (−1: the root), with the cumulative draft log-probability
    ``scores[i]``. Parents come before their children."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    # sampled trees: node (−1: the root) -> the draft distribution over the target vocabulary its
    # children were drawn from (in node order, without replacement)
    drafts: dict[int, torch.Tensor] = field(default_factory=dict)

    def children(self) -> dict[int, list[int]]:
        """node (−1: the root) -> its children, in node order."""
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(self.parents):
            children.setdefault(parent, []).append(node)
        return children

    def depth(self, node: int) -> int:
        return 0 if node < 0 else 1 + self.depth(self.parents[node])

    def lineage(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node``."""
        return [] if node < 0 else [*self.lineage(self.parents[node]), node]

    def lineages(self) -> torch.Tensor:
        """[nodes, nodes] bool: row i marks node i and its ancestors; one tensor step per level, not per node."""
        parents = torch.tensor(self.parents, dtype=torch.long)
        rows = torch.arange(len(self.parents))
        lineages = torch.zeros(len(self.parents), len(self.parents), dtype=torch.bool)
        ancestor = rows  # each row's node, then its parent, grandparent, ... (−1 past the root's child)
        while bool((found := ancestor >= 0).any()):
            lineages[rows[found], ancestor[found]] = True
            ancestor = torch.where(found, parents[ancestor.clamp(min=0)], ancestor)
        return lineages

    def best(self, size: int) -> DraftTree:
        """The ``size`` highest-scoring nodes. A child scores at most its parent and ties keep node order,
        so every kept node's parent is kept too."""
        return self._subtree(sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], i))[:size])

    def best_families(self, size: int) -> DraftTree:
        """Whole families (a parent's children) while the nodes fit in ``size``, shallower parents first
        and, at one depth, by the parent's score. Whether a family is kept then depends only on nodes
        no deeper than its parent, never on the family itself, as sampled verification needs."""
        kept: list[int] = []
        families = self.children()
        order = sorted(families, key=lambda n: (self.depth(n), -(self.scores[n] if n >= 0 else 0.0), n))
        for parent in order:
            if (parent < 0 or parent in kept) and len(kept) + len(families[parent]) <= size:
                kept += families[parent]
        return self._subtree(kept)

    def _subtree(self, nodes: list[int]) -> DraftTree:
        kept = sorted(nodes)
        index = {old: new for new, old in enumerate(kept)}
        parents = {self.parents[i] for i in kept}  # a childless node's distribution is not needed
        return DraftTree([self.tokens[i] for i in kept], [index.get(self.parents[i], -1) for i in kept],
                         [self.scores[i] for i in kept],
                         {index.get(node, -1): q for node, q in self.drafts.items() if node in parents})

    def verification(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, mask) of the root and every node verified after ``start`` cached positions: the
        root at ``start``, a node at ``start`` + its depth; each sees the cache, the root, its lineage."""
        lineages, count = self.lineages(), len(self.tokens) + 1
        mask = torch.zeros(count, start + count, dtype=torch.bool)
        mask[:, :start + 1] = True
        mask[1:, start + 1:] = lineages
        return torch.cat((torch.tensor([start]), start + lineages.sum(1))), mask  # a node's depth: its lineage's length


def chain_verification(start: int, drafts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``DraftTree.verification`` of a chain (each of ``drafts`` nodes the child of the one before), made
    directly: causal attention after ``start`` cached positions, in a few tensor operations a round."""
    return torch.arange(start, start + drafts + 1), causal_mask(start, drafts + 1)


def grow_tree(shape: TreeShape, children_of, sampled: bool = False) -> DraftTree:
    """EAGLE-2's tree: ``children_of(frontier, tree)`` runs the drafter on the frontier nodes (−1: the
    root) and returns, per node, its children's (log-probabilities, token ids, and for a ``sampled``
    tree the distribution they were drawn from)."""
    tree, frontier = DraftTree(), [-1]
    for _ in range(shape.depth):
        first = len(tree.tokens)
        for node, (log_probs, tokens, draft) in zip(frontier, children_of(frontier, tree)):
            if draft is not None:
                tree.drafts[node] = draft
            base = 0.0 if node < 0 else tree.scores[node]
            for log_prob, token in zip(log_probs.tolist(), tokens.tolist()):
                tree.tokens.append(int(token))
                tree.parents.append(node)
                tree.scores.append(base + log_prob)
        frontier = sorted(range(first, len(tree.tokens)), key=lambda i: (-tree.scores[i], i))[:shape.topk]
    return tree.best_families(shape.size) if sampled else tree.best(shape.size)


def draft_children(logits: torch.Tensor, topk: int, sampler: Sampler) -> list[tuple]:
    """Per row of ``logits`` [rows, V] (a drafter's, over its vocabulary): the ``topk`` children as
    (log-probabilities, ids, distribution). Greedy: the most likely ids, no distribution. Sampled: ids
    drawn from q = softmax(logits / T) without replacement (Gumbel top-k: the k largest of
    log q + Gumbel noise), at most as many as q has non-zero entries, in the order drawn."""
    if sampler.settings.temperature == 0:  # only ranks: float32, and no full log-softmax row
        logits = logits.float()
        values, ids = logits.topk(topk, dim=-1)
        return [(v, i, None) for v, i in zip(values - torch.logsumexp(logits, -1, keepdim=True), ids)]
    log_q = torch.log_softmax(logits.double() / sampler.settings.temperature, -1)
    children = []
    for row in log_q:
        _, ids = (row + sampler.gumbel(row.shape)).topk(min(topk, int(torch.isfinite(row).sum())))
        children.append((row[ids], ids, row.exp()))
    return children


def tree_attention_mask(tree: DraftTree, frontier: list[int], slots: dict[int, int], visible: int,
                        cache_length: int) -> torch.Tensor:
    """A drafter's mask for running ``frontier`` nodes after ``cache_length`` cached entries: the first
    ``visible`` entries (its verified context), each node's ancestors at their ``slots``, itself."""
    rows, nodes = torch.arange(len(frontier)), torch.tensor(frontier)
    mask = torch.zeros(len(frontier), cache_length + len(frontier), dtype=torch.bool)
    mask[:, :visible] = True
    mask[rows, cache_length + rows] = True
    ancestors = tree.lineages()[nodes]
    ancestors[rows, nodes] = False  # a node's own entry is the new one
    slot_of = torch.tensor([slots.get(node, -1) for node in range(len(tree.tokens))])
    row, ancestor = ancestors.nonzero(as_tuple=True)
    mask[row, slot_of[ancestor]] = True
    return mask


class ModelDrafter:
    """A whole model drafting (a smaller model with the target's tokenizer, or the target itself), on
    its own KV cache; the entries its proposals computed are kept where verification kept the tokens."""

    aux_layers: tuple[int, ...] = ()

    def __init__(self, runtime: RuntimeModel, target_vocab_size: int):
        if runtime.config.vocab_size != target_vocab_size:
            raise ValueError(f"target and draft vocabularies differ ({target_vocab_size} vs "
                             f"{runtime.config.vocab_size}): a draft must share the target's tokenizer")
        self.runtime = runtime
        self.crop(0)

    def crop(self, length: int) -> None:
        if length == 0:
            self._cache = self.runtime.new_cache(self.runtime.attention.compressed_keys)
        elif length > self._observed:
            raise ValueError(f"the draft has observed {self._observed} positions, not {length}")
        self._cache.crop(length)
        self._observed, self._next = length, None

    def observe(self, tokens: torch.Tensor, states: dict[int, torch.Tensor], next_tokens: torch.Tensor) -> None:
        keep = min(self._cache.length, self._observed + len(tokens))  # a proposal already ran these tokens
        self._cache.crop(keep)
        if keep < self._observed + len(tokens):
            self.runtime.forward(tokens[keep - self._observed:], self._cache)
        self._observed += len(tokens)
        self._next = int(next_tokens[-1])

    def propose(self, count: int, sampler: Sampler) -> tuple[list[int], list[torch.Tensor] | None]:
        greedy = sampler.settings.temperature == 0
        tokens, distributions, token = [], [], self._next
        for _ in range(count):
            logits = self.runtime.forward(torch.tensor([token]), self._cache)
            if greedy:
                token = int(logits.argmax())
            else:
                distributions.append(torch.softmax(logits.double() / sampler.settings.temperature, dim=-1))
                token = sampler.draw(distributions[-1])
            tokens.append(token)
        return tokens, None if greedy else distributions

    def propose_tree(self, shape: TreeShape, sampler: Sampler) -> DraftTree:
        root_logits = self.runtime.forward(torch.tensor([self._next]), self._cache)  # the committed token
        context, slots = self._cache.length, {}  # verified context + the root; node -> cache slot

        def children_of(frontier: list[int], tree: DraftTree):
            if frontier == [-1]:
                logits = root_logits[None]
            else:
                start = self._cache.length
                positions = torch.tensor([context - 1 + tree.depth(node) for node in frontier])
                mask = tree_attention_mask(tree, frontier, slots, context, start)
                logits, _ = self.runtime.forward_capturing(torch.tensor([tree.tokens[n] for n in frontier]),
                                                           self._cache, (), tree=(positions, mask))
                slots.update({node: start + row for row, node in enumerate(frontier)})
            return draft_children(logits, shape.topk, sampler)

        tree = grow_tree(shape, children_of, sampled=sampler.settings.temperature > 0)
        self._cache.crop(self._observed)  # expansions are not the verified sequence
        return tree


@dataclass
class Acceptance:
    """What the rounds of one or more generations accepted, ``draft_tokens`` drafts a round."""

    draft_tokens: int
    rounds: int = 0  # target forwards that verified drafts
    committed: int = 0  # tokens those rounds committed, the target's own included
    accepted_at: list[int] = field(default_factory=list)  # [i]: rounds whose draft i was kept
    reached: list[int] = field(default_factory=list)  # [i]: rounds that verified draft i (all before it kept)

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.draft_tokens
        self.reached = self.reached or [0] * self.draft_tokens

    def add_round(self, drafted: int, kept: int) -> None:
        self.rounds += 1
        self.committed += kept + 1
        for position in range(min(kept + 1, drafted)):
            self.reached[position] += 1
            self.accepted_at[position] += position < kept

    def merge(self, other: Acceptance) -> None:
        self.rounds += other.rounds
        self.committed += other.committed
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at)]
        self.reached = [a + b for a, b in zip(self.reached, other.reached)]

    @property
    def tau(self) -> float:
        """Tokens committed per target forward (accepted drafts + the target's own token)."""
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def position_rates(self) -> list[float]:
        """P(draft i kept | every draft before it was)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]

    def to_dict(self) -> dict:
        return {"draft_tokens": self.draft_tokens, "rounds": self.rounds, "committed": self.committed,
                "tau": self.tau, "position_rates": self.position_rates}


def verify_greedy(drafts: list[int], logits: torch.Tensor) -> tuple[int, int]:
    """logits [len(drafts) + 1, V] of the target at the committed token and each draft -> (drafts kept,
    the target's token after them)."""
    predicted = logits.argmax(-1).tolist()
    kept = 0
    while kept < len(drafts) and drafts[kept] == predicted[kept]:
        kept += 1
    return kept, predicted[kept]


def verify_tree_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """logits [1 + nodes, V] of the target at the root and each node -> (the longest branch whose tokens
    follow the target's argmax, as nodes; the target's token after it)."""
    predicted = logits.argmax(-1).tolist()
    children: dict[int, dict[int, int]] = {}
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        children.setdefault(parent, {}).setdefault(token, node)
    path, node = [], -1
    while (child := children.get(node, {}).get(predicted[node + 1])) is not None:
        path.append(child)
        node = child
    return path, predicted[node + 1]


def verify_tree_sampled(tree: DraftTree, logits: torch.Tensor, sampler: Sampler) -> tuple[list[int], int]:
    """Recursive rejection sampling down a sampled tree: logits [1 + nodes, V] of the target at the root
    and each node -> (the kept branch, as nodes; the token drawn after it)."""
    families, path, node = tree.children(), [], -1
    while True:
        p, q = sampler.probabilities(logits[node + 1]), tree.drafts.get(node)
        for child in families.get(node, []):
            token = tree.tokens[child]
            if sampler.uniform() * float(q[token]) < float(p[token]):  # u < p/q without dividing by q
                path.append(child)
                node = child
                break
            residual = (p - q.to(p.dtype)).clamp_(min=0)
            p = residual / residual.sum() if float(residual.sum()) > 0 else p
            q = q.clone()
            q[token] = 0
            q /= q.sum()
        else:
            return path, sampler.draw(p)


def verify_sampled(drafts: list[int], draft_probs: list[torch.Tensor], logits: torch.Tensor,
                   sampler: Sampler) -> tuple[int, int]:
    """Speculative sampling over a chain: (drafts kept, the next token), drawn with ``sampler``."""
    for position, (token, q) in enumerate(zip(drafts, draft_probs)):
        p = sampler.probabilities(logits[position])
        if sampler.uniform() * float(q[token]) < float(p[token]):  # u < p/q without dividing by q
            continue
        residual = (p - q.to(p.dtype)).clamp_(min=0)
        return position, sampler.draw(residual if float(residual.sum()) > 0 else p)
    return len(drafts), sampler(logits[len(drafts)])


AUTO = "auto"  # --draft-tokens auto: ``AutoChain``
AUTO_LONGEST = 5  # the longest chain AutoChain drafts
# P(draft i kept | every draft before it was) of MiniCPM4.1's EAGLE-3 head, from OpenBMB's per-position
# acceptance (0.58, 0.34, 0.22 of the rounds keep drafts 1, 2, 3); the last holds further on. A generation's
# own counts outweigh this prior after a few rounds.
PRIOR_RATES = (0.58, 0.34 / 0.58, 0.22 / 0.34)
PRIOR_ROUNDS = 4
RECENT_ROUNDS = 8  # round times kept per chain length: their median is its cost
RETIME_EVERY = 16  # rounds between re-timing the length timed longest ago (costs grow with the context)


@dataclass
class FixedChain:
    """``length`` drafts every round (fewer only where the generation ends sooner)."""

    length: int

    def next(self, budget: int) -> int:
        return min(self.length, budget)

    def record(self, drafted: int, seconds: float) -> None:
        pass


class AutoChain:
    """``--draft-tokens auto``: each round drafts the chain, 0 (a plain step, the head still observing) to
    ``acceptance.draft_tokens`` long, that is expected to commit the most tokens a second on this machine,
    target and text: a chain of k commits 1 + sum over j <= k of r_1 ... r_j tokens on average, r_i this
    generation's acceptance at position i (``acceptance``'s counts, with ``PRIOR_RATES`` as a prior), and
    costs the median time of its recent rounds, each length timed once before the first choice and re-timed
    in turn. Verification's cost is not linear in the rows (the integer kernels change tiling past a few
    rows), so every length is timed rather than fitted."""

    def __init__(self, acceptance: Acceptance):
        self.acceptance = acceptance
        self.longest = acceptance.draft_tokens
        self.seconds: dict[int, list[float]] = {}
        self.timed_at: dict[int, int] = {}
        self.chosen: Counter[int] = Counter()

    def rates(self) -> list[float]:
        prior = [PRIOR_RATES[min(i, len(PRIOR_RATES) - 1)] for i in range(self.longest)]
        return [(kept + rate * PRIOR_ROUNDS) / (reached + PRIOR_ROUNDS)
                for kept, reached, rate in zip(self.acceptance.accepted_at, self.acceptance.reached, prior)]

    def expected_tokens(self, length: int) -> float:
        total = reach = 1.0
        for rate in self.rates()[:length]:
            reach *= rate
            total += reach
        return total

    def tokens_per_second(self, length: int) -> float:
        return self.expected_tokens(length) / statistics.median(self.seconds[length])

    def next(self, budget: int) -> int:
        lengths = range(self.longest + 1)
        untimed = [length for length in lengths if length not in self.seconds]
        rounds = sum(self.chosen.values())
        if untimed:
            length = untimed[0]
        elif rounds % RETIME_EVERY == RETIME_EVERY - 1:
            length = min(lengths, key=self.timed_at.__getitem__)
        else:
            length = max(lengths, key=self.tokens_per_second)
        return min(length, budget)

    def record(self, drafted: int, seconds: float) -> None:
        """A round of ``drafted`` drafts (``acceptance`` has counted what it kept) took ``seconds``."""
        self.chosen[drafted] += 1
        self.seconds[drafted] = [*self.seconds.get(drafted, [])[1 - RECENT_ROUNDS:], seconds]
        self.timed_at[drafted] = sum(self.chosen.values())


def speculative_tokens(runtime: RuntimeModel, drafter: Drafter, prompt: list[int], max_new_tokens: int,
                       sampler: Sampler, cache: KVCache, chain: FixedChain | AutoChain, stop_tokens: set[int],
                       prefill_chunk: int, acceptance: Acceptance, tree: TreeShape | None = None) -> Iterator[int]:
    """New tokens until a stop token (not yielded) or ``max_new_tokens``, drafting a chain of the length
    ``chain`` gives each round (or, with ``tree``, a tree); ``acceptance`` collects each round's count.
    Returns (``yield from``) the stop reason."""
    if not prompt:
        raise ValueError("the prompt is empty")
    layers = drafter.aux_layers
    drafter.crop(cache.length)  # a continued cache (a chat's next turn) keeps the draft's context too
    ids = torch.tensor(prompt, dtype=torch.long)
    for start in range(0, len(prompt), prefill_chunk):  # the drafter sees each chunk once its next tokens are known
        end = min(start + prefill_chunk, len(prompt))
        logits, states = runtime.forward_capturing(ids[start:end], cache, layers, last_only=True)
        if end < len(prompt):
            drafter.observe(ids[start:end], states, ids[start + 1:end + 1])
    token = sampler(logits[-1])
    drafter.observe(ids[start:], states, torch.cat([ids[start + 1:], torch.tensor([token])]))
    committed, emitted = [token], 0
    while True:
        for token in committed:
            if token in stop_tokens:
                return "stop token"
            yield token
            emitted += 1
            if emitted == max_new_tokens:
                return "length"
        position, budget = cache.length, max_new_tokens - emitted - 1  # a round commits at most drafts + 1
        if tree is not None and budget >= tree.depth:
            drafted = drafter.propose_tree(tree, sampler)
            block = torch.tensor([token, *drafted.tokens], dtype=torch.long)
            logits, states = runtime.forward_capturing(block, cache, layers, drafted.verification(position))
            path, after = (verify_tree_greedy(drafted, logits) if sampler.settings.temperature == 0
                           else verify_tree_sampled(drafted, logits, sampler))
            acceptance.add_round(tree.depth, len(path))
            rows = [0, *(1 + node for node in path)]
            cache.keep(position, [position + row for row in rows])
            committed = [*(drafted.tokens[node] for node in path), after]
            drafter.observe(block[rows], {layer: state[rows] for layer, state in states.items()},
                            torch.tensor(committed))
            continue
        started = time.perf_counter()
        drafts, draft_probs = drafter.propose(chain.next(budget), sampler)
        block = torch.tensor([token, *drafts], dtype=torch.long)
        # verified as a one-branch tree: each row then attends as a decode step at its position would,
        # also where InfLLM v2 would run a whole forward crossing dense_len sparse
        logits, states = runtime.forward_capturing(block, cache, layers, chain_verification(position, len(drafts)))
        if draft_probs is None:
            kept, after = verify_greedy(drafts, logits)
        else:
            kept, after = verify_sampled(drafts, draft_probs, logits, sampler)
        if drafts:
            acceptance.add_round(len(drafts), kept)
        cache.crop(position + kept + 1)
        committed = [*drafts[:kept], after]
        drafter.observe(block[:kept + 1], {layer: state[:kept + 1] for layer, state in states.items()},
                        torch.tensor(committed))
        chain.record(len(drafts), time.perf_counter() - started)
