"""quantkit.kernels and quantkit.eval import from the editable install and from a built wheel,
and neither install creates top-level `kernels` or `eval` modules (a top-level `kernels` may exist:
Hugging Face's package of that name, which transformers requires, but it must not be quantkit's folder)."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = ("import quantkit.kernels, quantkit.eval, quantkit.recipes, quantkit.calib_data, importlib.util;"
         "print(quantkit.kernels.__file__); print(quantkit.eval.__file__);"
         "print(*((importlib.util.find_spec(top) or importlib.util.spec_from_loader(top, None)).origin or '-'"
         " for top in ('kernels', 'eval')))")


def _probe(env=None, roots: tuple[Path, ...] = (REPO,)) -> tuple[str, str, str]:
    """quantkit.kernels' and quantkit.eval's files, and "True" if no top-level `kernels` or `eval` is a
    folder directly under one of ``roots`` (quantkit's own, installed or in the checkout)."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd="/",
                         check=True)
    kernels_file, eval_file, *top_level = out.stdout.split()
    ours = [origin for origin in top_level if origin != "-" and Path(origin).parent.parent in roots]
    return kernels_file, eval_file, str(not ours)


def test_editable_install_maps_folders():
    kernels_file, eval_file, no_top_level = _probe()
    assert Path(kernels_file) == REPO / "kernels" / "__init__.py"
    assert Path(eval_file) == REPO / "eval" / "__init__.py"
    assert no_top_level == "True"


@pytest.mark.slow
def test_built_wheel_contains_and_imports_subpackages(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
                   check=True, capture_output=True)
    wheel = next(tmp_path.glob("quantkit-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "quantkit/kernels/__init__.py" in names and "quantkit/eval/ppl.py" in names
    assert "quantkit/recipes/rtn-w4g128.yaml" in names
    assert not any(n.startswith(("kernels/", "eval/")) for n in names)
    assert "quantkit/eval/tasks/sandbox_child.py" in names  # run from its source text, never imported
    assert "quantkit/cli/__main__.py" in names  # python -m quantkit.cli
    for top, package in (("quantkit", "quantkit"), ("eval", "quantkit/eval"), ("kernels", "quantkit/kernels")):
        for init in (REPO / top).rglob("__init__.py"):  # every subpackage, listed or not in pyproject
            assert f"{package}/{init.relative_to(REPO / top).as_posix()}" in names, init
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    kernels_file, eval_file, no_top_level = _probe({**os.environ, "PYTHONPATH": str(target)}, (target, REPO))
    assert Path(kernels_file) == target / "quantkit" / "kernels" / "__init__.py"
    assert Path(eval_file) == target / "quantkit" / "eval" / "__init__.py"
    assert no_top_level == "True"
