"""Every GGUF file type below Q4 (and Q5_0/Q5_1): quantkit's export is llama-quantize's file, tensor by tensor,
type and bytes, with an importance matrix and (where llama.cpp allows it) without, on a model whose rows
are whole 256-blocks and one whose are not (the fallbacks); the types llama.cpp writes only with an
importance matrix are refused without one, before anything is written."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from quantkit.gguf.export import export_gguf
from quantkit.gguf.imatrix_file import read_imatrix, write_imatrix
from quantkit.gguf.mixes import FILE_TYPES, Model, choose_type, needs_imatrix
from quantkit.imatrix import collect

pytestmark = pytest.mark.llamacpp

LOW_BIT = ["q5_0", "q5_1", "iq4_xs", "iq4_nl", "q3_k_l", "q3_k_m", "q3_k_s", "iq3_m", "iq3_s", "iq3_xs", "iq3_xxs",
           "q2_k", "q2_k_s", "iq2_m", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s"]
# the file types whose default or rule types llama.cpp writes only with an importance matrix
NEED_IMATRIX = {"q2_k_s", "iq3_xs", "iq3_xxs", "iq2_m", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s"}
MODELS = {
    # 16 layers, so that every layer rule (the first 1/16, 1/8, use_more_bits) picks a layer; GQA 2:1
    "whole": {"num_hidden_layers": 16, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
              "num_key_value_heads": 2, "seed": 3},
    # K = 288 and 576: no 256-block fits, every K-quant and 256-block IQ type falls back; GQA 9:1
    "ragged": {"num_hidden_layers": 2, "hidden_size": 288, "intermediate_size": 576, "num_attention_heads": 9,
               "num_key_value_heads": 1, "seed": 4},
}


@pytest.fixture(scope="module")
def prepared(tiny_checkpoint_factory, tmp_path_factory):
    """Per model: the checkpoint, its F32 GGUF (llama-quantize's input) and an imatrix of its activations."""
    import torch

    folder = tmp_path_factory.mktemp("mixes")
    out = {}
    for name, shape in MODELS.items():
        model = tiny_checkpoint_factory(**shape)
        f32 = folder / f"{name}-f32.gguf"
        export_gguf(model, f32, "f32", progress=False)
        ids = torch.randint(0, 250, (4, 32), generator=torch.Generator().manual_seed(0))
        imatrix = write_imatrix(collect(model, ids, ["tests"]), folder / f"{name}-imatrix.gguf")
        out[name] = (model, f32, imatrix)
    return out


def _tensors(path) -> dict[str, tuple[str, bytes]]:
    return {t.name: (t.tensor_type.name, np.asarray(t.data).view(np.uint8).tobytes()) for t in GGUFReader(path).tensors}


CASES = [(model, file_type, imatrix) for model in MODELS for file_type in LOW_BIT for imatrix in (True, False)
         if imatrix or (model == "whole" and file_type not in NEED_IMATRIX)]


@pytest.mark.parametrize(("model", "file_type", "with_imatrix"), CASES,
                         ids=[f"{m}-{t}-{'imatrix' if i else 'plain'}" for m, t, i in CASES])
def test_export_is_llama_quantizes_file(prepared, tmp_path, model, file_type, with_imatrix):
    from quantkit.eval.llamacpp import llama_quantize

    checkpoint, f32, imatrix = prepared[model]
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    export_gguf(checkpoint, ours, file_type, imatrix=imatrix if with_imatrix else None, progress=False)
    llama_quantize(f32, theirs, FILE_TYPES[file_type], imatrix=read_imatrix(imatrix) if with_imatrix else None)
    ours_tensors, their_tensors = _tensors(ours), _tensors(theirs)
    assert ours_tensors.keys() == their_tensors.keys()
    for name, (tensor_type, data) in their_tensors.items():
        assert ours_tensors[name][0] == tensor_type, name
        assert ours_tensors[name][1] == data, name


@pytest.mark.parametrize("file_type", sorted(NEED_IMATRIX))
def test_types_llama_cpp_writes_only_with_an_imatrix_are_refused_without_one(prepared, tmp_path, file_type):
    checkpoint, _, _ = prepared["whole"]
    with pytest.raises(ValueError, match="importance matrix: make one with `quantkit imatrix`"):
        export_gguf(checkpoint, tmp_path / "x.gguf", file_type, progress=False)
    assert not list(tmp_path.iterdir())


def test_need_for_an_imatrix_is_read_from_the_table():
    """NEED_IMATRIX above is what the mixes' own types imply for some placement of a layer's tensor."""
    model = Model(layers=16, gqa=2, tied_embeddings=False)
    implied = set()
    for file_type in LOW_BIT:
        for layer in range(model.layers):
            for stem in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
                name = f"blk.{layer}.{stem}.weight"
                if needs_imatrix(file_type, name, choose_type(file_type, name, (256, 256), model, imatrix=True)):
                    implied.add(file_type)
    assert implied == NEED_IMATRIX


def test_an_imatrix_of_another_model_is_refused_naming_the_tensor(prepared, tmp_path):
    checkpoint, _, _ = prepared["whole"]
    _, _, other = prepared["ragged"]
    with pytest.raises(ValueError, match=r"the imatrix's blk\.0\.\w+\.weight has 288 channels; the model's has 256"):
        export_gguf(checkpoint, tmp_path / "x.gguf", "q3_k_m", imatrix=other, progress=False)
    assert not list(tmp_path.iterdir())


def test_an_imatrix_naming_tensors_the_model_lacks_is_refused(prepared, tmp_path):
    checkpoint, _, _ = prepared["ragged"]
    _, _, deeper = prepared["whole"]  # 16 layers against 2
    with pytest.raises(ValueError, match=r"the imatrix has blk\.\d+\.\w+\.weight, which this model lacks"):
        export_gguf(checkpoint, tmp_path / "x.gguf", "q3_k_m", imatrix=deeper, progress=False)
    assert not list(tmp_path.iterdir())
