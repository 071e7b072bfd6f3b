"""KL divergence and top-1 agreement of a model against a reference, token by token.

KL(P_ref ‖ P_model) is computed in float64 (in float32 the two log-normalisers alone bias it by
~1e-5 nats, as large as the effect of good 8-bit quantization).

``reference_prefix`` = N runs each window's first N positions through the reference and lets the
model continue from their K/V cache: a deployment that stores the prefix's K/V in full precision
(PrefixQuant, and MiniCPM4's W+A setting), so only the later positions are scored. Comparing it
with N = 0 shows how much of a quantized model's KL is its error on the attention-sink positions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from quantkit.eval.ppl import Window, chunked_log_probs, window_log_probs, windows


@dataclass(frozen=True)
class KLResult:
    mean_kl: float
    max_kl: float
    top1_agreement: float
    perplexity: float
    reference_perplexity: float
    tokens: int
    window: int
    reference_prefix: int = 0


@torch.inference_mode()
def _log_probs_after_prefix(model, reference, tokens: torch.Tensor, w: Window, prefix: int):
    """``window_log_probs`` of ``model`` continuing from the reference's K/V of the window's first
    ``prefix`` positions."""
    cache = DynamicCache(config=reference.config)
    reference(tokens[None, w.begin:w.begin + prefix], cache=cache, use_cache=True)
    logits = model(tokens[None, w.begin + prefix:w.end], cache=cache, use_cache=True).logits[0]
    yield from chunked_log_probs(logits, w.begin + prefix, tokens, w)


def kl_divergence(model, reference, tokens: torch.Tensor, window: int = 2048, stride: int | None = None,
                  progress: bool = False, reference_prefix: int = 0) -> KLResult:
    if not 0 <= reference_prefix < window - 1:
        raise ValueError(f"reference_prefix must be in [0, window - 1 = {window - 1}), got {reference_prefix}")
    kl_sum, kl_max, agree, nll, ref_nll, count = 0.0, 0.0, 0, 0.0, 0.0, 0
    spans = [Window(w.begin, w.end, max(w.first_scored, w.begin + reference_prefix + 1))
             for w in windows(len(tokens), window, stride)]
    spans = [w for w in spans if w.first_scored < w.end]
    if not spans:
        raise ValueError(f"no position is left to score after a reference prefix of {reference_prefix}")
    for w in tqdm(spans, desc="kl-divergence", unit="window", disable=not progress):
        tested = (_log_probs_after_prefix(model, reference, tokens, w, reference_prefix) if reference_prefix
                  else window_log_probs(model, tokens, w))
        for (log_q, targets), (log_p, _) in zip(tested, window_log_probs(reference, tokens, w)):
            kl = (log_p.exp() * (log_p - log_q)).sum(-1)
            kl_sum += kl.sum().item()
            kl_max = max(kl_max, kl.max().item())
            agree += (log_p.argmax(-1) == log_q.argmax(-1)).sum().item()
            nll -= log_q.gather(1, targets[:, None]).sum().item()
            ref_nll -= log_p.gather(1, targets[:, None]).sum().item()
            count += len(targets)
    return KLResult(kl_sum / count, kl_max, agree / count, math.exp(nll / count), math.exp(ref_nll / count),
                    count, window, reference_prefix)
