"""What every task is and returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from quantkit.eval.tasks.model import TaskModel


@dataclass
class TaskResult:
    task: str
    metric: str  # the headline metric's name; its value is ``score``
    score: float
    samples: int
    seconds: float
    summary: str  # one line for the table: further metrics, counts, settings
    details: dict = field(default_factory=dict)  # the same and more, for machines (seeds, limits, counts)
    records: list[dict] = field(default_factory=list)  # one per sample: its id, outcome, model output


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    default_limit: int  # samples scored when no limit is given
    run: Callable[[TaskModel, int, bool], TaskResult]  # (model, number of samples, progress bar)
    # the modules its data comes from: packages of the `tasks` extra, checked before any model loads
    requires: tuple[str, ...] = ()
