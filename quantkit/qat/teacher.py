"""The FP teacher's top-k logits, computed once for every row a run will visit and cached on disk.

Running the teacher beside the student every step would cost a forward per step and keep a second
model in memory. Instead its k largest logits per position (and their token ids) are computed in
one no-grad pass before training (``quantkit.training.rowcache``) and then read back by row. The
distillation loss (``quantkit.training.distill``) renormalises the teacher over those k tokens;
``tests/test_qat.py`` measures how close that is to the full distribution's KL.

On the held-out text the teacher's whole distribution is kept in memory (``heldout_targets``; a top-k
renormalised over a flat distribution rewards a student for sharpening, not for matching), so that the
student's KL to the teacher can be measured there (``heldout_kl``): the run keeps the weights where it
was lowest, and its value at the start sets the learning rate.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from quantkit.distributed import SINGLE, World
from quantkit.training import rowcache


def cache_key(model_fingerprint: str, data_fingerprint: str, top_k: int, dtype: torch.dtype) -> str:
    return hashlib.sha256(f"{model_fingerprint}:{data_fingerprint}:{top_k}:{dtype}".encode()).hexdigest()[:24]


def build_cache(teacher, rows: Tensor, visited: list[int], top_k: int, directory: Path,
                progress: bool = True, world: World = SINGLE) -> rowcache.RowCache:
    """Top-k logits of ``teacher`` on the rows ``visited`` (ids into ``rows`` [R, T], in visit order):
    tensors ``ids`` (int32) and ``logits`` (float32, descending), [rows, T, k]; ``world``'s ranks compute a
    share of them each."""
    def top_logits(tokens: Tensor) -> dict[str, Tensor]:
        values, indices = teacher(tokens[None]).logits[0].float().topk(top_k, dim=-1)
        return {"ids": indices.to(torch.int32), "logits": values}

    return rowcache.build(rowcache.row_by_row(top_logits), rows, visited, directory, "teacher top-k", progress,
                          world)


@dataclass
class HeldoutTargets:
    """Held-out rows [R, T] and the teacher's log-probabilities for every position but the last [R, T-1, V]
    (float16: the same stored values every measurement compares with, at half float32's memory)."""

    rows: Tensor
    log_probs: Tensor


@torch.no_grad()
def heldout_targets(teacher, tokens: Tensor, seq_len: int) -> HeldoutTargets:
    """``tokens`` [N] cut into rows of ``seq_len`` (one row of all of them if fewer), with ``teacher``'s
    whole next-token distribution at every position."""
    rows = tokens[: len(tokens) // seq_len * seq_len].reshape(-1, seq_len) if len(tokens) >= seq_len else tokens[None]
    log_probs = [torch.log_softmax(teacher(row[None, :-1]).logits[0].float(), -1).to(torch.float16) for row in rows]
    return HeldoutTargets(rows, torch.stack(log_probs))


@torch.no_grad()
def heldout_kl(model, targets: HeldoutTargets) -> float:
    """Mean KL(teacher || model) per held-out position, over the whole vocabulary (what `quantkit eval kld`
    measures, here in windows of the training rows)."""
    total = 0.0
    for row, teacher in zip(targets.rows, targets.log_probs):
        student = torch.log_softmax(model(row[None, :-1]).logits[0].float(), -1)
        teacher = teacher.float()
        total += float((teacher.exp() * (teacher - student)).sum(-1).mean())
    return total / targets.rows.shape[0]
