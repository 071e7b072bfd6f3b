"""GGUF import of llama.cpp's ``minicpm`` architecture: what quantkit's own GGUF export writes comes back
through ``convert_gguf`` as the same model (logits, μP constants, LongRoPE, sparse_config, tokenizer).

The llama/qwen2 conversions are covered by tests/test_default_model.py and tests/test_hub.py.
"""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantkit.gguf.export import SPARSE_CONFIG_KEY, export_gguf, exported_weights
from quantkit.gguf.importer import convert_gguf
from quantkit.synthetic import MINICPM41_SPARSE_CONFIG

# Token ids of the tiny vocabulary (384 tokens, <s>=1, <|im_start|>=3): 80 positions, past the original LongRoPE
# context of 64.
TOKEN_IDS = [1, 3, 17, 250, 383, 42, 7, 99, 128, 4, 300, 64, 5, 211, 2, 150] * 5
TEXT = ("<|im_start|>user\nWhat is 12 + 30? /no_think<|im_end|>\n"
        "量化把权重映射到低比特网格。 The quick brown fox 3.14159")
MUP_KEYS = ("scale_emb", "scale_depth", "dim_model_base")


def _checkpoint(factory, case: str):
    kwargs = {
        "untied": {"longrope": False},  # no LongRoPE: no rope scaling metadata, no factor tensors
        "tied": {"tied": True},  # tiny_tied_checkpoint: lm_head is the embedding, LongRoPE
        "longrope": {},  # tiny_checkpoint: untied, LongRoPE with distinct long and short factors
        "sparse": {"sparse_config": dict(MINICPM41_SPARSE_CONFIG)},
    }[case]
    return factory(**kwargs)


@pytest.fixture(scope="module")
def roundtrip(tiny_checkpoint_factory, tmp_path_factory):
    """``roundtrip(case, file_type)`` -> (original dir, GGUF path, converted dir), built once per argument pair."""
    built = {}

    def make(case: str, file_type: str = "f32"):
        if (case, file_type) not in built:
            original = _checkpoint(tiny_checkpoint_factory, case)
            folder = tmp_path_factory.mktemp(f"roundtrip-{case}-{file_type}")
            path = folder / f"tiny-{file_type}.gguf"
            export_gguf(original, path, file_type, progress=False)
            built[case, file_type] = original, path, convert_gguf(path, folder / "converted", progress=False)
        return built[case, file_type]

    return make


def _logits(model_dir) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert type(model).__name__ == "MiniCPMForCausalLM"
    with torch.no_grad():
        return model(torch.tensor([TOKEN_IDS])).logits[0].double()


def _config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _tensor_names(model_dir) -> set[str]:
    with safe_open(model_dir / "model.safetensors", "pt") as stored:
        return set(stored.keys())


@pytest.mark.parametrize("case", ["untied", "tied", "longrope", "sparse"])
def test_f32_export_converts_back_to_the_same_model(roundtrip, case):
    original, path, converted = roundtrip(case)
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == "minicpm"
    ours, theirs = _logits(converted), _logits(original)
    # F32 is lossless and the μP multipliers are kept, not folded into the weights: the converted
    # model is the original one up to fp32 rounding (measured: bit-identical logits).
    assert (ours - theirs).abs().max().item() <= 1e-5 * theirs.abs().max().item()

    config, expected = _config(converted), _config(original)
    for key in (*MUP_KEYS, "rope_scaling", "sparse_config", "tie_word_embeddings", "hidden_size",
                "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "rope_theta", "rms_norm_eps", "vocab_size", "bos_token_id"):
        assert config.get(key) == expected.get(key), key
    # The GGUF stores one EOS id: the first of the original's list.
    assert config["eos_token_id"] == expected["eos_token_id"][0]
    # LongRoPE's factors are configuration again, not weights; a tied head stays tied (not stored).
    assert _tensor_names(converted) == _tensor_names(original)


@pytest.mark.parametrize("case", ["untied", "tied", "longrope", "sparse"])
def test_conversion_record_says_what_was_done(roundtrip, case):
    original, _, converted = roundtrip(case)
    record = json.loads((converted / "quantkit_source.json").read_text())
    assert record["gguf"]["architecture"] == "minicpm"
    conversion = record["conversion"]
    expected = _config(original)
    assert conversion["qk_rows_unpermuted"] is True
    assert conversion["mup_from"] == "the GGUF's own multipliers"
    assert conversion["mup"] == {key: expected[key] for key in MUP_KEYS}
    assert conversion["rescaled"] == {}  # the weights are the file's, unscaled
    assert conversion["multipliers"]["gguf"] == conversion["multipliers"]["config"]
    multipliers = conversion["multipliers"]["gguf"]
    layers = expected["num_hidden_layers"]
    assert multipliers["embedding"] == expected["scale_emb"]
    assert multipliers["residual"] == pytest.approx(expected["scale_depth"] / layers**0.5, rel=1e-7)  # float32
    assert multipliers["logit"] == expected["hidden_size"] / expected["dim_model_base"]
    assert conversion["tie_word_embeddings"] is (case == "tied")
    if case == "untied":
        assert "rope_scaling" not in conversion
    else:
        assert conversion["rope_scaling"] == {"rope_type": "longrope",
                                              "from_tensors": ["rope_factors_long.weight", "rope_factors_short.weight"]}
    assert conversion.get("sparse_config_from") == (SPARSE_CONFIG_KEY if case == "sparse" else None)


def test_tokenizer_encodes_like_the_original(roundtrip):
    original, _, converted = roundtrip("longrope")
    ours, theirs = AutoTokenizer.from_pretrained(converted), AutoTokenizer.from_pretrained(original)
    ids = ours(TEXT).input_ids
    assert ids == theirs(TEXT).input_ids
    assert ids[:2] == [1, 3] and len(ids) > 30  # BOS added, <|im_start|> kept whole
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.chat_template == theirs.chat_template


def test_q8_0_export_converts_to_the_weights_it_stores(roundtrip):
    original, _, converted = roundtrip("longrope", "q8_0")
    # Q8_0 dequantizes exactly in fp32 (an f16 scale times an int8), so the converted checkpoint holds
    # precisely the weights the file computes with.
    stored = exported_weights(original, "q8_0")
    with safe_open(converted / "model.safetensors", "pt") as weights:
        assert set(weights.keys()) == set(stored)
        for name, value in stored.items():
            assert torch.equal(weights.get_tensor(name), value), name
    # Against the unquantized original, the logits carry Q8_0's rounding. Measured on these 80 tokens:
    # max |Δ| 1.5 % of max |logit| (logits are O(1) in this random model), mean KL 5.3e-6 nats, top-1 79/80
    # (the one miss a near-tie).
    ours, theirs = _logits(converted), _logits(original)
    assert (ours - theirs).abs().max().item() < 0.03 * theirs.abs().max().item()
    log_p, log_q = theirs.log_softmax(-1), ours.log_softmax(-1)
    assert (log_p.exp() * (log_p - log_q)).sum(-1).mean().item() < 1e-4
    assert (ours.argmax(-1) == theirs.argmax(-1)).double().mean().item() >= 0.95
    assert _config(converted)["rope_scaling"] == _config(original)["rope_scaling"]


def _metadata_only_gguf(path, arch: str, rope_scaling: dict) -> None:
    """A GGUF with the hyperparameters the conversion reads first, the given rope.scaling.* keys and one tensor."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_embedding_scale(12.0)
    writer.add_residual_scale(1.4)
    writer.add_logit_scale(1.0)
    for key, value in rope_scaling.items():
        (writer.add_string if isinstance(value, str) else writer.add_float32)(f"{arch}.rope.scaling.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch, rope_scaling", [
    ("minicpm", {"type": "yarn", "factor": 4.0}),
    ("minicpm", {"type": "linear", "factor": 2.0}),
    ("minicpm", {"type": "longrope", "factor": 4.0}),  # LongRoPE, but with a key MiniCPM has no place for
    ("llama", {"type": "linear", "factor": 2.0}),
    ("llama", {"type": "longrope"}),
], ids=["minicpm-yarn", "minicpm-linear", "minicpm-longrope-factor", "llama-linear", "llama-longrope"])
def test_rope_scaling_minicpm_cannot_express_is_refused(tmp_path, arch, rope_scaling):
    path = tmp_path / "scaled.gguf"
    _metadata_only_gguf(path, arch, rope_scaling)
    with pytest.raises(ValueError, match=r"GGUF rope scaling (keys )?\[.*\] cannot be expressed in a MiniCPM config"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["scaled.gguf"]  # no staging directory left either
