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

τ (the acceptance length) is the mean number of tokens a round commits, the target's own included,
as the EAGLE papers and vLLM report it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch
from quantkit.kernels.kv_cache import KVCache
from quantkit.kernels.model import RuntimeModel
from quantkit.kernels.sampling import Sampler


class Drafter(Protocol):
    aux_layers: tuple[int, ...]  # target layers whose entering residual states the drafter reads

    def reset(self) -> None:
        """Forget the sequence (a new prompt)."""

    def observe(self, tokens: torch.Tensor, states: dict[int, torch.Tensor], next_tokens: torch.Tensor) -> None:
        """Verified context: the tokens [T] at the next T positions, the target's states there [T, Ht]
        (entering ``aux_layers``), and the token that follows each position [T]."""

    def propose(self, count: int, sampler: Sampler) -> tuple[list[int], list[torch.Tensor] | None]:
        """``count`` draft tokens after the observed context; when ``sampler`` samples, also each one's
        draft distribution over the target vocabulary (what verification needs)."""


class ModelDrafter:
    """A whole model drafting (a smaller model with the target's tokenizer, or the target itself), on
    its own KV cache; the entries its proposals computed are kept where verification kept the tokens."""

    aux_layers: tuple[int, ...] = ()

    def __init__(self, runtime: RuntimeModel, target_vocab_size: int):
        if runtime.config.vocab_size != target_vocab_size:
            raise ValueError(f"target and draft vocabularies differ ({target_vocab_size} vs "
                             f"{runtime.config.vocab_size}): a draft must share the target's tokenizer")
        self.runtime = runtime
        self.reset()

    def reset(self) -> None:
        self._cache, self._observed, self._next = self.runtime.new_cache(), 0, None

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


def speculative_tokens(runtime: RuntimeModel, drafter: Drafter, prompt: list[int], max_new_tokens: int,
                       sampler: Sampler, cache: KVCache, draft_tokens: int, stop_tokens: set[int],
                       prefill_chunk: int, acceptance: Acceptance) -> Iterator[int]:
    """New tokens until a stop token (not yielded) or ``max_new_tokens``, drafting ``draft_tokens`` a
    round; ``acceptance`` collects each round's count. Returns (``yield from``) the stop reason."""
    layers = drafter.aux_layers
    drafter.reset()
    ids = torch.tensor(prompt, dtype=torch.long)
    for start in range(0, len(prompt), prefill_chunk):  # the drafter sees each chunk once its next tokens are known
        logits, states = runtime.forward_capturing(ids[start:start + prefill_chunk], cache, layers)
        end = start + logits.shape[0]
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
        # a round commits at most drafts + 1 tokens: draft no more than the budget can use
        drafts, draft_probs = drafter.propose(min(draft_tokens, max_new_tokens - emitted - 1), sampler)
        block = torch.tensor([token, *drafts], dtype=torch.long)
        position = cache.length
        logits, states = runtime.forward_capturing(block, cache, layers)
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
