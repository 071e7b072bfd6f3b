"""Speculative decoding acceptance: how many tokens a draft model lets the target commit per forward.

Each round the draft proposes a chain of k tokens, one at a time; the target scores all of them in
one forward. Greedy: draft tokens are accepted while they equal the target's argmax, then the
target's own token is committed (its correction, or the bonus token after k accepts). Sampled at
temperature T: the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023), accept x
with probability min(1, p(x)/q(x)), on rejection draw from max(0, p − q) normalised, after k
accepts draw the bonus from p, so that the output is distributed exactly as the target's own
samples. τ = tokens committed / target forwards, counting the target's token; a target drafting
for itself gives τ = k + 1 under greedy decoding, an unrelated draft about 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache


@dataclass
class AcceptanceStats:
    k: int
    rounds: int = 0  # target forwards
    committed: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [k]: rounds whose draft position i was accepted
    reached: list[int] = field(default_factory=list)  # [k]: rounds that got as far as draft position i

    def __post_init__(self) -> None:
        self.accepted_at = self.accepted_at or [0] * self.k
        self.reached = self.reached or [0] * self.k

    def add_round(self, accepted: int) -> None:
        self.rounds += 1
        self.committed += accepted + 1
        for position in range(min(accepted + 1, self.k)):
            self.reached[position] += 1
            self.accepted_at[position] += position < accepted

    def merge(self, other: "AcceptanceStats") -> None:
        self.rounds += other.rounds
        self.committed += other.committed
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at)]
        self.reached = [a + b for a, b in zip(self.reached, other.reached)]

    @property
    def tau(self) -> float:
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def position_rates(self) -> list[float]:
        """P(draft position i accepted | positions before it were)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]


def _distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.double() / temperature, dim=-1)


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, token: int, generator: torch.Generator) -> tuple[bool, int]:
    """One speculative-sampling decision for a draft ``token`` drawn from ``q``: (accepted, token to commit)."""
    if torch.rand((), generator=generator, dtype=torch.float64) < torch.clamp(p[token] / q[token], max=1.0):
        return True, token
    residual = torch.clamp(p - q, min=0)
    residual = residual / residual.sum() if residual.sum() > 0 else p
    return False, int(torch.multinomial(residual, 1, generator=generator))


class _Stepper:
    """A causal LM with a KV cache that can be cut back to the committed tokens."""

    def __init__(self, model, prompt: torch.Tensor):
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.length = 0  # tokens in the cache
        self.pending = prompt  # tokens committed but not yet in the cache

    @torch.inference_mode()
    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [len(pending) + len(tokens), V] after feeding the pending tokens and ``tokens``."""
        ids = torch.cat([self.pending, tokens])
        logits = self.model(ids[None], cache=self.cache, use_cache=True).logits[0]
        self.length += len(ids)
        self.pending = ids[:0]
        return logits

    def rollback(self, keep: int, pending: torch.Tensor) -> None:
        """Keep the first ``keep`` cached tokens; ``pending`` are committed tokens still to feed."""
        if keep < self.length:
            self.cache.crop(keep - self.length)  # transformers 5: a negative count of tokens to drop
        self.length = keep
        self.pending = pending


@torch.inference_mode()
def speculative_generate(target, draft, prompt: torch.Tensor, k: int, max_new_tokens: int,
                         temperature: float = 0.0, generator: torch.Generator | None = None,
                         stop_ids: tuple[int, ...] = ()) -> tuple[list[int], AcceptanceStats]:
    """Generate up to ``max_new_tokens`` after ``prompt`` [T]; returns (tokens, acceptance statistics)."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"target and draft vocabularies differ ({target.config.vocab_size} vs "
                         f"{draft.config.vocab_size}): a draft must share the target's tokenizer")
    generator = generator or torch.Generator().manual_seed(0)
    stats = AcceptanceStats(k)
    out: list[int] = []
    target_run, draft_run = _Stepper(target, prompt[:-1]), _Stepper(draft, prompt[:-1])
    last = prompt[-1:]
    while len(out) < max_new_tokens:
        base = len(prompt) - 1 + len(out)  # committed tokens before ``last``
        proposed, draft_probs, step = [], [], last
        for _ in range(k):
            logits = draft_run.feed(step)[-1]
            if temperature == 0:
                token = int(logits.argmax())
            else:
                draft_probs.append(_distribution(logits, temperature))
                token = int(torch.multinomial(draft_probs[-1], 1, generator=generator))
            proposed.append(token)
            step = torch.tensor([token])
        target_logits = target_run.feed(torch.cat([last, torch.tensor(proposed)]))[-(k + 1):]
        accepted, commit = 0, None
        for i, token in enumerate(proposed):
            if temperature == 0:
                ok, chosen = token == int(target_logits[i].argmax()), int(target_logits[i].argmax())
            else:
                ok, chosen = accept_or_resample(_distribution(target_logits[i], temperature), draft_probs[i], token,
                                                generator)
            if not ok:
                commit = chosen
                break
            accepted += 1
        if commit is None:  # every draft token accepted: the target's bonus token
            bonus = target_logits[k]
            commit = int(bonus.argmax()) if temperature == 0 else int(
                torch.multinomial(_distribution(bonus, temperature), 1, generator=generator))
        stats.add_round(accepted)
        new = proposed[:accepted] + [commit]
        out += new
        # caches keep ``last`` and the accepted draft tokens; the committed token is fed next round
        target_run.rollback(base + 1 + accepted, torch.tensor([], dtype=torch.long))
        draft_run.rollback(min(draft_run.length, base + 1 + accepted), torch.tensor(
            ([proposed[accepted - 1]] if draft_run.length < base + 1 + accepted else []), dtype=torch.long))
        last = torch.tensor([commit])
        if any(t in stop_ids for t in new):
            break
    return out[:max_new_tokens], stats


def prompt_rows(tokens: torch.Tensor, prompts: int, length: int) -> torch.Tensor:
    """The first ``prompts`` x ``length`` of ``tokens`` as prompts [prompts, length]."""
    if len(tokens) < prompts * length:
        raise ValueError(f"{prompts} prompts of {length} tokens need {prompts * length} tokens, the data gives "
                         f"{len(tokens)}")
    return tokens[:prompts * length].view(prompts, length)


def acceptance(target, draft, prompts: torch.Tensor, k: int, max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0, progress: bool = False, description: str | None = None) -> AcceptanceStats:
    """The acceptance statistics (τ, per-position rates) of ``draft`` for ``target`` over every prompt of
    ``prompts`` [N, T], ``max_new_tokens`` generated after each; one sampler seeded with ``seed`` runs
    through all of them (temperature > 0)."""
    from tqdm.auto import tqdm

    total = AcceptanceStats(k)
    generator = torch.Generator().manual_seed(seed)
    for prompt in tqdm(prompts, desc=description, disable=not progress, leave=False):
        total.merge(speculative_generate(target, draft, prompt, k, max_new_tokens, temperature, generator)[1])
    return total
