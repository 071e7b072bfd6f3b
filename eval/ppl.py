"""Perplexity over a token stream with a sliding window.

Windows of ``window`` tokens advance by ``stride``; each token is scored once, by the first window
that contains it with context (the HF convention). ``stride == window`` gives disjoint windows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
from tqdm.auto import tqdm


@dataclass(frozen=True)
class Window:
    begin: int
    end: int
    first_scored: int  # positions [first_scored, end) are predicted by this window


def windows(n_tokens: int, window: int, stride: int | None = None) -> Iterator[Window]:
    stride = stride or window
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in (0, window={window}], got {stride}")
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score, got {n_tokens}")
    scored_until = 1  # position 0 has no context and is never predicted
    for begin in range(0, n_tokens - 1, stride):
        end = min(begin + window, n_tokens)
        if end > scored_until:
            yield Window(begin, end, max(scored_until, begin + 1))
            scored_until = end
        if end == n_tokens:
            break


@torch.inference_mode()
def window_log_probs(model, tokens: torch.Tensor, w: Window) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities (float64) of the positions scored by ``w`` and their targets."""
    logits = model(tokens[None, w.begin:w.end]).logits[0]
    # logits at position p predict token p + 1
    predicting = logits[w.first_scored - 1 - w.begin: w.end - 1 - w.begin].double()
    return torch.log_softmax(predicting, dim=-1), tokens[w.first_scored:w.end]


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float
    tokens: int
    window: int
    stride: int


def perplexity(model, tokens: torch.Tensor, window: int = 2048, stride: int | None = None,
               progress: bool = False) -> PerplexityResult:
    total_nll, count = 0.0, 0
    spans = list(windows(len(tokens), window, stride))
    for w in tqdm(spans, desc="perplexity", unit="window", disable=not progress):
        log_probs, targets = window_log_probs(model, tokens, w)
        total_nll -= log_probs.gather(1, targets[:, None]).sum().item()
        count += len(targets)
    mean = total_nll / count
    return PerplexityResult(math.exp(mean), mean, count, window, stride or window)
