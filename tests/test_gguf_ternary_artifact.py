"""Ternary artifacts (format ``ternary``) exported as llama.cpp's TQ2_0/TQ1_0 and read back by llama.cpp.

TQ2_0/TQ1_0 hold t·d with one d per 256 weights, and the export re-quantizes with llama.cpp's rule
d = max|x| per block. A record with one scale s per 256 weights (group 256 or -1, K whole blocks)
has max|x| = s in every block that is not all zeros, so the codes come back as t and d as s: the
file is the artifact, bit for bit. A g32 record has eight scales per block and is re-rounded; a row
that is not whole 256-blocks falls back to another type (``BLOCK_FALLBACK``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from test_gguf_export import _assert_llama_quantize_agrees, _kl_top1, _llama_logits, _model

from quantkit.engine import quantize
from quantkit.gguf.export import export_gguf, exported_weights
from quantkit.gguf.mixes import BLOCK_FALLBACK
from quantkit.gguf.names import gguf_name, unpermute_rows
from quantkit.models.layers import K, Q, layer_prefix
from quantkit.quant import QuantizedTensor
from quantkit.reader import ArtifactReader
from quantkit.recipe import load_recipe

pytestmark = pytest.mark.llamacpp
TQ_TYPES = ["tq2_0", "tq1_0"]
IDS = list(range(5, 105))


def _ternary_artifact(model: Path, group_size: int, out: Path) -> Path:
    """``rtn-ternary-g32`` with ``group_size`` on a small calibration set (RTN's weights do not depend on it)."""
    recipe = load_recipe("rtn-ternary-g32", {"quant.group_size": group_size, "calibration.n_samples": 2,
                                             "calibration.seq_len": 32})
    quantize(model, recipe, out, progress=False)
    return out


def _qat_artifact(model: Path, folder: Path) -> Path:
    """Three steps of ``qat-ternary-g256`` (cross-entropy only, so no teacher cache is written)."""
    from quantkit.calib import load_documents
    from quantkit.eval.ppl import perplexity
    from quantkit.qat import run_qat

    text = folder / "train.txt"
    text.write_text("\n\n".join(load_documents("en"))[:20_000])
    recipe = load_recipe("qat-ternary-g256", {"qat.seq_len": 64, "qat.batch_tokens": 128, "qat.eval_tokens": 128,
                                              "qat.data": str(text), "qat.distill_weight": 0.0})
    run_qat(model, recipe, folder / "qat-g256", perplexity=perplexity, tokens=3 * 128, progress=False)
    return folder / "qat-g256"


@pytest.fixture(scope="module")
def artifacts(tiny_checkpoint_factory, tmp_path_factory) -> dict[int | str, Path]:
    """The default tiny model (hidden 256, intermediate 512: every linear's K is whole 256-blocks)
    as ternary artifacts with one scale per 256 weights, per row, and per 32, and as trained by QAT
    with one scale per 256."""
    model, folder = tiny_checkpoint_factory(), tmp_path_factory.mktemp("ternary")
    return {**{g: _ternary_artifact(model, g, folder / f"g{g}") for g in (256, -1, 32)},
            "qat-g256": _qat_artifact(model, folder)}


def _records(artifact: Path) -> dict[str, QuantizedTensor]:
    reader = ArtifactReader(artifact)
    records = {}
    for index in range(reader.num_layers):
        records |= reader.layer(index)[1]
    return records


def _file_linears(path: Path, artifact: Path, keys) -> dict[str, tuple[str, torch.Tensor]]:
    """Each linear's (GGUF type name, float32 weight in MiniCPM row order), dequantized by gguf-py from the file."""
    config = ArtifactReader(artifact).config
    heads = {Q: config.num_attention_heads, K: config.num_key_value_heads}
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    result = {}
    for key in keys:
        tensor = tensors[gguf_name(key)]
        weight = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(tensor.data, tensor.tensor_type),
                                                       dtype=np.float32))
        part = key[len(layer_prefix(int(key.split(".")[2]))):].rsplit(".", 1)[0]
        result[key] = tensor.tensor_type.name, unpermute_rows(weight, heads[part]) if part in heads else weight
    return result


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.parametrize("file_type", TQ_TYPES)
@pytest.mark.parametrize("group_size", [256, -1, "qat-g256"], ids=["g256", "per_row", "qat_g256"])
def test_ternary_artifact_with_a_scale_per_256_weights_is_lossless_in_llama_cpp(artifacts, tmp_path, group_size,
                                                                                 file_type):
    artifact = artifacts[group_size]
    path = tmp_path / f"{file_type}.gguf"
    export_gguf(artifact, path, file_type, progress=False)
    records = _records(artifact)
    assert len(records) == 14  # 2 layers x 7 linears
    for key, (type_name, weight) in _file_linears(path, artifact, records).items():
        assert type_name == file_type.upper(), key
        assert _same_bits(weight, records[key].dequantize(torch.float32)), key

    # llama.cpp's own quantizer, given the dequantized artifact (the F32 export), writes the same bytes
    export_gguf(artifact, tmp_path / "f32.gguf", "f32", progress=False)
    types = _assert_llama_quantize_agrees(tmp_path / "f32.gguf", path, file_type, tmp_path)
    assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"

    # quantkit's model on the artifact's weights (the embedding and output as the file re-rounds them)
    # against llama.cpp on the file. Measured on 100 tokens: mean KL 2.3e-6 (the same for TQ2_0 and
    # TQ1_0: same weights, llama.cpp's Q8_K activation rounding is the difference), top-1 95-98 % (the
    # random tiny model has near-ties).
    exported = exported_weights(artifact, file_type)
    state = {key: value for key, value in exported.items() if key not in records}
    with torch.no_grad():
        ours = _model(artifact, state)(torch.tensor([IDS])).logits[0].double().numpy()
    kl, top1 = _kl_top1(ours, _llama_logits(path, IDS))
    assert kl < 2e-5 and top1 >= 0.95, (kl, top1)


@pytest.mark.parametrize("file_type", TQ_TYPES)
def test_g32_ternary_artifact_is_rerounded_by_tq(artifacts, tmp_path, file_type):
    """Eight g32 scales share a TQ block's one d = the largest of them: each other group's ±s is
    re-rounded to ±d or 0."""
    artifact = artifacts[32]
    path = tmp_path / f"{file_type}.gguf"
    export_gguf(artifact, path, file_type, progress=False)
    records = _records(artifact)
    errors = []
    for key, (type_name, weight) in _file_linears(path, artifact, records).items():
        record = records[key].dequantize(torch.float32)
        assert type_name == file_type.upper() and not torch.equal(weight, record), key
        errors.append(float((weight - record).norm() / record.norm()))
    # measured: relative Frobenius error |file - record| / |record| 0.206 to 0.244 per linear, 0.233 on
    # average; 60 % of the weights move
    assert 0.18 < min(errors) and max(errors) < 0.28, errors


@pytest.mark.parametrize("file_type", TQ_TYPES)
def test_rows_not_whole_256_blocks_fall_back(tiny_checkpoint_factory, tmp_path, file_type):
    """intermediate_size 384: ffn_down's K is 1.5 blocks of 256 and takes ``BLOCK_FALLBACK``'s type
    (as llama.cpp's quantizer does); the K = 256 linears stay ternary and exact."""
    artifact = _ternary_artifact(tiny_checkpoint_factory(intermediate_size=384), -1, tmp_path / "g-1")
    path = tmp_path / f"{file_type}.gguf"
    export_gguf(artifact, path, file_type, progress=False)
    records = _records(artifact)
    fallback = BLOCK_FALLBACK[file_type].upper()
    assert fallback == "Q4_0"
    errors = []
    for key, (type_name, weight) in _file_linears(path, artifact, records).items():
        record = records[key].dequantize(torch.float32)
        if key.endswith("mlp.down_proj.weight"):
            assert type_name == fallback, key
            errors.append(float((weight - record).norm() / record.norm()))
        else:
            assert type_name == file_type.upper() and _same_bits(weight, record), key
    # Q4_0's d is the block's first largest weight / -8, so ±s of that weight's sign is exact and the
    # other sign lands on code 15 = 7/8 of its magnitude: about half the nonzero weights lose 1/8,
    # sqrt(1/2)/8 = 0.088. Measured: relative error 0.086 in both layers.
    assert len(errors) == 2 and 0.07 < min(errors) and max(errors) < 0.11, errors

    export_gguf(artifact, tmp_path / "f32.gguf", "f32", progress=False)
    types = _assert_llama_quantize_agrees(tmp_path / "f32.gguf", path, file_type, tmp_path)
    assert types["blk.0.ffn_down.weight"] == fallback and types["blk.0.ffn_up.weight"] == file_type.upper()
