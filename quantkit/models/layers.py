"""The one declarative description of a MiniCPM decoder layer's quantizable parts.

Everything that needs to know which linears exist, in which order GPTQ visits them, which op
absorbs an AWQ smoothing scale, or how CPM.cu fuses them reads this table: the engine, the
algorithms, the Marlin/CPM.cu packers and the GGUF exporter. Names are relative to
``model.layers.{i}.`` in the official MiniCPM checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass

LAYER_PREFIX = "model.layers.{index}."

Q, K, V, O_PROJ = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"
GATE, UP, DOWN = "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"

# Every quantizable linear of a decoder layer, in checkpoint order.
LINEARS: tuple[str, ...] = (Q, K, V, O_PROJ, GATE, UP, DOWN)

# True-sequential order: each group is quantized after the groups before it, so its calibration
# inputs already carry the quantization error of the earlier ones.
SEQUENTIAL_GROUPS: tuple[tuple[str, ...], ...] = ((Q, K, V), (O_PROJ,), (GATE, UP), (DOWN,))

# The projections attention reads: once they are quantized, o_proj's input is fixed for the layer.
ATTENTION_PROJECTIONS: tuple[str, ...] = (Q, K, V)


@dataclass(frozen=True)
class ScalingGroup:
    """Linears that share one input and so one smoothing scale, and the op that absorbs 1/s."""

    previous: str  # a norm (its weight) or a linear (its output rows) that absorbs 1/s
    linears: tuple[str, ...]
    # The previous op's output must be exactly the linears' input channel for channel; for
    # v_proj -> o_proj this holds only when every query head has its own KV head.
    needs_mha: bool = False


SCALING_GROUPS: tuple[ScalingGroup, ...] = (
    ScalingGroup("input_layernorm", (Q, K, V)),
    ScalingGroup(V, (O_PROJ,), needs_mha=True),
    ScalingGroup("post_attention_layernorm", (GATE, UP)),
    ScalingGroup(UP, (DOWN,)),
)

# CPM.cu's fused projections: the fused tensor concatenates its parts along the output dimension.
FUSIONS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": (Q, K, V),
    "mlp.gate_up_proj": (GATE, UP),
}

# Tensors outside the decoder layers; they stay in their original precision.
EMBEDDING = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
LAYER_NORMS: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")


def layer_prefix(index: int) -> str:
    return LAYER_PREFIX.format(index=index)


def scaling_groups_for(num_attention_heads: int, num_key_value_heads: int) -> tuple[ScalingGroup, ...]:
    """The scaling groups that apply to a model with these head counts."""
    mha = num_attention_heads == num_key_value_heads
    return tuple(g for g in SCALING_GROUPS if mha or not g.needs_mha)
