"""One option per tensor, the summed loss least under a byte budget: a multiple-choice knapsack.

Each tensor's options are first cut to their lower convex hull in (bytes, loss): an option that costs more
and loses more than another, or that lies above the line between two others, is never the best use of its
bytes at any exchange rate λ between loss and bytes. Along a hull the loss saved per extra byte falls, so
taking every tensor's upgrades in one order of falling saving per byte is the Lagrangian solution
(min Σ loss + λ·bytes) at each λ the budget passes through: it is optimal whenever it lands exactly on
the budget, and within one upgrade's loss of it otherwise. An upgrade that no longer fits closes its
tensor (its later upgrades save less per byte); the bytes left are then spent on the single change, to
any option off the hull included, that saves the most loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from quantkit.budget.target import BudgetError


@dataclass(frozen=True)
class Option:
    name: str  # what the format stores (a GGUF type, a bit width)
    bytes: int  # exact stored size of the tensor with it, scales and metadata included
    loss: float  # estimated increase of the model's loss


def hull(options: Sequence[Option]) -> list[Option]:
    """The options on the lower convex hull of (bytes, loss), cheapest first."""
    if not options:
        raise ValueError("a tensor needs at least one option")
    cheapest_first = sorted(options, key=lambda o: (o.bytes, o.loss, o.name))
    frontier: list[Option] = []
    for option in cheapest_first:
        if frontier and option.loss >= frontier[-1].loss:
            continue  # more bytes (or as many) and no less loss
        if frontier and option.bytes == frontier[-1].bytes:
            frontier.pop()
        while len(frontier) >= 2 and _saving(frontier[-2], frontier[-1]) <= _saving(frontier[-1], option):
            frontier.pop()  # the middle point lies on or above the line from its neighbours
        frontier.append(option)
    return frontier


def _saving(cheaper: Option, dearer: Option) -> float:
    return (cheaper.loss - dearer.loss) / (dearer.bytes - cheaper.bytes)


def reachable(options: Mapping[str, Sequence[Option]]) -> tuple[int, int]:
    """The smallest and largest total bytes any choice gives."""
    return (sum(min(o.bytes for o in opts) for opts in options.values()),
            sum(max(o.bytes for o in opts) for opts in options.values()))


def allocate(options: Mapping[str, Sequence[Option]], budget: int) -> dict[str, Option]:
    """Per tensor, the option chosen so that the total bytes are at most ``budget`` and the summed loss is
    as small as the method above finds. Deterministic: ties go to the tensor name, then the fewer bytes."""
    smallest, _ = reachable(options)
    if budget < smallest:
        raise BudgetError(f"the budget leaves {budget:,} bytes for these tensors; their smallest choice takes "
                          f"{smallest:,}")
    hulls = {name: hull(opts) for name, opts in options.items()}
    chosen = {name: frontier[0] for name, frontier in hulls.items()}
    spent = sum(option.bytes for option in chosen.values())
    upgrades = sorted(((-_saving(a, b), name, b.bytes, i + 1) for name, frontier in hulls.items()
                       for i, (a, b) in enumerate(zip(frontier, frontier[1:]))))
    closed: set[str] = set()
    for _, name, _, step in upgrades:
        if name in closed:
            continue
        extra = hulls[name][step].bytes - chosen[name].bytes
        if spent + extra > budget:
            closed.add(name)
            continue
        chosen[name] = hulls[name][step]
        spent += extra
    while True:  # the bytes left: the one change that saves most, until none fits
        best = None
        for name in sorted(options):
            for option in options[name]:
                extra = option.bytes - chosen[name].bytes
                gain = chosen[name].loss - option.loss
                if gain > 0 and spent + extra <= budget and (best is None or gain > best[0]):
                    best = (gain, name, option, extra)
        if best is None:
            return chosen
        _, name, option, extra = best
        chosen[name] = option
        spent += extra
