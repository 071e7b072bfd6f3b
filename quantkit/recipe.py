"""Recipes: YAML files that name a pipeline's steps and parameters, validated against one schema.

A recipe is data. The schema below is the single list of what a recipe may say; an unknown key or a
bad value is an error that names the key and the file, before any work starts.

The defaults are the settings measured best on the default model and shared by most built-in recipes,
so a recipe states only what differs from them. docs/recipes.md says which measurement chose each and
holds the table of every key that `python -m quantkit.recipe` prints.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from quantkit.algorithms import ALGORITHMS, SOLVES_BLOCK_TYPES
from quantkit.errors import QuantkitError
from quantkit.formats import FORMATS
from quantkit.formats.mlx import MIXES
from quantkit.models.layers import LINEARS, SEQUENTIAL_GROUPS
from quantkit.quant import FLOAT_BIAS_BITS
from quantkit.training.fake_quant import TRAINS


class RecipeError(QuantkitError, ValueError):
    """A recipe that cannot be used as written."""


@dataclass(frozen=True)
class Field:
    kind: type
    default: Any = None
    required: bool = False
    choices: tuple | None = None
    check: Callable[[Any], bool] | None = None
    rule: str = ""  # what `check` demands, for the error message
    help: str = ""


def _positive(v) -> bool:
    return v > 0


def _fraction(v) -> bool:
    return 0 <= v <= 1


class Section(dict):
    """A nested group of keys. An ``optional`` section is absent from recipes that do not state it
    (and from their fingerprints), rather than filled with defaults: only QAT recipes have ``qat``."""

    def __init__(self, fields: dict, optional: bool = False):
        super().__init__(fields)
        self.optional = optional


def _whole_groups(names: list) -> bool:
    """Known linears, each listed once, and every sequential group in or out as a whole: q/k/v share one
    input and so one Hessian, as do gate/up."""
    chosen = set(names)
    return (len(chosen) == len(names) and chosen <= set(LINEARS)
            and all(len(chosen & set(group)) in (0, len(group)) for group in SEQUENTIAL_GROUPS))


SCHEMA: dict[str, Any] = {
    "name": Field(str, required=True, help="recipe name, as `quantkit quantize --recipe NAME`"),
    "description": Field(str, required=True, help="one line: what the recipe is for"),
    "algorithm": Field(str, required=True, choices=tuple(ALGORITHMS), help="quantization algorithm"),
    "format": Field(str, default="gptq", choices=tuple(FORMATS), help="checkpoint format written"),
    "prefix_tokens": Field(int, default=0, check=lambda v: v >= 0, rule=">= 0",
                           help="P-GPTQ: leave the first N positions of every calibration sequence out of "
                                "the statistics (the forward pass still runs on all tokens)"),
    "prefix_linears": Field(list, default=list(LINEARS), check=_whole_groups,
                            rule=f"a list of distinct linears from {list(LINEARS)} in which q/k/v and gate/up "
                                 "appear together or not at all (each set shares one input)",
                            help="the linears whose statistics leave the prefix out (default: all of them, "
                                 "as the MiniCPM4 report does); the others see every position"),
    "compute_dtype": Field(str, default="auto", choices=("auto", "bfloat16", "float32"),
                           help="dtype of calibration forwards; auto: bfloat16 on CPUs that multiply it in "
                                "hardware (AMX, AVX-512 BF16), float32 elsewhere (statistics accumulate in fp32)"),
    "quant": {
        "bits": Field(int, required=True, choices=FLOAT_BIAS_BITS,
                      help="bits per weight code (5 and 6 on MLX's affine grid only)"),
        "group_size": Field(int, default=128, choices=(-1, 32, 64, 128, 256),
                            help="input channels sharing a scale and zero point (-1: one group of every channel)"),
        "sym": Field(bool, default=True, help="symmetric grid (fixed zero point) instead of a zero point per group"),
        "ternary": Field(bool, default=False,
                         help="BitCPM4's absmean ternary grid {-s, 0, +s} per group (needs bits 2, sym false)"),
    },
    # Not the reference GPTQ settings (natural order, damp 0.01, min/max ranges), which gave about 1.7x
    # the KL of these on the default model: docs/recipes.md, "GPTQ solver: order, damping, clipping".
    "gptq": {
        "damp_percent": Field(float, default=0.2, check=lambda v: 0 < v < 1, rule="in (0, 1)",
                              help="dampening added to H's diagonal, as a fraction of its mean"),
        "block_size": Field(int, default=128, choices=(32, 64, 128, 256),
                            help="columns solved per lazy batch update"),
        "desc_act": Field(bool, default=False, help="act-order: columns by descending Hessian diagonal"),
        "static_groups": Field(bool, default=False, help="group parameters from the unmodified weights"),
        "group_aware": Field(bool, default=True,
                             help="group-aware reordering (GAR): groups by descending max Hessian diagonal, "
                                  "columns within each; keeps g_idx trivial, so Marlin can pack it"),
        "clip_search": Field(bool, default=True,
                             help="reference GPTQ's mse option: each group's range is the best of 80 shrunk "
                                  "ranges (least |error|^2.4)"),
    },
    "smooth": {
        "enabled": Field(bool, default=False, help="AWQ smoothing before quantizing (AWQ, S-GPTQ, S-P-GPTQ)"),
        "grid": Field(int, default=20, check=_positive, rule="> 0", help="exponent grid points in [0, 1)"),
    },
    "calibration": {
        "source": Field(str, default="default", help="corpus or mix name, local file, or hf:<dataset>"),
        "n_samples": Field(int, default=128, check=_positive, rule="> 0", help="calibration sequences"),
        "seq_len": Field(int, default=512, check=lambda v: v >= 16, rule=">= 16", help="tokens per sequence"),
        "seed": Field(int, default=0, help="seed of the sample draw"),
        "chat": Field(bool, default=False, help="wrap each sample in the chat template"),
        "batch_size": Field(int, default=8, check=_positive, rule="> 0",
                            help="samples per forward batch (memory, not results)"),
    },
    # MLX's mixed precision: present only in recipes that state it, so the others' fingerprints do not change
    "mlx": Section({
        "mixed": Field(str, required=True, choices=tuple(MIXES),
                       help="mlx-lm's mixed predicate (`mlx_lm.convert --quant-predicate NAME`): quant.bits for "
                            "most modules, more for the LM head and some layers' v_proj and down_proj (format mlx)"),
    }, optional=True),
    # Quantization-aware training (`quantkit qat`): BitCPM4's recipe shape (re-warmup, WSD schedule,
    # distillation from the FP model). docs/qat.md says which values were measured.
    "qat": Section({
        "trains": Field(str, default="weights", choices=tuple(TRAINS),
                        help="weights: latent weights through the grid and the norm gains (QAT); scales: the codes "
                             "fixed, each group's scale and float bias (mlx-lm's DWQ; float-bias grids: format mlx)"),
        "tokens": Field(int, default=400_000, check=_positive, rule="> 0",
                        help="training tokens (`--tokens` overrides): steps = tokens / batch_tokens"),
        "batch_tokens": Field(int, default=2048, check=_positive, rule="> 0",
                              help="tokens per optimizer step, a multiple of seq_len (gradient accumulation)"),
        "micro_batch": Field(int, default=1, check=_positive, rule="> 0",
                             help="sequences per forward/backward (memory, not results)"),
        "seq_len": Field(int, default=512, check=lambda v: v >= 16, rule=">= 16", help="tokens per sequence"),
        "learning_rate": Field(float, default=1e-3, check=_positive, rule="> 0",
                               help="peak learning rate (docs/qat.md: 1e-3 beat 4e-3 and 2e-4 on the default model)"),
        "warmup": Field(float, default=0.05, check=_fraction, rule="in [0, 1]",
                        help="fraction of steps warming up from 0 (the re-warmup BitCPM4 calls critical)"),
        "stable": Field(float, default=0.75, check=_fraction, rule="in [0, 1]",
                        help="fraction of steps at the peak rate (WSD); warmup + stable + decay = 1"),
        "decay": Field(float, default=0.2, check=_fraction, rule="in [0, 1]",
                       help="fraction of steps decaying linearly to final_lr x the peak"),
        "final_lr": Field(float, default=0.1, check=_fraction, rule="in [0, 1]",
                          help="learning rate at the end, as a fraction of the peak"),
        "weight_decay": Field(float, default=0.0, check=lambda v: v >= 0, rule=">= 0", help="AdamW weight decay"),
        "betas": Field(list, default=[0.9, 0.95],
                       check=lambda v: len(v) == 2 and all(type(b) is float and 0 <= b < 1 for b in v),
                       rule="two floats in [0, 1)", help="AdamW betas"),
        "eps": Field(float, default=1e-8, check=_positive, rule="> 0", help="AdamW epsilon"),
        "grad_clip": Field(float, default=1.0, check=_positive, rule="> 0", help="gradient norm clipped to this"),
        "distill_weight": Field(float, default=0.5, check=_fraction, rule="in [0, 1]",
                                help="loss = (1 - w) x cross-entropy + w x KL to the FP teacher (0: CE alone)"),
        "temperature": Field(float, default=1.0, check=_positive, rule="> 0", help="distillation temperature"),
        "top_k": Field(int, default=32, check=_positive, rule="> 0",
                       help="teacher logits cached per token (its distribution renormalised over them)"),
        "data": Field(str, default="default", help="training text: a calibration corpus or mix, or a local file"),
        "seed": Field(int, default=0, help="seed of the data order"),
        "eval_interval": Field(int, default=50, check=_positive, rule="> 0",
                               help="steps between held-out perplexity measurements"),
        "eval_tokens": Field(int, default=4096, check=lambda v: v >= 2, rule=">= 2",
                             help="held-out tokens per measurement"),
        "checkpoint_interval": Field(int, default=25, check=_positive, rule="> 0",
                                     help="steps between resumable checkpoints"),
        "max_loss_growth": Field(float, default=4.0, check=lambda v: v > 1, rule="> 1",
                                 help="stop if a step's loss exceeds this multiple of the best loss so far"),
    }, optional=True),
}


@dataclass(frozen=True)
class Recipe:
    """A validated recipe with every default filled in."""

    values: dict
    source: str  # file it came from, for messages

    def __getitem__(self, key: str):
        return self.values[key]

    @property
    def name(self) -> str:
        return self.values["name"]

    def fingerprint(self) -> str:
        """SHA-256 of the canonical settings (name and description do not change results)."""
        settings = {k: v for k, v in self.values.items() if k not in ("name", "description")}
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _as_float(value: int | str) -> float | str:
    try:
        return float(value)
    except ValueError:
        return value  # left to the type check's message


def _validate(raw: Any, schema: dict, where: str, source: str) -> dict:
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: '{where or 'recipe'}' must be a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(schema))
    if unknown:
        known = ", ".join(sorted(schema))
        raise RecipeError(f"{source}: unknown key '{where}{unknown[0]}' (allowed here: {known})")
    out = {}
    for key, spec in schema.items():
        path = f"{where}{key}"
        if isinstance(spec, dict):
            if getattr(spec, "optional", False) and key not in raw:
                continue
            out[key] = _validate(raw.get(key, {}), spec, f"{path}.", source)
            continue
        if key not in raw:
            if spec.required:
                raise RecipeError(f"{source}: missing required key '{path}'")
            out[key] = spec.default
            continue
        value = raw[key]
        # bool is an int subclass in Python: reject `bits: true` and `sym: 1` alike. Where a float is
        # wanted, a whole number (`--set qat.distill_weight=0`) is that float, and so is `1e-3`, which
        # YAML 1.1 reads as a string.
        if spec.kind is float and (type(value) is int or type(value) is str):
            value = _as_float(value)
        if type(value) is not spec.kind:
            raise RecipeError(f"{source}: '{path}' must be {spec.kind.__name__}, got {value!r}")
        if spec.choices is not None and value not in spec.choices:
            raise RecipeError(f"{source}: '{path}' = {value!r} is not one of {list(spec.choices)}")
        if spec.check is not None and not spec.check(value):
            raise RecipeError(f"{source}: '{path}' = {value!r} must be {spec.rule}")
        out[key] = value
    return out


def builtin_dir() -> Path:
    return Path(str(resources.files("quantkit.recipes")))


def builtin_names() -> list[str]:
    return sorted(p.stem for p in builtin_dir().glob("*.yaml"))


def parse_override(text: str) -> tuple[str, Any]:
    """`quant.bits=3` -> ("quant.bits", 3); the value is read as YAML (numbers, booleans, strings)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise RecipeError(f"override {text!r} must look like section.key=value")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise RecipeError(f"override '{key.strip()}': value {value!r} is not valid YAML "
                          f"({str(e).splitlines()[0]})") from None


def _apply_overrides(raw: dict, overrides: dict[str, Any], source: str) -> dict:
    for dotted, value in overrides.items():
        node, *parents, leaf = [raw, *dotted.split(".")]
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"{source}: cannot override '{dotted}': '{part}' is not a section")
        node[leaf] = value
    return raw


def load_recipe(name_or_path: str | Path, overrides: dict[str, Any] | None = None) -> Recipe:
    """Load a built-in recipe by name, or a YAML file by path, with optional `section.key` overrides
    (validated like the file itself)."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = builtin_dir() / f"{name_or_path}.yaml"
        if not path.is_file():
            raise RecipeError(f"unknown recipe '{name_or_path}'; built-in recipes: {', '.join(builtin_names())}")
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from e
    if overrides:
        raw = _apply_overrides(raw if isinstance(raw, dict) else {}, overrides, str(path))
    values = _validate(raw, SCHEMA, "", str(path))
    if values["gptq"]["desc_act"] and values["gptq"]["group_aware"]:
        raise RecipeError(f"{path}: 'gptq.desc_act' and 'gptq.group_aware' are two column orders: enable one "
                          "(group_aware is on by default: set gptq.group_aware: false for act-order)")
    try:
        config = FORMATS[values["format"]].grid(values["quant"], torch.float16)
    except ValueError as e:
        # QuantConfig's messages start with the field they are about ("bits must be one of ...")
        field = str(e).split(" ", 1)[0]
        key = f"quant.{field}" if field in values["quant"] else "quant"
        raise RecipeError(f"{path}: '{key}' on format {values['format']}: {e}") from e
    clips = values["algorithm"] == "awq" or (values["algorithm"] == "gptq" and values["gptq"]["clip_search"])
    if config.ternary and clips:
        raise RecipeError(f"{path}: a ternary grid's scale is the group's mean |w|, with no range to clip: "
                          "set gptq.clip_search: false and use algorithm rtn or gptq")
    if FORMATS[values["format"]].block_types and values["algorithm"] not in SOLVES_BLOCK_TYPES:
        raise RecipeError(f"{path}: format '{values['format']}' is solved on GGUF block types, which "
                          f"'{values['algorithm']}' cannot do (use one of {', '.join(SOLVES_BLOCK_TYPES)})")
    own_grid = [key for key in ("clip_search", "static_groups") if values["gptq"][key]]
    if FORMATS[values["format"]].block_types and values["algorithm"] == "gptq" and own_grid:
        raise RecipeError(f"{path}: format '{values['format']}' keeps GGUF blocks, whose scales llama.cpp's "
                          f"quantizer chooses: set {' and '.join(f'gptq.{key}: false' for key in own_grid)}")
    if "qat" in values:
        _check_qat(values, config, path)
    if "mlx" in values:
        _check_mixed(values, path)
    return Recipe(values, str(path))


def _check_mixed(values: dict, path: Path) -> None:
    mix = values["mlx"]["mixed"]
    low = MIXES[mix][0]
    rules = (
        (values["format"] == "mlx", f"is a per-module grid of format mlx, not of format '{values['format']}'"),
        ("qat" not in values, "is applied by `quantkit quantize` (RTN, GPTQ, AWQ), not yet by QAT or DWQ training"),
        (values["quant"]["bits"] == low, f"gives most modules {low} bits: set quant.bits: {low} (the grid of "
                                         "every other module, and the defaults of the config it writes)"),
    )
    for holds, why in rules:
        if not holds:
            raise RecipeError(f"{path}: 'mlx.mixed' = {mix!r} {why}")


def _check_qat(values: dict, config, path: Path) -> None:
    qat = values["qat"]
    if TRAINS[qat["trains"]].float_bias_only and not config.float_bias:
        raise RecipeError(f"{path}: 'qat.trains' = {qat['trains']!r} trains each group's scale and float bias with "
                          f"the codes fixed, which needs a float-bias grid (format: mlx), not format "
                          f"'{values['format']}'")
    phases = qat["warmup"] + qat["stable"] + qat["decay"]
    if abs(phases - 1) > 1e-9:
        raise RecipeError(f"{path}: 'qat.warmup' + 'qat.stable' + 'qat.decay' must be 1 (the whole run), "
                          f"got {phases:g}")
    if qat["batch_tokens"] % (qat["seq_len"] * qat["micro_batch"]):
        raise RecipeError(f"{path}: 'qat.batch_tokens' = {qat['batch_tokens']} must be a multiple of "
                          f"qat.seq_len x qat.micro_batch = {qat['seq_len'] * qat['micro_batch']}")
    if qat["tokens"] < qat["batch_tokens"]:
        raise RecipeError(f"{path}: 'qat.tokens' = {qat['tokens']} is less than one step "
                          f"(qat.batch_tokens = {qat['batch_tokens']})")


def purpose(path: Path) -> str:
    """The one-line purpose a recipe states in its `description`."""
    return yaml.safe_load(path.read_text()).get("description", "")


def schema_table(schema: dict = SCHEMA, prefix: str = "") -> list[list[str]]:
    """One row per key: [key, type, default, allowed values, meaning] (docs/recipes.md's table)."""
    rows = []
    for key, spec in schema.items():
        if isinstance(spec, dict):
            rows += schema_table(spec, f"{prefix}{key}.")
            continue
        default = "required" if spec.required else f"`{json.dumps(spec.default)}`"
        allowed = " ".join(map(str, spec.choices)) if spec.choices is not None else spec.rule
        rows.append([f"`{prefix}{key}`", spec.kind.__name__, default, allowed, spec.help])
    return rows


def schema_markdown() -> str:
    lines = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in schema_table()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(schema_markdown())
