"""A size budget's plan for a recipe: the type of every weight matrix (the decoder's linears, the input
embedding and the output), the predicted size and loss.

The candidates are what the recipe's format can mix and its solver can solve: for GGUF, every type with
a GPTQ grid whose blocks divide the tensor's rows (``CANDIDATE_TYPES``), each costed at its exact stored
bytes. Each candidate's loss is ``sensitivity.estimated_kl`` of the rounding llama.cpp's quantizer makes
with the calibration rows' importance (the solver's own error is smaller, by a similar factor across
types). The estimates depend only on the model, the calibration rows and the candidates, so they are
cached: a second plan, at another budget, takes seconds.
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
from quantkit.budget.target import Budget, BudgetError

# the calibration rows the estimates are measured on (the recipe's first draw, at most this many)
PLAN_SAMPLES = 32
# GGUF types a plan may give a linear, from llama.cpp's largest to its smallest; a tensor gets those
# whose blocks divide its rows
CANDIDATE_TYPES = ("q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "q4_1", "q4_0", "iq4_xs", "iq4_nl", "q3_k",
                   "iq3_s", "iq3_xxs", "q2_k", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s")
ESTIMATE_VERSION = 2  # bump when the estimate's method changes: old cache entries are then not read


@dataclass
class Plan:
    recipe: str
    file_type: str
    budget: Budget
    fixed_bytes: int  # the header and every tensor the plan does not allocate, at the mix's types
    weights: int  # weights of the allocated tensors (every matrix)
    chosen: dict[str, Option]  # GGUF tensor name -> its type
    mix: dict[str, Option]  # the recipe's own mix, for comparison

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
        return [[f"{self.file_type} mix", round(self.file_bytes(self.mix) / 1e6, 2),
                 round(self.matrix_bpw(self.mix), 3), f"{self.predicted_kl(self.mix):.4g}"],
                [f"plan ({self.budget.describe()})", round(self.file_bytes() / 1e6, 2), round(self.matrix_bpw(), 3),
                 f"{self.predicted_kl():.4g}"]]

    def layer_rows(self) -> tuple[list[str], list[list]]:
        """Headers and one row per layer: each linear's type (what gets more bits shows at a glance)."""
        from quantkit.gguf.names import layer_table

        return layer_table(self.tensor_types)

    def other_rows(self) -> list[list[str]]:
        """The allocated tensors outside the layers (embedding, output): name, planned type, the mix's type."""
        from quantkit.gguf.names import LAYER_TENSOR_NAME

        return [[name, option.name, self.mix[name].name] for name, option in self.chosen.items()
                if not LAYER_TENSOR_NAME.fullmatch(name)]

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "file_type": self.file_type, "budget": self.budget.to_dict(),
                "file_bytes": self.file_bytes(), "matrix_bpw": round(self.matrix_bpw(), 4),
                "predicted_kl": self.predicted_kl(), "mix": {"file_bytes": self.file_bytes(self.mix),
                                                             "matrix_bpw": round(self.matrix_bpw(self.mix), 4),
                                                             "predicted_kl": self.predicted_kl(self.mix)},
                "tensors": {name: {"type": o.name, "bytes": o.bytes, "estimated_kl": o.loss, "mix": self.mix[name].name}
                            for name, o in self.chosen.items()}}


def gguf_file_type(recipe) -> str:
    """The GGUF file type a recipe's format writes, or a BudgetError for a format a plan cannot mix yet."""
    from quantkit.formats import FORMATS

    fmt = FORMATS[recipe["format"]]
    file_type = getattr(fmt, "file_type", None)
    if file_type is None:
        raise BudgetError(f"format {fmt.name}: size budgets choose GGUF types per tensor so far; use a gguf-* "
                          "recipe (e.g. gguf-q4_k_m)")
    return file_type


def _padded(rows: int, k: int, type_name: str) -> int:
    """The tensor's bytes in the file: padded to GGUF's default alignment, as the exporter writes them."""
    from gguf import GGUF_DEFAULT_ALIGNMENT, GGUFWriter

    from quantkit.gguf.types import TYPES

    return GGUFWriter.ggml_pad(rows * TYPES[type_name].row_bytes(k), GGUF_DEFAULT_ALIGNMENT)


def rounding(tensor_type, weighted: bool = True):
    """llama.cpp's rounding onto ``tensor_type``, weighted by an importance row or not: weight [N, K]
    float32 -> the weight it stores (the estimate's ΔW)."""
    return lambda weight, importance: tensor_type.dequantize(
        tensor_type.quantize_fast(weight, importance if weighted else None), weight.shape[1])


def allocated_tensors(config) -> dict[str, tuple[str, ...]]:
    """The GGUF tensors a plan allocates -> the modules whose statistics their rounding is charged to:
    every decoder linear (solved by the recipe, rounded with importance), the input embedding and the
    output matrix (rounded by the export without importance); an embedding tied to the output serves both."""
    from quantkit.budget.sensitivity import EMBEDDING, OUTPUT
    from quantkit.gguf.names import gguf_name
    from quantkit.models.layers import LINEARS, layer_prefix

    tensors = {gguf_name(f"{layer_prefix(index)}{linear}.weight"): (layer_prefix(index) + linear,)
               for index in range(config.num_hidden_layers) for linear in LINEARS}
    embedding, output = gguf_name(f"{EMBEDDING}.weight"), gguf_name(f"{OUTPUT}.weight")
    if config.tie_word_embeddings:
        return tensors | {embedding: (EMBEDDING, OUTPUT)}
    return tensors | {embedding: (EMBEDDING,), output: (OUTPUT,)}


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


def measure_options(model_dir: str | Path, recipe, *, progress: bool = False) -> dict[str, list[Option]]:
    """Every allocated tensor's candidates (GGUF name -> options), estimated once per model, calibration and
    candidate set, and cached."""
    from quantkit.atomic import write_json
    from quantkit.budget.sensitivity import EMBEDDING, OUTPUT, collect, estimated_kl
    from quantkit.checkpoint import CheckpointReader
    from quantkit.gguf.types import TYPES
    from quantkit.loading import load_model

    rows = plan_rows(model_dir, recipe)
    key = {"model": CheckpointReader(model_dir).fingerprint(), "calibration": rows.fingerprint,
           "candidates": CANDIDATE_TYPES, "version": ESTIMATE_VERSION}
    cached = _cache_path(key)
    if cached.is_file():
        stored = json.loads(cached.read_text())
        return {name: [Option(*entry) for entry in entries] for name, entries in stored.items()}
    model = load_model(model_dir, torch.float32)
    stats = collect(model, rows.input_ids, seed=recipe["calibration"]["seed"], progress=progress)
    options = {}
    for name, uses in tqdm(allocated_tensors(model.config).items(), desc="estimate", unit="tensor",
                           disable=not progress):
        weight = model.get_submodule(uses[0]).weight.detach()
        n, k = weight.shape
        weighted = uses[0] not in (EMBEDDING, OUTPUT)  # the export rounds these two without importance
        options[name] = [Option(t, _padded(n, k, t), estimated_kl(weight, [stats[use] for use in uses],
                                                                  rounding(TYPES[t], weighted)))
                         for t in CANDIDATE_TYPES
                         if TYPES[t].fits(k) and (weighted or not TYPES[t].requires_importance)]
    write_json(cached, {name: [[o.name, o.bytes, o.loss] for o in opts] for name, opts in options.items()})
    return options


def plan(options: dict[str, list[Option]], mix_types: dict[str, str], fixed_bytes: int, budget: Budget, *,
         recipe: str, file_type: str, weights: int) -> Plan:
    """The allocation of ``options`` under ``budget``: ``fixed_bytes`` are the file's bytes outside the
    allocated tensors, ``mix_types`` the recipe's own types (for comparison), ``weights`` the allocated
    tensors' weight count. A budget outside what the candidates can reach is refused, naming the range."""
    smallest, largest = reachable(options)
    unquantized = fixed_bytes + 2 * weights  # the matrices in 16 bits
    if budget.file_bytes is not None:
        room, asked = budget.file_bytes - fixed_bytes, budget.file_bytes
        shown = (f"{(fixed_bytes + smallest) / 1e6:.2f} MB", f"{unquantized / 1e6:.2f} MB")
    else:
        room, asked = math.floor(budget.matrix_bpw * weights / 8), fixed_bytes + budget.matrix_bpw * weights / 8
        shown = (f"{8 * smallest / weights:.3f}", "16 bits per weight")
    if room < smallest or asked >= unquantized:
        raise BudgetError(f"{budget.describe()} is out of reach for {file_type}: the plan can make files from "
                          f"{shown[0]} (every linear at its smallest type) up to below the unquantized "
                          f"{shown[1]}")
    chosen = allocate(options, min(room, largest))
    mix = {name: next(o for o in opts if o.name == mix_types[name]) for name, opts in options.items()}
    return Plan(recipe, file_type, budget, fixed_bytes, weights, chosen, mix)
