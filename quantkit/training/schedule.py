"""Warmup-stable-decay (WSD) learning rate, as MiniCPM trains and BitCPM4 re-warms for QAT.

Linear warmup from 0 over the first ``warmup`` fraction of steps (a pretrained model's optimizer
state is gone, so QAT restarts the warmup), the peak rate through ``stable``, then a linear decay to
``final`` times the peak over ``decay``. A pure function of the step: resuming needs no state.
The peak itself is scaled down for a run that starts close to the unquantized model (``start_rate_factor``).
"""
from __future__ import annotations

import math


def wsd_learning_rate(step: int, total_steps: int, peak: float, warmup: float, decay: float, final: float) -> float:
    """The rate for optimizer step ``step`` (0-based) of ``total_steps``."""
    warmup_steps = round(warmup * total_steps)
    decay_steps = round(decay * total_steps)
    decay_start = total_steps - decay_steps
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if step < decay_start:
        return peak
    done = (step - decay_start + 1) / decay_steps
    return peak * (1 - (1 - final) * done)


def start_rate_factor(excess: float, full_rate_excess: float) -> float:
    """The factor on the peak rate for a run whose start is ``excess`` nats from the unquantized model
    (its held-out KL to it): 1 from ``full_rate_excess`` up, ``sqrt(excess / full_rate_excess)`` below it (near a
    good start the loss grows with the square of the distance from it, so the steps that keep a run near
    the start shrink with the square root of its excess), and 1 when ``full_rate_excess`` is 0."""
    if full_rate_excess == 0:
        return 1.0
    return min(1.0, math.sqrt(max(excess, 0.0) / full_rate_excess))
