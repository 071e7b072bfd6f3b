"""What a recipe's schema is made of: a key (``Field``) and a group of keys (``Section``).

Each part of quantkit that reads recipe settings declares its own section beside its code (GPTQ's
``gptq`` in ``quantkit.algorithms.gptq``, ``mlx`` on the MLX format, ``qat`` beside fake
quantization); ``quantkit.recipe`` assembles them into the one schema recipes are validated
against. This module is a leaf so that every one of them can import it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Field:
    kind: type
    default: Any = None
    required: bool = False
    choices: tuple | None = None
    check: Callable[[Any], bool] | None = None
    rule: str = ""  # what `check` demands, for the error message
    help: str = ""


# Seeds are 32-bit everywhere: torch's generators take 64 bits, and the data order's seeds are derived
# from the one given (times a prime, plus the epoch), which must still fit.
MAX_SEED = 2**32 - 1


def seed_field(help: str) -> Field:
    return Field(int, default=0, check=lambda v: 0 <= v <= MAX_SEED, rule=f"in [0, {MAX_SEED}]", help=help)


def positive(value) -> bool:
    return value > 0


def fraction(value) -> bool:
    return 0 <= value <= 1


class Section(dict):
    """A nested group of keys. An ``optional`` section is absent from recipes that do not state it
    (and from their fingerprints), rather than filled with defaults: only QAT recipes have ``qat``.
    ``check`` is a rule among the section's own keys, run once every key of the recipe is valid: the
    section's values -> why they cannot be used together, or None."""

    def __init__(self, fields: dict, optional: bool = False, check: Callable[[dict], str | None] | None = None):
        super().__init__(fields)
        self.optional = optional
        self.check = check
