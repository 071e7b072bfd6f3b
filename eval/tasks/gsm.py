"""GSM-style math word problems, exact match on the final number.

Problems come from reasoning-gym's ``gsm_symbolic`` generator (Apache-2.0): GSM8K's templates with
freshly drawn numbers, each with a worked answer ending in ``#### N``. The evaluation problems use
seed ``EVAL_SEED``; the few-shot examples are drawn with another seed, ``FEWSHOT_SEED``.

A chat task: with a chat template the examples are earlier user/assistant turns (reasoning off,
see TaskModel.chat_prompt), because instruction-tuned models (MiniCPM4.1, SmolLM2-Instruct) answer
questions in that form; without one, a plain "Question: ... Answer: ..." few-shot prompt. The
worked answers end "The answer is N.", and so does what the model learns to write.
"""
from __future__ import annotations

import re
import time
from decimal import Decimal, InvalidOperation

from tqdm.auto import tqdm

from quantkit.eval.tasks.base import Task, TaskResult
from quantkit.eval.tasks.model import TaskModel

EVAL_SEED, FEWSHOT_SEED = 0, 1
FEWSHOT = 4
MAX_NEW_TOKENS = 256
PLAIN_STOP = ("\n\nQuestion:", "\nQuestion:")

_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
_STATED = re.compile(rf"answer is\s*:?\s*\**\s*({_NUMBER})", re.IGNORECASE)
_HASHES = re.compile(rf"####\s*({_NUMBER})")
_ANY = re.compile(_NUMBER)
_THINKING = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)


def problems(n: int, seed: int) -> list[dict]:
    import reasoning_gym

    return list(reasoning_gym.create_dataset("gsm_symbolic", size=n, seed=seed))


def worked_answer(problem: dict) -> str:
    """The generator's chain of thought, its final ``#### N`` line written as "The answer is N."."""
    steps, _, answer = problem["metadata"]["answer_cot"].rpartition("####")
    return f"{steps.strip()}\nThe answer is {answer.strip()}."


def final_number(text: str) -> Decimal | None:
    """The answer in a model's output: what follows the last "answer is", else the last "#### N",
    else the last number; commas, a dollar sign and a trailing full stop are ignored."""
    text = _THINKING.sub("", text)
    for pattern in (_STATED, _HASHES, _ANY):
        found = pattern.findall(text)
        if found:
            try:
                return Decimal(found[-1].replace(",", "").replace("$", ""))
            except InvalidOperation:
                return None
    return None


def prompt(lm: TaskModel, question: str, shots: list[dict]) -> tuple[list[int], tuple[str, ...]]:
    """(prompt ids, stop strings) for ``question`` after the worked examples ``shots``."""
    if lm.has_chat_template:
        messages = []
        for shot in shots:
            messages += [{"role": "user", "content": shot["question"]},
                         {"role": "assistant", "content": worked_answer(shot)}]
        messages.append({"role": "user", "content": question})
        return lm.encode(lm.chat_prompt(messages), special_tokens=False), ()
    text = "".join(f"Question: {s['question']}\nAnswer: {worked_answer(s)}\n\n" for s in shots)
    return lm.encode(f"{text}Question: {question}\nAnswer:"), PLAIN_STOP


def _run(lm: TaskModel, limit: int, progress: bool) -> TaskResult:
    start = time.monotonic()
    shots = problems(FEWSHOT, FEWSHOT_SEED)
    records, correct = [], 0
    for i, problem in enumerate(tqdm(problems(limit, EVAL_SEED), desc="gsm", unit="problem", disable=not progress)):
        ids, stop = prompt(lm, problem["question"], shots)
        output = lm.generate(ids, stop, MAX_NEW_TOKENS)
        predicted = final_number(output)
        ok = predicted is not None and predicted == Decimal(problem["answer"])
        correct += ok
        records.append({"id": f"gsm_symbolic/{EVAL_SEED}/{i}", "answer": problem["answer"],
                        "predicted": None if predicted is None else str(predicted), "correct": ok, "output": output})
    summary = f"{FEWSHOT}-shot, {'chat template' if lm.has_chat_template else 'plain prompt'}, seed {EVAL_SEED}"
    return TaskResult("gsm", "exact_match", correct / limit, limit, time.monotonic() - start, summary,
                      {"seed": EVAL_SEED, "fewshot": FEWSHOT, "fewshot_seed": FEWSHOT_SEED,
                       "chat_template": lm.has_chat_template, "max_new_tokens": MAX_NEW_TOKENS}, records)


TASK = Task("gsm", "reasoning-gym gsm_symbolic (GSM8K templates), 4-shot, exact match on the final number",
            default_limit=10, run=_run, requires=("reasoning_gym",))
