"""Shared pytest fixtures: tiny random MiniCPM checkpoint folders.

The folders are session-scoped and shared between tests: treat them as read-only (write outputs
to ``tmp_path``).
"""
from __future__ import annotations

import os

# No GPU exists where quantkit is tested: Triton kernels run in Triton's interpreter on CPU tensors.
# It must be chosen before triton is first imported; set TRITON_INTERPRET=0 to test on a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import pytest  # noqa: E402

import quantkit  # noqa: F401  (registers MiniCPM with the transformers Auto classes)
from quantkit.synthetic import write_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory) -> Callable[..., Path]:
    """``make(**kwargs)`` -> a folder from ``write_tiny_checkpoint(**kwargs)``, written once per kwargs."""
    written: dict[str, Path] = {}

    def make(**kwargs) -> Path:
        key = repr(sorted(kwargs.items()))
        if key not in written:
            written[key] = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_minicpm"), **kwargs)
        return written[key]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoint_factory) -> Path:
    """Default tiny checkpoint: 2 layers, hidden 256, GQA 16:1, untied, LongRoPE, float32."""
    return tiny_checkpoint_factory()


@pytest.fixture(scope="session")
def tiny_tied_checkpoint(tiny_checkpoint_factory) -> Path:
    """As ``tiny_checkpoint`` but with lm_head tied to the embeddings (no lm_head.weight stored)."""
    return tiny_checkpoint_factory(tied=True)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct as MiniCPM), from the user's quantkit cache:
    fetched and converted on first use, then shared with `make demo`."""
    from quantkit import zoo

    return zoo.ensure_model(progress=False)


@pytest.fixture(scope="session")
def marlin_legal(tiny_checkpoint_factory) -> Path:
    """K and N multiples of 128/64 everywhere (4 KV heads of 16 -> N = 64): every format can pack it."""
    return tiny_checkpoint_factory(num_hidden_layers=2, num_key_value_heads=4, seed=5)


@pytest.fixture(scope="module")
def private_cache(tmp_path_factory):
    """What a test's runs cache (a teacher's logits, a target's features) goes to a test folder, not the
    user's ~/.cache/quantkit (module scope: a module's shared runs need it too)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTKIT_CACHE", str(tmp_path_factory.mktemp("quantkit-cache")))
        yield


@pytest.fixture(scope="session")
def training_text(tmp_path_factory) -> Path:
    """A slice of the bundled English calibration text: enough rows for training tests, quick to tokenize."""
    from quantkit.calib import load_documents

    path = tmp_path_factory.mktemp("training-text") / "train.txt"
    path.write_text("\n\n".join(load_documents("en"))[:60_000])
    return path


# The fixtures of the suites that record reliability rows (tests/reliability.py; `make test-reliability`):
# each module gets its own tally (flushed when the module ends), fork-server launcher and tiny model.

@pytest.fixture(scope="module")
def tally():
    from reliability import Tally

    t = Tally()
    yield t
    t.flush()


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    from reliability import Launcher

    runs = Launcher(tmp_path_factory.mktemp("runs"))
    yield runs
    runs.close()


@pytest.fixture(scope="module")
def model(tiny_checkpoint_factory) -> Path:
    return tiny_checkpoint_factory()
