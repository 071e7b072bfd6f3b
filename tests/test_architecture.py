"""quantkit's layers, enforced on every import statement (those inside functions included) and through
every chain of them: a module may reach, directly or through others, only the layers its own may use.

The table is the architecture (docs/architecture.md draws it): leaves → io → models → codecs (algorithms,
formats, GGUF's types) → the reader → runtime, scoring, exporters, Hub → shared pipeline parts → the
pipelines → entry points (CLI, the public API, benchmark and peer drivers). The runtime and scoring see
only the reader and what is below it; only the entry points import a pipeline."""
import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the package its files import as (pyproject.toml maps kernels/ and eval/ into quantkit)
PACKAGES = {"quantkit": "quantkit", "kernels": "quantkit.kernels", "eval": "quantkit.eval",
            "recipes": "quantkit.recipes", "calib_data": "quantkit.calib_data"}

# layer -> the modules in it, as prefixes (the longest prefix that matches a module decides its layer)
LAYERS = {
    "leaves": ("quantkit.version", "quantkit.errors", "quantkit.quant", "quantkit.stats", "quantkit.device",
               "quantkit.memory", "quantkit.atomic", "quantkit.lock", "quantkit.table", "quantkit.cpu_ops",
               "quantkit.rdata", "quantkit.recipes", "quantkit.calib_data", "quantkit.activation_quant",
               "quantkit.fp8", "quantkit.distributed"),
    "io": ("quantkit.json_files", "quantkit.checkpoint", "quantkit.file_hashes", "quantkit.artifact",
           "quantkit.inspect", "quantkit.cache", "quantkit.corpora", "quantkit.calib", "quantkit.chat_template",
           "quantkit.tokenizer"),
    "models": ("quantkit.models",),
    "gguf types": ("quantkit.gguf",),
    "algorithms": ("quantkit.algorithms",),
    "formats": ("quantkit.formats",),
    "reader": ("quantkit.reader", "quantkit.loading"),
    "synthetic checkpoints": ("quantkit.synthetic",),
    "runtime": ("quantkit.kernels",),
    "scoring": ("quantkit.eval",),
    "exporters": ("quantkit.gguf.export", "quantkit.gguf.eagle3_head", "quantkit.gguf.importer", "quantkit.mlx_export"),
    "hub": ("quantkit.hub", "quantkit.zoo"),
    "pipeline parts": ("quantkit.run", "quantkit.recipe", "quantkit.training", "quantkit.activations"),
    "post-training quantization": ("quantkit.engine",),
    "importance matrix": ("quantkit.imatrix",),
    "size budget": ("quantkit.budget",),
    "qat": ("quantkit.qat",),
    "draft heads": ("quantkit.draft",),
    "entry points": ("quantkit", "quantkit.cli", "quantkit.eval.bench", "quantkit.eval.interop",
                     "quantkit.calib_data.build"),
}
PIPELINES = ("post-training quantization", "importance matrix", "size budget", "qat", "draft heads")
_CODECS = {"leaves", "io", "models", "gguf types"}
_READER = _CODECS | {"formats", "reader"}
# layer -> the layers it may import besides its own (algorithms and formats never import each other: a
# format turns records into bytes whatever chose the codes; pipelines never import each other)
MAY_IMPORT = {
    "leaves": set(),
    "io": {"leaves"},
    "models": {"leaves", "io"},
    "gguf types": {"leaves", "io", "models"},
    "algorithms": _CODECS,
    "formats": _CODECS,
    "reader": _READER,
    "synthetic checkpoints": {"leaves", "io", "models"},
    "runtime": _READER,
    "scoring": _READER | {"runtime"},
    "exporters": _READER,
    "hub": _READER | {"exporters"},
    "pipeline parts": _READER | {"algorithms"},
    **{pipeline: _READER | {"algorithms", "pipeline parts"} for pipeline in PIPELINES},
    "entry points": set(LAYERS),
}
def module_name(path: Path) -> str:
    top, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [PACKAGES[top], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for top in PACKAGES for p in (ROOT / top).rglob("*.py")}


def imports_of(path: Path, name: str, known) -> set[str]:
    """The project's modules ``path`` (module ``name``) imports. ``from a import b`` is ``a.b`` when that is a
    module and ``a`` otherwise; importing ``a.b`` does not count as importing package ``a``'s ``__init__``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def layer_of(module: str) -> str:
    matches = [(len(prefix), layer) for layer, prefixes in LAYERS.items() for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer: add it to LAYERS"
    return max(matches)[1]


@cache
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, name, known) for name, path in known.items()}


def allowed(source: str, target: str) -> bool:
    a, b = layer_of(source), layer_of(target)
    return a == b or b in MAY_IMPORT[a]


def violations(edges: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """Every (module, module it reaches) the layers forbid, with the chain of imports that reaches it."""
    found = {}
    for start in edges:
        chains, seen = [[start]], {start}
        while chains:
            chain = chains.pop()
            for nxt in sorted(edges.get(chain[-1], ())):
                if nxt in seen:
                    continue
                seen.add(nxt)
                if not allowed(start, nxt):
                    found[(start, nxt)] = [*chain, nxt]
                chains.append([*chain, nxt])
    return found


def direct(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in edges.items() for b in targets if not allowed(a, b)}


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name)


def test_may_import_is_closed_under_chains():
    """A layer that may use another may use all that one uses: otherwise the table contradicts itself."""
    for layer, uses in MAY_IMPORT.items():
        for used in uses:
            assert MAY_IMPORT[used] <= uses | {layer}, (layer, used, MAY_IMPORT[used] - uses)


def test_imports_follow_the_layers():
    edges = graph()
    assert direct(edges) == set(), "imports against the layers: " + ", ".join(
        f"{a} ({layer_of(a)}) -> {b} ({layer_of(b)})" for a, b in sorted(direct(edges)))
    reached = violations(edges)
    assert reached == {}, "reached through other modules: " + "; ".join(" -> ".join(c) for c in reached.values())


@pytest.mark.parametrize("source, target", [
    ("quantkit.models.zoo", "quantkit.hub.pull"),
    ("quantkit.models.gguf_convert", "quantkit.gguf.export"),
    ("quantkit.models.eagle3", "quantkit.formats"),
    ("quantkit.formats.mlx", "quantkit.algorithms.rtn"),
    ("quantkit.stats", "quantkit.kernels.linear"),
    ("quantkit.gguf.imatrix", "quantkit.loading"),
    ("quantkit.recipe", "quantkit.qat.fake_quant"),
    ("quantkit.qat.trainer", "quantkit.engine"),
    ("quantkit.qat.trainer", "quantkit.eval.ppl"),
    ("quantkit.draft.trainer", "quantkit.engine"),
    ("quantkit.engine", "quantkit"),
    ("quantkit.engine", "quantkit.kernels.generate"),
    ("quantkit.kernels.generate", "quantkit.engine"),
    ("quantkit.eval.report", "quantkit.qat.trainer"),
    ("quantkit.hub.card", "quantkit.eval.report"),
])
def test_the_knots_of_issue_68_are_refused(source, target):
    """Each edge that tied the packages into knots is refused by the table, directly and through a module
    in between."""
    assert not allowed(source, target)
    middle = "quantkit.atomic"  # a leaf: anything may import it
    assert (source, target) in violations({source: {middle}, middle: {target}})


def test_the_check_sees_lazy_relative_and_from_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from quantkit.engine import quantize\n    from . import ppl\n"
                     "from quantkit import atomic\n")
    found = imports_of(probe, "quantkit.eval.probe", modules())
    assert found == {"quantkit.engine", "quantkit.eval.ppl", "quantkit.atomic"}


def test_the_checkouts_kernels_folder_does_not_hide_the_installed_kernels_package():
    """Run from the checkout's root (as ``python -m pytest`` and the benchmarks are), the folder kernels/ is
    on sys.path as a top-level package; transformers' model code imports Hugging Face's ``kernels`` package
    whenever it is installed, and must get that one, not quantkit's runtime."""
    import subprocess
    import sys

    probe = ("import quantkit, sys\nimport transformers.modeling_utils\nimport quantkit.kernels.generate\n"
             "module = sys.modules.get('kernels')\n"
             "assert module is None or not module.__file__.startswith(sys.argv[1]), module.__file__\n")
    result = subprocess.run([sys.executable, "-c", probe, str(ROOT / "kernels")], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
