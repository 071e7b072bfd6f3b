"""Multiple-choice tasks scored by log-likelihood.

A question is a context, its choices and the index of the right one; choice i is scored as the
continuation ``delimiter + choices[i]``. Each choice's log-likelihood given the context comes from
one batched forward per question; the prediction is the argmax of the summed log-likelihood
(``acc``) and of the log-likelihood per character of the choice, delimiter not counted (``acc_norm``).
Both are lm-evaluation-harness's definitions, so a question scored here and the same question as an
lm-eval ``multiple_choice`` task (``target_delimiter``) agree. The context is plain text (no chat
template), as lm-eval scores log-likelihood tasks.

Shipped task ``family``: questions from reasoning-gym's ``family_relationships`` generator
(Apache-2.0; generated, not a published benchmark): a short family story, then "What is X to Y?";
the choices are the 16 relationship words of reasoning-gym's own ``Relationship`` list, so chance
is 1/16.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from tqdm.auto import tqdm

from quantkit.eval.tasks.base import Task, TaskResult
from quantkit.eval.tasks.model import TaskModel

FAMILY_SEED = 0


@dataclass(frozen=True)
class Question:
    id: str
    context: str
    choices: tuple[str, ...]
    gold: int
    delimiter: str = " "

    @property
    def continuations(self) -> tuple[str, ...]:
        return tuple(self.delimiter + choice for choice in self.choices)

    def __post_init__(self):
        if len(self.choices) < 2 or not 0 <= self.gold < len(self.choices):
            raise ValueError(f"question {self.id}: need >= 2 choices and a gold index among them")


@dataclass(frozen=True)
class ChoiceScores:
    log_likelihoods: tuple[float, ...]
    characters: tuple[int, ...]

    @property
    def predicted(self) -> int:
        return max(range(len(self.log_likelihoods)), key=self.log_likelihoods.__getitem__)

    @property
    def predicted_normalized(self) -> int:
        per_char = [ll / n for ll, n in zip(self.log_likelihoods, self.characters)]
        return max(range(len(per_char)), key=per_char.__getitem__)


def score_question(lm: TaskModel, question: Question) -> ChoiceScores:
    continuations = [lm.encode(text, special_tokens=False) for text in question.continuations]
    scored = lm.continuation_log_likelihoods(lm.encode(question.context), continuations)
    return ChoiceScores(tuple(c.log_likelihood for c in scored), tuple(len(choice) for choice in question.choices))


def evaluate_questions(lm: TaskModel, task: str, questions: list[Question], progress: bool = False) -> TaskResult:
    start = time.monotonic()
    records, correct, correct_norm = [], 0, 0
    for question in tqdm(questions, desc=task, unit="question", disable=not progress):
        scores = score_question(lm, question)
        correct += scores.predicted == question.gold
        correct_norm += scores.predicted_normalized == question.gold
        records.append({"id": question.id, "gold": question.choices[question.gold],
                        "predicted": question.choices[scores.predicted],
                        "predicted_normalized": question.choices[scores.predicted_normalized],
                        "log_likelihoods": list(scores.log_likelihoods)})
    n = len(questions)
    chance = sum(1 / len(q.choices) for q in questions) / n
    return TaskResult(task, "acc", correct / n, n, time.monotonic() - start,
                      f"acc_norm {correct_norm / n:.3f}, chance {chance:.3f}",
                      {"acc": correct / n, "acc_norm": correct_norm / n, "chance": chance}, records)


def family_questions(n: int, seed: int = FAMILY_SEED) -> list[Question]:
    import reasoning_gym
    from reasoning_gym.graphs.family_relationships import Relationship

    words = tuple(r.value for r in Relationship)
    return [Question(f"family_relationships/{seed}/{i}", f"{item['question']}\nAnswer:", words,
                     words.index(item["answer"]))
            for i, item in enumerate(reasoning_gym.create_dataset("family_relationships", size=n, seed=seed))]


def _run_family(lm: TaskModel, limit: int, progress: bool) -> TaskResult:
    result = evaluate_questions(lm, "family", family_questions(limit), progress)
    result.details["seed"] = FAMILY_SEED
    return result


FAMILY = Task("family", "reasoning-gym family_relationships, 16-way log-likelihood choice (acc, acc_norm)",
              default_limit=40, run=_run_family, requires=("reasoning_gym",))
