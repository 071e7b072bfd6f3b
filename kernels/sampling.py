"""Choosing the next token from float32 logits: greedy, temperature, top-p (nucleus)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # NaN fails every comparison
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


class Sampler:
    def __init__(self, settings: Sampling):
        self.settings = settings
        self._generator = torch.Generator().manual_seed(settings.seed)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampled from: softmax(logits / T), restricted to the smallest set of
        most likely tokens whose mass reaches top_p (the token that crosses top_p is kept)."""
        probs = torch.softmax(logits.double() / self.settings.temperature, dim=-1)
        if self.settings.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            mass_before = sorted_probs.cumsum(-1) - sorted_probs
            sorted_probs[mass_before >= self.settings.top_p] = 0
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
            probs /= probs.sum()
        return probs

    def __call__(self, logits: torch.Tensor) -> int:
        if self.settings.temperature == 0:
            return int(logits.argmax())
        return self.draw(self.probabilities(logits))

    def draw(self, probs: torch.Tensor) -> int:
        """A token drawn from ``probs`` with this sampler's generator."""
        return int(torch.multinomial(probs, 1, generator=self._generator))

    def gumbel(self, shape: torch.Size) -> torch.Tensor:
        """Standard Gumbel noise (−log(−log U)) from this sampler's generator: the k largest of log q plus
        this noise are k draws from q without replacement."""
        uniform = torch.rand(shape, generator=self._generator, dtype=torch.float64).clamp_(min=1e-300)
        return -torch.log(-torch.log(uniform))

    def uniform(self) -> float:
        """A number in [0, 1) from this sampler's generator (speculative sampling's acceptance test)."""
        return float(torch.rand((), generator=self._generator, dtype=torch.float64))
