"""Every quantized linear of an artifact decoded the way each of its consumers decodes it, compared
bit for bit with quantkit's own reading.

Round-trip tests cannot see a convention that quantkit's writer and reader share but a consumer
does not: a GPTQ v1 zero point of 0 once round-tripped perfectly in quantkit and decoded to 16 in
vLLM. So each rule below re-implements one consumer's dequantization from that consumer's code, in
NumPy, without quantkit's format modules (their packers, permutations and zero-point offsets are
written here again, from the consumers' side, on purpose). Products of an integer below 2^8 and a
float16 scale are exact in float32, so every consumer's float16 arithmetic gives the same float32
value and the comparison is exact equality. Layouts: docs/formats.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, NamedTuple

import numpy as np
import torch

from quantkit.models.layers import layer_prefix

Arrays = Mapping[str, np.ndarray]
# (tensors of the layer, module name, quantization_config, (out_features, in_features)) -> float32 [N, K]
Decoder = Callable[[Arrays, str, Mapping, tuple[int, int]], np.ndarray]


class ConsumerRule(NamedTuple):
    name: str
    source: str  # the consumer's code this rule follows
    decode: Decoder
    applies: Callable[[Mapping], bool] = lambda quant: True  # e.g. gptq_marlin loads sym 4/8-bit only


# --- bit streams: GPTQ-family packing is LSB first, value after value, across the int32 words ---

def unpack_stream(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words packed along ``axis`` -> the ``bits``-bit values they hold (int64), in order.

    Each line of words along ``axis`` is read as one little-endian bit stream (word 0's bit 0
    first), so 3-bit values straddling two words need no special case."""
    moved = np.moveaxis(words.astype(np.int64) & 0xFFFFFFFF, axis, 0)  # [W, ...]
    stream = (moved[:, None] >> np.arange(32).reshape(1, 32, *[1] * (moved.ndim - 1))) & 1
    stream = stream.reshape(-1, *moved.shape[1:])  # [W*32, ...] bits in stream order
    fields = stream.reshape(-1, bits, *moved.shape[1:])
    weights = (1 << np.arange(bits)).reshape(1, bits, *[1] * (moved.ndim - 1))
    return np.moveaxis((fields * weights).sum(axis=1), 0, axis)


def _group_of(quant: Mapping, k: int) -> np.ndarray:
    size = quant["group_size"]
    return np.zeros(k, np.int64) if size == -1 else np.arange(k) // size


def _affine(codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """codes [K, N], zeros and scales [G, N], group of each input channel [K] -> weight [N, K]."""
    weight = (codes - zeros[groups]).astype(np.float32) * scales[groups].astype(np.float32)
    return np.ascontiguousarray(weight.T)


# --- GPTQ (qweight packed along K, qzeros along N, g_idx per input channel) ---

def _gptq(zero_rule: Callable[[np.ndarray, int], np.ndarray]) -> Decoder:
    def decode(tensors: Arrays, name: str, quant: Mapping, shape: tuple[int, int]) -> np.ndarray:
        bits = quant["bits"]
        codes = unpack_stream(tensors[f"{name}.qweight"], bits, axis=0)
        zeros = zero_rule(tensors[f"{name}.qzeros"], bits)
        return _affine(codes, zeros, tensors[f"{name}.scales"], tensors[f"{name}.g_idx"].astype(np.int64))
    return decode


def autogptq_v1_zeros(qzeros: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ qlinear_cuda_old / GPTQModel's dequantizer: each stored field plus one, masked to ``bits``."""
    return (unpack_stream(qzeros, bits, axis=1) + 1) & (2**bits - 1)


def vllm_v1_zeros(qzeros: np.ndarray, bits: int) -> np.ndarray:
    """vLLM's gptq_gemm kernels: each stored field plus ``zero_offset`` = 1, not masked."""
    return unpack_stream(qzeros, bits, axis=1) + 1


# GPTQModel (utils/model.py, convert_gptq_v1_to_v2_format_module) adds one to every field of a
# 2/4/8-bit word with a single int32 addition, so a field of all ones carries into its neighbour;
# 3-bit fields straddle words, so it decodes, adds one masked, and repacks those.
_GPTQMODEL_WORD_CONSTANTS = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}


def gptqmodel_v1_zeros(qzeros: np.ndarray, bits: int) -> np.ndarray:
    if bits not in _GPTQMODEL_WORD_CONSTANTS:
        return autogptq_v1_zeros(qzeros, bits)
    words = ((qzeros.astype(np.int64) & 0xFFFFFFFF) + _GPTQMODEL_WORD_CONSTANTS[bits]) & 0xFFFFFFFF
    return unpack_stream(words, bits, axis=1)


def v2_zeros(qzeros: np.ndarray, bits: int) -> np.ndarray:
    """checkpoint_format "gptq_v2": the stored field is the zero point."""
    return unpack_stream(qzeros, bits, axis=1)


def gptq_marlin_zeros(qzeros: np.ndarray, bits: int) -> np.ndarray:
    """vLLM's gptq_marlin (what it promotes sym 4/8-bit GPTQ to) loads qzeros but never reads them:
    the type uint4b8 / uint8b128 implies a zero point of 2^(bits-1)."""
    return np.full_like(unpack_stream(qzeros, bits, axis=1), 2 ** (bits - 1))


def _marlin_compatible(quant: Mapping) -> bool:
    return bool(quant.get("sym")) and quant["bits"] in (4, 8) and quant["group_size"] in (-1, 32, 64, 128)


# --- AutoAWQ GEMM (qweight [K, N/8] and qzeros [G, N/8] packed along N in AWQ's nibble order) ---

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # AutoAWQ packing_utils: column j of 8 sits in nibble [j]


def autoawq_unpack(words: np.ndarray) -> np.ndarray:
    """AutoAWQ unpack_awq + reverse_awq_order: nibbles in storage order, then re-indexed by column."""
    nibbles = np.stack([(words.astype(np.int64) >> (4 * i)) & 15 for i in range(8)], axis=-1)
    return nibbles[..., list(AWQ_REVERSE_ORDER)].reshape(words.shape[0], -1)


def vllm_awq_unpack(words: np.ndarray) -> np.ndarray:
    """vLLM's awq_dequantize (Triton): column j of each 8 is shifted right by [0,16,4,20,8,24,12,28][j]."""
    shifts = np.array([0, 16, 4, 20, 8, 24, 12, 28])
    return ((words.astype(np.int64)[..., None] >> shifts) & 15).reshape(words.shape[0], -1)


def _awq(unpack: Callable[[np.ndarray], np.ndarray]) -> Decoder:
    def decode(tensors: Arrays, name: str, quant: Mapping, shape: tuple[int, int]) -> np.ndarray:
        k = shape[1]
        codes, zeros = unpack(tensors[f"{name}.qweight"]), unpack(tensors[f"{name}.qzeros"])
        return _affine(codes, zeros, tensors[f"{name}.scales"], _group_of(quant, k))
    return decode


# --- Marlin (vLLM marlin_utils_test get_weight_perm / marlin_permute_scales, IST-DASLab marlin) ---

def _vllm_marlin_perms() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM's weight permutation (1024 entries) and its two scale permutations (grouped, single)."""
    perm = []
    for lane in range(32):
        column = lane // 4
        rows = [2 * (lane % 4), 2 * (lane % 4) + 1, 2 * (lane % 4 + 4), 2 * (lane % 4 + 4) + 1]
        per_lane = [16 * row + column + 8 * half for half in range(2) for row in rows]
        for tile in range(4):
            perm += [256 * tile + p for p in per_lane]
    weight = np.array(perm).reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].ravel()
    grouped = np.array([i + 8 * j for i in range(8) for j in range(8)])
    single = np.array([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)])
    return weight, grouped, single


MARLIN_WEIGHT_PERM, MARLIN_SCALE_PERM, MARLIN_SCALE_PERM_SINGLE = _vllm_marlin_perms()


def marlin_weight(qweight: np.ndarray, scales: np.ndarray, k: int, n: int, group_size: int) -> np.ndarray:
    """Undo vLLM's marlin_weights (tile, permute, pack 8 per word) and marlin_permute_scales; uint4b8."""
    permuted = unpack_stream(qweight, 4, axis=1).reshape(-1, MARLIN_WEIGHT_PERM.size)
    tiled = np.empty_like(permuted)
    tiled[:, MARLIN_WEIGHT_PERM] = permuted
    codes = tiled.reshape(k // 16, n // 16, 16, 16).transpose(0, 2, 1, 3).reshape(k, n)
    perm = MARLIN_SCALE_PERM if group_size != -1 and group_size < k else MARLIN_SCALE_PERM_SINGLE
    natural = np.empty_like(scales).reshape(-1, perm.size)
    natural[:, perm] = scales.reshape(-1, perm.size)
    natural = natural.reshape(scales.shape)
    groups = np.zeros(k, np.int64) if group_size == -1 else np.arange(k) // group_size
    return _affine(codes, np.full_like(natural, 8, dtype=np.int64), natural, groups)


def _marlin(tensors: Arrays, name: str, quant: Mapping, shape: tuple[int, int]) -> np.ndarray:
    n, k = shape
    return marlin_weight(tensors[f"{name}.qweight"], tensors[f"{name}.scales"], k, n, quant["group_size"])


# CPM.cu's gptq2marlin.py concatenates these GPTQ linears along N (in this order) before the Marlin repack.
CPMCU_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_CPMCU_OWNER = {part: (module, i) for module, parts in CPMCU_PARTS.items() for i, part in enumerate(parts)}


def make_cpmcu_decoder(shapes: Mapping[str, tuple[int, int]]) -> Decoder:
    """CPM.cu reads one fused Marlin GEMM per qkv / gate_up; ``shapes``: linear -> (N, K) of a layer."""
    def decode(tensors: Arrays, name: str, quant: Mapping, shape: tuple[int, int]) -> np.ndarray:
        layer, submodule, projection = name.rsplit(".", 2)
        linear = f"{submodule}.{projection}"
        if linear not in _CPMCU_OWNER:
            return _marlin(tensors, name, quant, shape)
        module, position = _CPMCU_OWNER[linear]
        widths = [shapes[part][0] for part in CPMCU_PARTS[module]]
        fused = marlin_weight(tensors[f"{layer}.{module}.qweight"], tensors[f"{layer}.{module}.scales"],
                              shape[1], sum(widths), quant["group_size"])
        start = sum(widths[:position])
        return fused[start:start + widths[position]]
    return decode


# --- quantkit's ternary planes (docs/formats.md, "Ternary"): bit j of a word is +1, bit 16 + j is -1 ---

def ternary_planes(tensors: Arrays, name: str, quant: Mapping, shape: tuple[int, int]) -> np.ndarray:
    n, k = shape
    words = tensors[f"{name}.qweight"].astype(np.int64) & 0xFFFFFFFF  # [N, K/16]
    lanes = np.arange(16)
    plus = (words[..., None] >> lanes) & 1
    minus = (words[..., None] >> (lanes + 16)) & 1
    trits = (plus - minus).reshape(n, k)
    scales = tensors[f"{name}.scales"].astype(np.float32)  # [N, G]
    return (trits.astype(np.float32) * scales[:, _group_of(quant, k)]).astype(np.float32)


# --- MLX (mx.dequantize): each row of uint32 words one little-endian bit stream, w = scale · q + bias ---

def mlx_affine(tensors: Arrays, name: str, quant: Mapping, shape: tuple[int, int]) -> np.ndarray:
    n, k = shape
    codes = unpack_stream(tensors[f"{name}.weight"], quant["bits"], axis=1)[:, :k]  # [N, K]
    groups = _group_of(quant, k)
    scales, biases = (tensors[f"{name}.{part}"].astype(np.float32)[:, groups] for part in ("scales", "biases"))
    return codes.astype(np.float32) * scales + biases


# --- compressed-tensors pack-quantized: each row of weight_packed one bit stream along K holding q + 2^(b-1),
# the zero points (asymmetric only) one stream down each column of weight_zero_point, w = (q - zp) · scale;
# int-quantized: the int8 weight itself times its channel's scale; float-quantized: each E4M3 byte's value
# (sign, 4 exponent bits biased by 7, 3 mantissa bits; exponent 0 subnormal; S.1111.111 NaN) times its
# row's or the tensor's scale ---

def _e4m3_values() -> np.ndarray:
    """The float32 value of each of the 256 E4M3 bytes, from the bit layout."""
    byte = np.arange(256)
    sign = np.where(byte & 0x80, -1.0, 1.0)
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return np.where((exponent == 0xF) & (mantissa == 0x7), np.nan, sign * magnitude).astype(np.float32)


E4M3_VALUES = _e4m3_values()


def compressed_tensors_packed(tensors: Arrays, name: str, quant: Mapping, shape: tuple[int, int]) -> np.ndarray:
    n, k = shape
    weights = quant["config_groups"]["group_0"]["weights"]
    if quant["format"] == "int-quantized":  # int8 weights as they are, one scale per output channel
        return tensors[f"{name}.weight"].astype(np.float32) * tensors[f"{name}.weight_scale"].astype(np.float32)
    if quant["format"] == "float-quantized":  # E4M3 bytes (read as uint8), a scale per row or one per tensor
        return E4M3_VALUES[tensors[f"{name}.weight"]] * tensors[f"{name}.weight_scale"].astype(np.float32)
    bits, offset = weights["num_bits"], 1 << (weights["num_bits"] - 1)
    signed = unpack_stream(tensors[f"{name}.weight_packed"], bits, axis=1)[:, :k] - offset  # [N, K]
    zero = 0 if weights["symmetric"] else unpack_stream(tensors[f"{name}.weight_zero_point"], bits, axis=0)[:n] - offset
    size = k if weights["strategy"] == "channel" else weights["group_size"]
    scale = tensors[f"{name}.weight_scale"].astype(np.float32)  # [N, G]
    zeros = np.broadcast_to(zero, scale.shape)
    return ((signed.reshape(n, -1, size) - zeros[..., None]).astype(np.float32) * scale[..., None]).reshape(n, k)


def rules_of(format_name: str, shapes: Mapping[str, tuple[int, int]]) -> tuple[ConsumerRule, ...]:
    """The rules of the consumers whose reading of ``format_name`` artifacts is checked."""
    gptq_marlin = ConsumerRule("vLLM gptq_marlin (sym 4/8-bit)", "vLLM gptq_marlin.py, uint4b8/uint8b128",
                               _gptq(gptq_marlin_zeros), _marlin_compatible)
    table = {
        "gptq": (ConsumerRule("AutoGPTQ", "qlinear_cuda_old.py: (zeros + 1) & maxq", _gptq(autogptq_v1_zeros)),
                 ConsumerRule("vLLM gptq", "csrc/quantization/gptq/q_gemm.cu: zeros + zero_offset (1)",
                              _gptq(vllm_v1_zeros)),
                 ConsumerRule("GPTQModel", "utils/model.py: v1->v2 word-wise add", _gptq(gptqmodel_v1_zeros)),
                 gptq_marlin),
        "gptq-v2": (ConsumerRule("GPTQModel / vLLM gptq (v2)", "zero_offset 0: stored zero as is", _gptq(v2_zeros)),
                    gptq_marlin),
        "awq": (ConsumerRule("AutoAWQ", "awq/utils/packing_utils.py: unpack_awq, reverse_awq_order",
                             _awq(autoawq_unpack)),
                ConsumerRule("vLLM awq", "awq_triton.py: awq_dequantize shifts", _awq(vllm_awq_unpack))),
        "marlin": (ConsumerRule("vLLM / IST-DASLab Marlin", "marlin_utils_test.py: get_weight_perm, uint4b8",
                                _marlin),),
        "cpmcu": (ConsumerRule("CPM.cu", "scripts/model_convert/gptq2marlin.py: fused qkv/gate_up Marlin",
                               make_cpmcu_decoder(shapes)),),
        "ternary": (ConsumerRule("quantkit runtime (documented planes)", "docs/formats.md, Ternary",
                                 ternary_planes),),
        "compressed-tensors": (ConsumerRule(
            "compressed-tensors / vLLM wNa16, w8a8, fp8",
            "compressors: pack_quantized unpack_from_int32, int_quantized, float_quantized; dequantize",
            compressed_tensors_packed),),
        "mlx": (ConsumerRule("mlx / mlx-lm", "mlx/backend/cpu/quantized.cpp: dequantize, scale * q + bias",
                             mlx_affine),),
    }
    if format_name not in table:
        raise ValueError(f"no consumer rules for format {format_name!r} (GGUF files are checked against llama.cpp "
                         f"itself by the test suite); rules exist for {', '.join(table)}")
    return table[format_name]


@dataclass
class ConsumerCheck:
    consumer: str
    source: str
    linears: int = 0
    mismatched: list[str] = field(default_factory=list)
    max_abs_diff: float = 0.0

    @property
    def identical(self) -> bool:
        return self.linears > 0 and not self.mismatched


def compare(check: ConsumerCheck, name: str, theirs: np.ndarray, ours: np.ndarray) -> None:
    """Count one linear: identical means equal bits (NaN nowhere, same shape)."""
    check.linears += 1
    if theirs.shape != ours.shape or not np.array_equal(theirs, ours):
        check.mismatched.append(name)
        if theirs.shape == ours.shape:
            check.max_abs_diff = max(check.max_abs_diff, float(np.abs(theirs.astype(np.float64) - ours).max()))
        else:
            check.max_abs_diff = float("inf")


@dataclass
class ConformanceReport:
    artifact: str
    format: str
    quantization_config: dict
    checks: list[ConsumerCheck]
    quantkit_error: str | None = None  # quantkit refused to read the artifact (e.g. an ambiguous zero)

    @property
    def passed(self) -> bool:
        applicable = [c for c in self.checks if c.linears]
        return self.quantkit_error is None and bool(applicable) and all(c.identical for c in applicable)

    def as_dict(self) -> dict:
        checks = [{"consumer": c.consumer, "source": c.source, "linears": c.linears, "identical": c.identical,
                   "mismatched": c.mismatched[:20], "mismatched_count": len(c.mismatched),
                   "max_abs_diff": c.max_abs_diff} for c in self.checks]
        return {"artifact": self.artifact, "format": self.format, "quantization_config": self.quantization_config,
                "quantkit_error": self.quantkit_error, "passed": self.passed, "consumers": checks}


# what NumPy, which has neither, is given for a bfloat16 tensor (MLX's scales in a bfloat16 model: float32,
# exactly) and an E4M3 one (its bytes: the consumer's rule decodes them)
_NUMPY_STAND_INS = {torch.bfloat16: lambda t: t.float(), torch.float8_e4m3fn: lambda t: t.view(torch.uint8)}


def _numpy(tensors: Mapping) -> dict[str, np.ndarray]:
    return {name: _NUMPY_STAND_INS.get(t.dtype, lambda t: t)(t).numpy() for name, t in tensors.items()}


def check_conformance(model_dir: str | Path) -> ConformanceReport:
    """Decode every quantized linear of ``model_dir`` with each consumer's rule and compare with
    quantkit's reading. Where quantkit refuses a layer (an ambiguous zero point, say), its linears
    are compared with the first consumer's reading instead, which shows whether the consumers at
    least agree with each other."""
    from quantkit.reader import ArtifactReader, dequantize_layer

    artifact = ArtifactReader(model_dir)
    if artifact.format is None:
        raise ValueError(f"{model_dir} is not quantized: there is nothing for a consumer to decode")
    quant = artifact.quantization_config
    rules = [rule for rule in rules_of(artifact.format.name, artifact.shapes) if rule.applies(quant)]
    report = ConformanceReport(str(model_dir), artifact.format.name, dict(quant),
                               [ConsumerCheck(rule.name, rule.source) for rule in rules])
    for index in range(artifact.num_layers):
        stored = artifact.layer_tensors(index)
        try:
            ours = dequantize_layer(stored, index, artifact.config, artifact.qconfig, artifact.format)
        except (ValueError, KeyError) as error:
            report.quantkit_error = report.quantkit_error or f"layer {index}: {str(error).strip(chr(39))}"
            ours = None
        arrays = _numpy(stored)
        for linear, shape in artifact.shapes.items():
            name = f"{layer_prefix(index)}{linear}"
            decoded = [rule.decode(arrays, name, quant, shape) for rule in rules]
            reference = ours[f"{name}.weight"].numpy() if ours is not None else decoded[0]
            for check, theirs in zip(report.checks, decoded):
                compare(check, f"{name}.weight", theirs, reference)
    return report
