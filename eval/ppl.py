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


# Scored positions whose float64 log-probabilities exist at once: at Qwen2.5's 152k vocabulary a
# whole 2048-token window took 2.5 GB per tensor (19 GB peak for a KL run), 256 positions 311 MB.
ROWS_PER_CHUNK = 256


@torch.no_grad()  # not inference_mode: a sharded model (FSDP) reuses the buffers it gathers here when it trains
def window_log_probs(model, tokens: torch.Tensor, w: Window) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(log-probabilities in float64, targets) of the positions scored by ``w``, ROWS_PER_CHUNK at a time."""
    yield from chunked_log_probs(model(tokens[None, w.begin:w.end]).logits[0], w.begin, tokens, w)


def chunked_log_probs(logits: torch.Tensor, logits_begin: int, tokens: torch.Tensor,
                      w: Window) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The scored rows of ``logits`` (positions ``logits_begin`` … ``w.end - 1``) as in
    ``window_log_probs``: the logits at position p predict token p + 1."""
    predicting = logits[w.first_scored - 1 - logits_begin: w.end - 1 - logits_begin]
    targets = tokens[w.first_scored:w.end]
    for start in range(0, len(targets), ROWS_PER_CHUNK):
        rows = slice(start, start + ROWS_PER_CHUNK)
        yield torch.log_softmax(predicting[rows].double(), dim=-1), targets[rows]


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
        for log_probs, targets in window_log_probs(model, tokens, w):
            total_nll -= log_probs.gather(1, targets[:, None]).sum().item()
            count += len(targets)
    mean = total_nll / count
    return PerplexityResult(math.exp(mean), mean, count, window, stride or window)
