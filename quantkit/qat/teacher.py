"""The FP teacher's top-k logits, computed once for every row a run will visit and cached on disk.

Running the teacher beside the student every step would cost a forward per step and keep a second
model in memory. Instead its k largest logits per position (and their token ids) are computed in
one no-grad pass before training (``quantkit.training.rowcache``) and then read back by row. The
distillation loss (``quantkit.training.distill``) renormalises the teacher over those k tokens;
``tests/test_qat.py`` measures how close that is to the full distribution's KL.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import Tensor

from quantkit.training import rowcache


def cache_key(model_fingerprint: str, data_fingerprint: str, top_k: int, dtype: torch.dtype) -> str:
    return hashlib.sha256(f"{model_fingerprint}:{data_fingerprint}:{top_k}:{dtype}".encode()).hexdigest()[:24]


def build_cache(teacher, rows: Tensor, visited: list[int], top_k: int, directory: Path,
                progress: bool = True) -> rowcache.RowCache:
    """Top-k logits of ``teacher`` on the rows ``visited`` (ids into ``rows`` [R, T], in visit order):
    tensors ``ids`` (int32) and ``logits`` (float32, descending), [rows, T, k]."""
    def top_logits(tokens: Tensor) -> dict[str, Tensor]:
        values, indices = teacher(tokens[None]).logits[0].float().topk(top_k, dim=-1)
        return {"ids": indices.to(torch.int32), "logits": values}

    return rowcache.build(rowcache.row_by_row(top_logits), rows, visited, directory, "teacher top-k", progress)
