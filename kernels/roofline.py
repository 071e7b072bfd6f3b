"""Decode and prefill ceilings: arithmetic, not measurements.

Decode (memory-bound): a step reads every weight the model multiplies with (not the embedding table:
one row) and the keys and values it attends to. Tokens/s can never exceed bandwidth / bytes per
token; the bytes come from an artifact's stored tensors (quantized weights as stored, float tensors
in the runtime's bf16) and the attention pattern.

Prefill (compute-bound): a prompt of ``context`` tokens in one forward costs 2 operations (multiply
and add) per multiply-accumulate:

- every decoder linear, once per token, from the config's shapes (``quantkit.reader.linear_shapes``);
- the LM head once per prefill: a prompt needs only its last position's logits (the runtime's
  ``forward`` computes no others), so it adds vocab × hidden / context per token;
- attention per layer and query head: QK^T and PV over the keys a query sees. Causal, the query at
  position i sees i + 1 keys, so the prompt sums context × (context + 1) / 2 of them (an average of
  (context + 1) / 2, about context / 2). Under InfLLM v2 (``context`` at or past dense_len, the prefill
  one call) a query attends to at most the selected blocks' keys and scores (QK^T only) the compressed
  keys it sees, counted as the decode ceiling counts them.

Tokens/s can never exceed context / (time at peak): the linears run at the tensor-core rate of the
artifact's math precision (``math``: W8A8 INT8 → int8, W8A8 FP8 → fp8, anything else → bf16, weight-only
formats dequantizing into 16-bit math), the LM head and attention at the bf16 rate (W8A8 schemes keep
the LM head in 16 bits and attend in 16 bits). With ``math`` bf16 this is the peak over operations per
token. Peaks are the vendors' dense (not 2:4 sparse) tensor-core figures.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from quantkit.checkpoint import CheckpointReader
from quantkit.kernels.infllm import SparseAttentionConfig
from quantkit.models import MiniCPMConfig, MiniCPMSettings
from quantkit.models.layers import EMBEDDING
from quantkit.models.settings import checked_values
from quantkit.reader import artifact_format, linear_shapes

RUNTIME_FLOAT_BYTES = 2  # bf16 activations, KV cache and unquantized weights
RUNTIME_MATH = "bf16"  # the runtime's 16-bit math: weight-only linears, the LM head and attention
MATH_OF_ACTIVATIONS = {"int8": "int8", "fp8": "fp8"}  # an activation grid's kind -> its tensor-core math


@dataclass(frozen=True)
class Peak:
    """A dense tensor-core peak: 10^12 operations (a multiply-accumulate is two) per second."""

    tera_ops: float
    source: str


@dataclass(frozen=True)
class Hardware:
    """A GPU the runtime targets (not a --device: those are where torch runs, auto|cpu|cuda)."""

    name: str
    memory_bandwidth_gb_s: float  # vendor peak, GB/s (10^9 bytes)
    memory_gb: float
    source: str
    tensor_peaks: dict[str, Peak]  # math precision -> dense peak; a precision absent has no tensor cores


# The whitepaper's RTX 4090 column (dense figures; 2:4 sparse ones are twice these). GeForce runs FP16/BF16 and
# FP8 with FP32 accumulate at half the FP16-accumulate rate; the kernels accumulate float types in float32.
_ADA = ("NVIDIA Ada GPU Architecture whitepaper, GeForce RTX 4090 column (the whitepaper not re-read here; its "
        "dense figures match third-party spec listings: 165.15, 330.30, 660.60)")
_ORIN = "NVIDIA Jetson AGX Orin 64GB, GPU only (not the DLAs)"
HARDWARE: dict[str, Hardware] = {
    "rtx4090": Hardware(
        "NVIDIA GeForce RTX 4090 (sm_89)", 1008.0, 24.0, "NVIDIA spec: 384-bit GDDR6X at 21 Gbps", {
            "bf16": Peak(165.2, f"{_ADA}: peak BF16 tensor TFLOPS with FP32 accumulate, dense (330.4 sparse)"),
            "fp16": Peak(165.2, f"{_ADA}: peak FP16 tensor TFLOPS with FP32 accumulate, dense (330.4 sparse; "
                                "330.3 with FP16 accumulate)"),
            "fp8": Peak(330.3, f"{_ADA}: peak FP8 tensor TFLOPS with FP32 accumulate, dense (660.6 sparse; "
                               "660.6 with FP16 accumulate)"),
            "int8": Peak(660.6, f"{_ADA}: peak INT8 tensor TOPS, dense (1321.2 sparse)"),
        }),
    "orin": Hardware(
        "NVIDIA Jetson AGX Orin 64GB (sm_87)", 204.8, 64.0, "NVIDIA spec: 256-bit LPDDR5", {
            "int8": Peak(85.0, f"{_ORIN}: half the GPU's 170 sparse INT8 TOPS of NVIDIA's Jetson AGX Orin "
                               "technical brief (read as quoted elsewhere; NVIDIA's DLA README: 171 at MAXN); the "
                               "275 TOPS headline adds the two DLAs"),
            "bf16": Peak(42.5, f"{_ORIN}: derived, not read in an NVIDIA document: half the dense INT8 rate, the "
                               "Ampere tensor cores' 16-bit rate (64 tensor cores x 256 FMA/clock x 2 x 1.3 GHz "
                               "= 42.6); whether FP32 accumulate runs at full rate on Orin is unverified"),
            "fp16": Peak(42.5, f"{_ORIN}: derived as bf16, not read in an NVIDIA document"),
            # no "fp8": Ampere (sm_87) has no FP8 tensor cores
        }),
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
    math: str  # the tensor-core precision of the decoder's linears: bf16, fp8 or int8
    prefill_linear_ops: int  # a prefill of `context` tokens: the decoder's linears, at `math`
    prefill_bf16_ops: int  # the same prefill: the LM head (once) and attention, at bf16
    ops_per_token: float  # (prefill_linear_ops + prefill_bf16_ops) / context
    prefill_tokens_per_second_ceiling: float | None  # None: the hardware has no `math` tensor cores
    prefill_note: str | None = None  # why there is no prefill ceiling
    note: str = ("arithmetic, not a measurement: decode = bytes per token / peak bandwidth; prefill = tokens / "
                 "(operations / peak dense tensor-core rate)")

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


def _floor_sum(n: int, stride: int) -> int:
    """sum of k // stride for k = 1..n."""
    q, r = divmod(n, stride)
    return stride * q * (q - 1) // 2 + q * (r + 1)


def prefill_attended_keys(context: int, sparse: SparseAttentionConfig | None) -> tuple[int, int]:
    """``attended_keys`` summed over the queries of a one-call prefill of ``context`` tokens (the query at
    position i sees i + 1 keys): (keys attended with QK^T and PV, compressed keys scored with QK^T)."""
    if sparse is None or sparse.is_dense(context):
        return context * (context + 1) // 2, 0
    budget = sparse.selected_blocks * sparse.block_size
    seen = min(context, budget)  # queries before the budget fills attend to every key they see, later ones to budget
    full = seen * (seen + 1) // 2 + (context - seen) * budget
    return full, _floor_sum(context, sparse.kernel_stride) + _floor_sum(context, sparse.coarse_kernel_stride)


def _format_and_grid(model_dir: Path):
    """(the artifact's format, its grid) or (None, None) when unquantized, from the format's settings alone,
    as ``ArtifactReader`` reads them (no file is hashed or loaded)."""
    quantization = checked_values(Path(model_dir) / "config.json").get("quantization_config")
    fmt = artifact_format(Path(model_dir), quantization)
    return (None, None) if fmt is None else (fmt, fmt.parse_config(dict(quantization or {})))


def served_precisions(model_dir: Path) -> tuple[str, int]:
    """(the tensor-core math of the artifact's decoder linears, the bytes of one cached key or value
    element). Math: the kind its activations are quantized to (W8A8: int8 or fp8), else bf16 (unquantized,
    or weight-only: dequantized into 16-bit math). Cache: one byte where the artifact states FP8 KV-cache
    scales (served with an FP8 cache), else the runtime's 16 bits."""
    fmt, config = _format_and_grid(model_dir)
    grid = None if fmt is None else fmt.activation_grid(config)
    kv_fp8 = fmt is not None and fmt.kv_cache_grid(config) is not None
    return (RUNTIME_MATH if grid is None else MATH_OF_ACTIVATIONS[grid.kind]), (1 if kv_fp8 else RUNTIME_FLOAT_BYTES)


def prefill_ops(model_dir: Path, context: int, sparse: SparseAttentionConfig | None) -> tuple[int, int]:
    """(operations of the decoder's linears, of the LM head and attention) for a prefill of ``context``
    tokens in one forward, two per multiply-accumulate."""
    config = MiniCPMSettings.from_values(checked_values(Path(model_dir) / "config.json"))
    linear_macs = config.num_hidden_layers * sum(n * k for n, k in linear_shapes(config).values())
    head_macs = config.vocab_size * config.hidden_size  # the last position's logits only
    full, compressed = prefill_attended_keys(context, sparse)
    attention_macs = config.num_hidden_layers * config.num_attention_heads * config.head_dim * (2 * full + compressed)
    return 2 * linear_macs * context, 2 * (head_macs + attention_macs)


def roofline(model_dir: str | Path, hardware: str, context: int, sparse: SparseAttentionConfig | None) -> Roofline:
    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(HARDWARE)}")
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    model_dir = Path(model_dir)
    config = MiniCPMConfig.from_pretrained(model_dir)
    weights = weight_bytes_per_token(model_dir)
    full, compressed = attended_keys(context, sparse)
    precision, kv_bytes = served_precisions(model_dir)
    per_key = config.num_hidden_layers * config.num_key_value_heads * config.head_dim * kv_bytes
    kv_read = (2 * full + compressed) * per_key
    kv_stored = 2 * context * per_key
    spec = HARDWARE[hardware]
    total = weights + kv_read
    linear_ops, bf16_ops = prefill_ops(model_dir, context, sparse)
    peaks = spec.tensor_peaks
    if precision in peaks:
        seconds = linear_ops / (peaks[precision].tera_ops * 1e12) + bf16_ops / (peaks[RUNTIME_MATH].tera_ops * 1e12)
        prefill, why_not = context / seconds, None
    else:
        prefill, why_not = None, (f"{spec.name} has no {precision} tensor cores: this artifact's W8A8 linears cannot "
                                  "run natively there, so there is no prefill ceiling")
    return Roofline(hardware=hardware, context=context,
                    attention="dense" if sparse is None or sparse.is_dense(context) else "InfLLM v2",
                    weight_bytes=weights, kv_bytes=kv_read, bytes_per_token=total,
                    decode_tokens_per_second_ceiling=spec.memory_bandwidth_gb_s * 1e9 / total,
                    fits_in_memory=weights + kv_stored <= spec.memory_gb * 1e9,
                    math=precision, prefill_linear_ops=linear_ops, prefill_bf16_ops=bf16_ops,
                    ops_per_token=(linear_ops + bf16_ops) / context,
                    prefill_tokens_per_second_ceiling=prefill, prefill_note=why_not)
