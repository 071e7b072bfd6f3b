"""Warmup-stable-decay (WSD) learning rate, as MiniCPM trains and BitCPM4 re-warms for QAT.

Linear warmup from 0 over the first ``warmup`` fraction of steps (a pretrained model's optimizer
state is gone, so QAT restarts the warmup), the peak rate through ``stable``, then a linear decay to
``final`` times the peak over ``decay``. A pure function of the step: resuming needs no state.
"""
from __future__ import annotations


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
