"""Dependencies point one way: the CLI drives the library; what reads artifacts (runtime, GGUF
exporter, evaluation) never imports the quantization engine or the CLI; the model code never imports
the runtime. Checked on every import statement, including the ones inside functions."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the package its files import as (pyproject.toml maps kernels/ and eval/ into quantkit)
PACKAGES = {"quantkit": "quantkit", "kernels": "quantkit.kernels", "eval": "quantkit.eval"}


def package_of(path: Path) -> str:
    top = path.relative_to(ROOT).parts[0]
    return ".".join([PACKAGES[top], *path.relative_to(ROOT / top).parent.parts])


def imports_of(path: Path, package: str) -> set[str]:
    """Every module ``path`` (in ``package``) imports, absolute; ``from a import b`` counts as ``a`` and ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def offenders(paths: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for path in paths:
        hits = sorted(m for m in imports_of(path, package_of(path))
                      if any(m == f or m.startswith(f + ".") for f in forbidden))
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    return bad


READERS = ["kernels", "eval", "quantkit/gguf"]


@pytest.mark.parametrize("folders, forbidden", [
    (READERS + ["quantkit/reader.py", "quantkit/loading.py", "quantkit/formats", "quantkit/mlx_export.py"],
     ("quantkit.engine", "quantkit.cli")),
    # the Hub, both ways, works on finished artifacts: never the engine or the CLI
    (["quantkit/hub"], ("quantkit.engine", "quantkit.cli", "quantkit.kernels", "quantkit.eval")),
    (["quantkit/models"], ("quantkit.kernels", "quantkit.engine", "quantkit.cli", "quantkit.eval")),
    (["quantkit/formats", "quantkit/algorithms", "quantkit/quant.py"], ("quantkit.engine", "quantkit.cli",
                                                                       "quantkit.kernels", "quantkit.eval")),
])
def test_no_import_against_the_grain(folders, forbidden):
    paths = [ROOT / f for f in folders if f.endswith(".py")] + files(*[f for f in folders if not f.endswith(".py")])
    assert paths
    assert offenders(paths, forbidden) == {}


def test_the_check_sees_lazy_and_relative_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from quantkit.engine import quantize\n    from . import ppl\n")
    found = imports_of(probe, "quantkit.eval")
    assert {"quantkit.engine", "quantkit.engine.quantize", "quantkit.eval.ppl"} <= found
