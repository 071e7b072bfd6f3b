"""A resumable training checkpoint: trainable weights, AdamW's moments and the loop's position, written by
torch.distributed.checkpoint (DCP) as safetensors files, one per rank, and readable at any world size.

A checkpoint is a folder. Each save writes a new ``step-NNNNNNNN`` folder, every rank its own part of the
tensors (the whole of each for an unsharded run, where DCP writes every replicated tensor once; its shard of
each for a sharded one), then rank 0 writes ``RECORD`` atomically, naming that folder and holding the loop's
position, and removes the older folders. The record is the commit: a save interrupted at any point leaves the
record naming the previous, whole folder. A load asks DCP for each tensor in this run's own layout (a
``DTensor`` shard under FSDP, a plain tensor otherwise), and DCP reads whatever parts of the files hold it:
a run written by two sharded ranks continues in one process, and the reverse. The files are read as
safetensors (``HuggingFaceStorageReader``): no pickle.

Nothing else carries state: the learning rate is a function of the step, the data order a function of the
position, and no operation draws random numbers, so these restore the run exactly. Whether a run may
continue from it is the run's lifecycle's to say (``quantkit.run``).
"""
from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

from quantkit import atomic
from quantkit.distributed import World

RECORD = "checkpoint.json"  # the committed checkpoint: which folder, and the loop's position
_STEP_FOLDER = "step-{:08d}"


def progress_file(folder_name: str) -> str:
    """The file whose presence says a staging holds a checkpoint in its folder ``folder_name``
    (``quantkit.run.Run.begin``'s ``progress_file``)."""
    return f"{folder_name}/{RECORD}"


def record(folder: Path) -> dict:
    """The committed checkpoint's record: ``{"step", "folder", "loop"}``."""
    return json.loads((folder / RECORD).read_text())


def save(folder: Path, parameters: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer | None,
         loop: dict, world: World) -> None:
    """Write ``parameters`` (with their AdamW moments, when ``optimizer`` is given) and ``loop`` (which holds the
    ``step``) as the folder's checkpoint. Every rank calls it."""
    step_folder = _STEP_FOLDER.format(loop["step"])
    if world.is_main:
        atomic.remove_tree(folder / step_folder)  # a save of this step that was interrupted
        folder.mkdir(parents=True, exist_ok=True)
    world.barrier("waiting for rank 0 to make the checkpoint's folder")
    with _single_process_quiet():
        dcp.save(_tensors(parameters, optimizer), no_dist=world.world_size == 1,
                 storage_writer=HuggingFaceStorageWriter(str(folder / step_folder), save_distributed=True))
    if world.is_main:  # DCP's save returns on rank 0 once every rank's files are written
        atomic.write_json(folder / RECORD, {"step": loop["step"], "folder": step_folder, "loop": loop})
        for old in folder.glob("step-*"):
            if old.name != step_folder:
                atomic.remove_tree(old)
    world.barrier("waiting for rank 0 to commit the checkpoint")


def load(folder: Path, parameters: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer | None,
         world: World) -> dict:
    """Restore the folder's checkpoint into ``parameters`` (and AdamW's state, when ``optimizer`` is given), in
    place and in their own layout; return the loop's position. Every rank calls it."""
    committed = record(folder)
    reader = HuggingFaceStorageReader(str(folder / committed["folder"]))
    stored = set(reader.read_metadata().state_dict_metadata)
    moments = {}
    if optimizer is not None:  # a parameter that never had a gradient has no moments yet
        moments = {name: {"step": torch.zeros((), dtype=torch.float32),
                          "exp_avg": torch.zeros_like(param.detach()), "exp_avg_sq": torch.zeros_like(param.detach())}
                   for name, param in parameters.items() if f"exp_avg/{name}" in stored}
    wanted = {f"param/{name}": param.detach() for name, param in parameters.items()}
    for name, state in moments.items():
        wanted.update({f"{key}/{name}": tensor for key, tensor in state.items()})
    with _single_process_quiet(), torch.no_grad():
        dcp.load(wanted, storage_reader=HuggingFaceStorageReader(str(folder / committed["folder"])),
                 no_dist=world.world_size == 1)
    for name, state in moments.items():
        optimizer.state[parameters[name]] = state
    return committed["loop"]


def _tensors(parameters: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer | None) -> dict:
    tensors = {}
    for name, param in parameters.items():
        tensors[f"param/{name}"] = param.detach()
        state = optimizer.state.get(param) if optimizer is not None else None
        if state:
            tensors.update({f"{key}/{name}": state[key] for key in ("step", "exp_avg", "exp_avg_sq")})
    return tensors


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process whenever it runs without a process group; a single-process run
    is exactly that, so the warning says nothing to its user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
