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

    def reset(self) -> None: ...

    def observe(self, states: dict[int, torch.Tensor], next_tokens: torch.Tensor) -> None: ...

    def propose(self, count: int, sampler: Sampler) -> tuple[list[int], list[torch.Tensor] | None]: ...


@dataclass
class Acceptance:
    """What the rounds of one generation accepted."""

    draft_tokens: int
    rounds: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [i]: rounds whose drafts 0..i were all kept

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.draft_tokens

    def add(self, accepted: int) -> None:
        self.rounds += 1
        self.accepted += accepted
        for position in range(accepted):
            self.accepted_at[position] += 1

    @property
    def tau(self) -> float:
        """Tokens committed per target forward (accepted drafts + the target's own token)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        return {"draft_tokens": self.draft_tokens, "rounds": self.rounds, "accepted": self.accepted,
                "tau": self.tau, "acceptance_at": [n / self.rounds if self.rounds else 0.0 for n in self.accepted_at]}


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
            drafter.observe(states, ids[start + 1:end + 1])
    token = sampler(logits[-1])
    drafter.observe(states, torch.cat([ids[start + 1:], torch.tensor([token])]))
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
            acceptance.add(kept)
        cache.crop(position + kept + 1)
        committed = [*drafts[:kept], after]
        drafter.observe({layer: state[:kept + 1] for layer, state in states.items()}, torch.tensor(committed))
