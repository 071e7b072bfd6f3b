"""A size budget's plan for a recipe: the grid of every weight matrix (the decoder's linears, the input
embedding and the output), the predicted size and loss.

The candidates are what the recipe's format can mix and its solver can solve (``quantkit.budget.formats``),
each costed at its exact stored bytes. Each candidate's loss is ``sensitivity.estimated_kl`` of the rounding
the format's own quantizer makes (the solver's error is smaller, by a similar factor across candidates).
The estimates depend only on the model, the calibration rows and the candidates, so they are cached: a
second plan, at another budget, takes seconds.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from quantkit.budget.allocate import Option, allocate, reachable
from quantkit.budget.formats import FAMILIES, Layout
from quantkit.budget.target import Budget, BudgetError

# the calibration rows the estimates are measured on (the recipe's first draw, at most this many)
PLAN_SAMPLES = 32
ESTIMATE_VERSION = 2  # bump when the estimate's method changes: old cache entries are then not read


@dataclass
class Plan:
    recipe: str
    family: str  # the format's budget family (quantkit.budget.formats.FAMILIES)
    mix_label: str  # what the recipe alone would write, as tables name it
    budget: Budget
    fixed_bytes: int  # the files' bytes outside the allocated tensors
    weights: int  # weights of the allocated tensors (every matrix)
    chosen: dict[str, Option]  # tensor -> its grid
    mix: dict[str, Option]  # the recipe's own grids, for comparison

    @property
    def tensor_types(self) -> dict[str, str]:
        return {name: option.name for name, option in self.chosen.items()}

    def file_bytes(self, options: dict[str, Option] | None = None) -> int:
        return self.fixed_bytes + sum(o.bytes for o in (options or self.chosen).values())

    def matrix_bpw(self, options: dict[str, Option] | None = None) -> float:
        return 8 * sum(o.bytes for o in (options or self.chosen).values()) / self.weights

    def predicted_kl(self, options: dict[str, Option] | None = None) -> float:
        return sum(o.loss for o in (options or self.chosen).values())

    def summary(self) -> list[list]:
        """One row each for the mix and the plan: file MB, the matrices' bits per weight, predicted KL."""
        return [[self.mix_label, round(self.file_bytes(self.mix) / 1e6, 2), round(self.matrix_bpw(self.mix), 3),
                 f"{self.predicted_kl(self.mix):.4g}"],
                [f"plan ({self.budget.describe()})", round(self.file_bytes() / 1e6, 2), round(self.matrix_bpw(), 3),
                 f"{self.predicted_kl():.4g}"]]

    def layer_rows(self) -> tuple[list[str], list[list]]:
        """Headers and one row per layer: each linear's grid (what gets more bits shows at a glance)."""
        return FAMILIES[self.family].layer_table(self.tensor_types)

    def other_rows(self) -> list[list[str]]:
        """The allocated tensors outside the layers (embedding, output): name, planned grid, the mix's."""
        table = FAMILIES[self.family].layer_table
        return [[name, option.name, self.mix[name].name] for name, option in self.chosen.items()
                if not table({name: option.name})[1]]

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "family": self.family, "mix_label": self.mix_label,
                "budget": self.budget.to_dict(), "file_bytes": self.file_bytes(),
                "matrix_bpw": round(self.matrix_bpw(), 4), "predicted_kl": self.predicted_kl(),
                "mix": {"file_bytes": self.file_bytes(self.mix), "matrix_bpw": round(self.matrix_bpw(self.mix), 4),
                        "predicted_kl": self.predicted_kl(self.mix)},
                "tensors": {name: {"type": o.name, "bytes": o.bytes, "estimated_kl": o.loss, "mix": self.mix[name].name}
                            for name, o in self.chosen.items()}}


def _cache_path(key: dict) -> Path:
    from quantkit.cache import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_root() / "budget" / f"{digest}.json"


def plan_rows(model_dir: str | Path, recipe):
    """The calibration rows the estimates are measured on: the recipe's draw, at most PLAN_SAMPLES rows."""
    from quantkit import calib
    from quantkit.tokenizer import load_tokenizer

    cal = recipe["calibration"]
    return calib.calibration_set(load_tokenizer(model_dir), source=cal["source"],
                                 n_samples=min(PLAN_SAMPLES, cal["n_samples"]), seq_len=cal["seq_len"],
                                 seed=cal["seed"], chat=cal["chat"])


def measure_options(model_dir: str | Path, recipe, fmt, *, progress: bool = False) -> dict[str, list[Option]]:
    """Every allocated tensor's candidates in the budget family ``fmt`` (tensor -> options), estimated once per
    model, calibration and candidate set, and cached."""
    from quantkit.atomic import write_json
    from quantkit.budget.sensitivity import collect, estimated_kl
    from quantkit.checkpoint import CheckpointReader
    from quantkit.loading import load_model
    from quantkit.models import MiniCPMConfig
    from quantkit.models.layers import EMBEDDING

    rows = plan_rows(model_dir, recipe)
    reader = CheckpointReader(model_dir)
    allocated = fmt.tensors(MiniCPMConfig.from_pretrained(model_dir))
    dtype = reader.dtype(EMBEDDING)  # the model's dtype, which MLX stores its scales in
    candidates = {name: fmt.candidates(tuple(reader.shape(f"{uses[0]}.weight")), uses, dtype)
                  for name, uses in allocated.items()}
    key = {"model": reader.fingerprint(), "calibration": rows.fingerprint, "family": fmt.family,
           "candidates": sorted({c.name for options in candidates.values() for c in options}),
           "version": ESTIMATE_VERSION}
    cached = _cache_path(key)
    if cached.is_file():
        stored = json.loads(cached.read_text())
        return {name: [Option(*entry) for entry in entries] for name, entries in stored.items()}
    model = load_model(model_dir, torch.float32)
    stats = collect(model, rows.input_ids, seed=recipe["calibration"]["seed"], progress=progress)
    options = {}
    for name, uses in tqdm(allocated.items(), desc="estimate", unit="tensor", disable=not progress):
        weight = model.get_submodule(uses[0]).weight.detach()
        options[name] = [Option(c.name, c.bytes, estimated_kl(weight, [stats[use] for use in uses], c.round_trip))
                         for c in candidates[name]]
    write_json(cached, {name: [[o.name, o.bytes, o.loss] for o in opts] for name, opts in options.items()})
    return options


def plan(options: dict[str, list[Option]], layout: Layout, budget: Budget, *, recipe: str, fmt) -> Plan:
    """The allocation of ``options`` under ``budget``: ``layout`` gives the bytes outside the allocated tensors,
    the recipe's own grids (for comparison) and the allocated tensors' weight count. A budget outside what the
    candidates can reach is refused, naming the range."""
    smallest, largest = reachable(options)
    fixed_bytes, weights = layout.fixed_bytes, layout.weights
    unquantized = fixed_bytes + 2 * weights  # the matrices in 16 bits
    if budget.file_bytes is not None:
        room, asked = budget.file_bytes - fixed_bytes, budget.file_bytes
        shown = (f"{(fixed_bytes + smallest) / 1e6:.2f} MB", f"{unquantized / 1e6:.2f} MB")
    else:
        room, asked = math.floor(budget.matrix_bpw * weights / 8), fixed_bytes + budget.matrix_bpw * weights / 8
        shown = (f"{8 * smallest / weights:.3f}", "16 bits per weight")
    if room < smallest or asked >= unquantized:
        raise BudgetError(f"{budget.describe()} is out of reach for {fmt.label}: the plan can make files from "
                          f"{shown[0]} (every matrix at its smallest grid) up to below the unquantized "
                          f"{shown[1]}")
    chosen = allocate(options, min(room, largest))
    mix = {name: next(o for o in opts if o.name == layout.mix[name]) for name, opts in options.items()}
    return Plan(recipe, fmt.family, fmt.label, budget, fixed_bytes, weights, chosen, mix)
