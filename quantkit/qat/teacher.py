"""The FP teacher's top-k logits, computed once for every row a run will visit and cached on disk.

Running the teacher beside the student every step would cost a forward per step and keep a second
model in memory. Instead its k largest logits per position (and their token ids) are computed in
one no-grad pass before training, written in chunks (an interrupted pass resumes at its last
chunk) and then read back by row. The distillation loss renormalises the teacher over those k
tokens; ``tests/test_qat.py`` measures how close that is to the full distribution's KL.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor
from tqdm.auto import tqdm

from quantkit import atomic

CHUNK_ROWS = 16  # rows per cache file: what an interruption can lose


@dataclass(frozen=True)
class TeacherCache:
    position: dict[int, int]  # row id -> its index in ids/logits
    ids: Tensor  # int32 [rows visited, T, k]
    logits: Tensor  # float32 [rows visited, T, k], descending

    def batch(self, rows: list[int]) -> tuple[Tensor, Tensor]:
        at = [self.position[row] for row in rows]
        return self.ids[at].long(), self.logits[at]


def cache_key(model_fingerprint: str, data_fingerprint: str, top_k: int, dtype: torch.dtype) -> str:
    return hashlib.sha256(f"{model_fingerprint}:{data_fingerprint}:{top_k}:{dtype}".encode()).hexdigest()[:24]


@torch.no_grad()
def build_cache(teacher, rows: Tensor, visited: list[int], top_k: int, directory: Path,
                progress: bool = True) -> TeacherCache:
    """Top-k logits of ``teacher`` on the rows ``visited`` (ids into ``rows`` [R, T], in the order a run
    first visits them), cached in ``directory``. Visit orders share their prefix, so a longer run
    reuses a shorter one's chunks."""
    directory.mkdir(parents=True, exist_ok=True)
    chunks = range(0, len(visited), CHUNK_ROWS)
    for start in tqdm(chunks, desc="teacher top-k", unit="chunk", disable=not progress):
        path = directory / f"rows-{start:06d}.safetensors"
        if path.is_file() and _rows_in(path) == len(visited[start:start + CHUNK_ROWS]):
            continue  # a shorter run's last chunk may hold fewer rows: then it is computed again
        ids, logits = [], []
        for row in visited[start:start + CHUNK_ROWS]:
            values, indices = teacher(rows[row][None]).logits[0].float().topk(top_k, dim=-1)
            ids.append(indices.to(torch.int32).cpu())
            logits.append(values.cpu())
        atomic.save_safetensors(path, {"ids": torch.stack(ids), "logits": torch.stack(logits)})
    parts = [load_file(str(directory / f"rows-{start:06d}.safetensors")) for start in chunks]
    return TeacherCache({row: at for at, row in enumerate(visited)}, torch.cat([p["ids"] for p in parts]),
                        torch.cat([p["logits"] for p in parts]))


def _rows_in(path: Path) -> int:
    with safe_open(str(path), framework="pt") as f:
        return f.get_slice("ids").get_shape()[0]


def distillation_loss(student_logits: Tensor, teacher_ids: Tensor, teacher_logits: Tensor,
                      temperature: float) -> Tensor:
    """Mean over positions of T² · KL(teacher ‖ student), the teacher renormalised over its top-k ids.

    ``student_logits`` [..., V]; ``teacher_ids``/``teacher_logits`` [..., k]."""
    teacher = torch.log_softmax(teacher_logits / temperature, dim=-1)
    student = torch.log_softmax(student_logits.float() / temperature, dim=-1).gather(-1, teacher_ids)
    return temperature**2 * (teacher.exp() * (teacher - student)).sum(-1).mean()
