"""Formats register themselves: defining a ``Format`` subclass is all it takes, the base class's defaults
fill in what a format does not say, and the registry lists every format once, in the order listings show."""
import pytest
import torch

from quantkit.formats import FORMATS, base
from quantkit.formats.base import Format
from quantkit.formats.consumers import QUANTKIT
from quantkit.quant import QuantConfig


@pytest.fixture
def fresh_registry(monkeypatch):
    """The registry as it would be before any format was defined, restored afterwards."""
    monkeypatch.setattr(base, "_REGISTERED", [])
    return base._REGISTERED


def test_defining_a_subclass_registers_it_with_the_defaults(fresh_registry):
    class Plain(Format):
        name, summary, suffixes, list_order = "plain", "a test format", ("qweight",), 99

    [fmt] = fresh_registry
    assert isinstance(fmt, Plain) and fmt.name == "plain"
    assert fmt.consumers == (QUANTKIT,) and fmt.stored_layout is None and fmt.settings is None
    assert fmt.draft_head_fc is None and not fmt.block_types and fmt.write_outside is None
    quant = {"bits": 4, "group_size": 128, "sym": True, "ternary": False}
    grid = fmt.grid(quant, torch.bfloat16)
    assert grid == QuantConfig(**quant) and fmt.resolve(grid, {}, 8) is grid
    assert fmt.target(grid, "mlp.up_proj", 0, None, (64, 64)) is grid
    assert fmt.config_files({"a": 1}) == {"config.json": {"a": 1}}
    assert fmt.stores("model.layers.0.mlp.up_proj.qweight") and not fmt.stores("model.layers.0.mlp.up_proj.weight")


def test_an_abstract_base_is_not_registered_and_a_name_is_taken_once(fresh_registry):
    class Family(Format, abstract=True):
        suffixes, list_order = ("qweight",), 99

    class One(Family):
        name, summary = "one", "first"

    assert [fmt.name for fmt in fresh_registry] == ["one"]
    with pytest.raises(ValueError, match="'one' is defined twice"):
        class Again(Family):
            name, summary = "one", "second"


def test_the_registry_holds_every_format_in_listing_order():
    assert list(FORMATS)[:7] == ["gptq", "gptq-v2", "awq", "compressed-tensors", "marlin", "cpmcu", "ternary"]
    assert list(FORMATS)[-1] == "mlx" and all(name.startswith("gguf-") for name in list(FORMATS)[7:-1])
    assert [fmt.list_order for fmt in FORMATS.values()] == sorted(fmt.list_order for fmt in FORMATS.values())
    assert all(fmt.name == name for name, fmt in FORMATS.items())


def test_what_each_format_says_of_itself():
    assert {name for name, fmt in FORMATS.items() if fmt.draft_head_fc is not None} == {"gptq", "marlin", "cpmcu"}
    assert {name: fmt.stored_layout for name, fmt in FORMATS.items() if fmt.stored_layout} == {
        "awq": "awq", "marlin": "marlin", "ternary": "ternary planes"}
    assert {name for name, fmt in FORMATS.items() if fmt.settings is not None} == {"mlx", "compressed-tensors"}
    assert {name for name, fmt in FORMATS.items() if fmt.block_types} == {n for n in FORMATS if n.startswith("gguf-")}
