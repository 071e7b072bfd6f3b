"""Speculative decoding acceptance: how many tokens a draft lets the target commit per forward.

Measured in quantkit's runtime (``quantkit.kernels.speculative``), the same code that decodes
speculatively for users: each round the draft proposes a chain of k tokens, the target verifies them
in one forward, greedy or by speculative sampling. τ = tokens committed / target forwards, counting
the target's own token; a target drafting for itself gives τ = k + 1 under greedy decoding, an
unrelated draft about 1. A draft is an EAGLE-3 head or a whole model with the target's tokenizer.
"""
from __future__ import annotations

from pathlib import Path

import torch

from quantkit.kernels.speculative import Acceptance


def prompt_rows(tokens: torch.Tensor, prompts: int, length: int) -> torch.Tensor:
    """The first ``prompts`` x ``length`` of ``tokens`` as prompts [prompts, length]."""
    if len(tokens) < prompts * length:
        raise ValueError(f"{prompts} prompts of {length} tokens need {prompts * length} tokens, the data gives "
                         f"{len(tokens)}")
    return tokens[:prompts * length].view(prompts, length)


def acceptance(generator, draft: str | Path, prompts: torch.Tensor, k: int, max_new_tokens: int,
               temperature: float = 0.0, seed: int = 0, progress: bool = False,
               description: str | None = None, tree=None) -> Acceptance:
    """The acceptance statistics (τ, per-position rates) of ``draft`` for the target of ``generator`` (a
    runtime ``TextGenerator``) over every prompt of ``prompts`` [N, T], exactly ``max_new_tokens`` generated
    after each (stop tokens do not end a run, so every target is measured on as many rounds); prompt
    i samples with seed ``seed + i`` (temperature > 0). With a ``tree`` (``TreeShape``) the draft
    proposes trees instead of chains of ``k`` (sampled trees: ``quantkit.kernels.speculative``)."""
    from tqdm.auto import tqdm

    from quantkit.kernels.generate import TextGenerator, load_drafter
    from quantkit.kernels.sampling import Sampling

    drafter = load_drafter(draft, generator.runtime, generator.runtime.device.type)  # on its target's device
    speculative = TextGenerator(generator.runtime, generator.tokenizer, set(), generator.prefill_chunk, drafter,
                                k, tree)
    total = Acceptance(tree.depth if tree is not None else k)
    for index, prompt in enumerate(tqdm(prompts, desc=description, disable=not progress, leave=False)):
        timings: dict = {}
        for _ in speculative.tokens(prompt.tolist(), max_new_tokens, Sampling(temperature, seed=seed + index),
                                    timings=timings):
            pass
        total.merge(timings["acceptance"])
    return total
