"""Bandwidth-bound decode ceilings: arithmetic, not measurements.

A decode step reads every weight the model multiplies with (not the embedding table: one row) and
the keys and values it attends to. On a memory-bound device tokens/s can never exceed
bandwidth / bytes per token; this module computes that bound from an artifact's stored tensors
(quantized weights as stored, float tensors in the runtime's bf16) and the attention pattern.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from quantkit.checkpoint import CheckpointReader
from quantkit.kernels.infllm import SparseAttentionConfig
from quantkit.models import MiniCPMConfig
from quantkit.models.layers import EMBEDDING

RUNTIME_FLOAT_BYTES = 2  # bf16 activations, KV cache and unquantized weights


@dataclass(frozen=True)
class Hardware:
    """A GPU the runtime targets (not a --device: those are where torch runs, auto|cpu|cuda)."""

    name: str
    memory_bandwidth_gb_s: float  # vendor peak, GB/s (10^9 bytes)
    memory_gb: float
    source: str


HARDWARE: dict[str, Hardware] = {
    "rtx4090": Hardware("NVIDIA GeForce RTX 4090 (sm_89)", 1008.0, 24.0, "NVIDIA spec: 384-bit GDDR6X at 21 Gbps"),
    "orin": Hardware("NVIDIA Jetson AGX Orin 64GB (sm_87)", 204.8, 64.0, "NVIDIA spec: 256-bit LPDDR5"),
}


@dataclass(frozen=True)
class Roofline:
    hardware: str
    context: int
    attention: str
    weight_bytes: int
    kv_bytes: int
    bytes_per_token: int
    decode_tokens_per_second_ceiling: float
    fits_in_memory: bool
    note: str = "arithmetic (bytes per token / peak bandwidth), not a measurement"

    def to_dict(self) -> dict:
        return asdict(self)


def weight_bytes_per_token(model_dir: Path) -> int:
    """Bytes of every stored tensor a decode step reads: all but the embedding table (unless the
    LM head is tied to it), float tensors counted at the runtime's bf16 (FP8 ones at their one byte)."""
    reader = CheckpointReader(model_dir)
    tied = MiniCPMConfig.from_pretrained(model_dir).tie_word_embeddings
    total = 0
    for name in reader.names:
        if name == EMBEDDING and not tied:
            continue
        dtype = reader.dtype(name)
        # float32 and 16-bit tensors run in bf16; FP8 weights are read as stored, one byte each
        width = min(dtype.itemsize, RUNTIME_FLOAT_BYTES) if dtype.is_floating_point else dtype.itemsize
        total += math.prod(reader.shape(name)) * width
    return total


def attended_keys(context: int, sparse: SparseAttentionConfig | None) -> tuple[int, int]:
    """(keys and values read in full, compressed keys read by stage 1) per layer and KV head."""
    if sparse is None or sparse.is_dense(context):
        return context, 0
    selected = min(context, sparse.selected_blocks * sparse.block_size)
    compressed = context // sparse.kernel_stride + context // sparse.coarse_kernel_stride
    return selected, compressed


def roofline(model_dir: str | Path, hardware: str, context: int, sparse: SparseAttentionConfig | None) -> Roofline:
    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(HARDWARE)}")
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    model_dir = Path(model_dir)
    config = MiniCPMConfig.from_pretrained(model_dir)
    weights = weight_bytes_per_token(model_dir)
    full, compressed = attended_keys(context, sparse)
    per_key = config.num_hidden_layers * config.num_key_value_heads * config.head_dim * RUNTIME_FLOAT_BYTES
    kv_read = (2 * full + compressed) * per_key
    kv_stored = 2 * context * per_key
    spec = HARDWARE[hardware]
    total = weights + kv_read
    return Roofline(hardware, context, "dense" if sparse is None or sparse.is_dense(context) else "InfLLM v2",
                    weights, kv_read, total, spec.memory_bandwidth_gb_s * 1e9 / total,
                    weights + kv_stored <= spec.memory_gb * 1e9)
