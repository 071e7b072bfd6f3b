"""The native MiniCPM model against an independent float64 reference written here from the spec
(docs/model.md, "μP scaling"), against transformers' Llama with μP folded into the weights, and the
Auto-class registration, config round trip, chat template, fixtures and meta 8B shapes."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.cache_utils import DynamicCache

from quantkit.models import (
    MiniCPMConfig,
    MiniCPMDecoderLayer,
    MiniCPMForCausalLM,
    MiniCPMModel,
    MiniCPMRMSNorm,
    MiniCPMRotaryEmbedding,
)
from quantkit.synthetic import (
    MINICPM41_SPARSE_CONFIG,
    meta_model,
    minicpm41_8b_config,
    write_tiny_checkpoint,
)

SEQ_LEN = 96  # past the tiny LongRoPE original context (64)


# ---------------------------------------------------------------- independent float64 reference

def ref_rms_norm(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def ref_cos_sin(cfg: dict, length: int):
    """The official cos/sin cache: a table over max(max_position_embeddings, length) positions."""
    head_dim = cfg["head_dim"]
    inv_freq = 1.0 / cfg["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    table_len = max(cfg["max_position_embeddings"], length)
    t = torch.arange(table_len, dtype=torch.float64)
    scaling, factor = cfg.get("rope_scaling"), 1.0
    if scaling:
        original = scaling["original_max_position_embeddings"]
        ext = scaling["long_factor"] if table_len > original else scaling["short_factor"]
        t = t[:, None] / torch.tensor(ext, dtype=torch.float64)
        ratio = cfg["max_position_embeddings"] / original
        if ratio > 1:
            factor = math.sqrt(1 + math.log(ratio) / math.log(original))
    else:
        t = t[:, None]
    freqs = t * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:length]
    return emb.cos() * factor, emb.sin() * factor


def ref_rope(x, cos, sin):  # x [heads, T, d]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def ref_logits(checkpoint, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] of one sequence, in float64, straight from config.json and the weights file."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(checkpoint / "model.safetensors").items()}
    n_layers, n_heads, n_kv, d = (cfg[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                                   "head_dim"))
    eps, length = cfg["rms_norm_eps"], input_ids.numel()
    branch = cfg["scale_depth"] / math.sqrt(n_layers)
    cos, sin = ref_cos_sin(cfg, length)
    causal = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)

    def linear(name, x):
        out = x @ w[name + ".weight"].T
        return out + w[name + ".bias"] if name + ".bias" in w else out

    h = w["model.embed_tokens.weight"][input_ids] * cfg["scale_emb"]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        x = ref_rms_norm(h, w[p + "input_layernorm.weight"], eps)
        q = linear(p + "self_attn.q_proj", x).view(length, n_heads, d).transpose(0, 1)
        k = linear(p + "self_attn.k_proj", x).view(length, n_kv, d).transpose(0, 1)
        v = linear(p + "self_attn.v_proj", x).view(length, n_kv, d).transpose(0, 1)
        q, k = ref_rope(q, cos, sin), ref_rope(k, cos, sin)
        group = n_heads // n_kv
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        probs = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d) + causal, dim=-1)
        attn = (probs @ v).transpose(0, 1).reshape(length, n_heads * d)
        h = h + linear(p + "self_attn.o_proj", attn) * branch
        x = ref_rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = linear(p + "mlp.gate_proj", x), linear(p + "mlp.up_proj", x)
        h = h + linear(p + "mlp.down_proj", gate * torch.sigmoid(gate) * up) * branch
    h = ref_rms_norm(h, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return (h / (cfg["hidden_size"] / cfg["dim_model_base"])) @ head.T


def random_ids(vocab_size: int, length: int = SEQ_LEN, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


def load(path, dtype=torch.float32) -> MiniCPMForCausalLM:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


# ---------------------------------------------------------------- forward pass

VARIANTS = {
    "untied-longrope-gqa16": dict(),
    "tied-longrope-gqa16": dict(tied=True),
    "untied-plainrope-gqa2": dict(longrope=False, num_key_value_heads=8),
    "tied-longrope-gqa2-bias": dict(tied=True, num_key_value_heads=8, attention_bias=True),
}


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_float32_logits_match_reference(tiny_checkpoint_factory, variant):
    path = tiny_checkpoint_factory(**variant)
    model = load(path)
    ids = random_ids(model.config.vocab_size)
    with torch.no_grad():
        logits = model(ids).logits[0]
    expected = ref_logits(path, ids[0])
    assert logits.dtype == torch.float32
    assert expected.abs().max() > 0.5  # the comparison is not between near-zero numbers
    assert (logits.double() - expected).abs().max() <= 1e-5


def test_bfloat16_logits_track_reference(tiny_checkpoint):
    model = load(tiny_checkpoint, torch.bfloat16)
    ids = random_ids(model.config.vocab_size)
    with torch.no_grad():
        logits = model(ids).logits[0]
    expected = ref_logits(tiny_checkpoint, ids[0])
    assert logits.dtype == torch.float32  # logits are upcast even from a bf16 model
    error = (logits.double() - expected).abs().max().item()
    assert 0 < error <= 0.05 * expected.abs().max().item()  # bf16 rounding, nothing structural


def test_rms_norm_casts_back_before_the_weight():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3
    norm = MiniCPMRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
        norm = norm.to(torch.bfloat16)
        out = norm(x)
    xf = x.float()
    normalized = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    expected = normalized * norm.weight
    weight_in_fp32 = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
                      * norm.weight.float()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    assert not torch.equal(out, weight_in_fp32)  # the order is observable in bf16


ROPE_CASES = {
    # max_position_embeddings > original: long factors, attention factor sqrt(1 + ln 4 / ln 64)
    "extended": (256, 64, 96, math.sqrt(1 + math.log(4) / math.log(64))),
    # max_position_embeddings == original: short factors, factor 1
    "native": (64, 64, 40, 1.0),
    # a position past both: the official cache is rebuilt with long factors (factor still 1)
    "past-the-cache": (64, 64, 80, 1.0),
}


@pytest.mark.parametrize("max_pos,original,length,factor", ROPE_CASES.values(), ids=ROPE_CASES.keys())
def test_longrope_cos_sin_match_reference(max_pos, original, length, factor):
    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.5 * i for i in range(8)],
        "long_factor": [1.0 + 2.0 * i for i in range(8)],
        "original_max_position_embeddings": original,
    }
    config = MiniCPMConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=max_pos, rope_scaling=scaling)
    x = torch.zeros(2, length, 64, dtype=torch.bfloat16)
    positions = torch.arange(length).expand(2, length)
    cos, sin = MiniCPMRotaryEmbedding(config)(x, positions)
    ref_cos, ref_sin = ref_cos_sin(config.to_dict(), length)
    assert cos.shape == sin.shape == (2, length, 16) and cos.dtype == torch.bfloat16
    cos32, sin32 = MiniCPMRotaryEmbedding(config)(x.float(), positions)
    assert (cos32[1].double() - ref_cos).abs().max() <= 1e-5
    assert (sin32[1].double() - ref_sin).abs().max() <= 1e-5
    assert cos32[0, 0, 0].item() == pytest.approx(factor, abs=1e-6)


def test_layer_by_layer_forward_matches_model(tiny_checkpoint):
    """The calling convention the layer-wise quantization engine relies on."""
    model = load(tiny_checkpoint)
    ids = random_ids(model.config.vocab_size, length=33)
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids) * model.config.scale_emb
        cos, sin = model.model.rotary_emb(hidden, torch.arange(33)[None])
        for layer in model.model.layers:
            assert isinstance(layer, MiniCPMDecoderLayer)
            hidden = layer(hidden, (cos, sin))  # attention_mask=None: causal
        logits = model.logits_from_hidden(model.model.norm(hidden))
        expected = model(ids).logits
    assert cos.shape == (1, 33, model.config.head_dim)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_resumes_bit_exactly_from_o_proj_input(tiny_checkpoint, dtype):
    """The engine computes the attention once and restarts the layer from o_proj's input."""
    model = load(tiny_checkpoint, dtype)
    ids = torch.cat([random_ids(model.config.vocab_size, length=33, seed=seed) for seed in (1, 2)])
    layer = model.model.layers[0]
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids) * model.config.scale_emb
        position_embeddings = model.model.rotary_emb(hidden, torch.arange(33)[None])
        mixed = layer.self_attn.mix(layer.input_layernorm(hidden), position_embeddings)
        assert mixed.shape == (2, 33, layer.self_attn.o_proj.in_features)
        assert torch.equal(layer.after_attention(hidden, mixed), layer(hidden, position_embeddings))


def test_matches_llama_with_mup_folded_into_weights(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(tied=True, longrope=False, num_key_value_heads=4)
    model = load(path)
    cfg = model.config
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
    )).eval()
    weights = load_file(path / "model.safetensors")
    folded = dict(weights)
    folded["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * cfg.scale_emb
    # tied checkpoint: the folded lm_head is an untied copy of the unscaled embedding
    folded["lm_head.weight"] = weights["model.embed_tokens.weight"] / (cfg.hidden_size / cfg.dim_model_base)
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            folded[name] = weights[name] * (cfg.scale_depth / math.sqrt(cfg.num_hidden_layers))
    llama.load_state_dict(folded, strict=True)
    ids = random_ids(cfg.vocab_size)
    with torch.no_grad():
        assert (model(ids).logits - llama(ids).logits).abs().max() <= 1e-4


def test_kv_cache_decoding_matches_full_forward(tiny_checkpoint):
    model = load(tiny_checkpoint)
    ids = random_ids(model.config.vocab_size, length=40)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        steps = [model(ids[:, :24], cache=cache, use_cache=True).logits]
        for t in range(24, 40):
            steps.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    assert cache.get_seq_length() == 40
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5


def test_left_padded_batch_matches_single_sequences(tiny_checkpoint):
    model = load(tiny_checkpoint)
    long, short = random_ids(model.config.vocab_size, 7, seed=5), random_ids(model.config.vocab_size, 4, seed=6)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)])
    mask = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batched = model(batch, attention_mask=mask, position_ids=positions).logits
        assert (batched[0] - model(long).logits[0]).abs().max() <= 1e-5
        assert (batched[1, 3:] - model(short).logits[0]).abs().max() <= 1e-5


def test_greedy_generate_matches_stepwise_argmax(tiny_checkpoint):
    model = load(tiny_checkpoint)
    prompt = random_ids(model.config.vocab_size, length=12, seed=3)
    settings = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    # explicit mask: the random prompt may contain the pad id
    generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=settings)
    expected = prompt
    with torch.no_grad():
        for _ in range(10):
            next_token = model(expected, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, next_token], dim=1)
    assert generated.shape == (1, 22)
    assert torch.equal(generated, expected)
    assert len(set(expected[0, 12:].tolist())) > 1  # not a degenerate repeat


# ---------------------------------------------------------------- loading, saving, config

def test_auto_classes_load_without_remote_code(tiny_checkpoint, tiny_tied_checkpoint):
    assert isinstance(AutoConfig.from_pretrained(tiny_checkpoint), MiniCPMConfig)
    assert type(AutoModel.from_pretrained(tiny_checkpoint)) is MiniCPMModel
    untied, info = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, output_loading_info=True)
    assert type(untied) is MiniCPMForCausalLM
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    stored = load_file(tiny_checkpoint / "model.safetensors")
    assert torch.equal(untied.lm_head.weight, stored["lm_head.weight"])
    tied, info = AutoModelForCausalLM.from_pretrained(tiny_tied_checkpoint, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"])
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    encoded = tokenizer("The answer is 42.")["input_ids"]
    assert encoded[0] == tokenizer.bos_token_id == 1
    assert tokenizer.decode(encoded, skip_special_tokens=True) == "The answer is 42."
    assert tokenizer.convert_tokens_to_ids(["<unk>", "<s>", "</s>"]) == [0, 1, 2]
    assert tokenizer.eos_token == "<|im_end|>"


def test_save_pretrained_keeps_official_keys(tiny_checkpoint_factory, tmp_path):
    path = tiny_checkpoint_factory(sparse_config=MINICPM41_SPARSE_CONFIG)
    original = json.loads((path / "config.json").read_text())
    model = load(path)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["sparse_config"] == MINICPM41_SPARSE_CONFIG
    assert saved["rope_scaling"] == original["rope_scaling"]
    assert saved["rope_scaling"]["rope_type"] == "longrope" and len(saved["rope_scaling"]["long_factor"]) == 8
    assert saved["rope_theta"] == 10000.0
    assert "rope_parameters" not in saved
    assert saved["architectures"] == ["MiniCPMForCausalLM"] and saved["model_type"] == "minicpm"
    for key in ("scale_emb", "scale_depth", "dim_model_base", "num_key_value_heads", "tie_word_embeddings"):
        assert saved[key] == original[key], key
    reloaded = load(tmp_path)
    assert reloaded.config.sparse_attention.topk == 64
    ids = random_ids(model.config.vocab_size, length=16)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


BAD_CONFIGS = {
    "kv-heads": (dict(num_attention_heads=16, num_key_value_heads=3), "num_key_value_heads"),
    "rope-type": (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_type"),
    "factor-length": (
        dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8,
                           "original_max_position_embeddings": 64}),
        "short_factor",
    ),
    "sparse-value": (dict(sparse_config={"block_size": 60}), "block_size \\(60\\) must be a multiple of kernel_stride"),
    "sparse-unknown": (dict(sparse_config={**MINICPM41_SPARSE_CONFIG, "topK": 1}), "unknown keys \\['topK'\\]"),
    "negative-size": (dict(hidden_size=-1), "hidden_size must be an integer >= 1, got -1"),
    "nan-eps": (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number > 0, got nan"),
    "fractional-layers": (dict(num_hidden_layers=2.5), "num_hidden_layers must be an integer >= 1, got 2.5"),
    "heads-not-dividing": (dict(hidden_size=250, head_dim=None), "hidden_size \\(250\\) must be a multiple of"),
    "other-architecture": (dict(architectures=["LlamaForCausalLM"]), "architectures must be null or a list of"),
    "nan-rope-factor": (dict(head_dim=2, rope_scaling={"rope_type": "longrope", "short_factor": [float("nan")],
                                                       "long_factor": [1.0], "original_max_position_embeddings": 8}),
                        "short_factor must be a list, each entry a finite number > 0"),
}


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_config_is_a_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        MiniCPMConfig(**{"hidden_size": 256, "num_attention_heads": 16, **overrides})


# ---------------------------------------------------------------- chat template

THINK_CASES = {
    "default-thinks": ([("user", "Hi")], {}, ""),
    "enable_thinking=True": ([("user", "Hi")], {"enable_thinking": True}, ""),
    "enable_thinking=False": ([("user", "Hi")], {"enable_thinking": False}, "<think>\n\n</think>\n\n"),
    "/no_think": ([("user", "Hi /no_think")], {}, "<think>\n\n</think>\n\n"),
    "/think beats enable_thinking=False": ([("user", "Hi /think")], {"enable_thinking": False}, ""),
    "/no_think beats enable_thinking=True": (
        [("user", "Hi /no_think")], {"enable_thinking": True}, "<think>\n\n</think>\n\n"),
    "marker holds for its turn only": (
        [("user", "A /no_think"), ("assistant", "B"), ("user", "C")], {}, ""),
}


@pytest.mark.parametrize("turns,kwargs,suffix", THINK_CASES.values(), ids=THINK_CASES.keys())
def test_chat_template_hybrid_reasoning(tiny_checkpoint, turns, kwargs, suffix):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    messages = [{"role": "system", "content": "Be brief."}] + [{"role": r, "content": c} for r, c in turns]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    history = "<|im_start|>system\nBe brief.<|im_end|>\n" + "".join(
        f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns
    )
    assert text == history + "<|im_start|>assistant\n" + suffix


def test_chat_template_without_generation_prompt(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2


# ---------------------------------------------------------------- fixtures and the 8B on meta

def test_tiny_checkpoint_is_byte_deterministic(tmp_path):
    kwargs = dict(tied=True, dtype=torch.bfloat16, num_hidden_layers=1)
    first = write_tiny_checkpoint(tmp_path / "a", **kwargs)
    second = write_tiny_checkpoint(tmp_path / "b", **kwargs)
    other_seed = write_tiny_checkpoint(tmp_path / "c", seed=1, **kwargs)
    names = sorted(p.name for p in first.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other_seed / "model.safetensors").read_bytes()
    with safe_open(first / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_meta_8b_shapes_and_parameter_count():
    config = minicpm41_8b_config()
    model = meta_model(config)
    H, intermediate, V, L, KV = 4096, 16384, 73448, 32, 2 * 128
    expected = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (KV, H),
            p + "self_attn.v_proj.weight": (KV, H), p + "self_attn.o_proj.weight": (H, H),
            p + "mlp.gate_proj.weight": (intermediate, H), p + "mlp.up_proj.weight": (intermediate, H),
            p + "mlp.down_proj.weight": (H, intermediate),
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
        }
    state = model.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    assert all(v.is_meta for v in state.values())
    per_layer = 2 * H * H + 2 * KV * H + 3 * intermediate * H + 2 * H
    total = sum(p.numel() for p in model.parameters())
    assert total == L * per_layer + 2 * V * H + H == 8_185_253_888
    assert config.residual_scale == pytest.approx(1.4 / math.sqrt(32)) and config.logit_divisor == 16
    assert config.sparse_attention.dense_len == 8192
    assert len(config.rope_scaling["long_factor"]) == 64
