"""quantkit's artifact for a GGUF file type: every linear stored as the blocks llama.cpp will read.

An algorithm run with format ``gguf-<file type>`` (for example ``gguf-q4_k_m``) solves each linear
on the GGUF type llama.cpp's mix gives that tensor (Q4_K, Q6_K for the _M mixes' attn_v/ffn_down
layers, Q5_0 where rows are not whole 256-blocks, ...), and the shard keeps its blocks as
``<linear>.gguf_<type>``. ``quantkit export gguf --type <file type>`` then copies them into the
file unchanged; everything else (embeddings, norms) is quantized by the export as llama.cpp would.

A recipe's ``gguf.tensor_types`` overrides the mix per tensor (llama-quantize's ``--tensor-type``), by
GGUF name: what a size budget's plan writes (``quantkit.budget``). The overrides are recorded in the
artifact's quantization config, so the export gives those tensors the same types.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import Tensor

from quantkit.formats.base import Format
from quantkit.gguf.mixes import MIXES, Model, choose_type, layer_types
from quantkit.gguf.names import LAYER_TENSOR_NAME, LAYER_TENSORS, gguf_name
from quantkit.gguf.record import GGUFTensor
from quantkit.gguf.types import TYPES, TensorType
from quantkit.models.layers import EMBEDDING, LINEARS, LM_HEAD, layer_prefix
from quantkit.quant import QuantConfig
from quantkit.recipes.fields import Field, Section

if TYPE_CHECKING:  # the config class imports transformers: annotations only
    from quantkit.models import MiniCPMConfig

QUANT_METHOD = "quantkit-gguf"
SUFFIX = "gguf_"
BLOCK = 32  # the smallest block of any type the solver can use: every linear's K must be a multiple
# File types whose blocks GPTQ can solve on: those whose main type has a scalar grid or a lattice codec
# (the float and ternary TQ files have no grid to solve on)
FILE_TYPES = tuple(name for name, mix in MIXES.items() if TYPES[mix.default].solvable)


# the GGUF stems of the decoder's linears, which the overrides may name
LINEAR_STEMS = frozenset(stem for stem, key in LAYER_TENSORS.items() if key in LINEARS)
SOLVABLE_TYPES = tuple(name for name, tensor_type in TYPES.items() if tensor_type.solvable)


@dataclass(frozen=True)
class GGUFGrid(QuantConfig):
    """The run's grid (the smoothing search's) and the per-tensor overrides of the file type's mix, as
    (GGUF tensor name, type name) pairs."""

    tensor_types: tuple[tuple[str, str], ...] = ()


# the matrices outside the layers the overrides may name: the export rounds them as llama-quantize would
MATRICES = (gguf_name(EMBEDDING), gguf_name(LM_HEAD))


def _overridable(name: object, tensor_type: object) -> bool:
    if tensor_type not in SOLVABLE_TYPES:
        return False
    if name in MATRICES:  # rounded without importance statistics, which some types cannot do without
        return not TYPES[tensor_type].requires_importance
    match = LAYER_TENSOR_NAME.fullmatch(name) if isinstance(name, str) else None
    return match is not None and match[2] in LINEAR_STEMS and match[3] == "weight"


def _valid_overrides(value: dict) -> bool:
    return all(_overridable(name, tensor_type) for name, tensor_type in value.items())


# The recipe's ``gguf`` section: present only in recipes that state it, so the others' fingerprints do not change
SETTINGS = Section({
    "tensor_types": Field(dict, default={}, check=_valid_overrides,
                          rule=f"a mapping of GGUF names of decoder linears (blk.N.<{'|'.join(sorted(LINEAR_STEMS))}>"
                               f".weight) or of {' and '.join(MATRICES)} to types GPTQ solves on "
                               f"({', '.join(SOLVABLE_TYPES)}; for those two, none that needs importance "
                               "statistics)",
                          help="per-tensor types over the file type's mix, as llama-quantize's --tensor-type "
                               "(what `quantkit quantize --target-size` writes; formats gguf-*)"),
}, optional=True)


def refusal(values: Mapping[str, Any]) -> str | None:
    """Why a recipe's ``gguf`` section cannot be used with its format, or None."""
    if "gguf" in values and not values["format"].startswith("gguf-"):
        return f"'gguf.tensor_types' overrides GGUF types: it needs a gguf-* format, not '{values['format']}'"
    return None


def resolve(config: QuantConfig, recipe: Mapping[str, Any], layers: int) -> QuantConfig:
    """``config`` with the recipe's per-tensor overrides, each checked against the model's ``layers``;
    unchanged without any."""
    overrides = recipe.get("gguf", {}).get("tensor_types", {})
    if not overrides:
        return config
    for name in overrides:
        if (match := LAYER_TENSOR_NAME.fullmatch(name)) and int(match[1]) >= layers:
            raise ValueError(f"gguf.tensor_types names {name}, but the model has {layers} layers")
    return GGUFGrid(**{f: getattr(config, f) for f in QuantConfig.__dataclass_fields__},
                    tensor_types=tuple(sorted(overrides.items())))


def target(file_type: str, linear: str, layer: int, model: MiniCPMConfig, shape: tuple[int, int],
           overrides: Mapping[str, str] = {}) -> TensorType:
    """The GGUF type llama.cpp's ``file_type`` mix gives this linear (what the solver rounds to): as
    llama-quantize chooses it with an importance matrix, which the solver's Hessian carries, or the
    recipe's override (GGUF name -> type)."""
    return choose_type(file_type, gguf_name(f"{layer_prefix(layer)}{linear}.weight"), shape, Model.of(model),
                       imatrix=True, overrides=overrides)


def check(config: QuantConfig, k: int, n: int, desc_act: bool, name: str) -> None:
    if desc_act:
        raise ValueError("GGUF blocks hold consecutive input channels: desc_act (act-order) cannot be stored; "
                         "use gptq.group_aware instead")
    if k % BLOCK:
        raise ValueError(f"{name}: in_features {k} is not a multiple of {BLOCK}, the smallest GGUF block")


def write_layer(records: Mapping[str, GGUFTensor], prefix: str) -> dict[str, Tensor]:
    return {f"{prefix}{name}.{SUFFIX}{record.type_name}": record.data for name, record in records.items()}


def read_layer(tensors: Mapping[str, Tensor], prefix: str, shapes: Mapping[str, tuple[int, int]]
               ) -> dict[str, GGUFTensor]:
    records = {}
    for name, shape in shapes.items():
        stem = f"{prefix}{name}.{SUFFIX}"
        keys = [key for key in tensors if key.startswith(stem)]
        if len(keys) != 1:
            raise ValueError(f"expected one '{stem}<type>' tensor, found {keys or 'none'}")
        records[name] = GGUFTensor(keys[0][len(stem):], tensors[keys[0]].to(torch.uint8), shape)
    return records


def quantization_config(file_type: str, config: QuantConfig, *, damp_percent: float | None = None,
                        quantizer: str | None = None, **_: Any) -> dict[str, Any]:
    """quantkit's own record of the run; ``bits``/``group_size``/``sym`` are the smoothing search's grid."""
    result = {"quant_method": QUANT_METHOD, "file_type": file_type, "bits": config.bits,
              "group_size": config.group_size, "sym": config.sym, "quantizer": quantizer}
    if getattr(config, "tensor_types", ()):
        result["tensor_types"] = dict(config.tensor_types)
    if damp_percent is not None:
        result["damp_percent"] = damp_percent
    return result


def parse_config(d: Mapping[str, Any]) -> GGUFGrid:
    return GGUFGrid(d["bits"], d["group_size"], d["sym"], tensor_types=tuple(sorted(d.get("tensor_types", {}).items())))


class GGUFBlocks(Format):
    """One format per GGUF file type a solver can round to: ``gguf-<file type>``."""

    list_order = 60
    suffixes = (SUFFIX,)
    block_types = True
    check = staticmethod(check)
    write_layer = staticmethod(write_layer)
    parse_config = staticmethod(parse_config)

    def __init__(self, file_type: str):
        self.file_type = file_type
        self.name = f"gguf-{file_type}"
        self.summary = f"GGUF {file_type.upper()} blocks per linear, copied unchanged by `export gguf`"

    @classmethod
    def variants(cls) -> tuple[GGUFBlocks, ...]:
        return tuple(cls(file_type) for file_type in FILE_TYPES)

    def read_layer(self, tensors, prefix, config, shapes):
        return read_layer(tensors, prefix, shapes)

    def solved_on(self, values):
        return "GGUF block types, whose scales llama.cpp's quantizer chooses"

    def untrainable(self, values):
        codebooks = sorted(name for name in layer_types(self.file_type) if not TYPES[name].codes_are_levels)
        if codebooks:
            return (f"format '{self.name}' writes {', '.join(codebooks)}, whose codes stand for codebook or lattice "
                    "points (the K-quant and legacy files train: gguf-q2_k, gguf-q3_k_m, gguf-q4_k_m, ...)")
        return None

    def quantization_config(self, config, **settings):
        return quantization_config(self.file_type, config, **settings)

    def target(self, config, linear, layer, model, shape):
        return target(self.file_type, linear, layer, model, shape, dict(getattr(config, "tensor_types", ())))

    def resolve(self, config, recipe, layers):
        return resolve(config, recipe, layers)
