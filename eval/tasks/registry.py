"""The task table (name -> task) and the loop that runs several tasks on one model."""
from __future__ import annotations

from quantkit.eval.tasks import gsm, humaneval, multiple_choice
from quantkit.eval.tasks.base import Task, TaskResult
from quantkit.eval.tasks.model import TaskModel

TASKS: dict[str, Task] = {task.name: task for task in (humaneval.TASK, gsm.TASK, multiple_choice.FAMILY)}


def parse_task_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TASKS]
    if unknown or not names:
        raise ValueError(f"unknown task(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(TASKS)}")
    return names


def evaluate_tasks(lm: TaskModel, names: list[str], limit: int | None = None,
                   progress: bool = False) -> list[TaskResult]:
    """Each named task on ``limit`` samples (default: the task's own default subset)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    return [TASKS[name].run(lm, limit or TASKS[name].default_limit, progress) for name in names]
