"""The target's side of draft-head training, computed once per row by teacher forcing.

For each training row the target runs once; kept are the head's input (the three residual states,
concatenated and scaled as the head's ``aux_states`` says, in bf16) and the target's next-token
distribution restricted to the draft vocabulary as its top-k logits, plus whether the target's own
argmax is in the draft vocabulary (positions where it is not are left out of the loss: the head
cannot predict it). The rows are cached on disk (``quantkit.training.rowcache``).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import Tensor

from quantkit.distributed import SINGLE, World
from quantkit.models.eagle3 import Eagle3Head, entering_states
from quantkit.training import rowcache


def features_key(target_fingerprint: str, data_fingerprint: str, head: Eagle3Head, top_k: int) -> str:
    vocabulary = hashlib.sha256(head.d2t.cpu().numpy().tobytes()).hexdigest()  # the same key on any device
    text = f"{target_fingerprint}:{data_fingerprint}:{vocabulary}:{head.config.aux_states}:{top_k}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def row_features(target, head: Eagle3Head, tokens: Tensor, top_k: int) -> dict[str, Tensor]:
    """``tokens`` [T] -> aux [T, 3·Ht] bf16, ids [T, k] int32 (draft ids), logits [T, k] float32 (the
    target's top-k over the draft vocabulary, descending), in_vocabulary [T] bool."""
    used = torch.nonzero(head.t2d).flatten()
    logits, states = entering_states(target, tokens[None], head.aux_layers)
    logits = logits[0].float()
    values, ids = logits[:, used].topk(min(top_k, used.numel()), dim=-1)
    return {"aux": head.aux_from_states({layer: state[0] for layer, state in states.items()}).to(torch.bfloat16),
            "ids": ids.to(torch.int32), "logits": values, "in_vocabulary": head.t2d[logits.argmax(-1)]}


@torch.no_grad()
def build_features(target, head: Eagle3Head, rows: Tensor, visited: list[int], top_k: int, directory: Path,
                   progress: bool = True, world: World = SINGLE) -> rowcache.RowCache:
    """The features of the rows in ``visited``, cached in ``directory``; in a torchrun job, ``world``'s share
    of the chunks computed here, the others by the other ranks."""
    compute = rowcache.row_by_row(lambda tokens: row_features(target, head, tokens, top_k))
    return rowcache.build(compute, rows, visited, directory, "target features", progress, world)
