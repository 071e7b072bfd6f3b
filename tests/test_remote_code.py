"""MiniCPM's code in the artifacts quantkit writes (quantkit/models/remote_code.py): stock transformers opens
them with trust_remote_code=True in a Python where quantkit cannot be imported, with quantkit's logits; the
files are generated from quantkit's own modules and import nothing of quantkit; a source's own remote code
(OpenBMB's) is kept and said so."""
import ast
import importlib.util
import json
import logging
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantkit import export_gguf
from quantkit.engine import quantize
from quantkit.gguf.importer import convert_gguf
from quantkit.loading import load_model
from quantkit.models import remote_code
from quantkit.models.remote_code import AUTO_MAP, MARKER, RemoteCodeError, bundle
from quantkit.synthetic import MINICPM41_SPARSE_CONFIG

from helpers import run_without, small_recipe

TOKEN_IDS = [1, 3, 17, 250, 383, 42, 7, 99, 128, 4, 300, 64, 5, 211, 2, 150] * 5  # 80 positions: past LongRoPE's 64
QUANTKIT = {"quantkit"}

# The child: stock transformers only. It writes the logits of TOKEN_IDS to argv[2] and fails if anything of
# quantkit was imported, or if the model class is not the artifact's own code.
LOAD = f"""
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
with torch.no_grad():
    torch.save(model(torch.tensor([{TOKEN_IDS}])).logits, sys.argv[2])
assert not [m for m in sys.modules if m.split(".")[0] == "quantkit"]
"""


def _logits(model_dir: Path) -> torch.Tensor:
    with torch.no_grad():
        return load_model(model_dir).eval()(torch.tensor([TOKEN_IDS])).logits


def _stock_logits(model_dir: Path, tmp_path: Path, code: str = LOAD):
    """What ``code`` (run on stock transformers, quantkit blocked, with ``model_dir`` and an output path) saved."""
    out = tmp_path / "logits.pt"
    run = run_without(QUANTKIT, code, str(model_dir), str(out), env={"HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def converted(tiny_checkpoint_factory, tmp_path_factory):
    """``converted(case)``: a tiny checkpoint exported to an F32 GGUF and converted back by quantkit's GGUF
    importer, the way the default model and every ``owner/name:QUANT`` model are made."""
    cases = {"longrope": {}, "tied": {"tied": True}, "sparse": {"sparse_config": dict(MINICPM41_SPARSE_CONFIG)}}
    built = {}

    def make(case: str) -> Path:
        if case not in built:
            folder = tmp_path_factory.mktemp(f"converted-{case}")
            export_gguf(tiny_checkpoint_factory(**cases[case]), folder / "tiny.gguf", "f32", progress=False)
            built[case] = convert_gguf(folder / "tiny.gguf", folder / "checkpoint", progress=False)
        return built[case]

    return make


@pytest.mark.parametrize("case", ["longrope", "tied", "sparse"])
def test_a_converted_checkpoint_loads_in_stock_transformers_without_quantkit(converted, case, tmp_path):
    checkpoint = converted(case)
    assert json.loads((checkpoint / "config.json").read_text())["auto_map"] == AUTO_MAP
    for name, text in bundle().items():
        assert (checkpoint / name).read_text() == text
    # The same code on the same weights: bit-identical logits (tolerance 0, measured).
    assert torch.equal(_stock_logits(checkpoint, tmp_path), _logits(checkpoint))


def test_the_generated_files_import_only_the_standard_library_torch_and_transformers():
    allowed = set(sys.stdlib_module_names) | {"torch", "transformers"}
    for name, text in bundle().items():
        assert text.startswith(MARKER + "\n")
        imported, relative = set(), set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level:
                relative.add(node.module)
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module.split(".")[0])
        assert imported <= allowed, (name, imported - allowed)
        assert relative <= {"configuration_minicpm"}, name
        assert not re.search(r"^\s*(import|from)\s+quantkit\b", text, re.MULTILINE), name


def test_the_generated_files_are_quantkits_modules_not_a_copy():
    """Every function and class of the modules the model is made of is in the files character for character."""
    text = "\n".join(bundle().values())
    for module in ("models/configuration_minicpm", "models/sparse_attention", "models/decoder", "models/minicpm",
                   "models/layers"):
        source = (remote_code.ROOT / f"{module}.py").read_text()
        for node in ast.parse(source).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                assert ast.get_source_segment(source, node) in text, (module, node.name)


def _package_copy(tmp_path: Path) -> Path:
    root = tmp_path / "quantkit"
    shutil.copytree(remote_code.ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_a_module_that_grows_is_bundled_as_it_is(tmp_path):
    """A validation rule added to the configuration, raising a quantkit error, with a table from another
    module imported inside a function: inlined too, and the file still stands alone."""
    root = _package_copy(tmp_path)
    config = root / "models" / "configuration_minicpm.py"
    config.write_text(config.read_text().replace(
        "from quantkit.models.sparse_attention import SparseAttentionConfig",
        "from quantkit.errors import QuantkitError\nfrom quantkit.models.sparse_attention import SparseAttentionConfig")
        + "\n\nclass ConfigRuleError(QuantkitError, ValueError):\n    pass\n\n\n"
          "def check_rule(config):\n    from quantkit.models.layers import LINEARS\n\n"
          "    if not LINEARS:\n        raise ConfigRuleError('no linears')\n")
    files = bundle(root)
    assert "class QuantkitError(Exception):" in files["configuration_minicpm.py"]
    assert "def check_rule(config):" in files["configuration_minicpm.py"]
    assert "quantkit.models.layers" not in files["configuration_minicpm.py"].replace("# ---- quantkit/models/", "")
    path = tmp_path / "grown_configuration_minicpm.py"
    path.write_text(files["configuration_minicpm.py"])
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = sys.modules[path.stem] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        module.check_rule(None)  # LINEARS is the inlined table
        assert issubclass(module.ConfigRuleError, module.QuantkitError)
    finally:
        del sys.modules[path.stem]


@pytest.mark.parametrize("change, message", [
    ("from quantkit.models import layers\n", "quantkit.models is a package"),
    ("import quantkit.models.layers\n", "`import quantkit...` cannot be inlined"),
    ("from quantkit.models.layers import LINEARS as ALL\n", "LINEARS imported under another name"),
    ("from quantkit.models.layers import layer_prefix\nLAYER_PREFIX = 1\n",
     "both define LAYER_PREFIX"),
])
def test_what_cannot_be_inlined_is_refused_when_the_files_are_made(tmp_path, change, message):
    root = _package_copy(tmp_path)
    minicpm = root / "models" / "minicpm.py"
    minicpm.write_text(minicpm.read_text().replace("from quantkit.models.configuration_minicpm",
                                                   change + "from quantkit.models.configuration_minicpm"))
    with pytest.raises(RemoteCodeError, match=message):
        bundle(root)


def test_without_trust_remote_code_stock_transformers_refuses_and_runs_nothing(converted, tmp_path):
    code = """
import sys
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1])
except ValueError as error:
    assert "trust_remote_code=True" in str(error), error
    assert not [m for m in sys.modules if m.startswith("transformers_modules")]
    print("refused")
"""
    run = run_without(QUANTKIT, code, str(converted("longrope")), env={"HF_MODULES_CACHE": str(tmp_path)})
    # transformers asks "Do you wish to run the custom code? [y/N]" (15 s); no answer is a refusal
    assert run.returncode == 0 and run.stdout.endswith("[y/N] refused\n"), run.stderr[-3000:]


@pytest.fixture(scope="module")
def w4(tiny_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("w4") / "tiny-w4"
    quantize(tiny_checkpoint, small_recipe("rtn-w4g128", out.parent), out, progress=False)
    return out


def test_a_quantized_artifact_carries_the_code_and_its_float_model_is_quantkits(w4, tmp_path):
    """Stock transformers needs GPTQModel for the quantized linears; everything else is the bundled model:
    the artifact's config through AutoConfig, the model built from it and given quantkit's dequantized
    weights, gives quantkit's logits."""
    config = json.loads((w4 / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and config["quantization_config"]["quant_method"] == "gptq"
    assert json.loads((w4 / "quantkit.json").read_text())["remote_code"] == {
        "origin": "quantkit", "written": sorted(bundle()), "copied": []}
    model = load_model(w4)
    weights = tmp_path / "dequantized.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
               or not model.config.tie_word_embeddings}, weights)
    code = f"""
import sys, torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)
del config.quantization_config
model = AutoModelForCausalLM.from_config(config, trust_remote_code=True).eval()
model.load_state_dict(load_file("{weights}"), strict=False)
with torch.no_grad():
    torch.save(model(torch.tensor([{TOKEN_IDS}])).logits, sys.argv[2])
assert not [m for m in sys.modules if m.split(".")[0] == "quantkit"]
"""
    with torch.no_grad():
        ours = model(torch.tensor([TOKEN_IDS])).logits
    assert torch.equal(_stock_logits(w4, tmp_path, code), ours)


def test_vllm_reads_its_config_keys_through_the_bundled_configuration(converted, tmp_path):
    """vLLM (not installed here) loads the config with AutoConfig.from_pretrained(trust_remote_code=True)
    and picks its own MiniCPM model by ``architectures``; the keys that model reads (docs/model.md) come
    back as config.json holds them."""
    checkpoint = converted("longrope")
    keys = ["hidden_size", "num_attention_heads", "num_key_value_heads", "rope_theta", "rope_scaling",
            "max_position_embeddings", "intermediate_size", "hidden_act", "rms_norm_eps", "scale_depth",
            "num_hidden_layers", "vocab_size", "scale_emb", "dim_model_base", "tie_word_embeddings",
            "architectures"]
    code = f"""
import json, sys
from transformers import AutoConfig
config = AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)
json.dump({{key: getattr(config, key) for key in {keys}}}, open(sys.argv[2], "w"))
"""
    out = tmp_path / "keys.json"
    run = run_without(QUANTKIT, code, str(checkpoint), str(out), env={"HF_MODULES_CACHE": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-3000:]
    stored = json.loads((checkpoint / "config.json").read_text())
    assert json.loads(out.read_text()) == {key: stored[key] for key in keys}
    assert stored["architectures"] == ["MiniCPMForCausalLM"] and stored["rope_scaling"]["rope_type"] == "longrope"


def _with_code(tiny_checkpoint: Path, folder: Path, files: dict[str, str]) -> Path:
    shutil.copytree(tiny_checkpoint, folder)
    for name, text in files.items():
        (folder / name).write_text(text)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": AUTO_MAP}))
    return folder


def test_a_sources_own_remote_code_is_kept_and_said_so(tiny_checkpoint, tmp_path, caplog):
    official = {"configuration_minicpm.py": "# OpenBMB's configuration\n", "modeling_minicpm.py": "# OpenBMB's model\n"}
    source = _with_code(tiny_checkpoint, tmp_path / "official", official)
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger=remote_code.__name__):
        quantize(source, small_recipe("rtn-w4g128", tmp_path), out, progress=False)
    assert {name: (out / name).read_text() for name in official} == official
    assert json.loads((out / "config.json").read_text())["auto_map"] == AUTO_MAP
    assert json.loads((out / "quantkit.json").read_text())["remote_code"] == {
        "origin": "source checkpoint", "written": [], "copied": sorted(official)}
    assert [r.getMessage() for r in caplog.records] == [
        "copying the source checkpoint's own Python files configuration_minicpm.py, modeling_minicpm.py unchanged "
        "(its config.json's auto_map names it): transformers runs such code with trust_remote_code=True; "
        "quantkit never runs it"]


def test_an_earlier_quantkits_files_are_regenerated(tiny_checkpoint, tmp_path):
    stale = {name: f"{MARKER}\n# an older quantkit's code\n" for name in bundle()}
    source = _with_code(tiny_checkpoint, tmp_path / "stale", stale)
    assert remote_code.remote_code_for(source, json.loads((source / "config.json").read_text())).files == bundle()


def test_the_cards_transformers_snippet_runs_as_written_without_quantkit(converted, tmp_path):
    """The card of an unquantized checkpoint (a converted GGUF file) shows transformers and vLLM; its
    transformers block, the repository id pointed at the local copy, runs in a Python without quantkit
    and gives quantkit's logits."""
    from quantkit.hub.publish import check, render_card
    from quantkit.hub.repo import RepoRef

    checkpoint, ref = converted("longrope"), RepoRef("someone/tiny-minicpm")
    card = render_card(check(checkpoint, ref), ref, "openbmb/MiniCPM4.1-8B")
    usage = card.split("## Use it")[1]
    assert [line for line in usage.splitlines() if line.startswith("### ")] == [
        "### transformers", "### vLLM", "### quantkit's runtime"]
    assert "vllm serve someone/tiny-minicpm --trust-remote-code" in usage and "GPTQModel" not in usage
    snippet = usage.split("```python\n")[1].split("\n```")[0]
    assert "import quantkit" not in snippet and snippet.count("trust_remote_code=True") == 2
    code = (snippet.replace('"someone/tiny-minicpm"', "sys.argv[1]") + "\nimport sys, torch\n"
            f"ids = tokenizer('{'hello world ' * 20}', return_tensors='pt').input_ids\n"
            "torch.save({'ids': ids, 'logits': model(ids).logits.detach()}, sys.argv[2])\n"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'quantkit']\n")
    saved = _stock_logits(checkpoint, tmp_path, "import sys\n" + code)
    with torch.no_grad():
        assert torch.equal(saved["logits"], load_model(checkpoint).eval()(saved["ids"]).logits)
