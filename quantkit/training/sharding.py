"""Fully sharded data parallelism for a training run whose state does not fit one device: FSDP2's
``fully_shard`` (torch.distributed.fsdp), parameters, gradients and AdamW's moments split over the ranks.

A model is sharded in units: each decoder layer of QAT's student, each module of a draft head (whose
training-time test calls its linears and norms one by one). A unit's parameters are gathered from the ranks
just before its forward (and again for its backward) and freed after it, so a rank holds its 1/W of every
parameter, of every gradient and of AdamW's moments (which the optimizer makes in the parameters' sharded
layout), plus one or two whole units at a time. The student's embedding, final norm and LM head are its root
unit's. Where the data
parallelism of ``quantkit.distributed`` sums a step's gradients over the ranks with one
``all_reduce``, FSDP reduce-scatters them: each rank receives the sum of its own shard only. Both sum (each
rank's gradient is already its share of the step's mean; FSDP's default would average them again), and both
reduce once a step, after a rank's last micro-batch, so the sums are added in the same order.

``--shard`` chooses: ``auto`` shards when the run's unsharded training state
(``state_bytes``) would take more than ``HEADROOM`` of the free memory of some rank's device, ``on`` and
``off`` decide regardless. Every rank decides alike: the answer is gathered.
"""
from __future__ import annotations

from typing import Sequence

import torch

from quantkit.distributed import World
from quantkit.memory import device_available_bytes
from quantkit.run import RunError

# the share of a device's free memory the training state may take unsharded: activations, the teacher (while
# it fills its cache) and the allocator's slack need the rest
HEADROOM = 0.5
TRAINING_BYTES_PER_ELEMENT = 12  # a float32 gradient and AdamW's two float32 moments for each trained element


def state_bytes(model: torch.nn.Module, trainable: dict[str, torch.nn.Parameter]) -> int:
    """What one rank holds of the run's training state unsharded: every parameter of ``model`` as it is
    stored, and a gradient and two moments for each element of ``trainable``."""
    return (sum(param.numel() * param.element_size() for param in model.parameters())
            + TRAINING_BYTES_PER_ELEMENT * sum(param.numel() for param in trainable.values()))


def sharded(choice: str, world: World, needed_bytes: int, device: str) -> bool:
    """Whether the run shards (``choice``: auto, on or off); ``needed_bytes``: ``state_bytes``."""
    if choice == "on" and world.world_size == 1:
        raise RunError("--shard on: sharding splits the training state over the ranks of a torchrun job, and "
                       "this run is one process; start it with torchrun --nproc-per-node N (N > 1), or drop --shard")
    if choice != "auto" or world.world_size == 1:
        return choice == "on"
    available = device_available_bytes(torch.device(device))
    fits = available is None or needed_bytes <= HEADROOM * available[0]
    return min(world.per_rank(float(fits))) == 0.0  # shard when any rank lacks the room


def shard(units: Sequence[torch.nn.Module]) -> None:
    """Shard ``units`` over the job's ranks, each a unit of its own (its parameters gathered for its forward and
    backward, and freed after): inner modules before the ones that hold them (a model's decoder layers, then
    the model). Their parameters become sharded ``DTensor``s: make the optimizer, and name what trains, after
    this."""
    from torch.distributed.fsdp import fully_shard

    for unit in units:
        fully_shard(unit)
        unit.set_gradient_divide_factor(1.0)  # a sum over the ranks, as the unsharded path sums
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied one


def syncing_gradients(root: torch.nn.Module, sync: bool) -> None:
    """Whether the next backward reduce-scatters the gradients of ``root``'s units (a rank's last micro-batch of
    a step) or keeps adding them up unsharded (the ones before it)."""
    root.set_requires_gradient_sync(sync)


def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float) -> float:
    """``clip_grad_norm_`` over the whole of each gradient, sharded or not; the norm before clipping."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def gather_into(parameters: dict[str, torch.nn.Parameter], unsharded: dict[str, torch.nn.Parameter] | None,
                world: World) -> None:
    """Copy each of the sharded ``parameters`` whole into the same-named parameter of ``unsharded`` (an unsharded
    copy of the model, for the writer, which rank 0 alone runs; None on the other ranks). A collective: every
    rank calls it."""
    with torch.no_grad():
        for name, param in parameters.items():
            whole = param.full_tensor()
            if unsharded is not None:
                unsharded[name].copy_(whole)
