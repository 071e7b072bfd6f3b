"""Importance-weighted GGUF quantization: ggml's imatrix scale search byte for byte, GPTQ on the
weighted block grid, and the imatrix file that `llama-quantize --imatrix` reads."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.algorithms.gptq import gptq_quantize, gptq_solve
from quantkit.gguf.imatrix_file import COUNTS, SUMS, read_imatrix, write_imatrix
from quantkit.gguf.legacy import row_sigma2
from quantkit.gguf.types import TYPES
from quantkit.imatrix import collect

from llama_cpp_oracle import ggml_quantize

BLOCK_TYPES = [name for name, t in TYPES.items() if t.block_size > 1]
WEIGHTED = [name for name, t in TYPES.items() if t.quantize_weighted is not None]
SOLVABLE = [name for name, t in TYPES.items() if t.codec is not None]
K = 512


def _rows(seed: int) -> np.ndarray:
    """Rows of different scales, with what breaks scale searches: an all-zero row, a zero block, a
    constant row, single outliers, exact halves and values near ggml's GROUP_MAX_EPS."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((24, K)) * rng.uniform(0.001, 2, (24, 1))
    x[0] = 0
    x[1, :256] = 0
    x[2] = 0.25
    x[3, 7] = 60
    x[4, 300] = -45
    x[5] = np.round(x[5] * 4) / 8
    x[6] = rng.standard_normal(K) * 1e-16
    x[7] = np.abs(x[7])  # no negative weights: the minimum clamps at 0
    return x.astype(np.float32)


def _importance(seed: int) -> np.ndarray:
    """Positive, spread over orders of magnitude like real mean x², with zero channels (never active)."""
    rng = np.random.default_rng(100 + seed)
    imp = np.exp(rng.normal(0, 2, K))
    imp[rng.choice(K, 40, replace=False)] = 0
    imp[32:64] = 0  # one whole legacy block that no input reaches
    imp[5] = 1e4
    return imp.astype(np.float32)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_importance_weighted_bytes_equal_ggml(name, seed):
    tensor_type = TYPES[name]
    x, imp = _rows(seed), _importance(seed)
    theirs = ggml_quantize(x, tensor_type.ggml, imp)
    ours = tensor_type.quantize_with(x, imp)
    assert ours.shape == theirs.shape
    differing = np.flatnonzero((ours != theirs).any(axis=1))
    assert differing.size == 0, f"{name}: rows {differing.tolist()} differ from ggml"
    # the weighted path is really taken where ggml has one, and ignored where ggml ignores it (a type
    # that needs the importance has no plain path to compare: ggml would abort)
    if tensor_type.requires_importance:
        assert name in WEIGHTED
        return
    plain = ggml_quantize(x, tensor_type.ggml)
    assert (name in WEIGHTED) == (not np.array_equal(theirs, plain)), name


@pytest.mark.parametrize("name", WEIGHTED)
def test_blocks_quantized_apart_with_the_row_sigma_give_the_rows_bytes(name):
    """The solver quantizes one block at a time: given the whole row's σ², the bytes are the whole row's."""
    tensor_type = TYPES[name]
    x, imp, width = _rows(7), _importance(7), tensor_type.block_size
    parts = [tensor_type.quantize_with(x[:, s:s + width], imp[s:s + width], row_sigma2(x)) for s in range(0, K, width)]
    assert np.array_equal(tensor_type.quantize_with(x, imp), np.concatenate(parts, axis=1))


def test_without_importance_the_plain_quantizer_runs():
    x = _rows(0)
    for name in BLOCK_TYPES:
        if TYPES[name].requires_importance:  # no plain quantizer: refused (tests/test_gguf_types.py)
            continue
        assert np.array_equal(TYPES[name].quantize_with(x), TYPES[name].quantize(x)), name
    with pytest.raises(ValueError, match="importance has shape"):
        TYPES["q4_k"].quantize_with(x, np.ones(K - 1, dtype=np.float32))


def _activations(tokens: int, k: int, seed: int) -> torch.Tensor:
    """Correlated inputs whose channels' loudness spreads over orders of magnitude (log-normal), as
    transformer activations' do, with a few massive outlier channels."""
    g = torch.Generator().manual_seed(seed)
    loudness = torch.exp(torch.randn(k, generator=g))
    loudness[torch.randperm(k, generator=g)[:3]] *= 20
    mix = torch.eye(k) + 0.3 * torch.randn(k, k, generator=g) / k**0.5
    return (torch.randn(tokens, k, generator=g) @ mix) * loudness


@pytest.mark.parametrize("name", SOLVABLE)
def test_gptq_on_the_weighted_grid_has_lower_output_error(name):
    """Σ over the calibration inputs of ‖(W − Ŵ)x‖²: llama.cpp's imatrix scale search with diag(H)
    beats its plain one under GPTQ (Q8_0 has no imatrix path: the same bytes)."""
    torch.manual_seed(0)
    x = _activations(2048, K, seed=1)
    hessian = 2 * x.T @ x / x.shape[0]
    weight = torch.randn(32, K) * 0.02
    weight[:, ::37] *= 5

    def output_error(record) -> float:
        return float(((x @ (record.dequantize() - weight).T) ** 2).sum())

    plain = gptq_solve(weight, hessian, TYPES[name], block_size=256, damp_percent=0.01, imatrix=False).quantized
    weighted = gptq_solve(weight, hessian, TYPES[name], block_size=256, damp_percent=0.01).quantized
    if name not in WEIGHTED:
        assert torch.equal(plain.data, weighted.data)
        return
    assert output_error(weighted) < 0.9 * output_error(plain), name


def test_the_recipes_entry_point_weighs_by_default():
    """ALGORITHMS["gptq"] calls gptq_quantize: calibrated gguf-* recipes get the weighted scale search."""
    x = _activations(512, 256, seed=2)
    hessian = 2 * x.T @ x / x.shape[0]
    weight = torch.randn(8, 256) * 0.02
    for name in ("q4_0", "q4_k"):
        weighted = gptq_solve(weight, hessian, TYPES[name], block_size=256).quantized
        plain = gptq_solve(weight, hessian, TYPES[name], block_size=256, imatrix=False).quantized
        assert not torch.equal(weighted.data, plain.data)
        assert torch.equal(gptq_quantize(weight, hessian, TYPES[name], block_size=256).data, weighted.data)
        assert torch.equal(gptq_quantize(weight, hessian, TYPES[name], block_size=256, imatrix=False).data,
                           plain.data)


@pytest.fixture(scope="module")
def tiny_imatrix(tiny_checkpoint, tmp_path_factory):
    ids = torch.randint(0, 250, (6, 40), generator=torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("imatrix") / "imatrix.gguf"
    return write_imatrix(collect(tiny_checkpoint, ids, ["tests"]), path), ids


def test_imatrix_file_has_llama_cpp_layout(tiny_checkpoint, tiny_imatrix):
    """The keys, tensor names, dtypes and shapes llama.cpp's loader (common/imatrix-loader.cpp) needs,
    read with gguf-py; and the sums are Σx² of each linear's inputs, i.e. n·diag(H)/2."""
    import gguf

    from quantkit.gguf.names import gguf_name, minicpm_name
    from quantkit.loading import load_model
    from quantkit.models.layers import LINEARS, layer_prefix
    from quantkit.stats import InputStats

    path, ids = tiny_imatrix
    reader = gguf.GGUFReader(path)
    value_types = {name: [t.name for t in field.types] for name, field in reader.fields.items()}
    assert value_types["general.type"] == ["STRING"] and str(bytes(reader.fields["general.type"].parts[-1]),
                                                               "utf-8") == "imatrix"
    assert value_types["imatrix.datasets"] == ["ARRAY", "STRING"]
    assert value_types["imatrix.chunk_count"] == value_types["imatrix.chunk_size"] == ["UINT32"]
    assert "general.architecture" not in value_types  # llama-imatrix writes none

    model = load_model(tiny_checkpoint)
    layers = model.config.num_hidden_layers
    expected = sorted(gguf_name(f"{layer_prefix(i)}{linear}.weight") for i in range(layers) for linear in LINEARS)
    names = [t.name for t in reader.tensors]
    assert names == [n + suffix for n in expected for suffix in (SUMS, COUNTS)]  # sorted, sums before counts
    for tensor in reader.tensors:
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
        linear = model.get_submodule(minicpm_name(tensor.name.split(".weight")[0] + ".weight").removesuffix(".weight"))
        assert list(tensor.shape) == ([linear.in_features] if tensor.name.endswith(SUMS) else [1])

    imatrix = read_imatrix(path)
    assert (imatrix.chunk_count, imatrix.chunk_size) == tuple(ids.shape)
    assert imatrix.datasets == ["tests"]
    down = gguf_name(f"{layer_prefix(1)}mlp.down_proj.weight")
    stats = InputStats(model.model.layers[1].mlp.down_proj.in_features)
    handle = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, args: stats.add(args[0]))
    with torch.no_grad():
        model.model(ids)
    handle.remove()
    assert imatrix.counts[down] == ids.numel() == stats.tokens
    np.testing.assert_allclose(imatrix.importance(down), stats.hessian.diagonal().numpy() / 2, rtol=1e-4)


def _llama_quantized(source: Path, out: Path, file_type: int, imatrix) -> dict[str, tuple[str, np.ndarray]]:
    """llama.cpp's ``llama_model_quantize`` with the imatrix entries, as llama-quantize passes them."""
    import gguf

    from quantkit.eval.llamacpp import llama_quantize

    llama_quantize(source, out, file_type, threads=1, imatrix=imatrix)
    return {t.name: (t.tensor_type.name.lower(), np.asarray(t.data).view(np.uint8).reshape(int(t.shape[-1]), -1))
            for t in gguf.GGUFReader(out).tensors if t.name.startswith("blk.") and len(t.shape) == 2}


@pytest.mark.llamacpp
@pytest.mark.parametrize("file_type", ["q4_0", "q4_k_m", "q4_1"])
def test_llama_cpp_quantizes_with_our_imatrix_as_quantkit_does(tiny_checkpoint, tiny_imatrix, tmp_path, file_type):
    """llama.cpp finds every entry under its tensor name, and its bytes are quantkit's weighted ones."""
    import gguf

    from quantkit.gguf.export import export_gguf
    from quantkit.gguf.mixes import FILE_TYPES

    path, _ = tiny_imatrix
    imatrix = read_imatrix(path)
    f32 = tmp_path / "f32.gguf"
    export_gguf(tiny_checkpoint, f32, "f32", progress=False)
    floats = {t.name: np.asarray(t.data, dtype=np.float32).reshape(int(t.shape[-1]), -1)
              for t in gguf.GGUFReader(f32).tensors if len(t.shape) == 2}
    theirs = _llama_quantized(f32, tmp_path / "out.gguf", int(FILE_TYPES[file_type]), imatrix)
    checked = 0
    for name in imatrix.sums:
        type_name, data = theirs[name]
        ours = TYPES[type_name].quantize_with(floats[name], imatrix.importance(name))
        assert np.array_equal(ours, data), (name, type_name)
        checked += TYPES[type_name].quantize_weighted is not None
    assert checked == len(imatrix.sums)


def test_prefix_cut_leaves_the_first_positions_out(tiny_checkpoint, tiny_imatrix):
    """With ``prefix_tokens`` the sums are P-GPTQ's prefix-free statistics (InputStats with the same
    skip), the counts say how many tokens were summed, and a cut that leaves nothing is refused."""
    from quantkit.gguf.names import gguf_name
    from quantkit.loading import load_model
    from quantkit.models.layers import layer_prefix
    from quantkit.stats import InputStats

    _, ids = tiny_imatrix
    full = read_imatrix(tiny_imatrix[0])
    cut = collect(tiny_checkpoint, ids, ["tests"], prefix_tokens=4)
    model = load_model(tiny_checkpoint)
    q_proj = model.model.layers[0].self_attn.q_proj
    stats = InputStats(q_proj.in_features, skip_prefix=4)
    handle = q_proj.register_forward_pre_hook(lambda m, args: stats.add(args[0]))
    with torch.no_grad():
        model.model(ids)
    handle.remove()
    name = gguf_name(f"{layer_prefix(0)}self_attn.q_proj.weight")
    assert cut.counts[name] == ids.shape[0] * (ids.shape[1] - 4) == stats.tokens
    np.testing.assert_allclose(cut.importance(name), stats.hessian.diagonal().numpy() / 2, rtol=1e-4)
    assert all(np.all(cut.sums[n] <= full.sums[n] * (1 + 1e-5)) for n in full.sums)  # a subset of the same squares
    assert not np.allclose(cut.importance(name), full.importance(name), rtol=1e-2)
    with pytest.raises(ValueError, match="prefix_tokens"):
        collect(tiny_checkpoint, ids, ["tests"], prefix_tokens=ids.shape[1])
