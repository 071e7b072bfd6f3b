"""Training rows in the model's own words: each row keeps its first ``prompt_tokens`` tokens of text
and the rest is the model's greedy continuation of them.

A draft head drafts the target's output, not human text: trained on the target's own continuations
it sees at every position the text it will be asked to predict at decode time (self-distillation,
as Medusa-2 does: Cai et al. 2024, arXiv 2401.10774, §2.3.2). The continuations are written once per
row the run visits, a chunk of rows decoding together, and cached on disk like the target features
(``quantkit.training.rowcache``), so a resumed or longer run does not write them again.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from quantkit.distributed import SINGLE, World
from quantkit.training import rowcache
from quantkit.training.data import TrainingData


@torch.no_grad()
def greedy_continuation(model, prompts: Tensor, length: int) -> Tensor:
    """``prompts`` [n, P] -> [n, length]: each prompt followed by ``model``'s greedy continuation (a
    ``MiniCPMForCausalLM``; all rows decode together, one cache)."""
    cache = DynamicCache(config=model.config)
    tokens, step = [prompts], prompts
    while sum(part.shape[1] for part in tokens) < length:
        logits = model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1).logits
        step = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(step)
    return torch.cat(tokens, dim=1)


def own_text(model, model_fingerprint: str, data: TrainingData, prompt_tokens: int, visited: list[int],
             cache: Path, progress: bool = True, world: World = SINGLE) -> TrainingData:
    """``data`` with each row in ``visited`` replaced by its first ``prompt_tokens`` tokens and ``model``'s
    greedy continuation to the row's length; rows never visited stay as they are (no step reads them).
    The continuations are cached under ``cache``, keyed by the model, the data and ``prompt_tokens``; in a
    torchrun job ``world``'s ranks write shares of them."""
    length = data.rows.shape[1]
    if not 0 < prompt_tokens < length:
        raise ValueError(f"own text needs a prompt of 1..{length - 1} tokens (rows of {length}), got {prompt_tokens}")
    key = hashlib.sha256(f"{model_fingerprint}:{data.fingerprint}:{prompt_tokens}".encode()).hexdigest()[:24]
    written = rowcache.build(lambda chunk: {"tokens": greedy_continuation(model, chunk[:, :prompt_tokens], length)},
                             data.rows.to(model.device), visited, cache / key, "target's own text", progress, world)
    rows = data.rows.clone()
    rows[visited] = written.batch(visited)["tokens"]
    return TrainingData(rows, data.seed, key, {**data.described, "own_text_after": prompt_tokens,
                                               "own_text_of": model_fingerprint})
