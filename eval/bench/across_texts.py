"""What the quality benchmarks share: the texts they score on, each artifact's scores remembered beside
it, and the rule by which one method beats another.

A figure is a mean over the test texts (and, where calibration enters, over calibration seeds), shown
with its range; a method wins only where its whole range is below the other's on every text, because
one text or one draw of calibration rows moves the ratio between two good methods by more than the
difference between them (docs/results/gptq.md, "Calibration seeds and the attention sink").
"""
from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import click


@dataclass(frozen=True)
class Spread:
    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, values) -> "Spread":
        values = list(values)
        return cls(statistics.fmean(values), min(values), max(values))

    def __str__(self) -> str:
        if self.low == self.high:
            return f"{self.mean:.4g}"
        return f"{self.mean:.4g} ({self.low:.3g}–{self.high:.3g})"


def texts_option(default: str):
    return click.option("--texts", default=default, show_default=True,
                        help="Comma-separated held-out texts scored (docs/data.md names them).")


def names(option_value: str) -> list[str]:
    """The comma-separated entries of an option, in order."""
    return [name.strip() for name in option_value.split(",") if name.strip()]


def text_tokens(tokenizer, texts: list[str], max_tokens: int) -> dict:
    """Each text's first ``max_tokens`` tokens."""
    from quantkit import calib

    return {name: calib.heldout_tokens(tokenizer, name=name, max_tokens=max_tokens) for name in texts}


def tokens_digest(tokens) -> str:
    return hashlib.sha256(tokens.numpy().tobytes()).hexdigest()[:16]


def remembered_scores(path: Path, score, tokens: dict, window: int, reuse: bool) -> dict[str, dict]:
    """``score(tokens_of_one_text)`` -> KLResult for every text, read back from ``path`` where ``reuse``
    is set and an earlier run scored the same tokens with the same window, and written there after."""
    keys = {name: f"{tokens_digest(t)}/{window}" for name, t in tokens.items()}
    known = json.loads(path.read_text()) if reuse and path.is_file() else {}
    for name, text in tokens.items():
        if known.get(name, {}).get("key") != keys[name]:
            known[name] = {"key": keys[name], **asdict(score(text))}
            click.echo(f"  {path.name.removesuffix('.scores.json')} on {name}: KL {known[name]['mean_kl']:.4f}",
                       err=True)
    path.write_text(json.dumps(known, indent=2))  # other texts' scores stay for a later run that asks for them
    return {name: known[name] for name in tokens}


def beats(ours: dict[str, list[float]], theirs: dict[str, list[float]]) -> bool:
    """Whether every value of ``ours`` is below every value of ``theirs``, text by text."""
    return all(max(ours[text]) < min(theirs[text]) for text in ours)
