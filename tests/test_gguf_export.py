"""GGUF export checked by the real consumer, llama.cpp (through llama-cpp-python): every type loads,
its logits match quantkit's reference for the same weights, F32 reproduces the model, tokens and
greedy chat generation agree, the metadata says what llama.cpp's MiniCPM needs, and llama.cpp's own
quantizer writes the same bytes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from quantkit.gguf.export import export_gguf, exported_weights
from quantkit.gguf.mixes import FILE_TYPES
from quantkit.models import MiniCPMConfig, MiniCPMForCausalLM

pytestmark = pytest.mark.llamacpp
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
        "in want of a wife. 1234567 apples cost $8.90!\n\n中文也可以。")


# the file types the llama.cpp quantizer's bytes are compared on here (every other one: test_gguf_mixes.py)
SAME_TENSORS = ["q8_0", "q6_k", "q5_k_m", "q5_k_s", "q4_k_m", "q4_k_s", "q4_0", "q4_1", "iq4_xs", "q3_k_m", "q2_k"]


@pytest.fixture(scope="module")
def exports(default_model, tmp_path_factory):
    """One export per file type compared here, of the default model, written once for the module."""
    folder = tmp_path_factory.mktemp("gguf")
    return {t: (export_gguf(default_model, folder / f"{t}.gguf", t, progress=False), folder / f"{t}.gguf")
            for t in dict.fromkeys(["f32", "f16", "bf16", *SAME_TENSORS])}


def _llama_logits(path, ids) -> np.ndarray:
    from quantkit.eval.llamacpp import LlamaCppModel

    model = LlamaCppModel(path, n_ctx=512)
    try:
        return model(torch.tensor([ids])).logits[0].double().numpy()
    finally:
        model.close()


def _model(model_dir, state=None) -> MiniCPMForCausalLM:
    from quantkit.loading import load_model

    model = load_model(model_dir)
    if state is not None:
        model.load_state_dict(state, strict=False)
    return model.eval()


def _kl_top1(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    log_p = ours - np.logaddexp.reduce(ours, axis=-1, keepdims=True)
    log_q = theirs - np.logaddexp.reduce(theirs, axis=-1, keepdims=True)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1).mean()
    return float(kl), float((ours.argmax(-1) == theirs.argmax(-1)).mean())


@pytest.fixture(scope="module")
def text_ids(default_model):
    """256 held-out tokens (Austen), the text the evaluation harness scores."""
    from transformers import AutoTokenizer

    from quantkit.calib import heldout_tokens

    return heldout_tokens(AutoTokenizer.from_pretrained(default_model), max_tokens=256).tolist()


@pytest.mark.slow  # the default model, exported in every type
def test_f32_export_reproduces_the_model_in_llama_cpp(default_model, exports, text_ids):
    with torch.no_grad():
        ours = _model(default_model)(torch.tensor([text_ids])).logits[0].double().numpy()
    theirs = _llama_logits(exports["f32"][1], text_ids)
    kl, top1 = _kl_top1(ours, theirs)
    # llama.cpp keeps its KV cache in f16 by default; measured: max |Δ| 0.13 % of max |logit|, KL 1.0e-6.
    # Top-1: 256/256 on a Xeon with AMX, 255/256 on an AVX2 EPYC, where one near-tie falls the other way.
    assert np.abs(ours - theirs).max() < 0.005 * np.abs(ours).max()
    assert kl < 1e-5 and top1 >= 1 - 2 / len(text_ids)


# Mean KL of llama.cpp's logits from quantkit's reference for the same weights, on 256 tokens.
# llama.cpp multiplies block-quantized weights with activations rounded to Q8 blocks, which is most
# of the difference. Measured: f16 2.7e-6, bf16 1.2e-4, q8_0 0.0040, q6_k 0.0081, q4_0 0.0051,
# q4_1 0.0043 (top-1 agreement 94.5-100 %).
KL_TOLERANCE = {"f16": 2e-5, "bf16": 1e-3, "q8_0": 0.01, "q6_k": 0.015, "q5_k_m": 0.015, "q4_k_m": 0.015,
                "q4_0": 0.01, "q4_1": 0.01, "iq4_xs": 0.015, "q3_k_m": 0.015, "q2_k": 0.015}


@pytest.mark.slow  # the default model, exported in every type
@pytest.mark.parametrize("file_type", list(KL_TOLERANCE))
def test_quantized_export_matches_quantkit_reference_in_llama_cpp(default_model, exports, text_ids,
                                                                  file_type):
    with torch.no_grad():
        reference = _model(default_model, exported_weights(default_model, file_type))
        ours = reference(torch.tensor([text_ids])).logits[0].double().numpy()
    theirs = _llama_logits(exports[file_type][1], text_ids)
    kl, top1 = _kl_top1(ours, theirs)
    assert kl < KL_TOLERANCE[file_type] and top1 > 0.92, (kl, top1)


@pytest.mark.slow  # the default model, exported in every type
def test_tokenizer_matches_llama_cpp(default_model, exports):
    import llama_cpp
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    llm = llama_cpp.Llama(str(exports["q8_0"][1]), vocab_only=True, verbose=False)
    samples = [TEXT, "  leading spaces\tand tabs\n\n\nnewlines", "x=12345678901234567890; y = 3.14159",
               "<|im_start|>user\nHi!<|im_end|>\n", "émigré naïve café — “quotes” ½ 😀"]
    try:
        for sample in samples:
            ours = tokenizer(sample)["input_ids"]
            assert llm.tokenize(sample.encode(), add_bos=False, special=True) == ours, sample
    finally:
        llm.close()


@pytest.mark.slow  # the default model, exported in every type
def test_greedy_chat_generation_matches_llama_cpp(default_model, exports):
    import llama_cpp
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt)["input_ids"]
    model, ours = _model(default_model), []
    with torch.no_grad():  # plain argmax decoding: the model's generation_config adds a repetition penalty
        for _ in range(32):
            ours.append(int(model(torch.tensor([prompt_ids + ours])).logits[0, -1].argmax()))
    from quantkit.eval.llamacpp import disable_weight_repacking

    disable_weight_repacking()
    llm = llama_cpp.Llama(str(exports["f32"][1]), n_ctx=512, n_batch=512, n_threads=2, verbose=False)
    try:
        assert llm.metadata["tokenizer.chat_template"] == tokenizer.chat_template
        theirs = []
        for token in llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
            theirs.append(token)
            if len(theirs) == 32:
                break
    finally:
        llm.close()
    assert theirs == ours


@pytest.mark.slow  # the default model, exported in every type
def test_metadata_is_what_llama_cpp_minicpm_reads(default_model, exports):
    config = MiniCPMConfig.from_pretrained(default_model)
    reader = GGUFReader(exports["q4_0"][1])

    def value(key):
        return reader.fields[key].contents()

    assert value("general.architecture") == "minicpm"
    assert value("minicpm.embedding_scale") == pytest.approx(config.scale_emb)
    assert value("minicpm.residual_scale") == pytest.approx(config.scale_depth / config.num_hidden_layers ** 0.5)
    assert value("minicpm.logit_scale") == pytest.approx(config.hidden_size / config.dim_model_base)
    assert value("minicpm.attention.head_count_kv") == config.num_key_value_heads
    assert value("tokenizer.ggml.pre") == "smollm" and value("tokenizer.ggml.bos_token_id") == config.bos_token_id
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["output.weight"] == "Q8_0"  # K = 576 is not whole 256-blocks: llama.cpp's Q6_K falls back
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["blk.0.attn_norm.weight"] == "F32"
    report = exports["q4_0"][0]
    assert report.file_bytes == exports["q4_0"][1].stat().st_size and 4.5 < report.bits_per_weight < 6


def _assert_llama_quantize_agrees(f32_path, ours_path, file_type, tmp_path) -> dict[str, str]:
    """llama.cpp's ``llama_model_quantize`` on quantkit's F32 export: same type and bytes per tensor."""
    from quantkit.eval.llamacpp import llama_quantize

    theirs_path = tmp_path / f"llama-{file_type}.gguf"
    llama_quantize(f32_path, theirs_path, FILE_TYPES[file_type])
    ours = {t.name: t for t in GGUFReader(ours_path).tensors}
    theirs = {t.name: t for t in GGUFReader(theirs_path).tensors}
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].tensor_type == tensor.tensor_type, name
        assert np.array_equal(np.asarray(ours[name].data).view(np.uint8), np.asarray(tensor.data).view(np.uint8)), name
    return {name: tensor.tensor_type.name for name, tensor in theirs.items()}


@pytest.mark.slow  # the default model, exported in every type
@pytest.mark.parametrize("file_type", SAME_TENSORS)
def test_llama_cpp_quantizer_writes_the_same_tensors(exports, tmp_path, file_type):
    _assert_llama_quantize_agrees(exports["f32"][1], exports[file_type][1], file_type, tmp_path)


@pytest.mark.parametrize("file_type", ["q4_0", "q4_k_m", "q4_k_s", "q5_k_m"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_cpp_quantizer_agrees_on_whole_k_blocks(tiny_checkpoint_factory, tmp_path, tied, file_type):
    """K = 256, so no fallbacks: the output (or tied embedding) is Q6_K, the _M mixes' layer rules apply."""
    model = tiny_checkpoint_factory(tied=tied)
    export_gguf(model, tmp_path / "f32.gguf", "f32", progress=False)
    export_gguf(model, tmp_path / "ours.gguf", file_type, progress=False)
    types = _assert_llama_quantize_agrees(tmp_path / "f32.gguf", tmp_path / "ours.gguf", file_type, tmp_path)
    assert types["token_embd.weight" if tied else "output.weight"] == "Q6_K"
    if file_type == "q4_k_m":  # use_more_bits: layer 1 of 2 is in the last eighth
        assert (types["blk.0.attn_v.weight"], types["blk.1.attn_v.weight"]) == ("Q4_K", "Q6_K")


@pytest.mark.parametrize("file_type", ["q4_k_m", "q4_1", "bf16"])
def test_export_without_libggml_writes_the_same_file(tiny_checkpoint, tmp_path, monkeypatch, file_type):
    """The NumPy codecs, where llama-cpp-python's libggml is absent, write the fast path's file byte for byte."""
    from quantkit.gguf import native

    export_gguf(tiny_checkpoint, tmp_path / "fast.gguf", file_type, progress=False)
    monkeypatch.setattr(native, "load_libggml", lambda: None)
    export_gguf(tiny_checkpoint, tmp_path / "numpy.gguf", file_type, progress=False)
    assert (tmp_path / "fast.gguf").read_bytes() == (tmp_path / "numpy.gguf").read_bytes()


@pytest.mark.parametrize("value", [["a", "bé", "", "Ġthe"], [1, -3, 7], [0.5, -2.25], [True, False], ["x", 1]],
                         ids=["strings", "ints", "floats", "bools", "mixed"])
def test_metadata_arrays_pack_as_gguf_py_packs_them(value):
    import gguf

    from quantkit.gguf.export import PackedWriter

    def packed(writer):
        try:
            return writer._pack_val(value, gguf.GGUFValueType.ARRAY, add_vtype=True)
        except ValueError as e:
            return str(e)
    assert packed(PackedWriter(None, "minicpm")) == packed(gguf.GGUFWriter(None, "minicpm"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads", [None, 3], ids=["rows", "rope-permuted"])
def test_row_blocks_equal_torch_conversion(dtype, heads):
    """The exporter widens tensors with NumPy (bfloat16 by a 16-bit shift) block by block into a reused
    buffer: the blocks, joined, are the same float32 values in the same row order as torch's conversion
    of ``permute_rows``, NaN and ±inf included, and each block holds at most the bound's whole rows (or
    one head's)."""
    from quantkit.gguf.export import _RowBlocks
    from quantkit.gguf.names import permute_rows

    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)) * 1e3
    weight[5, 7], weight[40, 0], weight[90, 63] = float("nan"), float("inf"), -float("inf")
    weight = weight.to(dtype)
    blocks = [block.copy() for block in _RowBlocks(block_elements=1000)(weight, heads)]
    rows_per_block = 32 if heads else 1000 // 64  # a head is 32 rows, more than the bound
    assert [len(block) for block in blocks[:-1]] == [rows_per_block] * (len(blocks) - 1)
    assert len(blocks[-1]) <= rows_per_block
    # for ggml's quantizer a float32 tensor in row order is one block, read in place
    whole = list(_RowBlocks(block_elements=1000)(weight, heads, whole=True))
    assert len(whole) == (len(blocks) if heads or dtype != torch.float32 else 1)
    expected = (permute_rows(weight, heads) if heads else weight).float().numpy()
    assert np.array_equal(np.concatenate(blocks), expected, equal_nan=True)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tiny_longrope_model_matches_llama_cpp(tiny_checkpoint_factory, tmp_path, tied):
    """LongRoPE factors and attention factor, GQA, tied embeddings and sparse_config survive export."""
    from quantkit.synthetic import MINICPM41_SPARSE_CONFIG

    model = tiny_checkpoint_factory(num_key_value_heads=4, tied=tied, sparse_config=dict(MINICPM41_SPARSE_CONFIG))
    path = tmp_path / "tiny.gguf"
    export_gguf(model, path, "q8_0", progress=False)
    reader = GGUFReader(path)
    assert json.loads(reader.fields["quantkit.sparse_config"].contents()) == MINICPM41_SPARSE_CONFIG
    assert reader.fields["minicpm.rope.scaling.type"].contents() == "longrope"
    names = {t.name: t.tensor_type.name for t in reader.tensors}
    assert names["rope_factors_long.weight"] == names["rope_factors_short.weight"] == "F32"
    assert ("output.weight" in names) != tied and names["token_embd.weight"] == "Q8_0"

    ids = list(range(5, 105))  # past the 64-token original context: both sides use the long factors
    with torch.no_grad():
        ours = _model(model, exported_weights(model, "q8_0"))(torch.tensor([ids])).logits[0].double().numpy()
    kl, top1 = _kl_top1(ours, _llama_logits(path, ids))
    assert kl < 1e-3 and top1 > 0.95, (kl, top1)


def test_bad_input_is_refused_and_leaves_no_file(tiny_checkpoint_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_checkpoint_factory()
    out = tmp_path / "x.gguf"
    with pytest.raises(ValueError, match="unknown GGUF type 'q5_k'"):
        export_gguf(model, out, "q5_k", progress=False)
    out.write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match="already exists"):
        export_gguf(model, out, "f16", progress=False)
    assert out.read_bytes() == b"keep me"

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][3, 7] = float("nan")
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ValueError, match="up_proj.weight' contains NaN"):
        export_gguf(broken, tmp_path / "nan.gguf", "q8_0", progress=False)
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".gguf" or p.name.endswith(".tmp")] == ["x.gguf"]


def _ternary_copy(model_dir, out_dir):
    """The tiny model with every linear rounded to absmean-ternary values (BitNet b1.58): W ≈ s · t, t ∈ {-1,0,1}."""
    import shutil

    from safetensors.torch import load_file, save_file

    from quantkit.models.layers import LINEARS

    shutil.copytree(model_dir, out_dir)
    weights = load_file(out_dir / "model.safetensors")
    for name, tensor in weights.items():
        if any(name.endswith(f"{linear}.weight") for linear in LINEARS):
            scale = tensor.abs().mean()
            weights[name] = (tensor / scale).round().clamp(-1, 1) * scale
    save_file(weights, out_dir / "model.safetensors")
    return out_dir


@pytest.mark.parametrize("file_type", ["tq1_0", "tq2_0"])
def test_ternary_export_is_lossless_and_matches_llama_cpp(tiny_checkpoint_factory, tmp_path, file_type):
    from safetensors.torch import load_file

    from quantkit.models.layers import LINEARS

    model = _ternary_copy(tiny_checkpoint_factory(), tmp_path / "ternary")
    export_gguf(model, tmp_path / "f32.gguf", "f32", progress=False)
    export_gguf(model, tmp_path / "ours.gguf", file_type, progress=False)
    types = _assert_llama_quantize_agrees(tmp_path / "f32.gguf", tmp_path / "ours.gguf", file_type, tmp_path)
    assert types["blk.0.ffn_down.weight"] == file_type.upper() and types["token_embd.weight"] == "Q4_K"

    source, exported = load_file(model / "model.safetensors"), exported_weights(model, file_type)
    for name in source:
        if any(name.endswith(f"{linear}.weight") for linear in LINEARS):  # one scale per tensor: exact in fp16
            assert torch.allclose(exported[name], source[name], rtol=1e-3, atol=0), name
    ids = list(range(5, 105))
    with torch.no_grad():
        ours = _model(model, exported)(torch.tensor([ids])).logits[0].double().numpy()
    kl, top1 = _kl_top1(ours, _llama_logits(tmp_path / "ours.gguf", ids))
    assert kl < 1e-3 and top1 > 0.95, (kl, top1)


def test_every_minicpm_tensor_name_round_trips(tiny_checkpoint):
    from quantkit.gguf.names import gguf_name, minicpm_name
    from quantkit.models.decoder import weight_shapes

    keys = weight_shapes(MiniCPMConfig.from_pretrained(tiny_checkpoint))
    assert all(minicpm_name(gguf_name(key)) == key for key in keys)
    assert gguf_name("model.layers.1.self_attn.o_proj.weight") == "blk.1.attn_output.weight"
    with pytest.raises(ValueError, match="MiniCPM tensor 'model.layers.0.mlp.experts.weight' has no counterpart"):
        gguf_name("model.layers.0.mlp.experts.weight")


def test_gptq_artifact_reaches_llama_cpp_on_its_own_grid(marlin_legal, tmp_path):
    """The gguf-q4_0 recipe's GPTQ blocks (scales from the weighted search) are written unchanged."""
    from quantkit.engine import quantize
    from quantkit.loading import load_model
    from quantkit.models.layers import LINEARS

    from helpers import small_recipe

    artifact = tmp_path / "gptq"
    quantize(marlin_legal, small_recipe("gguf-q4_0", tmp_path), artifact, progress=False)
    report = export_gguf(artifact, tmp_path / "q4_0.gguf", "q4_0", progress=False)
    assert report.exact_tensors == 2 * len(LINEARS)

    gptq_weights, exported = load_model(artifact).state_dict(), exported_weights(artifact, "q4_0")
    linear_keys = [k for k in exported if any(k.endswith(f"{linear}.weight") for linear in LINEARS)]
    assert all(torch.equal(exported[k], gptq_weights[k]) for k in linear_keys)
    # llama.cpp's plain rule (d from each block's largest weight) would move some of them (measured 15 %)
    from quantkit.gguf.types import TYPES

    q4_0, weight = TYPES["q4_0"], gptq_weights[linear_keys[0]].numpy()
    rerounded = torch.from_numpy(q4_0.dequantize(q4_0.quantize(weight), weight.shape[1]))
    assert (rerounded != gptq_weights[linear_keys[0]]).float().mean() > 0.05
    ids = list(range(5, 105))
    with torch.no_grad():
        ours = _model(artifact, exported)(torch.tensor([ids])).logits[0].double().numpy()
    kl, top1 = _kl_top1(ours, _llama_logits(tmp_path / "q4_0.gguf", ids))
    assert kl < 1e-3 and top1 > 0.95, (kl, top1)


@pytest.fixture(scope="module")
def sentencepiece_checkpoint(tiny_checkpoint_factory, tmp_path_factory):
    """A tiny MiniCPM with a SentencePiece BPE tokenizer like MiniCPM4.1's own (tokenizer.model, byte
    fallback, no normalization, chat tokens added on top), trained here on the shipped calibration text."""
    import shutil

    from helpers import write_sentencepiece_tokenizer

    folder = tmp_path_factory.mktemp("spm") / "model"
    shutil.copytree(tiny_checkpoint_factory(vocab_size=1216), folder)
    write_sentencepiece_tokenizer(folder)
    return folder


def test_sentencepiece_tokenizer_matches_llama_cpp(sentencepiece_checkpoint, tmp_path):
    """MiniCPM's tokenizer kind: llama.cpp's "llama" tokenizer on the exported pieces and scores
    tokenizes exactly as SentencePiece does, added chat tokens included."""
    import llama_cpp
    import sentencepiece

    path = tmp_path / "spm.gguf"
    export_gguf(sentencepiece_checkpoint, path, "f32", progress=False)
    fields = GGUFReader(path).fields

    def value(key):
        field = fields[key]
        return field.contents() if hasattr(field, "contents") else field.parts[field.data[0]][0]

    assert value("tokenizer.ggml.model") == "llama" and value("tokenizer.ggml.add_space_prefix") is True
    assert value("tokenizer.ggml.unknown_token_id") == 0 and value("tokenizer.ggml.bos_token_id") == 1
    assert len(value("tokenizer.ggml.scores")) == 1216
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_checkpoint / "tokenizer.model"))
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    samples = [TEXT, "  leading spaces\tand tabs\n\n\nnewlines", "x=12345678901234567890; y = 3.14159",
               "émigré naïve café — “quotes” ½ 😀", "def f(x):\n    return x**2\n"]
    try:
        for sample in samples:
            assert llm.tokenize(sample.encode(), add_bos=True, special=True) == [1, *sp.encode(sample)], sample
        assert llm.tokenize("<|im_start|><|im_end|>".encode(), add_bos=False, special=True) == [1200, 1201]
    finally:
        llm.close()
