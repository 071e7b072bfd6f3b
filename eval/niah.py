"""Needle in a haystack: can the model read back one fact placed anywhere in a long context?

A needle sentence ("The special magic number is 4829305.") is put between the sentences of
held-out text at a relative depth (0 = the start, 1 = just before the question), the whole is cut
to a token budget, and the prompt ends with "... The special magic number is", so that base and
instruct models alike answer by continuing it. A trial is correct when the greedy continuation's
first number is the needle's. Results form a grid: context length × depth.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

NEEDLE = "The special magic number is {number}."
QUESTION = "\n\nWhat is the special magic number mentioned in the text above? The special magic number is"
ANSWER_TOKENS = 12


@dataclass(frozen=True)
class Trial:
    length: int  # prompt tokens
    depth: float
    number: str
    answer: str

    @property
    def correct(self) -> bool:
        found = re.search(r"\d+", self.answer)
        return found is not None and found.group() == self.number


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]


def build_prompt(tokenizer, sentences: list[str], length: int, depth: float, number: str) -> list[int]:
    """Token ids of haystack sentences with the needle at ``depth``, then the question: ``length`` in all
    (the haystack is filled sentence by sentence and its last sentence cut to fit)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    needle = tokenizer.encode(" " + NEEDLE.format(number=number), add_special_tokens=False)
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    budget = length - len(needle) - len(question)
    if budget < 1:
        raise ValueError(f"a context of {length} tokens cannot hold the needle and the question")
    haystack: list[list[int]] = []
    total = 0
    for sentence in sentences * (1 + length // max(1, len(sentences))):
        if total >= budget:
            break
        ids = tokenizer.encode(" " + sentence, add_special_tokens=False)[: budget - total]
        haystack.append(ids)
        total += len(ids)
    if total < budget:
        raise ValueError(f"the haystack text gives only {total} of the {budget} tokens needed")
    # the needle goes between sentences: after the last sentence that starts before the depth
    starts, position = [], 0
    for ids in haystack:
        starts.append(position)
        position += len(ids)
    cut = sum(1 for start in starts if start < depth * total) if depth < 1 else len(haystack)
    before = [t for ids in haystack[:cut] for t in ids]
    after = [t for ids in haystack[cut:] for t in ids]
    return before + needle + after + question


@torch.inference_mode()
def run(model, tokenizer, text: str, lengths: list[int], depths: list[float], trials: int = 1, seed: int = 0,
        progress: bool = False, device: str = "cpu") -> list[Trial]:
    """The trials of every length x depth; prompts go to ``device``, where ``model`` runs."""
    sentences = _sentences(text)
    rng = random.Random(seed)
    cases = [(length, depth, str(rng.randrange(1_000_000, 10_000_000)))
             for length in lengths for depth in depths for _ in range(trials)]
    results = []
    for length, depth, number in tqdm(cases, desc="needle in a haystack", unit="trial", disable=not progress):
        ids = build_prompt(tokenizer, sentences, length, depth, number)
        output = model.generate(torch.tensor([ids], device=device), max_new_tokens=ANSWER_TOKENS, do_sample=False,
                                pad_token_id=tokenizer.eos_token_id)
        answer = tokenizer.decode(output[0, len(ids):], skip_special_tokens=True)
        results.append(Trial(length, depth, number, answer))
    return results


def accuracy_grid(results: list[Trial]) -> dict[int, dict[float, float]]:
    """length -> depth -> fraction of trials answered correctly."""
    grid: dict[int, dict[float, list[bool]]] = {}
    for trial in results:
        grid.setdefault(trial.length, {}).setdefault(trial.depth, []).append(trial.correct)
    return {length: {depth: sum(v) / len(v) for depth, v in row.items()} for length, row in grid.items()}


def plot(grid: dict[int, dict[float, float]], path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(grid)
    depths = sorted({d for row in grid.values() for d in row})
    values = [[grid[length].get(depth, float("nan")) for length in lengths] for depth in depths]
    figure, axes = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.5 * len(depths)))
    image = axes.imshow(values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    axes.set(xticks=range(len(lengths)), xticklabels=lengths, yticks=range(len(depths)),
             yticklabels=[f"{d:.0%}" for d in depths], xlabel="context tokens", ylabel="needle depth", title=title)
    for row, depth_values in enumerate(values):
        for column, value in enumerate(depth_values):
            axes.text(column, row, f"{value:.0%}", ha="center", va="center", fontsize=8)
    figure.colorbar(image, ax=axes, label="retrieval accuracy")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
