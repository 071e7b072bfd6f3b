"""The recipe schema's defaults, the built-in recipes written against them, and docs/recipes.md."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from quantkit.recipe import SCHEMA, RecipeError, builtin_dir, builtin_names, load_recipe, schema_markdown, schema_table

DOCS = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"

# sha256 of each built-in recipe's resolved settings (Recipe.fingerprint). A change here changes what
# the recipe quantizes and makes `--resume` refuse its earlier runs: update it only on purpose.
FINGERPRINTS = {
    "awq-w4g128": "1381ebc14fd96f42f323d27aec68b3fb822c13b6dc28d1acc1cda6e6f4ed8f2d",
    "block-recon-w2g64": "2e06d36d483f746dfbc2538602bb733ddf5c94eb547b00fc18de446133be5638",
    "block-recon-ternary-g32": "6049fefe92d2027add18601f5d6ebd918a355d9ba268e235a61481938bb7ed1e",
    "cpmcu": "f0a91dadfa3ae0c3a1d5cde65f9ab384d10d31aa332d207aa3aee8ce5786e098",
    "gguf-iq4_xs": "4ba417ad05244aa5af53b235cc76a3b7eb5f5a8175332b5036c969595a942ec7",
    "gguf-q2_k": "11bc16f4ecc573cd3d9027be281abb580f745dc62b18e71cfc145b44daa1e26a",
    "gguf-iq3_m": "daaffb1784903adb823d00afe721a5a2197fcba2bd09997d8e947215aab2987c",
    "gguf-iq2_m": "bf29693bec3aab3251ea3d015386d1a3d45b07aea5552fffd38e59fa015db0a2",
    "gguf-iq1_m": "937f87e249e8db25aa9b050f214cf2989dccf6239569f77f3a57a9d62a965555",
    "gguf-q3_k_m": "9ebc34c66e29f1ced57a6bf36cc83e0242ff046bf3dd7b4666a61006464426e2",
    "gguf-q4_0": "2429a805b21bcd4ccc5f7eac93eac97843dd028f4f570a6bd298c650921795a9",
    "gguf-q4_k_m": "da6eb6f26c57fcd5ba5ff624b7efc44126345bb08569ac50faeb00586e9b42cd",
    "gguf-q5_k_m": "7d0fa1fba050bdc5df6169dd3b5854ca8c025af61bb13098e12292e4e8a64d89",
    "gptq-ternary-g32": "15c95478e538f94faaf81001d8e74267fa7507028cbf799a62b4217c02a4cb56",
    "gptq-w4g128": "62169bc2e3d01e363170a39a408e0ad787ecd91e1c1dd0b73bf1520a33663cdc",
    "int8-w8a8": "289518d4511d7b0c12b6179168e2704cd4d9f9bbd8f82e56d32eca139549c5ca",
    "fp8-w8a8": "09e49f58f0afebbf7475502ed93c25f6846906b207e70a0475f8a44d42a7b51e",
    "marlin": "9ffacaa611224ff6ace644b8b15d6dbc5272dc103c67f8df19ebceacd83860a0",
    "mlx-dwq-w4g64": "ce0c65460fdb1ee67ac492496e5487dc53f994541d39d16e869479d590e628c7",
    "mlx-rtn-mixed-4-6": "03132625cc3acf6ea6f21d3c9743e4abae884cc273f0a411e22014ace64415ad",
    "mlx-s-gptq-mixed-4-6": "d22f5ba39d0f7c7ddd4d4570233f9f815c1cb4c02048a30909c295b8f6c4fc23",
    "mlx-s-gptq-w4g64": "23b239862f76f9a1c1fbd36faae0e937b24a05a7664528fcf8522dc362870f19",
    "mlx-rtn-w4g64": "8577dee8a3900de9370ce982b832abbf085db2a7ae78d3d9a0f10a617c8c7821",
    "p-gptq-w4g128": "b5c5ebf944bd95f3565f6ad0c2de54fbdaa65b0dd2084fe2265592b80660c474",
    "qat-ternary-g256": "7c37a7e2903fb960965695ced39bf35e9fee73876496a31cd34f32ed1c896bf6",
    "qat-ternary-g32": "c828de2187978e52f9c7178941d19d25ed408b4e09883c0315586501c466ddcb",
    "rtn-ternary-g32": "612fe98bb77c8964bcd898df0aebaf5c2e627fafb3bb351c4cb9b85c43be2272",
    "rtn-w4g128": "b149551c04d14d6d9e6b0815f7e6c390484a3330f7f584aae62e5fea25c03d63",
    "s-gptq-w4a16-ct": "165f96dfddb018b1ffc1d162f2875e7ffc54d4508b79c1344aec0aa23debb8e2",
    "s-gptq-w4g128": "60a1fc158ee5fd76d183f7cad60145a07c79cd2ed7a8028f8d3136a229ddbb84",
    "s-p-gptq-w4g128": "d69b28064a482f8230697c1629b25808b1c868a35f3065fadc5ee781f0e313d9",
}


def _lookup(tree: dict, dotted: str, missing=None):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return missing
        tree = tree[part]
    return tree


def test_builtin_recipes_resolve_to_their_recorded_settings():
    assert {name: load_recipe(name).fingerprint() for name in builtin_names()} == FINGERPRINTS


def test_builtin_recipes_state_only_what_differs_from_the_defaults():
    optional = [row[0].strip("`") for row in schema_table() if row[2] != "required"]
    for name in builtin_names():
        raw = yaml.safe_load((builtin_dir() / f"{name}.yaml").read_text())
        for dotted in optional:
            section = dotted.split(".")[0]
            # calibration: tests/helpers.py small_recipe() updates the section in place, so it stays.
            # gptq on RTN/AWQ: unused, but the old defaults keep those recipes' fingerprints.
            if section == "calibration" or (section == "gptq" and raw["algorithm"] != "gptq"):
                continue
            stated = _lookup(raw, dotted, missing=KeyError)
            assert stated != _lookup(SCHEMA, dotted).default, f"{name}: '{dotted}: {stated!r}' restates the default"


def test_defaults_are_the_measured_gptq_settings(tmp_path):
    path = tmp_path / "plain.yaml"
    path.write_text("name: plain\ndescription: defaults only\nalgorithm: gptq\nquant: {bits: 4}\n")
    gptq = load_recipe(path)["gptq"]
    assert gptq == {"damp_percent": 0.2, "block_size": 128, "desc_act": False, "static_groups": False,
                    "group_aware": True, "clip_search": True}


def test_act_order_needs_group_aware_turned_off():
    with pytest.raises(RecipeError, match="set gptq.group_aware: false"):
        load_recipe("gptq-w4g128", {"gptq.desc_act": True})
    assert load_recipe("gptq-w4g128", {"gptq.desc_act": True, "gptq.group_aware": False})["gptq"]["desc_act"]


def test_gguf_block_types_refuse_the_uniform_grid_options_before_any_work():
    with pytest.raises(RecipeError, match="set gptq.clip_search: false$"):
        load_recipe("gptq-w4g128", {"format": "gguf-q4_k_m"})
    with pytest.raises(RecipeError, match="gptq.clip_search: false and gptq.static_groups: false"):
        load_recipe("gptq-w4g128", {"format": "gguf-q4_k_m", "gptq.static_groups": True})
    assert load_recipe("gptq-w4g128", {"format": "gguf-q4_k_m", "gptq.clip_search": False})["format"] == "gguf-q4_k_m"
    assert load_recipe("rtn-w4g128", {"format": "gguf-q4_k_m"})["gptq"]["clip_search"] is False


def test_docs_table_is_the_schema():
    text = DOCS.read_text()
    begin, end = "<!-- schema table: begin -->\n", "\n<!-- schema table: end -->"
    assert text[text.index(begin) + len(begin):text.index(end)] == schema_markdown(), (
        "docs/recipes.md's key table is stale: regenerate it with `python -m quantkit.recipe`")


def test_docs_has_a_section_per_builtin_recipe():
    text = DOCS.read_text()
    assert all(f"### `{name}`" in text for name in builtin_names())


def test_mlx_mixed_needs_format_mlx_and_its_lower_width():
    assert load_recipe("mlx-rtn-w4g64", {"mlx.mixed": "mixed_3_6", "quant.bits": 3})["mlx"] == {"mixed": "mixed_3_6",
                                                                                               "modules": {}}
    with pytest.raises(RecipeError, match="set quant.bits: 2"):
        load_recipe("mlx-rtn-w4g64", {"mlx.mixed": "mixed_2_6"})
    with pytest.raises(RecipeError, match="not of format 'gptq'"):
        load_recipe("gptq-w4g128", {"mlx.mixed": "mixed_4_6"})
    with pytest.raises(RecipeError, match="is not one of"):
        load_recipe("mlx-rtn-w4g64", {"mlx.mixed": "mixed_4_8"})
    with pytest.raises(RecipeError, match="not yet by QAT or DWQ"):
        load_recipe("mlx-dwq-w4g64", {"mlx.mixed": "mixed_4_6"})


def test_mlx_modules_name_modules_and_mlx_grids():
    """Per-module grids (what a size budget's plan writes): decoder linears and the two matrices outside the
    layers, on MLX's grids; only those two may stay unquantized."""
    modules = {"model.layers.3.mlp.down_proj": {"bits": 6, "group_size": 32}, "lm_head": False,
               "model.embed_tokens": {"bits": 8, "group_size": 128}}
    assert load_recipe("mlx-s-gptq-w4g64", {"mlx.modules": modules})["mlx"] == {"mixed": None, "modules": modules}
    for bad in ({"model.layers.0.mlp.down_proj": False}, {"model.norm": {"bits": 4, "group_size": 64}},
                {"lm_head": {"bits": 7, "group_size": 64}}, {"lm_head": {"bits": 4, "group_size": 48}},
                {"lm_head": {"bits": 4}}):
        with pytest.raises(RecipeError, match="mlx.modules"):
            load_recipe("mlx-s-gptq-w4g64", {"mlx.modules": bad})
    with pytest.raises(RecipeError, match="not of format 'gptq'"):
        load_recipe("gptq-w4g128", {"mlx.modules": {"lm_head": False}})


def test_the_schema_is_assembled_from_the_sections_beside_their_code_in_recipe_order():
    from quantkit.algorithms import gptq, smooth
    from quantkit.formats import FORMATS
    from quantkit.formats import gguf as gguf_format
    from quantkit.training import fake_quant

    assert SCHEMA["gptq"] is gptq.SETTINGS and SCHEMA["smooth"] is smooth.SETTINGS
    assert SCHEMA["mlx"] is FORMATS["mlx"].settings and SCHEMA["qat"] is fake_quant.SETTINGS
    assert SCHEMA["compressed-tensors"] is FORMATS["compressed-tensors"].settings
    assert SCHEMA["gguf"] is gguf_format.SETTINGS  # one section for every gguf-* format
    # the order of Recipe.values, which every manifest records
    assert list(SCHEMA) == ["name", "description", "algorithm", "format", "prefix_tokens", "prefix_linears",
                            "compute_dtype", "quant", "gptq", "smooth", "reconstruct", "calibration",
                            "compressed-tensors", "mlx", "qat", "gguf"]
