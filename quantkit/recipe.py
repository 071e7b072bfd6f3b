"""Recipes: YAML files that name a pipeline's steps and parameters, validated against one schema.

A recipe is data. The schema below is the single list of what a recipe may say; an unknown key or a
bad value is an error that names the key and the file, before any work starts. It is assembled here
from the sections each part declares beside its code (the algorithms' ``gptq`` and ``smooth``, a
format's own, such as ``mlx``, and ``qat`` beside fake quantization); the keys every pipeline reads
are declared here. Rules across sections (an algorithm against a format's grid) are checked here too.

The defaults are the settings measured best on the default model and shared by most built-in recipes,
so a recipe states only what differs from them. docs/recipes.md says which measurement chose each and
holds the table of every key that `python -m quantkit.recipe` prints.
"""
from __future__ import annotations

import hashlib
import json
import reprlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml

from quantkit.algorithms import ALGORITHMS, SECTIONS
from quantkit.errors import QuantkitError
from quantkit.formats import FORMATS
from quantkit.formats import gguf as gguf_format
from quantkit.models.layers import LINEARS, SEQUENTIAL_GROUPS
from quantkit.quant import FLOAT_BIAS_BITS, QuantConfig
from quantkit.recipes.fields import Field, Section, positive, seed_field
from quantkit.training import fake_quant


class RecipeError(QuantkitError, ValueError):
    """A recipe that cannot be used as written."""


# A value quoted in an error is cut short: a recipe may hold a megabyte string, and the message is one line.
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 2, 60, 60, 40
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4


def _shown(value: Any) -> str:
    return _SHORT.repr(value)


def _clipped(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _RecipeLoader(yaml.SafeLoader):
    """YAML as a recipe may be written: no anchors or aliases (nine levels of nested aliases expand a few
    hundred bytes into billions of values, the "billion laughs"), and no key stated twice in a mapping
    (PyYAML would keep the last one silently)."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or event.anchor is not None:
            raise yaml.composer.ComposerError(None, None, "anchors and aliases (&name, *name) are not allowed "
                                              "in a recipe", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # a list or mapping as a key is refused as unhashable; `<<` merges, as in YAML
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {_shown(key)} is stated twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_RecipeLoader)


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error in one line: where and what (PyYAML's own message quotes the text over several lines)."""
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    if problem is None:
        return " ".join(str(error).split())[:200]
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


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
    **SECTIONS,
    "calibration": {
        "source": Field(str, default="default", help="corpus or mix name, local file, or hf:<dataset>"),
        "n_samples": Field(int, default=128, check=positive, rule="> 0", help="calibration sequences"),
        "seq_len": Field(int, default=512, check=lambda v: v >= 16, rule=">= 16", help="tokens per sequence"),
        "seed": seed_field("seed of the sample draw"),
        "chat": Field(bool, default=False, help="wrap each sample in the chat template"),
        "batch_size": Field(int, default=8, check=positive, rule="> 0",
                            help="samples per forward batch (memory, not results)"),
    },
    **{fmt.name: fmt.settings for fmt in FORMATS.values() if fmt.settings is not None},
    "qat": fake_quant.SETTINGS,
    "gguf": gguf_format.SETTINGS,
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
        raise RecipeError(f"{source}: unknown key '{where}{_clipped(str(unknown[0]))}' "
                          f"(allowed here: {known})")
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
            raise RecipeError(f"{source}: '{path}' must be {spec.kind.__name__}, got {_shown(value)}")
        if spec.choices is not None and value not in spec.choices:
            raise RecipeError(f"{source}: '{path}' = {_shown(value)} is not one of {list(spec.choices)}")
        if spec.check is not None and not spec.check(value):
            raise RecipeError(f"{source}: '{path}' = {_shown(value)} must be {spec.rule}")
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
        raise RecipeError(f"override {_shown(text)} must look like section.key=value")
    try:
        return key.strip(), _read_yaml(value)
    except yaml.YAMLError as e:
        raise RecipeError(f"override '{key.strip()}': value {_shown(value)} is not valid YAML "
                          f"({_yaml_problem(e)})") from None


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
        raw = _read_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if overrides:
        raw = _apply_overrides(raw if isinstance(raw, dict) else {}, overrides, str(path))
    values = _validate(raw, SCHEMA, "", str(path))
    for key, section in SCHEMA.items():  # the rules among each section's own keys
        if isinstance(section, Section) and section.check is not None and key in values:
            _refuse(path, section.check(values[key]))
    config = _grid(values, path)
    _refuse(path, _codec_conflict(values, config))
    if "qat" in values:
        _refuse(path, fake_quant.refusal(values, config))
    for fmt in FORMATS.values():  # the recipe's format, and a format's own section wherever it is stated
        if fmt.name == values["format"] or (fmt.settings is not None and fmt.name in values):
            _refuse(path, fmt.recipe_refusal(values))
    _refuse(path, gguf_format.refusal(values))
    _refuse(path, _smoothing_conflict(values, config))
    _refuse(path, _reconstruction_conflict(values, config))
    return Recipe(values, str(path))


def _reconstruction_conflict(values: dict, config: QuantConfig) -> str | None:
    """Block reconstruction trains codes and scales on the uniform grid (codes alone on GGUF's affine block
    types), matching each layer's output with 16-bit activations, from a post-training start."""
    settings = values.get("reconstruct")
    if settings is None:
        return None
    fmt = FORMATS[values["format"]]
    untrainable = fmt.untrainable(values)
    if untrainable is not None:
        return (f"'reconstruct' trains the rounding of the uniform integer grid and of GGUF's affine block types; "
                f"{untrainable}, which it cannot train: remove the reconstruct section")
    resolved = fmt.resolve(config, values, 0)
    if fmt.activation_grid(resolved) is not None or fmt.kv_cache_grid(resolved) is not None:
        return ("'reconstruct' matches each layer's output with 16-bit activations and KV cache; this recipe "
                "quantizes them too: remove the reconstruct section")
    if "qat" in values:
        return "'reconstruct' is a post-training step; a 'qat' recipe trains the whole model instead: remove one"
    if settings["batch_size"] > values["calibration"]["n_samples"]:
        return (f"'reconstruct.batch_size' {settings['batch_size']} exceeds calibration.n_samples "
                f"{values['calibration']['n_samples']}: lower it or calibrate on more sequences")
    return None


def _smoothing_conflict(values: dict, config: QuantConfig) -> str | None:
    """SmoothQuant balances activation against weight quantization: without the first it has nothing to do."""
    if values["smooth"]["method"] != "smoothquant" or not values["smooth"]["enabled"]:
        return None
    fmt = FORMATS[values["format"]]
    if fmt.activation_grid(fmt.resolve(config, values, 0)) is None:
        return ("'smooth.method: smoothquant' balances activation against weight quantization, and this recipe's "
                "activations stay in 16 bits: use format compressed-tensors with compressed-tensors.activations "
                "int8-dynamic (W8A8), or smooth.method: awq")
    return None


def _refuse(path: Path, why: str | None) -> None:
    if why is not None:
        raise RecipeError(f"{path}: {why}")


def _grid(values: dict, path: Path) -> QuantConfig:
    """The run's grid as the recipe's format builds it from the quant section (float16 standing in for
    the checkpoint's dtype)."""
    try:
        return FORMATS[values["format"]].grid(values["quant"], torch.float16)
    except ValueError as e:
        # QuantConfig's messages start with the field they are about ("bits must be one of ...")
        field = str(e).split(" ", 1)[0]
        key = f"quant.{field}" if field in values["quant"] else "quant"
        raise RecipeError(f"{path}: '{key}' on format {values['format']}: {e}") from e


def _codec_conflict(values: dict, config: QuantConfig) -> str | None:
    """Why the recipe's algorithm cannot produce what its format stores on ``config``, or None."""
    algorithm, fmt = ALGORITHMS[values["algorithm"]], FORMATS[values["format"]]
    if config.ternary and algorithm.clips(values):
        return ("a ternary grid's scale is the group's mean |w|, with no range to clip: set gptq.clip_search: false "
                "and use algorithm rtn or gptq")
    solved_on = fmt.solved_on(values)
    if solved_on is None:
        return None
    if not algorithm.solves_block_types:
        solvers = ", ".join(name for name, other in ALGORITHMS.items() if other.solves_block_types)
        return (f"format '{fmt.name}' is solved on {solved_on.split(',')[0]}, which '{algorithm.name}' cannot do "
                f"(use one of {solvers})")
    uniform_only = algorithm.uniform_grid_settings(values)
    if uniform_only:
        settings = " and ".join(f"{key}: false" for key in uniform_only)
        return f"format '{fmt.name}' is solved on {solved_on}: set {settings}"
    return None


def purpose(path: Path) -> str:
    """The one-line purpose a recipe states in its `description`."""
    return _read_yaml(path.read_text()).get("description", "")


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
