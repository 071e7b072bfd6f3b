"""Per-row tensors a frozen model computes once, cached on disk for the training loop to read back.

A trainer lists the rows it will visit, in visit order; ``build`` computes ``compute(chunk tokens)``
(a dict of tensors, one entry per row) for chunks of ``CHUNK_ROWS`` rows, writes each chunk to its
own file (an interrupted pass resumes at its last chunk), and returns a ``RowCache`` that reads a
step's rows from those files when asked: a run holds one step's rows in memory, never the whole
cache (a whole corpus's draft features are gigabytes, an 8B's more); ``row_by_row``
makes a chunk function of a per-row one, whose numbers then cannot depend on the chunk. Visit
orders of runs on the same data share their prefix, so a longer run reuses a shorter one's chunks;
a shorter run's last, partial chunk is computed again.

In a torchrun job the ranks compute disjoint shares of the chunks, then every rank reads them all: a
chunk's file depends on the visit order only, never on the world size, so a cache built by one world
size is reused by any other. Ranks on several machines must therefore share the cache's folder.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import Tensor
from tqdm.auto import tqdm

from quantkit import atomic
from quantkit.distributed import SINGLE, World
from quantkit.run import RunError

CHUNK_ROWS = 16  # rows per cache file: what an interruption can lose


@dataclass(frozen=True)
class RowCache:
    position: dict[int, tuple[Path, int]]  # row id -> (its chunk's file, its index there)

    def batch(self, rows: list[int]) -> dict[str, Tensor]:
        """The cached tensors of ``rows``, stacked in that order."""
        parts = []
        for row in rows:
            path, at = self.position[row]
            with safe_open(str(path), framework="pt") as f:  # memory-mapped: reads this row's bytes only
                parts.append({name: f.get_slice(name)[at:at + 1] for name in f.keys()})
        return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}


@torch.no_grad()
def build(compute: Callable[[Tensor], dict[str, Tensor]], rows: Tensor, visited: list[int], directory: Path,
          description: str, progress: bool = True, world: World = SINGLE) -> RowCache:
    """``compute(rows[chunk])`` for the row ids in ``visited`` (visit order), chunk by chunk, cached in
    ``directory``; in a torchrun job, ``world``'s share of the chunks here and the others by the other ranks."""
    directory.mkdir(parents=True, exist_ok=True)
    starts = range(0, len(visited), CHUNK_ROWS)
    for start in tqdm([starts[i] for i in world.share(len(starts))], desc=description, unit="chunk",
                      disable=not progress):
        path = _chunk_file(directory, start)
        wanted = visited[start:start + CHUNK_ROWS]
        if path.is_file() and _rows_in(path) == len(wanted):
            continue
        atomic.save_safetensors(path, {name: tensor.cpu() for name, tensor in compute(rows[wanted]).items()})
    world.barrier(f"waiting for the other ranks' chunks of the {description} cache")
    missing = next((path for path in (_chunk_file(directory, start) for start in starts) if not path.is_file()), None)
    if missing is not None:  # another machine's rank wrote it to a folder this one does not see
        raise RunError(f"rank {world.rank}: {missing} is missing after every rank computed its chunks of the "
                       f"{description} cache: ranks on several machines need QUANTKIT_CACHE on a filesystem "
                       "they share")
    return RowCache({row: (_chunk_file(directory, index - index % CHUNK_ROWS), index % CHUNK_ROWS)
                     for index, row in enumerate(visited)})


def row_by_row(compute: Callable[[Tensor], dict[str, Tensor]]) -> Callable[[Tensor], dict[str, Tensor]]:
    """A chunk function that runs ``compute`` on each row [T] alone and stacks the results."""
    def chunk(tokens: Tensor) -> dict[str, Tensor]:
        computed = [compute(row) for row in tokens]
        return {name: torch.stack([c[name] for c in computed]) for name in computed[0]}

    return chunk


def _chunk_file(directory: Path, first: int) -> Path:
    """The file of the chunk whose first row is ``first`` in visit order."""
    return directory / f"rows-{first:06d}.safetensors"


def _rows_in(path: Path) -> int:
    with safe_open(str(path), framework="pt") as f:
        return f.get_slice(next(iter(f.keys()))).get_shape()[0]
