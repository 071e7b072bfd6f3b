"""MLX affine-quantized checkpoints, the layout ``mlx_lm.convert -q`` writes and ``mlx_lm.load`` reads.

Per quantized module (K = in_features, N = out_features, G = K / group_size; see docs/formats.md,
"MLX"):

- ``weight`` uint32 [N, K·bits/32]: each row's codes as one little-endian bit stream, code k at bits
  [k·bits, (k+1)·bits) of the row (so 3-, 5- and 6-bit codes straddle words), as ``mx.quantize`` packs;
- ``scales`` and ``biases`` [N, G] in the model's float dtype: ``w = scales · q + biases`` per group.

The grid is quantkit's float-bias grid (``QuantConfig.float_bias``). As mlx-lm's converter does, the
embedding and the LM head are quantized too (round to nearest on the same grid) wherever their width
is a whole number of groups. ``config.json`` carries ``"quantization": {"group_size", "bits", "mode"}``
(and the same dict as ``quantization_config``, as mlx-lm writes it).

Mixed precision (``MLXGrid.modules``): the same dict may also hold one entry per module path, that
module's own ``{"group_size", "bits", "mode"}`` or ``false`` (left unquantized), which mlx-lm's loader
obeys before the defaults. A recipe's ``mlx.mixed`` (the format's own recipe section, ``SETTINGS``)
names one of mlx-lm's mixed predicates (``MIXES``), and ``mlx.modules`` gives modules their own entries
(what a size budget's plan writes), both resolved per module by ``resolve``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

import numpy as np
import torch
from torch import Tensor

from quantkit.formats.base import Format, fetch_packed, tensor_key
from quantkit.formats.consumers import MLX_LM, QUANTKIT
from quantkit.models.layers import DOWN, EMBEDDING, LINEARS, LM_HEAD, V, layer_prefix
from quantkit.quant import FLOAT_BIAS_BITS, QuantConfig, QuantizedTensor, default_g_idx, rtn_quantize
from quantkit.recipes.fields import Field, Section

GROUP_SIZES = (32, 64, 128)
WORD_BITS = 32
MODE = "affine"
# Outside the decoder layers, the modules mlx-lm's converter quantizes (it quantizes every module
# with ``to_quantized`` whose last dimension is a whole number of groups)
QUANTIZED_OUTSIDE = (EMBEDDING, LM_HEAD)
# transformers >= 5.0 reads this file instead of config.json (its ``configuration_files`` mechanism)
TRANSFORMERS_CONFIG = "config.5.0.0.json"
DEFAULT_ROPE_THETA = 10000.0  # MiniCPM's own default (quantkit.models.configuration_minicpm)
GRID_KEYS = ("group_size", "bits", "mode")  # the defaults of a quantization dict; every other key is a module

# mlx-lm's mixed predicates (`mlx_lm.convert --quant-predicate NAME`, mlx_lm/convert.py):
# name -> (bits of most modules, bits of the modules that get more)
MIXES = {"mixed_2_6": (2, 6), "mixed_3_4": (3, 4), "mixed_3_6": (3, 6), "mixed_4_6": (4, 6)}
# The decoder linears that get more bits in the layers that do (mlx-lm matches "v_proj" and
# "down_proj" in the module path, as llama.cpp's Q4_K_M favours attn_v and ffn_down)
MORE_BITS_LINEARS = (V, DOWN)
# Outside the decoder layers, what the mixed predicates give the LM head (more bits) and the embedding
MORE_BITS_OUTSIDE = {LM_HEAD.removesuffix(".weight"): True, EMBEDDING.removesuffix(".weight"): False}


@dataclass(frozen=True)
class MLXGrid(QuantConfig):
    """The grid of an MLX checkpoint: the defaults, and ``modules``, the per-module entries of its
    quantization dict as (module path, its grid or None for a module left unquantized)."""

    modules: tuple[tuple[str, QuantConfig | None], ...] = ()

    def default(self) -> QuantConfig:
        return QuantConfig(**{f.name: getattr(self, f.name) for f in fields(QuantConfig)})

    def module(self, path: str) -> QuantConfig | None:
        """The grid module ``path`` is stored on (None: not quantized)."""
        return dict(self.modules).get(path, self.default())


def check_mlx(config: QuantConfig, in_features: int, out_features: int, desc_act: bool = False,
              name: str = "") -> None:
    """Raise a ValueError naming ``name`` and every rule of MLX's affine grid this linear breaks."""
    rules = (
        (f"bits in {FLOAT_BIAS_BITS}", config.bits in FLOAT_BIAS_BITS, f"bits={config.bits}"),
        (f"group_size in {GROUP_SIZES}", config.group_size in GROUP_SIZES, f"group_size={config.group_size}"),
        ("an affine grid (quant.sym: false)", not config.sym, f"sym={config.sym}"),
        ("no ternary grid", not config.ternary, "ternary=True"),
        ("no act-order (groups are runs of input channels)", not desc_act, f"desc_act={desc_act}"),
        ("K a whole number of groups", config.group_size > 0 and in_features % config.group_size == 0,
         f"in_features K={in_features}, group_size={config.group_size}"),
    )
    broken = [f"{rule} ({found})" for rule, holds, found in rules if not holds]
    if broken:
        raise ValueError(f"{name or 'linear'}: cannot use the MLX format: " + "; ".join(broken))


def mlx_grid(quant: Mapping[str, Any], model_dtype: torch.dtype) -> QuantConfig:
    """The recipe's grid as MLX stores it: a float bias per group, scales and biases in the model dtype."""
    if quant.get("sym", True) or quant.get("ternary", False):
        raise ValueError("format mlx stores an affine grid (scale and float bias per group): set quant.sym: false "
                         "(and no quant.ternary)")
    return MLXGrid(**quant, float_bias=True, scale_dtype=model_dtype)


def gets_more_bits(layer: int, layers: int) -> bool:
    """Whether the mixed predicates give decoder layer ``layer`` (of ``layers``) more bits: the first
    and last eighth of the layers, and every third layer in between (mlx_lm/convert.py)."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def mixed_modules(layers: int) -> dict[str, bool]:
    """Every module a mixed predicate quantizes -> whether it gets the more bits."""
    decoder = {layer_prefix(index) + linear: linear in MORE_BITS_LINEARS and gets_more_bits(index, layers)
               for index in range(layers) for linear in LINEARS}
    return MORE_BITS_OUTSIDE | decoder


def resolve(config: MLXGrid, recipe: Mapping[str, Any], layers: int) -> MLXGrid:
    """``config`` with the grid of each module of a ``layers``-layer model: the recipe's mixed predicate
    (``mlx.mixed``), then its per-module entries (``mlx.modules``); unchanged without either."""
    section = recipe.get("mlx")
    if not section:
        return config
    modules: dict[str, QuantConfig | None] = {}
    if section["mixed"] is not None:
        low, high = MIXES[section["mixed"]]
        grids = {more: replace(config.default(), bits=high if more else low) for more in (False, True)}
        modules = {path: grids[more] for path, more in mixed_modules(layers).items()}
    for path, entry in section["modules"].items():
        if (match := LAYER_MODULE.fullmatch(path)) and int(match[1]) >= layers:
            raise ValueError(f"mlx.modules names {path}, but the model has {layers} layers")
        modules[path] = None if entry is False else replace(config.default(), bits=entry["bits"],
                                                            group_size=entry["group_size"])
    return replace(config, modules=tuple(modules.items()))


def target(config: MLXGrid, linear: str, layer: int, model, shape: tuple[int, int]) -> QuantConfig | None:
    """The grid the solver rounds this decoder linear to: its own entry, else the defaults."""
    return config.module(layer_prefix(layer) + linear)


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes [R, K] -> uint32 [R, K·bits/32]: each row one little-endian stream of ``bits``-bit fields."""
    rows, k = codes.shape
    if (k * bits) % WORD_BITS:
        raise ValueError(f"cannot pack {k} codes of {bits} bits into whole 32-bit words")
    fields = np.unpackbits(codes.cpu().numpy()[..., None], axis=-1, count=bits, bitorder="little")  # [R, K, bits]
    stream = np.packbits(fields.reshape(rows, k * bits), axis=-1, bitorder="little")
    return torch.from_numpy(stream.view("<u4").astype(np.uint32))


def unpack_codes(words: Tensor, bits: int) -> Tensor:
    """Inverse of ``pack_codes``: uint32 [R, W] -> uint8 [R, W·32/bits]."""
    rows, width = words.shape
    stream = np.unpackbits(words.numpy().astype("<u4").view(np.uint8), axis=-1, bitorder="little")
    fields = stream.reshape(rows, width * WORD_BITS // bits, bits)
    return torch.from_numpy(np.packbits(fields, axis=-1, bitorder="little")[..., 0])


def require_natural_groups(qt: QuantizedTensor, prefix: str) -> None:
    if not torch.equal(qt.g_idx, default_g_idx(qt.shape[1], qt.config.group_size)):
        raise ValueError(f"{prefix or 'linear'}: MLX stores no g_idx; this record has an act-order one")


def mlx_tensors(qt: QuantizedTensor, prefix: str) -> dict[str, Tensor]:
    """``{prefix}.weight/.scales/.biases`` for one module (``prefix`` = its module name)."""
    n, k = qt.shape
    check_mlx(qt.config, k, n, name=prefix)
    if not qt.config.float_bias:
        raise ValueError(f"{prefix or 'linear'}: MLX stores a float bias per group; this record has integer zero "
                         "points (quantize with format mlx, or `quantkit export mlx` an asymmetric artifact)")
    require_natural_groups(qt, prefix)
    return {
        tensor_key(prefix, "weight"): pack_codes(qt.codes, qt.config.bits),
        tensor_key(prefix, "scales"): qt.scales.T.contiguous(),
        tensor_key(prefix, "biases"): qt.biases.T.contiguous(),
    }


def read_mlx_tensors(tensors: Mapping[str, Tensor], prefix: str, config: QuantConfig,
                     shape: tuple[int, int]) -> QuantizedTensor:
    """Exact inverse of ``mlx_tensors``; the scales' dtype is the one stored."""
    n, k = shape
    check_mlx(config, k, n, name=prefix)
    groups = k // config.group_size
    scales = tensors.get(tensor_key(prefix, "scales"))
    if scales is None:
        raise KeyError(f"MLX tensor {tensor_key(prefix, 'scales')!r} is missing")
    grid = replace(config, scale_dtype=scales.dtype)
    weight = fetch_packed(tensors, tensor_key(prefix, "weight"), torch.uint32, (n, k * config.bits // WORD_BITS),
                          "MLX")
    scales = fetch_packed(tensors, tensor_key(prefix, "scales"), scales.dtype, (n, groups), "MLX")
    biases = fetch_packed(tensors, tensor_key(prefix, "biases"), scales.dtype, (n, groups), "MLX")
    return QuantizedTensor(unpack_codes(weight, config.bits), scales.T.contiguous(), None,
                           default_g_idx(k, config.group_size), grid, biases=biases.T.contiguous())


def read_mlx_layer(tensors: Mapping[str, Tensor], prefix: str, config: MLXGrid,
                   shapes: Mapping[str, tuple[int, int]]) -> dict[str, QuantizedTensor]:
    """Each quantized linear of a layer on its own grid; a linear left unquantized has no record (its
    float ``weight`` stays among the layer's plain tensors)."""
    grids = {linear: config.module(prefix + linear) for linear in shapes}
    return {linear: read_mlx_tensors(tensors, prefix + linear, grid, shapes[linear])
            for linear, grid in grids.items() if grid is not None}


def write_outside(tensors: Mapping[str, Tensor], config: MLXGrid) -> dict[str, Tensor]:
    """The embedding and LM head quantized as ``mlx_lm.convert`` does (round to nearest, each in its own
    dtype) where their width is a whole number of groups; everything else as it is."""
    if LM_HEAD not in tensors:
        raise ValueError("format mlx: this checkpoint ties its LM head to the embedding, and mlx-lm's MiniCPM "
                         "cannot load a tied checkpoint (mlx_lm/models/minicpm.py adds an lm_head.weight the tied "
                         "model has no module for), quantized or not")
    out = dict(tensors)
    for name in QUANTIZED_OUTSIDE:
        weight, module = tensors.get(name), name.removesuffix(".weight")
        grid = config.module(module)
        if weight is None or grid is None or weight.shape[1] % grid.group_size:
            continue
        del out[name]
        out |= mlx_tensors(rtn_quantize(weight, replace(grid, scale_dtype=weight.dtype)), module)
    return out


def read_outside(tensors: Mapping[str, Tensor], config: MLXGrid) -> dict[str, Tensor]:
    """Inverse of ``write_outside`` up to quantization: quantized modules come back as float32 weights."""
    out = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and tensor_key(module, "scales") in tensors:
            grid = config.module(module)
            if grid is None:
                raise ValueError(f"MLX module {module!r} stores scales, but its quantization entry is false")
            n, groups = tensors[tensor_key(module, "scales")].shape
            record = read_mlx_tensors(tensors, module, grid, (n, groups * grid.group_size))
            out[name] = record.dequantize(torch.float32)
        elif not name.endswith((".scales", ".biases")):
            out[name] = tensor
    return out


def _entry(grid: QuantConfig | None) -> dict[str, Any] | bool:
    return False if grid is None else {"group_size": grid.group_size, "bits": grid.bits, "mode": MODE}


def quantization_config(config: MLXGrid, **_settings: Any) -> dict[str, Any]:
    """mlx-lm's ``quantization`` dict, with an entry per module where modules differ; the solver's
    settings (desc_act, damping, ...) have no place in it."""
    return _entry(config) | {path: _entry(grid) for path, grid in config.modules}


def _parse_grid(d: Mapping[str, Any], where: str) -> QuantConfig:
    """The grid of one ``{"group_size", "bits"[, "mode"]}`` dict (``where`` names it in errors)."""
    unknown = sorted(set(d) - set(GRID_KEYS))
    mode = d.get("mode", MODE)
    problems = ((f"keys {unknown} (allowed: {list(GRID_KEYS)})", bool(unknown)),
                (f"mode {mode!r}: only {MODE!r} is supported", mode != MODE),
                (f"bits {d.get('bits')!r} not in {FLOAT_BIAS_BITS}", d.get("bits") not in FLOAT_BIAS_BITS),
                (f"group_size {d.get('group_size')!r} not in {GROUP_SIZES}", d.get("group_size") not in GROUP_SIZES))
    broken = [problem for problem, found in problems if found]
    if broken:
        raise ValueError(f"MLX quantization {where}: " + "; ".join(broken))
    return QuantConfig(bits=d["bits"], group_size=d["group_size"], sym=False, float_bias=True,
                       scale_dtype=torch.float32)


def _parse_module(path: str, value: Any, default: QuantConfig) -> QuantConfig | None:
    """A per-module entry as mlx-lm's loader takes it: a grid, false (unquantized) or true (the defaults)."""
    if isinstance(value, bool):
        return default if value else None
    if not isinstance(value, Mapping):
        raise ValueError(f"MLX quantization entry for module {path!r} must be a dict of group_size and bits, "
                         f"or false, got {value!r}")
    return _parse_grid(value, f"entry for module {path!r}")


def parse_quantization_config(d: Mapping[str, Any]) -> MLXGrid:
    """The grids of an MLX ``quantization`` dict; each record takes its scales' dtype from the tensors."""
    default = _parse_grid({key: d[key] for key in GRID_KEYS if key in d}, "defaults")
    modules = tuple((path, _parse_module(path, value, default)) for path, value in d.items() if path not in GRID_KEYS)
    return MLXGrid(default.bits, default.group_size, sym=False, float_bias=True, scale_dtype=torch.float32,
                   modules=modules)


def config_files(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """config.json with mlx-lm's ``quantization`` key; and, for transformers >= 5, the same config without
    ``rope_theta`` when it is MiniCPM's default.

    mlx-lm loads the tokenizer through transformers' ``AutoTokenizer``, which reads config.json; not
    knowing ``model_type: minicpm``, it falls back to its base config class, which crashes
    standardising LongRoPE whenever ``rope_theta`` and ``rope_scaling`` are both present. transformers
    reads the file named in ``configuration_files`` instead of config.json, so that file leaves
    ``rope_theta`` to its default (the same value), while mlx-lm, which reads config.json alone,
    computes exactly what it would have.
    """
    config = dict(config, quantization=config["quantization_config"])
    if not config.get("rope_scaling") or config.get("rope_theta", DEFAULT_ROPE_THETA) != DEFAULT_ROPE_THETA:
        return {"config.json": config}
    for_transformers = {key: value for key, value in config.items() if key != "rope_theta"}
    return {"config.json": dict(config, configuration_files=[TRANSFORMERS_CONFIG]),
            TRANSFORMERS_CONFIG: for_transformers}


# The modules ``mlx.modules`` may name: every decoder linear, and the two matrices outside the layers, which
# alone may stay unquantized (``false``: the engine quantizes every decoder linear)
LAYER_MODULE = re.compile(re.escape(layer_prefix(0)).replace("0", r"(\d+)", 1)
                          + f"({'|'.join(map(re.escape, LINEARS))})")
_OUTSIDE_MODULES = tuple(name.removesuffix(".weight") for name in QUANTIZED_OUTSIDE)


def _valid_module_entry(path: object, entry: object) -> bool:
    if not isinstance(path, str) or not (LAYER_MODULE.fullmatch(path) or path in _OUTSIDE_MODULES):
        return False
    if entry is False:
        return path in _OUTSIDE_MODULES
    return (isinstance(entry, dict) and set(entry) == {"bits", "group_size"} and entry["bits"] in FLOAT_BIAS_BITS
            and type(entry["bits"]) is int and entry["group_size"] in GROUP_SIZES)


# The recipe's ``mlx`` section: present only in recipes that state it, so the others' fingerprints do not change
SETTINGS = Section({
    "mixed": Field(str, choices=tuple(MIXES),
                   help="mlx-lm's mixed predicate (`mlx_lm.convert --quant-predicate NAME`): quant.bits for "
                        "most modules, more for the LM head and some layers' v_proj and down_proj (format mlx)"),
    "modules": Field(dict, default={}, check=lambda d: all(_valid_module_entry(p, e) for p, e in d.items()),
                     rule=f"a mapping of module paths (model.layers.N.<linear>, {', '.join(_OUTSIDE_MODULES)}) to "
                          f"{{bits: {'|'.join(map(str, FLOAT_BIAS_BITS))}, group_size: "
                          f"{'|'.join(map(str, GROUP_SIZES))}}}, or false for the two outside the layers",
                     help="per-module grids over quant and mlx.mixed, as mlx-lm's per-module quantization entries "
                          "(what `quantkit quantize --target-size` writes; format mlx)"),
}, optional=True)


class MLX(Format):
    name = "mlx"
    list_order = 70
    summary = ("MLX affine (mlx-lm): uint32 codes, scales and float biases in the model dtype; "
               "embedding and LM head quantized too")
    suffixes = (*(f"{linear}.weight" for linear in LINEARS), "scales", "biases")
    reads = ((None, None),)  # mlx-lm's quantization dict has no quant_method
    consumers = (MLX_LM, QUANTKIT)
    settings = SETTINGS
    check = staticmethod(check_mlx)
    write_linear = staticmethod(mlx_tensors)
    read_linear = staticmethod(read_mlx_tensors)
    read_layer = staticmethod(read_mlx_layer)
    quantization_config = staticmethod(quantization_config)
    parse_config = staticmethod(parse_quantization_config)
    grid = staticmethod(mlx_grid)
    resolve = staticmethod(resolve)
    target = staticmethod(target)
    write_outside = staticmethod(write_outside)
    read_outside = staticmethod(read_outside)
    config_files = staticmethod(config_files)

    def recipe_refusal(self, values):
        """Per-module grids belong to this format, and only `quantkit quantize` applies them; a mixed predicate
        gives most modules quant.bits."""
        if "mlx" not in values:
            return None
        section = values["mlx"]
        what = f"'mlx.mixed' = {section['mixed']!r}" if section["mixed"] is not None else "'mlx.modules'"
        rules = [
            (values["format"] == self.name, f"is a per-module grid of format mlx, not of format '{values['format']}'"),
            ("qat" not in values, "is applied by `quantkit quantize` (RTN, GPTQ, AWQ), not yet by QAT or DWQ training"),
        ]
        if section["mixed"] is not None:
            low = MIXES[section["mixed"]][0]
            rules.append((values["quant"]["bits"] == low, f"gives most modules {low} bits: set quant.bits: {low} (the "
                                                          "grid of every other module, and the defaults of the config "
                                                          "it writes)"))
        return next((f"{what} {why}" for holds, why in rules if not holds), None)
