"""The EAGLE-3 draft head: official layout, the forward as written out by hand, the aux-state
conventions against transformers' hidden_states, the FR-Spec vocabulary, and bad pairings."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from quantkit.models import MiniCPMConfig, MiniCPMForCausalLM
from quantkit.models.eagle3 import (
    AUX_STATES,
    DraftHeadError,
    draft_vocabulary,
    entering_states,
)
from quantkit.reader import load_head
from quantkit.synthetic import write_tiny_eagle3_head

OFFICIAL_KEYS = {"fc.weight", "d2t", "t2d", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight",
                 "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
                 *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                 *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}


@pytest.fixture(scope="module")
def target_dir(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(num_hidden_layers=8)  # deep enough for distinct aux layers 2, 4, 5 / 2, 4, 6


@pytest.fixture(scope="module")
def target(target_dir):
    return MiniCPMForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def head_dir(target_dir, tmp_path_factory):
    return write_tiny_eagle3_head(tmp_path_factory.mktemp("head") / "head", target_dir, draft_vocab_size=100)


def test_official_layout_and_config(head_dir, target):
    tensors = load_file(head_dir / "model.safetensors")
    assert set(tensors) == OFFICIAL_KEYS
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    hidden = target.config.hidden_size
    assert tensors["fc.weight"].shape == (hidden, 3 * hidden)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * hidden
    assert tensors["lm_head.weight"].shape == (100, hidden)
    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 100 and config["target_hidden_size"] == hidden
    assert config["aux_states"] == "cpmcu"
    L = target.config.num_hidden_layers
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, L // 2, L - 3]


def test_d2t_maps_every_draft_id_onto_the_t2d_set(head_dir, target):
    head = load_head(head_dir, target.config)
    mapped = head.target_ids(torch.arange(100))
    assert torch.equal(mapped, torch.nonzero(head.t2d).flatten())  # ascending, one to one


def test_t2d_is_optional_and_follows_from_d2t(head_dir, target, tmp_path):
    tensors = load_file(head_dir / "model.safetensors")
    t2d = tensors.pop("t2d")
    (tmp_path / "config.json").write_text((head_dir / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    assert torch.equal(load_head(tmp_path, target.config).t2d, t2d)


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, positions, theta):
    half = x.shape[-1] // 2
    frequencies = theta ** (-torch.arange(half, dtype=torch.float32) * 2 / x.shape[-1])
    angles = positions[:, None].float() * frequencies[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def test_one_draft_step_equals_the_formula_written_out(head_dir, target):
    """fc, embedding-first concatenation, q/k/v over 2H, causal RoPE attention, both residual branches
    times scale_depth/sqrt(L+1), norm, lm_head over the draft vocabulary."""
    head = load_head(head_dir, target.config)
    config, weights = head.config, {n: t for n, t in head.state_dict().items()}
    torch.manual_seed(0)
    T, H = 5, config.hidden_size
    aux = torch.randn(1, T, 3 * H)
    tokens = torch.randint(0, config.vocab_size, (1, T))
    positions = torch.arange(T)

    g = aux[0] @ weights["fc.weight"].T
    e = target.model.embed_tokens(tokens[0]) * target.config.scale_emb
    eps = config.rms_norm_eps
    x = torch.cat([_rms(e, weights["midlayer.input_layernorm.weight"], eps),
                   _rms(g, weights["midlayer.hidden_norm.weight"], eps)], -1)
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = (x @ weights["midlayer.self_attn.q_proj.weight"].T).view(T, heads, d).transpose(0, 1)
    k = (x @ weights["midlayer.self_attn.k_proj.weight"].T).view(T, kv_heads, d).transpose(0, 1)
    v = (x @ weights["midlayer.self_attn.v_proj.weight"].T).view(T, kv_heads, d).transpose(0, 1)
    q, k = _rope(q, positions, config.rope_theta), _rope(k, positions, config.rope_theta)
    k, v = (t.repeat_interleave(heads // kv_heads, 0) for t in (k, v))
    scores = (q @ k.transpose(1, 2)) / math.sqrt(d) + torch.triu(torch.full((T, T), -math.inf), 1)
    attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, -1)
    s = target.config.scale_depth / math.sqrt(target.config.num_hidden_layers + 1)
    h = g + s * (attended @ weights["midlayer.self_attn.o_proj.weight"].T)
    m = _rms(h, weights["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (F.silu(m @ weights["midlayer.mlp.gate_proj.weight"].T) * (m @ weights["midlayer.mlp.up_proj.weight"].T))
    h = h + s * (mlp @ weights["midlayer.mlp.down_proj.weight"].T)
    expected = _rms(h, weights["norm.weight"], eps) @ weights["lm_head.weight"].T

    with torch.no_grad():
        out = head.draft(head.project(aux), head.embed(target.model.embed_tokens, tokens), positions[None])
        logits = head.logits(out)
    torch.testing.assert_close(out[0], h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("convention", sorted(AUX_STATES))
def test_aux_states_against_transformers_hidden_states(target_dir, target, tmp_path, convention):
    """Both conventions read the same residual stream transformers reports as hidden_states; only the
    indices and the scale differ (the 8B's 32 layers: CPM.cu 2/16/29 scaled, the training script 2/16/30)."""
    head = load_head(write_tiny_eagle3_head(tmp_path / "h", target_dir, aux_states=convention), target.config)
    ids = torch.randint(0, target.config.vocab_size, (1, 7))
    with torch.no_grad():
        reported = target(ids, output_hidden_states=True).hidden_states
        aux = head.aux_from_states(entering_states(target, ids, head.aux_layers)[1])
    assert len(reported) == target.config.num_hidden_layers + 1
    L = target.config.num_hidden_layers
    if convention == "cpmcu":
        picked, scale = (reported[2], reported[L // 2], reported[L - 3]), target.config.residual_scale
    else:
        picked, scale = (reported[2], reported[len(reported) // 2], reported[-3]), 1.0
    torch.testing.assert_close(aux, torch.cat(picked, -1) * scale)
    assert AUX_STATES["cpmcu"].layers(32) == (2, 16, 29) and AUX_STATES["hf-hidden-states"].layers(32) == (2, 16, 30)


def test_draft_vocabulary_is_the_most_frequent_tokens_in_id_order():
    counts = torch.tensor([5, 9, 0, 9, 1, 7, 3])
    d2t, t2d = draft_vocabulary(counts, 4)
    assert torch.equal(torch.nonzero(t2d).flatten(), torch.tensor([0, 1, 3, 5]))
    assert torch.equal(torch.arange(4) + d2t, torch.tensor([0, 1, 3, 5]))
    _, ties = draft_vocabulary(torch.tensor([2, 2, 2]), 2)  # ties go to the lower id
    assert ties.tolist() == [True, True, False]
    with pytest.raises(DraftHeadError, match="1..3"):
        draft_vocabulary(torch.tensor([1, 2, 3]), 4)


def _edit_config(head_dir, tmp_path, **changes):
    tensors = load_file(head_dir / "model.safetensors")
    config = {**json.loads((head_dir / "config.json").read_text()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize("changes, message", [
    ({"target_hidden_size": 512}, "reads target states of width 512"),
    ({"vocab_size": 999}, "vocabulary has 999 tokens"),
    ({"num_hidden_layers": 2}, "one decoder layer"),
    ({"aux_states": "sglang"}, "choose one of"),
])
def test_a_head_that_does_not_fit_gets_a_clear_error(head_dir, target, tmp_path, changes, message):
    with pytest.raises(DraftHeadError, match=message):
        load_head(_edit_config(head_dir, tmp_path, **changes), target.config)


def test_a_head_without_d2t_is_refused(head_dir, target, tmp_path):
    tensors = load_file(head_dir / "model.safetensors")
    del tensors["d2t"]
    (tmp_path / "config.json").write_text((head_dir / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(DraftHeadError, match="lacks d2t.*maps draft ids to target ids"):
        load_head(tmp_path, target.config)


def test_a_target_of_another_width_or_depth_is_refused(head_dir, target):
    other = MiniCPMConfig(**{**target.config.to_dict(), "hidden_size": 128, "head_dim": 16})
    with pytest.raises(DraftHeadError, match="width 256.*hidden size is 128"):
        load_head(head_dir, other)
    shallow = MiniCPMConfig(**{**target.config.to_dict(), "num_hidden_layers": 2})
    with pytest.raises(DraftHeadError, match=r"reads layers \[2, 1, -1\], the target has 2"):
        load_head(head_dir, shallow)


def test_a_head_with_the_official_extras_loads(head_dir, target, tmp_path):
    """What SpecForge and EAGLE's trainers also write: an embed_tokens copy (the target's is used instead),
    eagle_config, rope_scaling null, torch_dtype, bf16 weights."""
    tensors = {name: t.to(torch.bfloat16) if t.is_floating_point() else t
               for name, t in load_file(head_dir / "model.safetensors").items()}
    tensors["embed_tokens.weight"] = torch.zeros(target.config.vocab_size, target.config.hidden_size)
    config = {**json.loads((head_dir / "config.json").read_text()), "torch_dtype": "bfloat16", "rope_scaling": None,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True},
              "transformers_version": "4.51.0", "hidden_act": "silu", "bos_token_id": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, tmp_path / "model.safetensors")
    head = load_head(tmp_path, target.config)
    assert head.lm_head.weight.dtype == torch.float32 and "embed_tokens.weight" not in head.state_dict()
