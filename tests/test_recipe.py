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
    "awq-w4g128": "27fa945f670fd5ab285778b24990545856950607ae384f1c78a2eabaefa22d07",
    "cpmcu": "0114cf83ade69d55536ce7dedce5ec2cc75495f64ae80f519c2042efbcf1194a",
    "gguf-q4_0": "77cce7aaa568e0f5521e5536dd6082d4579edb478c9a88b4342eb6f745e027a4",
    "gguf-q4_k_m": "8c5fac7fe950224ae9168c42048ac21063dc7e67b4ff06b38abd7b6cb3db21db",
    "gguf-q5_k_m": "1582fd57af316578504d6524c8532ac1ff462100d5ac489b59774fd6bcf7616f",
    "gptq-ternary-g32": "61be3f49e1a24eae79bfee9cfa9eeeefc700788cd8ddad6d3fc99023e5ada33f",
    "gptq-w4g128": "d4251035ec3396c5da54e881d005c72c99abf4510ff9c45cfe3792b05506cd1f",
    "int8-w8a8": "dd1e3ac7bb225056988028283b81907f5338b363897b01c44e4a3a20f7859d6c",
    "fp8-w8a8": "4091a9ef76c9f7081870b761f8c56b1cc7423d460e8bb673aad1fbcaabc9e6e5",
    "marlin": "c29502c09ca4a6be3edc0a4e59dab211fc189ab6f2dcb7da087ffb20a438671c",
    "mlx-dwq-w4g64": "a01b75c2fca233a6a6b61e345d9a2ccea0571406a22b810e20cc9dfeafa80235",
    "mlx-rtn-mixed-4-6": "ef669faf20da3a133c6cca8355027e7f63e3cf4e72472a76edfccf7451725404",
    "mlx-s-p-gptq-mixed-4-6": "29b1fabe1ffbcc679d892b9dfa75e3e9f3aec9d3f361973140853a34ec6b178a",
    "mlx-s-p-gptq-w4g64": "6eccba0556e1e3c03450af37ca7a7e6a922df1129763681d63906f80863845a6",
    "mlx-rtn-w4g64": "62fd3d2fd922bc8bc28b3cb2a6a60228f04184209d11aef30a4bc1925bc60165",
    "p-gptq-w4g128": "465013af18af503be36c5d035357772556f7bee573e1e2db8f19a680b79e7284",
    "qat-ternary-g256": "2f5c49b678cf12335b7be03e98b568ee9120994d75ceed1d3e8db14236844223",
    "qat-ternary-g32": "d48278ee212494699feea06cadcb3315e719e9613cbf96f2208d5a1662283492",
    "rtn-ternary-g32": "d71976feb8566126e8eef0ef76527491c9361f3c5774ab11371c93267515dd76",
    "rtn-w4g128": "9263d309a067aef778d24d78452d23bee79134ca1a333e8dbcba59f487e362c8",
    "s-gptq-w4a16-ct": "ce4db140bf3a73daf436025243eaac90b4d281f415651c62d5e4662326df96bf",
    "s-gptq-w4g128": "0d0c0078eb59ed8b93756f577b3cceb2b006d5c7485a77891650eb5035ce20e9",
    "s-p-gptq-w4g128": "fc61b395f0272e987ce1bc032e4b10ed95217fa21c8c107ab473a6f794e1121a",
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
    assert load_recipe("mlx-rtn-w4g64", {"mlx.mixed": "mixed_3_6", "quant.bits": 3})["mlx"] == {"mixed": "mixed_3_6"}
    with pytest.raises(RecipeError, match="set quant.bits: 2"):
        load_recipe("mlx-rtn-w4g64", {"mlx.mixed": "mixed_2_6"})
    with pytest.raises(RecipeError, match="not of format 'gptq'"):
        load_recipe("gptq-w4g128", {"mlx.mixed": "mixed_4_6"})
    with pytest.raises(RecipeError, match="is not one of"):
        load_recipe("mlx-rtn-w4g64", {"mlx.mixed": "mixed_4_8"})
    with pytest.raises(RecipeError, match="not yet by QAT or DWQ"):
        load_recipe("mlx-dwq-w4g64", {"mlx.mixed": "mixed_4_6"})


def test_the_schema_is_assembled_from_the_sections_beside_their_code_in_recipe_order():
    from quantkit.algorithms import gptq, smooth
    from quantkit.formats import FORMATS
    from quantkit.training import fake_quant

    assert SCHEMA["gptq"] is gptq.SETTINGS and SCHEMA["smooth"] is smooth.SETTINGS
    assert SCHEMA["mlx"] is FORMATS["mlx"].settings and SCHEMA["qat"] is fake_quant.SETTINGS
    assert SCHEMA["compressed-tensors"] is FORMATS["compressed-tensors"].settings
    # the order of Recipe.values, which every manifest records
    assert list(SCHEMA) == ["name", "description", "algorithm", "format", "prefix_tokens", "prefix_linears",
                            "compute_dtype", "quant", "gptq", "smooth", "calibration", "compressed-tensors", "mlx",
                            "qat"]
