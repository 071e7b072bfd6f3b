"""The EAGLE-3 draft head of a MiniCPM target (the layout of ``openbmb/MiniCPM4.1-8B-Eagle3``).

One decoder layer that drafts the target's next tokens from the target's own residual stream
(EAGLE-3, Li et al. 2025, arXiv 2503.01840; MiniCPM's runtime CPM.cu, ``MiniCPM4Eagle3Impl``):

    a  = concat(three residual states of the target at the same position)     [.., 3·Ht]
    g  = fc(a)                                  (later draft steps: g = the previous step's output)
    x  = concat(input_layernorm(embed(next token)), hidden_norm(g))              [.., 2·H]
    h  = g + s · o_proj(attention(q/k/v_proj(x)))        q/k/v read 2·H, RoPE, causal
    h  = h + s · mlp(post_attention_layernorm(h))
    draft logits = lm_head(norm(h))  over the draft vocabulary;  target id = draft id + d2t[draft id]

``s`` is MiniCPM's μP residual scale as CPM.cu applies it to the draft: scale_depth / √(L + 1) for a
target of L layers. Tensor and config names are the official ones (``fc.weight``, ``midlayer.*``,
``norm.weight``, ``lm_head.weight``, ``d2t``, optional ``t2d``; ``draft_vocab_size``,
``target_hidden_size``), so an official checkpoint loads as it is; ``embed_tokens.weight`` is
ignored when present, because the target's embedding is used (as vLLM and CPM.cu do).

Which residual states feed ``fc`` is the one point where MiniCPM's runtime and the EAGLE-3 training
script disagree, so it is a named choice (``AUX_STATES``), recorded in the head's config.json as
``aux_states``. docs/speculative.md gives the details.

This module is the head's architecture (config, modules, its linears, pairing checks) and writes an FP
head (``save_head``); ``quantkit.reader.load_head`` reads a head, FP or quantized, and
``quantkit.draft.head_files`` writes a quantized one: the formats are theirs to know.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.models.decoder import MiniCPMAttention, MiniCPMMLP, MiniCPMRMSNorm, MiniCPMRotaryEmbedding
from quantkit.models.layers import SEQUENTIAL_GROUPS
from quantkit.models.settings import MiniCPMSettings

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"  # the name vLLM and SGLang dispatch EAGLE-3 heads on
MIDLAYER = "midlayer."
# The head's quantizable linears in true-sequential order: fc, then the midlayer as a decoder layer.
HEAD_LINEAR_GROUPS: tuple[tuple[str, ...], ...] = (("fc",), *(tuple(MIDLAYER + linear for linear in group)
                                                              for group in SEQUENTIAL_GROUPS))


class DraftHeadError(QuantkitError, ValueError):
    """A draft head that cannot serve the target it was paired with, or is incomplete."""


@dataclass(frozen=True)
class AuxStates:
    """Which residual states of a target with ``L`` layers the head reads, and how they are scaled."""

    layers: Callable[[int], tuple[int, int, int]]  # L -> the layers whose *input* state is taken
    scaled: bool  # multiplied by the target's residual scale scale_depth/√L (as CPM.cu stores them)
    description: str


AUX_STATES: dict[str, AuxStates] = {
    # CPM.cu (MiniCPM's official runtime) captures the state entering layers 2, L/2 and L-3 and stores
    # it multiplied by the target's residual scale.
    "cpmcu": AuxStates(lambda L: (2, L // 2, L - 3), True,
                       "the states entering layers 2, L/2 and L-3, times scale_depth/sqrt(L) (CPM.cu)"),
    # The EAGLE-3 training script takes transformers' hidden_states[2], [(L+1)//2] and [-3] of the
    # L+1 states: entering layers 2, (L+1)//2 and L-2, unscaled.
    "hf-hidden-states": AuxStates(lambda L: (2, (L + 1) // 2, L - 2), False,
                                  "transformers' hidden_states[2], [(L+1)//2], [-3], unscaled (EAGLE-3 training)"),
}
DEFAULT_AUX_STATES = "cpmcu"


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    aux_states: str = DEFAULT_AUX_STATES

    @classmethod
    def from_dict(cls, values: dict) -> Eagle3Config:
        layers = values.get("num_hidden_layers", 1)
        if layers != 1:
            raise DraftHeadError(f"an EAGLE-3 head has one decoder layer; this config has num_hidden_layers={layers}")
        aux_states = values.get("aux_states", DEFAULT_AUX_STATES)
        if aux_states not in AUX_STATES:
            raise DraftHeadError(f"aux_states {aux_states!r}: choose one of {sorted(AUX_STATES)}")
        heads = values["num_attention_heads"]
        return cls(
            hidden_size=values["hidden_size"], intermediate_size=values["intermediate_size"],
            num_attention_heads=heads, num_key_value_heads=values.get("num_key_value_heads", heads),
            head_dim=values.get("head_dim") or values["hidden_size"] // heads, vocab_size=values["vocab_size"],
            draft_vocab_size=values.get("draft_vocab_size", values["vocab_size"]),
            target_hidden_size=values.get("target_hidden_size", values["hidden_size"]),
            rms_norm_eps=values.get("rms_norm_eps", 1e-6), rope_theta=values.get("rope_theta", 10000.0),
            max_position_embeddings=values.get("max_position_embeddings", 32768), aux_states=aux_states)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> Eagle3Config:
        path = Path(directory) / CONFIG_FILE
        if not path.is_file():
            raise DraftHeadError(f"{directory} has no {CONFIG_FILE}: not a draft head")
        return cls.from_dict(json.loads(path.read_text()))

    def to_dict(self, target: MiniCPMSettings) -> dict:
        """config.json in the layout vLLM, SGLang and CPM.cu read, plus ``aux_states``; the aux layer ids
        are also written under vLLM's key (the entering-layer convention)."""
        return {"architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
                **asdict(self), "tie_word_embeddings": False,
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layers(target))}

    def aux_layers(self, target: MiniCPMSettings) -> tuple[int, int, int]:
        return AUX_STATES[self.aux_states].layers(target.num_hidden_layers)

    def midlayer_config(self) -> MiniCPMSettings:
        """The draft layer's own shape as a MiniCPM config (its attention, MLP and RoPE)."""
        return MiniCPMSettings(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                               num_hidden_layers=1, num_attention_heads=self.num_attention_heads,
                               num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                               rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                               max_position_embeddings=self.max_position_embeddings, vocab_size=self.vocab_size)


def is_draft_head(directory: str | Path) -> bool:
    """Whether ``directory`` holds an EAGLE-3 head (by its config), rather than a whole model."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        return False
    config = json.loads(path.read_text())
    return "draft_vocab_size" in config or any("Eagle3" in name for name in config.get("architectures", []))


def check_pairing(config: Eagle3Config, target: MiniCPMSettings) -> None:
    """A head serves a target only if it reads its hidden size and embeds and predicts its vocabulary."""
    problems = []
    if config.target_hidden_size != target.hidden_size:
        problems.append(f"the head reads target states of width {config.target_hidden_size}, the target's hidden "
                        f"size is {target.hidden_size}")
    if config.hidden_size != target.hidden_size:
        problems.append(f"the head's hidden size {config.hidden_size} differs from the target's embedding width "
                        f"{target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"the head's vocabulary has {config.vocab_size} tokens, the target's {target.vocab_size}")
    if config.draft_vocab_size > target.vocab_size:
        problems.append(f"draft_vocab_size {config.draft_vocab_size} exceeds the target's vocabulary")
    layers = config.aux_layers(target)
    if not all(0 <= layer < target.num_hidden_layers for layer in layers):
        problems.append(f"aux_states {config.aux_states!r} reads layers {list(layers)}, the target has "
                        f"{target.num_hidden_layers}")
    if problems:
        raise DraftHeadError("this draft head does not fit the target: " + "; ".join(problems))


class Eagle3MidLayer(nn.Module):
    """The draft's decoder layer: q/k/v read the normed embedding and normed hidden state side by side."""

    def __init__(self, config: Eagle3Config, residual_scale: float):
        super().__init__()
        inner = config.midlayer_config()
        self.residual_scale = residual_scale
        self.hidden_norm = MiniCPMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = MiniCPMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = MiniCPMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MiniCPMAttention(inner, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):  # 2H wide inputs: embedding ‖ hidden state
            projection = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * config.hidden_size, projection.out_features, bias=False))
        self.mlp = MiniCPMMLP(inner)

    def forward(self, hidden, embeds, position_embeddings, attention_mask=None, past_key_values=None):
        both = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        mixed = self.self_attn.mix(both, position_embeddings, attention_mask, past_key_values)
        hidden = hidden + self.self_attn.o_proj(mixed) * self.residual_scale
        return hidden + self.mlp(self.post_attention_layernorm(hidden)) * self.residual_scale


def head_linear_shapes(config: Eagle3Config) -> dict[str, tuple[int, int]]:
    """[out, in] of each quantizable linear of a head of ``config`` (HEAD_LINEAR_GROUPS' names), whatever
    its target: fc reads the three target states side by side."""
    with torch.device("meta"):
        midlayer = Eagle3MidLayer(config, 1.0)
    shapes = {"fc": (config.hidden_size, 3 * config.target_hidden_size)}
    for group in HEAD_LINEAR_GROUPS[1:]:
        for name in group:
            linear = midlayer.get_submodule(name.removeprefix(MIDLAYER))
            shapes[name] = (linear.out_features, linear.in_features)
    return shapes


class Eagle3Head(nn.Module):
    """The head for one target. ``draft`` runs one drafting step over a sequence; the caller supplies
    the target's embedding of the tokens (``embed``) and, at the first step, its aux states (``project``)."""

    def __init__(self, config: Eagle3Config, target: MiniCPMSettings):
        super().__init__()
        check_pairing(config, target)
        self.config, self.target = config, target
        self.aux_layers = config.aux_layers(target)
        self.aux_scale = target.residual_scale if AUX_STATES[config.aux_states].scaled else 1.0
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3MidLayer(config, target.scale_depth / math.sqrt(target.num_hidden_layers + 1))
        self.norm = MiniCPMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = MiniCPMRotaryEmbedding(config.midlayer_config())
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def aux_from_states(self, entering: dict[int, torch.Tensor]) -> torch.Tensor:
        """fc's input from the target's residual states entering each layer (layer index -> [.., Ht])."""
        return torch.cat([entering[layer] for layer in self.aux_layers], dim=-1) * self.aux_scale

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        return self.fc(aux)

    def embed(self, target_embedding: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
        return target_embedding(tokens) * self.target.scale_emb

    def draft(self, hidden, embeds, position_ids, attention_mask=None, past_key_values=None) -> torch.Tensor:
        """One draft step: hidden [B, T, H] (fc's output, or the previous step's), embeds [B, T, H] of the
        tokens that follow -> the step's output [B, T, H] before ``norm`` (the next step's ``hidden``)."""
        position_embeddings = self.rotary_emb(hidden, position_ids)
        return self.midlayer(hidden, embeds, position_embeddings, attention_mask, past_key_values)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden)).float()

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def draft_vocabulary(token_counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FR-Spec's draft vocabulary (Zhao et al. 2025, arXiv 2502.14856): the ``size`` most frequent target
    tokens (ties to the lower id), in id order, as EAGLE-3's ``d2t`` (draft id -> offset to the target
    id) and ``t2d`` (target id -> in the draft vocabulary)."""
    if not 0 < size <= token_counts.numel():
        raise DraftHeadError(f"draft vocabulary size {size} must be in 1..{token_counts.numel()}")
    most_frequent = torch.sort(-token_counts.long(), stable=True).indices[:size]  # stable: ties keep id order
    used = most_frequent.sort().values
    t2d = torch.zeros(token_counts.numel(), dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(size), t2d


def save_head(head: Eagle3Head, directory: str | Path) -> Path:
    """Write ``head`` in the official layout (config.json, model.safetensors; d2t int64, t2d bool)."""
    from quantkit.atomic import save_safetensors, write_json

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_safetensors(directory / WEIGHTS_FILE, {name: t.contiguous() for name, t in head.state_dict().items()},
                     metadata={"format": "pt"})
    write_json(directory / CONFIG_FILE, head.config.to_dict(head.target))
    return directory


def entering_states(model, input_ids: torch.Tensor, layers) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """One teacher-forced forward of a MiniCPM ``model`` (``MiniCPMForCausalLM``) on ``input_ids``: its
    logits, and the residual states entering each of ``layers`` (captured by forward pre-hooks)."""
    captured: dict[int, torch.Tensor] = {}
    decoder = model.model.layers
    hooks = [decoder[index].register_forward_pre_hook(
        lambda _module, args, kwargs, index=index: captured.__setitem__(index, (args[0] if args else
                                                                               kwargs["hidden_states"])),
        with_kwargs=True) for index in sorted(set(layers))]
    try:
        logits = model(input_ids=input_ids, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    return logits, captured
