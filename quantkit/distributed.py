"""A process's place in a torchrun job, and the few collectives quantkit's data-parallel work needs (training,
and ``eval report`` spreading its variants).

torchrun (alone, or under SLURM as ``srun torchrun``) starts one process per device and tells each its
place through the environment: RANK, WORLD_SIZE, LOCAL_RANK, and where to meet (MASTER_ADDR,
MASTER_PORT). ``joined`` reads them and joins the job's process group, gloo on CPUs and NCCL on CUDA
GPUs. Without them (a plain ``quantkit`` run, a test) the world is one process: no process group is
made, nothing here calls torch.distributed, and every operation returns its input, so a single process
computes exactly what it did before data parallelism existed.

Every operation is one of torch.distributed's own collectives, bounded by the group's timeout
(``TIMEOUT_ENV``): a rendezvous that never completes, or a peer that died, ends the run with one line
naming this rank (``DistributedError``), never a hang. A collective waits for the slowest rank, so the timeout
must exceed the longest stretch one rank works alone: rank 0's held-out measurement, the last chunk of
a row cache (the teacher's, the target features).
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Sequence, TypeVar

import torch
import torch.distributed as dist

from quantkit.errors import QuantkitError

TIMEOUT_ENV = "QUANTKIT_DISTRIBUTED_TIMEOUT"  # seconds
DEFAULT_TIMEOUT_SECONDS = 600  # torch's own default for NCCL
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # device type -> the backend whose collectives run there
TENSORS_ON = {backend: device for device, backend in BACKENDS.items()}  # where a backend's collectives take tensors
# the process group each device's ranks make: on GPUs gloo beside NCCL, so that the ranks can compare their
# devices on the host before any collective on a device (ranks of mixed devices would make mixed backends)
GROUP_BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl"}
DEVICES = tuple(BACKENDS)
Made = TypeVar("Made")


class DistributedError(QuantkitError, RuntimeError):
    """A job whose ranks cannot meet, agree or go on together."""


@dataclass
class Stopwatch:
    """Seconds spent in one kind of work, summed over its stretches."""

    seconds: float = 0.0


@dataclass(frozen=True)
class World:
    """The processes of one training job and this one's place among them. ``backend`` is None for a
    world of one process, which has no process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    # time in collectives: moving the numbers, and waiting for the slowest rank to reach them
    in_collectives: Stopwatch = field(default_factory=Stopwatch, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        """Whether this process owns the run: its output, checkpoints, logs and progress."""
        return self.rank == 0

    @property
    def described(self) -> dict:
        """What a manifest and a report record of the world."""
        return {"world_size": self.world_size, "backend": self.backend}

    def refuse_uneven(self, count: int, items: str, change: str) -> None:
        """Refuse, on every rank alike and before any work, a world size that cannot give every rank as many of
        a step's ``count`` items (``items``: what they are, as the message names them; ``change``: the settings
        that make them): with fewer on some ranks, a step would not mean what it means in one process."""
        if count % self.world_size:
            raise DistributedError(f"{items} cannot be dealt evenly to {self.world_size} ranks: run a number of "
                                   f"ranks that divides {count}, or change {change}")

    def share(self, count: int) -> range:
        """This rank's items of ``count`` (a step's micro-batches, a cache's chunks): every
        ``world_size``-th from its own rank, so that the ranks' shares are disjoint and cover them all."""
        return range(self.rank, count, self.world_size)

    def sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replace each tensor by its sum over the ranks, in place (gradients: each rank's holds its
        share of the step's mean)."""
        if self.world_size > 1:
            with _collective(self, "summing gradients"):
                for work in [dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True) for t in tensors]:
                    work.wait()

    def unshared(self, mine: Sequence[float]) -> list[float]:
        """The values of all items when each rank computed those of its ``share`` (``mine``, in order):
        in item order, as one process computing them all would have listed them."""
        if self.world_size == 1:
            return list(mine)
        return self._interleaved(self._gathered(mine))

    def unshared_records(self, mine: Sequence) -> list:
        """``unshared`` for JSON values (a report's rows): every item's, in item order, on every rank."""
        if self.world_size == 1:
            return list(mine)
        return self._interleaved([json.loads(text) for text in self._gathered_texts(json.dumps(list(mine)))])

    def per_rank(self, value: float) -> list[float]:
        """Every rank's ``value``, by rank."""
        if self.world_size == 1:
            return [value]
        return [row[0] for row in self._gathered([value])]

    def from_main(self, compute: Callable[[], dict[str, float]], names: Sequence[str], *,
                  computed_by_all: bool = False) -> dict[str, float]:
        """``compute()``'s values on rank 0, the others receiving them: numbers only rank 0 measures (it
        alone holds what they need), that every rank must act on alike. ``names``: the keys it returns.
        ``computed_by_all``: every rank calls ``compute`` (it runs collectives itself, as a sharded model's
        forward does), and rank 0's values are still the ones every rank takes."""
        if self.world_size == 1:
            return compute()
        computed = compute() if self.is_main or computed_by_all else dict.fromkeys(names, 0.0)
        values = torch.tensor([computed[name] for name in names], dtype=torch.float64, device=self._device)
        with _collective(self, "waiting for rank 0's numbers"):
            dist.broadcast(values, src=0)
        return dict(zip(names, values.tolist()))

    def made_on_main(self, make: Callable[[], Made]) -> Made | None:
        """``make()`` on rank 0 (None on the others), its refusal raised on every rank in rank 0's words: a
        check only rank 0 can make (an existing output, a staging started with other inputs) stops the whole
        job with one line on each rank, not rank 0's line and the others' lost peer."""
        if self.world_size == 1:
            return make()
        made, refusal = None, None
        if self.is_main:
            try:
                made = make()
            except QuantkitError as e:
                refusal = e
        message = self._from_main_text("" if refusal is None else str(refusal))
        if refusal is not None:
            raise refusal
        if message:
            raise DistributedError(message)
        return made

    def refuse_mixed_devices(self, device: str) -> None:
        """Refuse, on every rank, a job whose ranks run on different devices (``device``: this rank's
        type, "cpu" or "cuda"): their collectives would take tensors on different devices, of different
        backends. Compared over gloo, which every rank's group has."""
        if self.world_size == 1:
            return
        mine = torch.tensor([DEVICES.index(device)])
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        with _collective(self, "comparing the ranks' devices"):
            dist.all_gather(gathered, mine)
        devices = [DEVICES[int(code)] for code in gathered]
        if len(set(devices)) > 1:
            listed = ", ".join(f"rank {rank} {device}" for rank, device in enumerate(devices))
            raise DistributedError(f"rank {self.rank} of {self.world_size}: the ranks run on different devices "
                                   f"({listed}), whose collectives need different backends (gloo on CPUs, NCCL on "
                                   "GPUs): give every rank the same --device")

    def barrier(self, what: str) -> None:
        """Wait until every rank has reached this point (``what``: the point, for the error's message)."""
        if self.world_size > 1:
            with _collective(self, what):
                dist.barrier()

    def _interleaved(self, per_rank: list[list]) -> list:
        """Each rank's share of the items (``share``), by rank, put back in item order."""
        total = sum(len(items) for items in per_rank)
        return [per_rank[item % self.world_size][item // self.world_size] for item in range(total)]

    def _gathered(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's ``values`` (as many on each), by rank; float64 holds a Python float exactly."""
        mine = torch.tensor(list(values), dtype=torch.float64, device=self._device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        with _collective(self, "gathering the ranks' numbers"):
            dist.all_gather(gathered, mine)
        return [row.tolist() for row in gathered]

    def _gathered_texts(self, text: str) -> list[str]:
        """Every rank's ``text``, by rank, as UTF-8: the lengths, then the bytes padded to the longest."""
        encoded = torch.tensor(list(text.encode()), dtype=torch.uint8, device=self._device)
        length = torch.tensor([encoded.numel()], dtype=torch.int64, device=self._device)
        lengths = [torch.empty_like(length) for _ in range(self.world_size)]
        with _collective(self, "gathering the ranks' results"):
            dist.all_gather(lengths, length)
            longest = max(int(n.item()) for n in lengths)
            padded = torch.zeros(longest, dtype=torch.uint8, device=self._device)
            padded[:encoded.numel()] = encoded
            gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(gathered, padded)
        return [bytes(row[:int(n.item())].tolist()).decode() for row, n in zip(gathered, lengths)]

    def _from_main_text(self, text: str) -> str:
        """Rank 0's ``text`` on every rank, as UTF-8: its length, then its bytes."""
        encoded = torch.tensor(list(text.encode()), dtype=torch.uint8, device=self._device)
        length = torch.tensor([encoded.numel()], dtype=torch.int64, device=self._device)
        with _collective(self, "waiting for rank 0 to start the run"):
            dist.broadcast(length, src=0)
            if not self.is_main:
                encoded = torch.empty(int(length.item()), dtype=torch.uint8, device=self._device)
            if encoded.numel():
                dist.broadcast(encoded, src=0)
        return bytes(encoded.tolist()).decode()

    @property
    def _device(self) -> str:
        return TENSORS_ON[self.backend]


SINGLE = World()


class Throughput(NamedTuple):
    tokens_per_second: float  # the job's
    rank_tokens_per_second: list[float]  # each rank's share of it, by rank
    # the share of each rank's loop spent in this module's collectives, by rank (FSDP's, inside a sharded
    # forward and backward, are not among them)
    rank_collective_share: list[float]


def throughput(world: World, tokens: int, seconds: float, collective_seconds: float) -> Throughput:
    """What a report gives of a training loop whose ranks together trained ``tokens`` in ``seconds``, this
    rank ``collective_seconds`` of them in collectives (a collective: every rank calls it)."""
    if not seconds:
        return Throughput(0.0, world.per_rank(0.0), world.per_rank(0.0))
    return Throughput(round(tokens / seconds, 2), world.per_rank(round(tokens / world.world_size / seconds, 2)),
                      world.per_rank(round(collective_seconds / seconds, 4)))


def timeout_seconds() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_SECONDS))


@contextmanager
def joined(device: str) -> Iterator[World]:
    """The job this process belongs to, its process group made for the block (and destroyed after it),
    with the backend of ``device`` ("cpu" or "cuda"): torchrun's environment says which (a world of one
    without it, which makes no group)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        yield SINGLE
        return
    world = World(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")), BACKENDS[device])
    if device == "cuda":
        torch.cuda.set_device(world.local_rank)  # one GPU per process: the local rank's
    timeout = timeout_seconds()
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout)))
        # torchrun keeps one store for every attempt of a job it restarts (--max-restarts): unprefixed, a restarted
        # rank can read a dead peer's address from the attempt before, and its connection is refused (torch 2.13)
        attempt = dist.PrefixStore(f"quantkit-attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(GROUP_BACKENDS[device], store=attempt, rank=world.rank, world_size=world.world_size,
                                timeout=datetime.timedelta(seconds=timeout))
    except (dist.DistError, ValueError) as e:  # no rendezvous: no peer came, or no address to meet at
        raise DistributedError(f"rank {world.rank} of {world.world_size}: no rendezvous with the other ranks at "
                               f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} within {timeout:g} "
                               f"s ({_first_line(e)}); start every rank with torchrun, or raise {TIMEOUT_ENV}") from e
    try:
        world.refuse_mixed_devices(device)
        yield world
    finally:
        _destroy_process_group()


def _destroy_process_group() -> None:
    """Destroy the job's process group so that its gloo threads are joined now. Left alive until the interpreter
    exits, the group is destroyed while Python tears down, and a rank can abort there ("terminate called without an
    active exception", torch 2.13) after its work is done. Two kinds of references outlive the run: FSDP's modules
    hold the group in reference cycles (collected here), and DTensor's caches (sharding propagation, mesh
    topology) keep the device meshes FSDP made for the life of the process, each holding its groups by name."""
    from torch.distributed.device_mesh import DeviceMesh

    gc.collect()
    dist.destroy_process_group()
    # by type, not isinstance: DeviceMesh's metaclass would ask every object its __class__, and a deprecated one warns
    for mesh in (obj for obj in gc.get_objects() if type(obj) is DeviceMesh):
        mesh._pg_registry.clear()


@contextmanager
def _collective(world: World, what: str) -> Iterator[None]:
    """A collective whose failure (a peer that died, or did not come within the timeout) is one line, its
    time added to the world's ``in_collectives``."""
    started = time.perf_counter()
    try:
        yield
    except RuntimeError as e:  # gloo and NCCL raise RuntimeError, or torch's DistError, one of its kinds
        raise DistributedError(f"rank {world.rank} of {world.world_size}: {what} failed, another rank stopped or "
                               f"did not answer within {timeout_seconds():g} s ({_first_line(e)})") from e
    finally:
        world.in_collectives.seconds += time.perf_counter() - started


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
