"""GGUF block quantizers (F32/F16/BF16, Q8_0/Q4_0/Q4_1, Q6_K): bytes identical to llama.cpp's own
quantizer on the same float32 input, dequantizers equal to gguf-py's, partial blocks refused."""
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from quantkit.gguf.types import TYPES

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


@pytest.mark.parametrize("name", list(TYPES))
def test_bytes_identical_to_llama_cpp(name):
    tensor_type = TYPES[name]
    x = _weights()
    ours = tensor_type.quantize(x)
    assert ours.dtype == np.uint8 and ours.shape == (64, tensor_type.row_bytes(512))
    np.testing.assert_array_equal(ours, ggml_quantize(x, tensor_type.ggml))


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantize_matches_gguf_py(name):
    tensor_type = TYPES[name]
    data = tensor_type.quantize(_weights(seed=1))
    ours = tensor_type.dequantize(data, 512)
    np.testing.assert_array_equal(ours, gguf_dequantize(data, tensor_type.ggml).astype(np.float32))


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1"])
def test_rows_must_be_whole_blocks(name):
    with pytest.raises(ValueError, match="whole blocks of 32"):
        TYPES[name].quantize(np.zeros((2, 48), dtype=np.float32))
    assert not TYPES[name].fits(48) and TYPES[name].fits(576)
