"""compressed-tensors checkpoints (``quant_method: compressed-tensors``), what llm-compressor writes and
vLLM and SGLang serve: ``pack-quantized`` (integer weights, activations in 16 bits: W4A16, W8A16),
``int-quantized`` (INT8 W8A8: int8 weights per output channel, activations quantized per token at run
time; the recipe's ``compressed-tensors.activations``) and ``float-quantized`` (FP8 E4M3 weights per
channel or tensor, ``compressed-tensors.weights: fp8``; with FP8 activations per token, FP8 W8A8).

Per linear (N = out_features, K = in_features; see docs/formats.md, "compressed-tensors"):

- ``weight_packed`` int32 [N, K·bits/32]: each row's codes as one LSB-first bit stream along K (GPTQ's
  packing, transposed). compressed-tensors stores the signed value q ∈ [−2^(b−1), 2^(b−1)) plus
  2^(b−1), which is quantkit's unsigned code itself.
- ``weight_scale`` [N, G] in the model's dtype (G = 1 for a per-channel grid).
- ``weight_zero_point`` int32 [N·bits/32, G], asymmetric grids only: the zero points packed along N the
  same way (again quantkit's unsigned zero, the signed one plus 2^(b−1)); a symmetric grid stores none
  (its zero is 2^(b−1)).
- ``weight_shape`` int64 [2]: (N, K).

``int-quantized`` stores ``weight`` int8 [N, K] (the signed value, quantkit's code − 128) and
``weight_scale`` [N, 1]; the config's ``input_activations`` says how the input is quantized.
``float-quantized`` stores ``weight`` float8_e4m3fn [N, K] and ``weight_scale`` float32 [N, 1] (per
channel) or [1] (per tensor): quantkit.fp8.

Groups run in natural channel order and must tile K: compressed-tensors 0.19 reshapes K into groups and
stores no ``g_idx`` (its act-order "group" mode was removed). Act-order is its "static" (alias "weight")
mode: columns solved in descending Hessian order with every group's parameters found up front on the
natural groups (quantkit's ``gptq.desc_act`` with ``gptq.static_groups``, which is what llm-compressor's
GPTQ does by default); act-order whose groups follow the processing order is refused. vLLM's
W4A16/W8A16 kernels take 4 and 8 bits.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch
from torch import Tensor

from quantkit.activation_quant import ActivationGrid
from quantkit.formats.base import Format, fetch_packed, tensor_key
from quantkit.formats.consumers import QUANTKIT, SGLANG, TRANSFORMERS, VLLM
from quantkit.formats.gptq import pack_cols, pack_rows, unpack_cols, unpack_rows, values_per_run
from quantkit.fp8 import E4M3, FloatGrid, FP8Tensor
from quantkit.models.layers import LINEARS
from quantkit.quant import INTEGER_SCALE_DTYPES, QuantConfig, QuantizedTensor, default_g_idx
from quantkit.recipes.fields import Field, Section

QUANT_METHOD = "compressed-tensors"
# The compressed-tensors release whose layout and config this module writes (llm-compressor 0.14's)
VERSION = "0.19.0"
PACKED = "pack-quantized"
INTEGER = "int-quantized"
FLOAT = "float-quantized"
BITS = (4, 8)  # vLLM's WNA16 kernels
TENSOR_NAMES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "input_scale", "k_scale",
                "v_scale")


def _arguments(**values: Any) -> dict[str, Any]:
    """compressed-tensors' ``QuantizationArgs`` with every field, as ``model_dump`` writes them."""
    return {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "observer": None,
            "observer_kwargs": {}, "scale_dtype": None, "symmetric": True, "type": "int", "zp_dtype": None,
            **values}


# recipe value of compressed-tensors.weights -> the FP8 grid, or None: an integer grid (quant.bits)
WEIGHTS = {"int": None, "fp8": FloatGrid("channel"), "fp8-tensor": FloatGrid("tensor")}
UNQUANTIZED = "16-bit"
# recipe value of compressed-tensors.activations -> how the runtime quantizes each linear's input, and
# the config group's input_activations that says so (llm-compressor's INT8 W8A8 and FP8_DYNAMIC presets)
ACTIVATIONS = {
    "int8-dynamic": (ActivationGrid("int8", dynamic=True),
                     _arguments(num_bits=8, strategy="token", dynamic=True)),
    "fp8-dynamic": (ActivationGrid("fp8", dynamic=True),
                    _arguments(num_bits=8, type="float", strategy="token", dynamic=True)),
    # one scale per linear, from the calibration inputs, stored as its input_scale (the INT8 and FP8 presets)
    "int8-static": (ActivationGrid("int8", dynamic=False),
                    _arguments(num_bits=8, strategy="tensor")),
    "fp8-static": (ActivationGrid("fp8", dynamic=False),
                   _arguments(num_bits=8, type="float", strategy="tensor")),
}
INPUT_SCALE = "input_scale"  # a static scheme's per-linear activation scale, float32 [1]
# recipe value of compressed-tensors.kv_cache -> how vLLM stores keys and values with the scales the
# artifact states (``--kv-cache-dtype fp8``), and the config's kv_cache_scheme that says so
KV_CACHE = {"fp8": (ActivationGrid("fp8", dynamic=False), _arguments(num_bits=8, type="float", strategy="tensor"))}
# each attention's scales, float32 [1]: max |K| (after RoPE) and max |V| over the calibration rows / 448
KV_SCALES = ("k_scale", "v_scale")


# what an input_activations entry must say to be one of ACTIVATIONS (the observer that calibrated it may differ)
ACTIVATION_FIELDS = ("num_bits", "type", "symmetric", "strategy", "dynamic", "group_size", "block_structure")


@dataclass(frozen=True)
class CompressedTensorsGrid(QuantConfig):
    """The weights' kind (a key of ``WEIGHTS``), the activations' (a key of ``ACTIVATIONS``, or 16-bit)
    and the KV cache's (a key of ``KV_CACHE``, or 16-bit); integer weights with nothing else quantized
    are a plain ``QuantConfig``."""

    weights: str = "int"
    activations: str = UNQUANTIZED
    kv_cache: str = UNQUANTIZED

    def __post_init__(self) -> None:
        super().__post_init__()
        for field, table in (("weights", WEIGHTS), ("activations", ACTIVATIONS), ("kv_cache", KV_CACHE)):
            allowed = tuple(table) if field == "weights" else (UNQUANTIZED, *table)
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field} must be one of {allowed}, got {getattr(self, field)!r}")

    @property
    def float_grid(self) -> FloatGrid | None:
        return WEIGHTS[self.weights]


def _settings(config: QuantConfig) -> tuple[FloatGrid | None, str | None]:
    """(the FP8 grid or None, the activation scheme or None) of any grid the format is given."""
    activations = getattr(config, "activations", UNQUANTIZED)
    return getattr(config, "float_grid", None), None if activations == UNQUANTIZED else activations


def _kv_cache(config: QuantConfig) -> str | None:
    """The KV-cache scheme (a key of ``KV_CACHE``) of any grid the format is given, or None."""
    kv_cache = getattr(config, "kv_cache", UNQUANTIZED)
    return None if kv_cache == UNQUANTIZED else kv_cache


# Every linear of the decoder is quantized; llm-compressor's recipes leave the LM head out the same way.
IGNORE = ["lm_head"]


def _layout(config: QuantConfig) -> str:
    """The compressed-tensors format a grid is stored in: float-quantized for FP8 weights, int-quantized
    for integer weights with quantized activations, else pack-quantized."""
    float_grid, activations = _settings(config)
    return FLOAT if float_grid else INTEGER if activations else PACKED


def _grid_rules(config: QuantConfig) -> tuple[tuple[str, bool, str], ...]:
    """(rule, holds, what was found) of the grid itself."""
    float_grid, activations = _settings(config)
    if float_grid:
        return (("FP8 activations or none with FP8 weights (vLLM's FP8 W8A8 and W8A16 kernels)",
                 activations is None or ACTIVATIONS[activations][0].kind == "fp8", f"activations={activations}"),)
    if _layout(config) == INTEGER:
        return (("W8A8: 8-bit symmetric weights, one scale per output channel (vLLM's INT8 W8A8 kernels)",
                 config.bits == 8 and config.sym and config.group_size == -1,
                 f"bits={config.bits}, sym={config.sym}, group_size={config.group_size}"),
                ("INT8 activations with integer weights", ACTIVATIONS[activations][0].kind == "int8",
                 f"activations={activations}"))
    return (
        (f"bits in {BITS} (vLLM's W4A16 and W8A16 kernels)", config.bits in BITS, f"bits={config.bits}"),
        ("an integer grid", not (config.ternary or config.float_bias), "a ternary or float-bias grid"),
    )


def _refuse(rules: tuple[tuple[str, bool, str], ...], name: str, config: QuantConfig) -> None:
    broken = [f"{rule} ({found})" for rule, holds, found in rules if not holds]
    if broken:
        raise ValueError(f"{name or 'linear'}: cannot use compressed-tensors {_layout(config)}: " + "; ".join(broken))


def check_packed(config: QuantConfig, in_features: int, out_features: int, desc_act: bool = False,
                 name: str = "") -> None:
    """Raise a ValueError naming ``name`` and every rule of its layout this linear breaks (before quantizing).
    Act-order stores nothing here; whether its groups stay in place is a recipe's question (``recipe_refusal``)."""
    if _layout(config) == FLOAT:  # E4M3 values are stored unpacked, one scale per row or tensor
        return _refuse(_grid_rules(config), name, config)
    group = in_features if config.group_size == -1 else config.group_size
    per_run = values_per_run(config.bits) if config.bits in BITS else 1
    _refuse(_grid_rules(config) + (
        ("groups that tile K (compressed-tensors reshapes K into groups)", in_features % group == 0,
         f"in_features K={in_features}, group_size={config.group_size}; try quant.group_size=64"),
        (f"K a multiple of {per_run}", in_features % per_run == 0, f"in_features K={in_features}"),
        (f"N a multiple of {per_run} (zero points are packed along N)", config.sym or out_features % per_run == 0,
         f"out_features N={out_features}"),
    ), name, config)


def packed_tensors(record: QuantizedTensor | FP8Tensor, module: str) -> dict[str, Tensor]:
    """``{module}.weight_packed/.weight_scale/(.weight_zero_point)/.weight_shape`` for one linear, or on a
    W8A8 grid or FP8 ``{module}.weight/.weight_scale``."""
    if isinstance(record, FP8Tensor):
        return {tensor_key(module, "weight"): record.values, tensor_key(module, "weight_scale"): record.scale}
    n, k = record.shape
    config = record.config
    check_packed(config, k, n, name=module)
    if not torch.equal(record.g_idx, default_g_idx(k, config.group_size)):
        raise ValueError(f"{module}: compressed-tensors stores no g_idx; this record has an act-order one")
    if _layout(config) == INTEGER:
        return {tensor_key(module, "weight"): (record.codes.to(torch.int16) - 128).to(torch.int8),
                tensor_key(module, "weight_scale"): record.scales.T.contiguous()}
    tensors = {
        tensor_key(module, "weight_packed"): pack_cols(record.codes, config.bits),
        tensor_key(module, "weight_scale"): record.scales.T.contiguous(),
        tensor_key(module, "weight_shape"): torch.tensor([n, k], dtype=torch.int64),
    }
    if not config.sym:
        tensors[tensor_key(module, "weight_zero_point")] = pack_rows(record.zeros.T.contiguous(), config.bits)
    return tensors


def read_packed_tensors(tensors: Mapping[str, Tensor], module: str, config: QuantConfig,
                        shape: tuple[int, int]) -> QuantizedTensor | FP8Tensor:
    """Exact inverse of ``packed_tensors``: each tensor checked against ``shape`` and the config."""
    n, k = shape
    check_packed(config, k, n, name=module)
    if _layout(config) == FLOAT:
        return _read_fp8(tensors, module, config.float_grid, shape)
    groups = config.num_groups(k)
    if _layout(config) == INTEGER:
        return _read_int8(tensors, module, config, shape)
    stored_shape = fetch_packed(tensors, tensor_key(module, "weight_shape"), torch.int64, (2,), "compressed-tensors")
    if stored_shape.tolist() != [n, k]:
        raise ValueError(f"compressed-tensors tensor {tensor_key(module, 'weight_shape')!r} says "
                         f"{stored_shape.tolist()}, but the model's {module} is [{n}, {k}]")
    packed = fetch_packed(tensors, tensor_key(module, "weight_packed"), torch.int32,
                          (n, k * config.bits // 32), "compressed-tensors")
    scale_key = tensor_key(module, "weight_scale")
    scale_dtype = _scale_dtype_of(tensors, scale_key)
    scales = fetch_packed(tensors, scale_key, scale_dtype, (n, groups), "compressed-tensors")
    zero_key = tensor_key(module, "weight_zero_point")
    if config.sym:
        if zero_key in tensors:
            raise ValueError(f"compressed-tensors tensor {zero_key!r} is present, but the config says symmetric")
        zeros = torch.full((groups, n), 2 ** (config.bits - 1), dtype=torch.uint8)
    else:
        zeros = unpack_rows(fetch_packed(tensors, zero_key, torch.int32, (n * config.bits // 32, groups),
                                         "compressed-tensors"), config.bits).T.contiguous()
    return QuantizedTensor(unpack_cols(packed, config.bits), scales.T.contiguous(), zeros,
                           default_g_idx(k, config.group_size), replace(config, scale_dtype=scale_dtype))


def _scale_dtype_of(tensors: Mapping[str, Tensor], key: str) -> torch.dtype:
    if key not in tensors:
        raise KeyError(f"compressed-tensors tensor {key!r} is missing")
    if tensors[key].dtype not in INTEGER_SCALE_DTYPES:
        raise ValueError(f"compressed-tensors tensor {key!r} must be one of {INTEGER_SCALE_DTYPES}, "
                         f"got {tensors[key].dtype}")
    return tensors[key].dtype


def _read_int8(tensors: Mapping[str, Tensor], module: str, config: QuantConfig,
               shape: tuple[int, int]) -> QuantizedTensor:
    """An int-quantized linear: ``weight`` int8 [N, K], ``weight_scale`` [N, 1]."""
    n, k = shape
    weight = fetch_packed(tensors, tensor_key(module, "weight"), torch.int8, (n, k), "compressed-tensors")
    scale_key = tensor_key(module, "weight_scale")
    scale_dtype = _scale_dtype_of(tensors, scale_key)
    scales = fetch_packed(tensors, scale_key, scale_dtype, (n, 1), "compressed-tensors")
    return QuantizedTensor((weight.to(torch.int16) + 128).to(torch.uint8), scales.T.contiguous(),
                           torch.full((1, n), 128, dtype=torch.uint8), default_g_idx(k, -1),
                           replace(config, scale_dtype=scale_dtype))


def _read_fp8(tensors: Mapping[str, Tensor], module: str, grid: FloatGrid, shape: tuple[int, int]) -> FP8Tensor:
    """A float-quantized linear: ``weight`` E4M3 [N, K], ``weight_scale`` [N, 1] or [1] in any float dtype
    (llm-compressor writes the model's; each is exact in float32, where quantkit keeps them)."""
    n, k = shape
    weight = fetch_packed(tensors, tensor_key(module, "weight"), E4M3, (n, k), "compressed-tensors")
    scale_key = tensor_key(module, "weight_scale")
    scale = fetch_packed(tensors, scale_key, _scale_dtype_of(tensors, scale_key), grid.scale_shape(n),
                         "compressed-tensors")
    return FP8Tensor(weight, scale.float(), grid)


ACT_ORDER = "static"  # what llm-compressor's GPTQ writes for its default act-order (alias "weight")


def _moving_groups(group_size: int, desc_act: bool, static_groups: bool) -> bool:
    """Act-order whose groups are runs of the processing order: they need a g_idx, which is not stored."""
    return desc_act and not static_groups and group_size != -1


def weight_arguments(config: QuantConfig, desc_act: bool = False) -> dict[str, Any]:
    """A config group's ``weights``: compressed-tensors' ``QuantizationArgs``, every field as it dumps them."""
    float_grid, _ = _settings(config)
    actorder = ACT_ORDER if desc_act else None
    if float_grid:
        return _arguments(num_bits=8, type="float", strategy=float_grid.strategy, actorder=actorder)
    return _arguments(group_size=None if config.group_size == -1 else config.group_size, num_bits=config.bits,
                      strategy="channel" if config.group_size == -1 else "group", symmetric=config.sym,
                      zp_dtype=None if config.sym else "torch.int8", actorder=actorder)


def quantization_config(config: QuantConfig, *, desc_act: bool = False, static_groups: bool = False,
                        damp_percent: float | None = None, quantizer: str | None = None) -> dict[str, Any]:
    """``config.json["quantization_config"]`` as compressed-tensors' ``ModelCompressor`` writes it: one
    config group over every Linear, the LM head ignored. ``static_groups`` and ``damp_percent`` are
    accepted for the formats' common signature (the format records neither); so is ``quantizer``."""
    _refuse(_grid_rules(config) + (
        ("act-order on groups found up front (compressed-tensors stores no g_idx)",
         not _moving_groups(config.group_size, desc_act, static_groups), "desc_act=True, static_groups=False"),),
        "quantization_config", config)
    _, activations = _settings(config)
    fmt = _layout(config)
    return {
        "config_groups": {"group_0": {"format": fmt, "output_activations": None, "targets": ["Linear"],
                                      "input_activations": ACTIVATIONS[activations][1] if activations else None,
                                      "weights": weight_arguments(config, desc_act)}},
        "format": fmt, "global_compression_ratio": None, "ignore": list(IGNORE),
        "kv_cache_scheme": KV_CACHE[_kv_cache(config)][1] if _kv_cache(config) else None,
        "quant_method": QUANT_METHOD, "quantization_status": "compressed", "sparsity_config": {},
        "transform_config": {}, "version": VERSION,
    }


# the kind of activation each layout quantizes to (pack-quantized: none)
LAYOUT_ACTIVATIONS = {PACKED: None, INTEGER: "int8", FLOAT: "fp8"}


def _scheme_of(arguments: Mapping[str, Any] | None, table: Mapping[str, tuple]) -> str | None:
    """The key of ``table`` (ACTIVATIONS, KV_CACHE) whose stated arguments ``arguments`` has, or None."""
    return next((key for key, (_, stated) in table.items()
                 if arguments and all(arguments.get(field) == stated[field] for field in ACTIVATION_FIELDS)), None)


def parse_quantization_config(d: Mapping[str, Any]) -> QuantConfig:
    """The grid of a compressed-tensors config (W4A16, W8A16, INT8 W8A8, FP8 W8A8 or W8A16); a scheme
    quantkit does not read yet is refused naming the setting."""
    if d.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"quant_method {d.get('quant_method')!r} is not {QUANT_METHOD!r}")
    groups = d.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: one config group is read, got {len(groups)} ({', '.join(groups)})")
    (name, group), = groups.items()
    fmt = group.get("format") or d.get("format")
    inputs = group.get("input_activations")
    activations = _scheme_of(inputs, ACTIVATIONS)
    kind = LAYOUT_ACTIVATIONS.get(fmt)
    kv_stated = d.get("kv_cache_scheme")
    kv_cache = _scheme_of(kv_stated, KV_CACHE)
    refusals = (
        ("format", fmt not in LAYOUT_ACTIVATIONS, f"{fmt!r} (read: {', '.join(map(repr, LAYOUT_ACTIVATIONS))})"),
        (f"config_groups.{name}.input_activations",
         inputs is not None and (activations is None or ACTIVATIONS[activations][0].kind != kind),
         f"{inputs!r} (read with {fmt!r}: {kind or 'none'} per token, dynamic, or per tensor, static)"),
        (f"config_groups.{name}.input_activations", fmt == INTEGER and inputs is None, f"none with {fmt!r}"),
        (f"config_groups.{name}.targets", group.get("targets") != ["Linear"], f"{group.get('targets')!r}"),
        (f"config_groups.{name}.output_activations", group.get("output_activations") is not None, "set"),
        ("ignore", any(module != "lm_head" for module in d.get("ignore") or ()), f"{d.get('ignore')!r}"),
        ("kv_cache_scheme", kv_stated is not None and kv_cache is None,
         f"{kv_stated!r} (read: FP8 E4M3, one static scale per tensor)"),
        ("sparsity_config", bool(d.get("sparsity_config")), "sparse weights are not read"),
        ("transform_config", bool(d.get("transform_config")), "rotations are not read"),
    )
    weights = group.get("weights") or {}
    strategy, group_size = weights.get("strategy"), weights.get("group_size")
    float_weights = fmt == FLOAT
    refusals += (
        ("weights.type", weights.get("type") != ("float" if float_weights else "int"),
         f"{weights.get('type')!r} with {fmt!r}"),
        ("weights.num_bits", weights.get("num_bits") not in ((8,) if float_weights else BITS),
         f"{weights.get('num_bits')!r}"),
        ("weights.strategy", strategy not in (("channel", "tensor") if float_weights else ("group", "channel")),
         f"{strategy!r}"),
        ("weights.group_size", (strategy == "group") == (group_size is None), f"{group_size!r} for {strategy!r}"),
        ("weights.dynamic", weights.get("dynamic") is not False, f"{weights.get('dynamic')!r}"),
        ("weights.actorder", weights.get("actorder") in ("group", "dynamic"), "act-order groups need a g_idx"),
        ("weights.block_structure", weights.get("block_structure") is not None, "set"),
        ("weights.symmetric", weights.get("symmetric") is not True if float_weights
         else not isinstance(weights.get("symmetric"), bool), f"{weights.get('symmetric')!r}"),
    )
    refused = [f"{setting}: {found}" for setting, broken, found in refusals if broken]
    if refused:
        raise ValueError("compressed-tensors config not read: " + "; ".join(refused))
    stated = {"activations": activations or UNQUANTIZED, "kv_cache": kv_cache or UNQUANTIZED}
    if float_weights:
        weight_kind = next(key for key, grid in WEIGHTS.items() if grid and grid.strategy == strategy)
        return CompressedTensorsGrid(bits=8, group_size=-1, sym=True, weights=weight_kind, **stated)
    grid = QuantConfig(bits=weights["num_bits"], group_size=-1 if strategy == "channel" else group_size,
                       sym=weights["symmetric"])
    return CompressedTensorsGrid(**vars(grid), **stated) if activations or kv_cache else grid


# The recipe's ``compressed-tensors`` section: present only in recipes that state it
SETTINGS = Section({
    "weights": Field(str, default="int", choices=tuple(WEIGHTS),
                     help="int: quant.bits integers (pack-quantized, or int-quantized with INT8 activations); fp8: "
                          "E4M3 with a scale per output channel, fp8-tensor one per tensor (float-quantized; "
                          "needs quant.bits 8, group_size -1, sym, and algorithm gptq or rtn)"),
    "activations": Field(str, default=UNQUANTIZED, choices=(UNQUANTIZED, *ACTIVATIONS),
                         help="how vLLM quantizes each linear's input: int8-* is INT8 W8A8 (int weights), fp8-* FP8 "
                              "W8A8 (fp8 weights); *-dynamic with a scale per token, *-static with one per linear "
                              "from the calibration inputs (stored as its input_scale)"),
    "kv_cache": Field(str, default=UNQUANTIZED, choices=(UNQUANTIZED, *KV_CACHE),
                      help="fp8: keys and values in FP8 E4M3 with one scale per layer for each, from the "
                           "calibration rows (kv_cache_scheme; served with --kv-cache-dtype fp8_e4m3)"),
}, optional=True)


class CompressedTensors(Format):
    name = "compressed-tensors"
    list_order = 25
    summary = ("compressed-tensors (what llm-compressor writes; vLLM, SGLang, transformers with compressed-tensors): "
               "pack-quantized W4A16/W8A16, int-quantized INT8 W8A8, float-quantized FP8 W8A8/W8A16")
    # int-quantized keeps a linear's "weight" name: only the decoder linears' count
    suffixes = TENSOR_NAMES + tuple(f"{linear}.weight" for linear in LINEARS)
    reads = ((QUANT_METHOD, None),)
    consumers = (replace(TRANSFORMERS, note="transformers reads compressed-tensors checkpoints through the "
                                            "compressed-tensors package: `pip install compressed-tensors`."),
                 replace(VLLM, note="vLLM reads the scheme from `quantization_config`: W4A16 and W8A16 run on its "
                                    "Marlin kernels, INT8 W8A8 on INT8 tensor cores (Jetson Orin, RTX 4090), FP8 "
                                    "W8A8 on FP8 tensor cores (sm_89: RTX 4090; GPUs without them run the FP8 "
                                    "weights on its FP8 Marlin kernel, activations in 16 bits)."),
                 SGLANG, QUANTKIT)
    check = staticmethod(check_packed)
    write_linear = staticmethod(packed_tensors)
    read_linear = staticmethod(read_packed_tensors)
    quantization_config = staticmethod(quantization_config)
    parse_config = staticmethod(parse_quantization_config)

    settings = SETTINGS

    def resolve(self, config, recipe, layers):
        """The run's grid with the recipe's weight and activation schemes, if it states them (the target,
        the writer and the config carry them)."""
        stated = recipe.get(self.name) or {}
        if all(value == SETTINGS[key].default for key, value in stated.items()):
            return config
        return CompressedTensorsGrid(**vars(config), **stated)

    def target(self, config, linear, layer, model, shape):
        float_grid, _ = _settings(config)
        return float_grid or config

    def solved_on(self, values):
        stated = values.get(self.name) or {}
        grid = WEIGHTS[stated.get("weights", "int")]
        return f"{grid.name}, whose scales map each row's largest |w| to 448" if grid else None

    def recipe_refusal(self, values):
        if values["format"] != self.name:
            return f"'{self.name}' is a section of format {self.name}, not of '{values['format']}'"
        quant = values["quant"]
        gptq = values.get("gptq") if values["algorithm"] == "gptq" else None
        if gptq and _moving_groups(quant["group_size"], gptq["desc_act"], gptq["static_groups"]):
            return ("'gptq.desc_act: true' moves the groups with the processing order, which needs a g_idx that "
                    f"compressed-tensors does not store: set gptq.static_groups: true (its actorder '{ACT_ORDER}')")
        stated = values.get(self.name) or {key: field.default for key, field in SETTINGS.items()}
        eight_bit_channels = (quant["bits"], quant["group_size"], quant["sym"]) == (8, -1, True)
        float_weights = WEIGHTS[stated["weights"]] is not None
        activations = stated["activations"]
        if activations != UNQUANTIZED:
            kind = ACTIVATIONS[activations][0].kind
            if kind != ("fp8" if float_weights else "int8"):
                return (f"'{self.name}.activations: {activations}' runs on vLLM's {kind.upper()} W8A8 kernels, "
                        f"whose weights are {kind.upper()}: set '{self.name}.weights: "
                        f"{'fp8' if kind == 'fp8' else 'int'}'")
        if (float_weights or activations != UNQUANTIZED) and not eight_bit_channels:
            what = f"weights: {stated['weights']}" if float_weights else f"activations: {activations}"
            return (f"'{self.name}.{what}' needs 8-bit weights with one symmetric scale per output channel: set "
                    "quant.bits: 8, quant.group_size: -1, quant.sym: true")
        if float_weights and values["smooth"]["enabled"]:
            return (f"'{self.name}.weights: {stated['weights']}': smoothing searches its scales on the integer "
                    "grid; set smooth.enabled: false")
        return None

    def activation_grid(self, config):
        _, activations = _settings(config)
        return ACTIVATIONS[activations][0] if activations else None

    def activation_tensors(self, config, input_abs_max, prefix):
        grid = self.activation_grid(config)
        if grid is None or grid.dynamic:
            return {}
        return {tensor_key(prefix + linear, INPUT_SCALE): grid.static_scale(abs_max)
                for linear, abs_max in input_abs_max.items()}

    def kv_cache_grid(self, config):
        kv_cache = _kv_cache(config)
        return KV_CACHE[kv_cache][0] if kv_cache else None

    def kv_cache_tensors(self, config, key_abs_max, value_abs_max, prefix):
        grid = self.kv_cache_grid(config)
        if grid is None:
            return {}
        return {f"{prefix}self_attn.{name}": grid.static_scale(abs_max)
                for name, abs_max in zip(KV_SCALES, (key_abs_max, value_abs_max))}

    def grid(self, quant, model_dtype):
        """Scales in a 16-bit model's dtype, as llm-compressor stores them and vLLM loads them; a float32
        model's in float16, where every product of a code and a scale is exact in float32 (the runtime's
        offsets and MLX export rely on it) and which float32 and float16 servers load unchanged."""
        return QuantConfig(**quant, scale_dtype=torch.float16 if model_dtype == torch.float32 else model_dtype)
