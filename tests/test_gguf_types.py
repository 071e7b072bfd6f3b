"""GGUF block quantizers (F32/F16/BF16, Q8_0/Q4_0/Q4_1, Q6_K): bytes identical to llama.cpp's own
quantizer on the same float32 input, dequantizers equal to gguf-py's, partial blocks refused; the
fast path (ggml's quantizer through quantkit.gguf.native) writes the NumPy codecs' bytes, and the
codecs run where the library is absent. Types llama.cpp quantizes only with an importance matrix
(IQ2_XXS, IQ2_XS, IQ1_S) are tested with one, and refused without one before ggml is reached."""
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from test_gguf_imatrix import _importance

from quantkit.gguf import native
from quantkit.gguf.types import TYPES, TensorType

from llama_cpp_oracle import ggml_quantize


def _weights(rows=64, k=512, seed=0) -> np.ndarray:
    """Gaussian rows with the awkward cases: an all-zero block, ties for the largest magnitude,
    a constant block, huge and tiny scales, and values that land exactly on .5 after scaling."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32) * np.logspace(-6, 3, rows, dtype=np.float32)[:, None]
    x[0, :32] = 0
    x[1, :32] = np.tile([1.0, -1.0], 16)
    x[2, :32] = 0.25
    x[3, :32] = np.arange(32, dtype=np.float32) - 16  # Q4_0: d = 2, so x/d hits .5 exactly
    x[4, :32] = np.concatenate([[127], np.arange(31) - 14.5])  # Q8_0: d = 1, so x/d hits .5 exactly
    x[5, :256] = 0  # a whole K-quant super-block of zeros
    x[6, 16:32] = 0  # one K-quant sub-block of zeros
    return x


def _required_importance(tensor_type: TensorType, seed: int = 0) -> np.ndarray | None:
    """An importance vector where llama.cpp quantizes the type only with one (IQ2_XXS, IQ2_XS, IQ1_S),
    else None: the plain path."""
    return _importance(seed) if tensor_type.requires_importance else None


@pytest.mark.parametrize("name", list(TYPES))
def test_bytes_identical_to_llama_cpp(name):
    tensor_type = TYPES[name]
    x, imp = _weights(), _required_importance(tensor_type)
    ours = tensor_type.quantize_with(x, imp)
    assert ours.dtype == np.uint8 and ours.shape == (64, tensor_type.row_bytes(512))
    np.testing.assert_array_equal(ours, ggml_quantize(x, tensor_type.ggml, imp))


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantize_matches_gguf_py(name):
    tensor_type = TYPES[name]
    data = tensor_type.quantize_with(_weights(seed=1), _required_importance(tensor_type, 1))
    ours = tensor_type.dequantize(data, 512)
    np.testing.assert_array_equal(ours, gguf_dequantize(data, tensor_type.ggml).astype(np.float32))


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1", "iq4_nl"])
def test_rows_must_be_whole_blocks(name):
    with pytest.raises(ValueError, match="whole blocks of 32"):
        TYPES[name].quantize(np.zeros((2, 48), dtype=np.float32))
    assert not TYPES[name].fits(48) and TYPES[name].fits(576)


FAST = [name for name, t in TYPES.items() if t.ggml_quantizes]


def _awkward_rows(seed=0) -> np.ndarray:
    """``_weights`` plus single outliers and rows of values near float32's smallest normals; an odd
    row count, so that the rows split unevenly across threads."""
    x = _weights(rows=67, seed=seed)
    x[7, 100] = 3e4
    x[8, 300] = -2e4
    x[9] = np.random.default_rng(seed).standard_normal(512).astype(np.float32) * 1e-30
    return x


def _forbid_numpy(monkeypatch) -> None:
    """Any NumPy codec call fails from here on, so what passes ran in ggml; rows split three ways."""
    def refuse(*args, **kwargs):
        raise AssertionError("the NumPy codec ran")
    monkeypatch.setattr(TensorType, "quantize_with", refuse)
    monkeypatch.setattr(native, "MIN_WEIGHTS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)


@pytest.mark.parametrize(("name", "weighted"), [
    pytest.param(name, weighted, id=f"{name}-{'imatrix' if weighted else 'plain'}")
    for name in FAST for weighted in (False, True) if weighted or not TYPES[name].requires_importance])
def test_fast_path_writes_the_numpy_codecs_bytes(name, weighted, monkeypatch):
    tensor_type = TYPES[name]
    x, imp = _awkward_rows(), _importance(0) if weighted else None
    expected = tensor_type.quantize_with(x, imp)
    _forbid_numpy(monkeypatch)
    assert native.load_libggml() is not None
    np.testing.assert_array_equal(tensor_type.quantize_fast(x, imp), expected)
    np.testing.assert_array_equal(tensor_type.quantize_fast(x[3], imp), expected[3])  # one row, [K]


@pytest.mark.parametrize("name", [name for name, t in TYPES.items() if t.requires_importance])
def test_types_llama_cpp_quantizes_only_with_an_imatrix_are_refused_without_one(name, monkeypatch):
    """ggml_quantize_chunk asserts (aborting the process) on these without an imatrix: every path
    refuses first, naming the way to an importance matrix, and ggml is never called."""
    def refuse(*args, **kwargs):
        raise AssertionError("ggml ran")
    tensor_type = TYPES[name]
    assert tensor_type.quantized_by_ggml  # so quantize_fast would have reached ggml
    monkeypatch.setattr(native, "quantize", refuse)
    x = _weights(rows=8)
    for quantize in (tensor_type.quantize_fast, tensor_type.quantize_with, tensor_type.quantize):
        with pytest.raises(ValueError, match=f"{name} needs an importance matrix.*`quantkit imatrix`"):
            quantize(x)


def test_fast_path_refuses_what_ggml_would_abort_on():
    with pytest.raises(ValueError, match="whole blocks of 256"):
        TYPES["q4_k"].quantize_fast(np.zeros((2, 288), dtype=np.float32))
    with pytest.raises(ValueError, match="importance has shape"):
        TYPES["q4_0"].quantize_fast(np.zeros((2, 64), dtype=np.float32), np.ones(63, dtype=np.float32))


@pytest.mark.parametrize("name", ["q4_k", "q4_0", "bf16"])
def test_without_the_library_the_numpy_codecs_run(name, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("ggml ran")
    monkeypatch.setattr(native, "load_libggml", lambda: None)
    monkeypatch.setattr(native, "quantize", refuse)
    x, imp = _awkward_rows(1), _importance(1)
    np.testing.assert_array_equal(TYPES[name].quantize_fast(x, imp), TYPES[name].quantize_with(x, imp))
    np.testing.assert_array_equal(TYPES[name].quantize_fast(x), TYPES[name].quantize(x))
