"""Q2_K and Q3_K beyond what the per-type tests (test_gguf_types, test_gguf_imatrix, test_gguf_gptq)
check for every type: the solver on the grids' awkward sub-blocks (Q3_K's negative scales, scales
stored as 0 over non-zero weights), a super-block no input reaches, and inputs of any rank."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gguf_imatrix import _importance, _rows

from quantkit.algorithms.gptq import gptq_solve
from quantkit.gguf.record import GGUFTensor
from quantkit.gguf.types import TYPES

from llama_cpp_oracle import ggml_quantize

LOW = ["q2_k", "q3_k"]


def _weights() -> np.ndarray:
    """Gaussian rows with two sub-blocks a thousand times quieter than the rest (their 4- or 6-bit
    scale level rounds to zero: a stored scale of 0 over non-zero weights) and, every third row, a
    one-signed sub-block four times louder (Q3_K's scales then take both signs within a block)."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((32, 512)) * 0.02
    w[:, 16:32] *= 1e-3
    w[:, 300:316] *= 1e-3
    w[::3, 64:80] = -np.abs(w[::3, 64:80]) * 4
    return w.astype(np.float32)


@pytest.mark.parametrize("imatrix", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("name", LOW)
def test_without_correlations_gptq_gives_llama_cpp_values_on_every_sub_block(name, imatrix):
    """A diagonal Hessian leaves nothing to compensate: the solver's values are llama.cpp's exactly,
    on negative scales (Q3_K) and on scales stored as 0 too, and so are the bytes, except the codes of
    a zero-scale sub-block (ggml leaves its search's codes there, the solver writes 0: both mean the
    sub-block's offset)."""
    tensor_type, codec = TYPES[name], TYPES[name].codec
    weight = torch.from_numpy(_weights())
    diag = torch.rand(512, generator=torch.Generator().manual_seed(0)) + 0.5
    ours = gptq_solve(weight, torch.diag(diag), tensor_type, block_size=256, imatrix=imatrix).quantized
    importance = diag.numpy() if imatrix else None  # what the solver weighs llama.cpp's search by
    theirs = GGUFTensor(name, torch.from_numpy(tensor_type.quantize_with(weight.numpy(), importance)), (32, 512))
    assert torch.equal(ours.dequantize(), theirs.dequantize())

    our_blocks, their_blocks = (r.data.numpy().reshape(-1, tensor_type.block_bytes) for r in (ours, theirs))
    scale, _ = codec.grid(their_blocks)
    zero = scale == 0
    assert zero.any() and (scale > 0).any()
    assert (scale < 0).any() == (name == "q3_k")  # Q2_K: unsigned 4-bit levels of a d ≥ 0
    our_codes, their_codes = (codec.codes(b).reshape(len(b), -1, codec.sub_block) for b in (our_blocks, their_blocks))
    assert np.array_equal(our_codes[zero], np.zeros_like(our_codes[zero]))
    assert np.array_equal(our_codes[~zero], their_codes[~zero])
    assert np.array_equal(codec.with_codes(their_blocks, our_codes.reshape(len(our_blocks), -1)), our_blocks)


@pytest.mark.parametrize("name", LOW)
def test_a_super_block_no_input_reaches_quantizes_as_ggml(name):
    """Importance 0 over a whole super-block: every weight in the scale searches is 0 (ggml's
    searches then fall back on their first guesses); the bytes are still ggml's."""
    tensor_type = TYPES[name]
    x, imp = _rows(1), _importance(1)
    imp[256:] = 0
    np.testing.assert_array_equal(tensor_type.quantize_with(x, imp), ggml_quantize(x, tensor_type.ggml, imp))


@pytest.mark.parametrize("name", LOW)
def test_any_leading_shape_quantizes_row_by_row(name):
    tensor_type = TYPES[name]
    x, imp = _rows(2), _importance(2)
    for importance in (None, imp):
        rows = tensor_type.quantize_with(x, importance)
        assert np.array_equal(tensor_type.quantize_with(x[5], importance), rows[5])
        assert np.array_equal(tensor_type.quantize_with(x.reshape(4, 6, 512), importance), rows.reshape(4, 6, -1))
        assert np.array_equal(tensor_type.dequantize(rows.reshape(4, 6, -1), 512), tensor_type.dequantize(rows, 512)
                              .reshape(4, 6, 512))
