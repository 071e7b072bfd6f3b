"""A size budget as the user states it: the whole file in bytes, or bits per weight of its matrices."""
from __future__ import annotations

import re
from dataclasses import dataclass

from quantkit.errors import QuantkitError

# decimal units as file managers and the Hub show sizes, binary ones as `free -g` does
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*")


class BudgetError(QuantkitError):
    """A budget that does not parse, or that no allocation can meet."""


@dataclass(frozen=True)
class Budget:
    """Either ``file_bytes`` (the whole written file) or ``matrix_bpw`` (bits per weight over the file's
    weight matrices: the decoder's linears, the embedding and the output, the tensors the plan allocates)."""

    file_bytes: int | None = None
    matrix_bpw: float | None = None

    def __post_init__(self) -> None:
        if (self.file_bytes is None) == (self.matrix_bpw is None):
            raise BudgetError("give one budget: --target-size or --target-bpw")

    def describe(self) -> str:
        if self.file_bytes is not None:
            return f"file of at most {self.file_bytes / 1e6:.2f} MB"
        return f"at most {self.matrix_bpw:g} bits per weight of the matrices"

    def to_dict(self) -> dict:
        return {"file_bytes": self.file_bytes} if self.file_bytes is not None else {"matrix_bpw": self.matrix_bpw}


def parse_size(text: str) -> int:
    """``"4.5GB"`` -> 4_500_000_000 bytes; ``GiB``/``MiB``/``KiB`` are binary, a bare number is bytes."""
    match = _SIZE.fullmatch(text)
    unit = match[2].upper() if match else None
    if match is None or unit not in UNITS and unit != "":
        raise BudgetError(f"cannot read size '{text}': write a number and one of {', '.join(UNITS)} (e.g. 4.5GB)")
    size = int(float(match[1]) * UNITS[unit or "B"])
    if size <= 0:
        raise BudgetError(f"size '{text}' must be more than 0 bytes")
    return size


def budget_from_options(target_size: str | None, target_bpw: float | None) -> Budget | None:
    """The CLI's ``--target-size`` / ``--target-bpw`` as a Budget, None when neither is given."""
    if target_size is None and target_bpw is None:
        return None
    if target_size is not None and target_bpw is not None:
        raise BudgetError("give --target-size or --target-bpw, not both")
    if target_bpw is not None and not target_bpw > 0:
        raise BudgetError(f"--target-bpw must be more than 0, got {target_bpw}")
    return Budget(parse_size(target_size)) if target_size is not None else Budget(matrix_bpw=float(target_bpw))
