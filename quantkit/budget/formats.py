"""What a plan may give each tensor, per format: the tensors it allocates, each one's candidates with their
exact stored bytes and the rounding that estimates their loss, the bytes of everything else, and the recipe
settings that hand the choice to the solver.

GGUF mixes llama.cpp's types per tensor (``gguf.tensor_types``, llama-quantize's ``--tensor-type``); MLX mixes
bits and group sizes per module (``mlx.modules``, the per-module entries mlx-lm's loader reads). A recipe's
format names its family (``budget_format``); the display of a recorded plan needs only the family's name
(``FAMILIES``), so ``quantkit inspect`` draws an artifact's plan without the recipe.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch

from quantkit.budget.sensitivity import EMBEDDING, OUTPUT
from quantkit.budget.target import BudgetError
from quantkit.models.layers import LINEARS, layer_prefix

# weight [N, K] float32, importance [K] or None -> the weight the format stores (the estimate's ΔW)
RoundTrip = Callable[[np.ndarray, "np.ndarray | None"], np.ndarray]


@dataclass(frozen=True)
class Candidate:
    name: str  # what the format stores, as tables show it
    bytes: int  # the tensor's exact stored bytes with it, scales and padding included
    round_trip: RoundTrip


@dataclass(frozen=True)
class Layout:
    mix: dict[str, str]  # allocated tensor -> the recipe's own choice (the plan's comparison)
    fixed_bytes: int  # the files' bytes outside the allocated tensors
    weights: int  # weights of the allocated tensors


def decoder_and_outside(config, name_of: Callable[[str], str]) -> dict[str, tuple[str, ...]]:
    """The tensors a plan allocates, by the format's name for each, -> the modules whose statistics their
    rounding is charged to: every decoder linear, the input embedding and the output matrix; an embedding
    tied to the output serves both."""
    tensors = {name_of(layer_prefix(index) + linear): (layer_prefix(index) + linear,)
               for index in range(config.num_hidden_layers) for linear in LINEARS}
    if config.tie_word_embeddings:
        return tensors | {name_of(EMBEDDING): (EMBEDDING, OUTPUT)}
    return tensors | {name_of(EMBEDDING): (EMBEDDING,), name_of(OUTPUT): (OUTPUT,)}


class GGUFBudget:
    """Every llama.cpp type GPTQ solves on whose blocks divide the tensor's rows, from Q8_0 down to IQ1_S,
    each costed at its bytes with GGUF's alignment; ΔW is llama.cpp's rounding with the calibration rows'
    importance (the embedding and output: without, as the export rounds them)."""

    family = "gguf"
    # from llama.cpp's largest type to its smallest
    CANDIDATES = ("q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "q4_1", "q4_0", "iq4_xs", "iq4_nl", "q3_k",
                  "iq3_s", "iq3_xxs", "q2_k", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s")

    def __init__(self, file_type: str, file_bytes: Callable | None):
        self.file_type = file_type
        self.label = f"{file_type} mix"
        self.file_bytes = file_bytes  # the exporter's count of a file (quantkit.gguf.export.file_bytes)

    def tensors(self, config) -> dict[str, tuple[str, ...]]:
        from quantkit.gguf.names import gguf_name

        return decoder_and_outside(config, lambda module: gguf_name(f"{module}.weight"))

    def candidates(self, shape: tuple[int, int], uses: tuple[str, ...], dtype: torch.dtype) -> list[Candidate]:
        from gguf import GGUF_DEFAULT_ALIGNMENT, GGUFWriter

        from quantkit.gguf.types import TYPES

        n, k = shape
        weighted = uses[0] not in (EMBEDDING, OUTPUT)  # the export rounds these two without importance
        return [Candidate(t, GGUFWriter.ggml_pad(n * TYPES[t].row_bytes(k), GGUF_DEFAULT_ALIGNMENT),
                          rounding(TYPES[t], weighted))
                for t in self.CANDIDATES if TYPES[t].fits(k) and (weighted or not TYPES[t].requires_importance)]

    def layout(self, model_dir: Path, allocated: Mapping[str, tuple[str, ...]]) -> Layout:
        """The exporter's own count of the file at the mix's types, without quantizing."""
        total, tensors = self.file_bytes(model_dir, self.file_type)
        mine = {name: tensors[name] for name in allocated}
        return Layout({name: type_name for name, (type_name, _, _) in mine.items()},
                      total - sum(size for _, size, _ in mine.values()),
                      sum(weights for _, _, weights in mine.values()))

    @staticmethod
    def settings(chosen: Mapping[str, str]) -> dict:
        return {"gguf.tensor_types": dict(chosen)}

    @staticmethod
    def bits(option: str) -> float:
        from quantkit.gguf.types import TYPES

        return 8 * TYPES[option].block_bytes / TYPES[option].block_size

    @staticmethod
    def layer_table(values: Mapping[str, object]) -> tuple[list[str], list[list]]:
        from quantkit.gguf.names import layer_table

        return layer_table(values)


def rounding(tensor_type, weighted: bool = True) -> RoundTrip:
    """llama.cpp's rounding onto ``tensor_type``, weighted by an importance row or not."""
    return lambda weight, importance: tensor_type.dequantize(
        tensor_type.quantize_fast(weight, importance if weighted else None), weight.shape[1])


class MLXBudget:
    """Every grid of MLX's affine format (2–8 bits, groups of 32, 64 or 128 dividing the row) for each module,
    and the embedding and output also left unquantized (mlx-lm's ``false`` entry; the engine quantizes every
    decoder linear). ΔW is round to nearest on the grid as stored (``mx.quantize``'s rule up to codes on the
    rounding of a boundary): the solver's own error is smaller by a similar factor on every grid. Bytes: the
    packed codes and the scales and biases in the model's dtype; the files' headers are bounded from above, so
    a written artifact never exceeds its budget."""

    family = "mlx"
    BITS = (8, 6, 5, 4, 3, 2)
    UNQUANTIZED = "unquantized"

    def __init__(self, recipe):
        self.recipe = recipe
        self.label = f"{recipe.name} grid"

    @staticmethod
    def tensors(config) -> dict[str, tuple[str, ...]]:
        if config.tie_word_embeddings:  # refused before the estimates, as the MLX writer would refuse it after
            raise BudgetError("format mlx: this checkpoint ties its LM head to the embedding, which mlx-lm's MiniCPM "
                              "cannot load")
        return decoder_and_outside(config, lambda module: module)

    @staticmethod
    def option(bits: int, group_size: int) -> str:
        return f"{bits}-bit g{group_size}"

    def candidates(self, shape: tuple[int, int], uses: tuple[str, ...], dtype: torch.dtype) -> list[Candidate]:
        from quantkit.algorithms.smooth import round_to_nearest
        from quantkit.formats.mlx import GROUP_SIZES, WORD_BITS, mlx_grid

        n, k = shape
        scale_bytes = torch.empty((), dtype=dtype).element_size()

        def round_trip(grid) -> RoundTrip:
            return lambda weight, _importance: round_to_nearest(torch.from_numpy(weight), grid).numpy()

        options = [Candidate(self.option(bits, group), n * k * bits // 8 + 2 * n * (k // group) * scale_bytes,
                             round_trip(mlx_grid({"bits": bits, "group_size": group, "sym": False}, dtype)))
                   for bits in self.BITS for group in GROUP_SIZES if k % group == 0 and k * bits % WORD_BITS == 0]
        if uses[0] in (EMBEDDING, OUTPUT):
            options.append(Candidate(self.UNQUANTIZED, n * k * scale_bytes, lambda weight, _importance: weight))
        return options

    def layout(self, model_dir: Path, allocated: Mapping[str, tuple[str, ...]]) -> Layout:
        """The recipe's own grid per module; the other tensors at their stored bytes, and a bound on the
        safetensors headers of the artifact's shards (one per layer and one for the rest)."""
        from quantkit.checkpoint import CheckpointReader
        from quantkit.formats.mlx import mlx_grid, resolve
        from quantkit.models import MiniCPMConfig

        reader = CheckpointReader(model_dir)
        config = MiniCPMConfig.from_pretrained(model_dir)
        weights = {f"{module}.weight" for module in allocated}
        others = [name for name in reader.names if name not in weights]
        grid = resolve(mlx_grid(self.recipe["quant"], reader.dtype(f"{EMBEDDING}.weight")), self.recipe.values,
                       config.num_hidden_layers)
        mix = {}
        for module in allocated:
            chosen = grid.module(module)
            mix[module] = self.UNQUANTIZED if chosen is None else self.option(chosen.bits, chosen.group_size)
        fixed = sum(math.prod(reader.shape(name)) * reader.dtype(name).itemsize for name in others)
        # at most three tensors per allocated module (codes, scales, biases), each a header entry whose offsets
        # have at most as many digits as the whole model's bytes in 16 bits
        digits = len(str(2 * sum(math.prod(reader.shape(name)) for name in reader.names)))
        entries = [(f"{module}.{part}", 3) for module in allocated for part in ("weight", "scales", "biases")]
        entries += [(name, len(reader.shape(name))) for name in others]
        header = sum(_HEADER_ENTRY + len(name) + dims * (_DIM_DIGITS + 1) + 2 * digits for name, dims in entries)
        shards = config.num_hidden_layers + 1
        return Layout(mix, fixed + header + shards * _SHARD_OVERHEAD,
                      sum(math.prod(reader.shape(f"{module}.weight")) for module in allocated))

    @staticmethod
    def settings(chosen: Mapping[str, str]) -> dict:
        return {"mlx.modules": {module: _grid_entry(option) for module, option in chosen.items()}}

    @classmethod
    def bits(cls, option: str) -> float:
        if option == cls.UNQUANTIZED:
            return 16.0
        bits, group = _MLX_OPTION.fullmatch(option).groups()
        return int(bits) + 2 * 16 / int(group)  # a 16-bit scale and bias per group

    @staticmethod
    def layer_table(values: Mapping[str, object]) -> tuple[list[str], list[list]]:
        from quantkit.formats.mlx import LAYER_MODULE

        layers: dict[int, dict[str, object]] = {}
        for name, value in values.items():
            if match := LAYER_MODULE.fullmatch(name):
                layers.setdefault(int(match[1]), {})[match[2].split(".")[-1]] = value
        stems = list(dict.fromkeys(stem for row in layers.values() for stem in row))
        return ["layer", *stems], [[i, *(row.get(stem, "") for stem in stems)] for i, row in sorted(layers.items())]


_MLX_OPTION = re.compile(r"(\d+)-bit g(\d+)")
# a safetensors header entry: "<name>":{"dtype":"XX","shape":[...],"data_offsets":[a,b]}, and its comma; each
# dimension at most _DIM_DIGITS digits and a comma
_HEADER_ENTRY = len('"":{"dtype":"BF16","shape":[],"data_offsets":[,]},')
_DIM_DIGITS = 7
# per shard: the 8-byte length, the braces and quantkit's metadata, and up to 7 bytes of padding
_SHARD_OVERHEAD = 8 + len('{"__metadata__":{"format":"pt"},}') + 7


def _grid_entry(option: str) -> dict | bool:
    """An option's entry in ``mlx.modules``: mlx-lm's per-module dict, or false for a module left as it is."""
    if option == MLXBudget.UNQUANTIZED:
        return False
    bits, group = _MLX_OPTION.fullmatch(option).groups()
    return {"bits": int(bits), "group_size": int(group)}


# the display of a recorded plan: its family -> (bits per weight of an option, the per-layer table)
FAMILIES = {family.family: family for family in (GGUFBudget, MLXBudget)}


def budget_format(recipe, gguf_file_bytes: Callable | None = None):
    """The budget family of a recipe's format, or a BudgetError for a format whose consumers cannot mix.
    ``gguf_file_bytes`` is the GGUF exporter's count of a file (``quantkit.gguf.export.file_bytes``: an
    exporter, which a pipeline does not import), needed for a GGUF plan's layout."""
    from quantkit.formats import FORMATS

    fmt = FORMATS[recipe["format"]]
    file_type = getattr(fmt, "file_type", None)
    if file_type is not None:
        return GGUFBudget(file_type, gguf_file_bytes)
    if fmt.name == "mlx":
        return MLXBudget(recipe)
    raise BudgetError(f"format {fmt.name}: size budgets choose per-tensor types for GGUF (gguf-* recipes) and "
                      "per-module grids for MLX (mlx-* recipes) so far")
