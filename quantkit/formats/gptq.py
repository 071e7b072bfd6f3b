"""GPTQ checkpoint tensors (AutoGPTQ / GPTQModel), ``checkpoint_format`` "gptq" (v1) or "gptq_v2".

Per linear: ``qweight`` int32 [K·bits/32, N] (codes packed down each column, along the input dim),
``qzeros`` int32 [G, N·bits/32] (packed along the output dim), ``scales`` fp16 [G, N],
``g_idx`` int32 [K]. Packing is an LSB-first bit stream: value j of a run occupies bits
[bits·j, bits·j + bits) of the run's words, so 3-bit values straddle words (32 values -> 3 words)
while 2/4/8-bit values never do.

v1 stores zero − 1 and v2 the zero itself. In v1 a zero of 0 would be stored as −1, which the
consumers decode three different ways (masked back to 0 by AutoGPTQ, 2^bits by vLLM's kernels, a
carry into the neighbouring field by GPTQModel's word-wise v1→v2 conversion), so v1 holds zeros in
[1, maxq] only: the writer refuses a record with a zero of 0 and the reader refuses a stored field of
all ones as ambiguous. See docs/formats.md, "GPTQ zero points".
"""
from __future__ import annotations

import math
import sys
from dataclasses import replace
from importlib.metadata import version
from typing import Any, Mapping

import torch
from torch import Tensor

from quantkit.formats.base import Format, tensor_key
from quantkit.formats.consumers import QUANTKIT, SGLANG, TRANSFORMERS, VLLM
from quantkit.quant import SUPPORTED_BITS, QuantConfig, QuantizedTensor

TENSOR_NAMES = ("qweight", "qzeros", "scales", "g_idx")
# checkpoint_format -> what is subtracted from each zero point before it is packed
ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}
_WORD_MASK = 0xFFFFFFFF


def _run(bits: int) -> tuple[int, int]:
    """(values, int32 words) of the smallest whole run: (8, 1) at 4 bits, (32, 3) at 3 bits."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    common = math.gcd(bits, 32)
    return 32 // common, bits // common


def values_per_run(bits: int) -> int:
    """How many values a packed dimension must be a multiple of."""
    return _run(bits)[0]


def _as_int32(words: Tensor) -> Tensor:
    """Reinterpret uint32 values held in int64 as the signed int32 that safetensors stores."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(values: Tensor, bits: int) -> Tensor:
    """Pack integer ``values`` [M, C] along dim 0 -> int32 [M·bits/32, C]; each value masked to ``bits``."""
    per_run, words_per_run = _run(bits)
    if values.dim() != 2:
        raise ValueError(f"pack_rows expects a 2-D tensor, got shape {tuple(values.shape)}")
    rows, cols = values.shape
    if rows % per_run:
        raise ValueError(f"cannot pack {rows} rows at {bits} bits: need a multiple of {per_run}")
    if _byte_aligned(bits):
        return _pack_rows_bytewise(values, bits)
    return _pack_rows_wordwise(values, bits)


# Widths whose values never straddle a byte, on a host that stores int32 little-endian: a word's four
# bytes are then consecutive runs of values, so packing is byte arithmetic and a view (an 8B down_proj
# in 0.17 s instead of 2.0 s, one thread); 3 bits (and big-endian hosts) go word by word.
def _byte_aligned(bits: int) -> bool:
    return 8 % bits == 0 and sys.byteorder == "little"


def _pack_rows_bytewise(values: Tensor, bits: int) -> Tensor:
    rows, cols = values.shape
    per_byte = 8 // bits
    v = (values & (2**bits - 1)).to(torch.uint8).reshape(rows // per_byte, per_byte, cols)
    packed = v[:, 0].clone()
    for j in range(1, per_byte):
        packed |= v[:, j] << (bits * j)
    # four consecutive bytes (rows) of a column form its word, least significant first
    return packed.reshape(-1, 4, cols).transpose(1, 2).reshape(-1, 4).view(torch.int32).reshape(-1, cols)


def _pack_rows_wordwise(values: Tensor, bits: int) -> Tensor:
    rows, cols = values.shape
    per_run, words_per_run = _run(bits)
    v = (values.to(torch.int64) & (2**bits - 1)).reshape(rows // per_run, per_run, cols)
    words = torch.zeros(rows // per_run, words_per_run, cols, dtype=torch.int64, device=values.device)
    for j in range(per_run):
        word, shift = divmod(bits * j, 32)
        words[:, word] |= (v[:, j] << shift) & _WORD_MASK
        if shift + bits > 32:  # 3-bit: the high bits continue at the bottom of the next word
            words[:, word + 1] |= v[:, j] >> (32 - shift)
    return _as_int32(words.reshape(-1, cols))


def unpack_rows(words: Tensor, bits: int) -> Tensor:
    """Inverse of ``pack_rows``: int32 [W, C] -> uint8 [W·32/bits, C]."""
    per_run, words_per_run = _run(bits)
    if words.dim() != 2 or words.dtype != torch.int32:
        raise ValueError(f"unpack_rows expects a 2-D int32 tensor, got {words.dtype} {tuple(words.shape)}")
    n_words, cols = words.shape
    if n_words % words_per_run:
        raise ValueError(f"cannot unpack {n_words} words at {bits} bits: need a multiple of {words_per_run}")
    if _byte_aligned(bits):
        per_byte = 8 // bits
        packed = words.reshape(-1).view(torch.uint8).reshape(n_words, cols, 4).transpose(1, 2)  # [W, 4, C]
        values = torch.stack([(packed >> (bits * j)) & (2**bits - 1) for j in range(per_byte)], dim=2)
        return values.reshape(-1, cols)
    u = (words.to(torch.int64) & _WORD_MASK).reshape(n_words // words_per_run, words_per_run, cols)
    values = torch.empty(n_words // words_per_run, per_run, cols, dtype=torch.int64)
    for j in range(per_run):
        word, shift = divmod(bits * j, 32)
        field = u[:, word] >> shift
        if shift + bits > 32:
            field = field | (u[:, word + 1] << (32 - shift))
        values[:, j] = field & (2**bits - 1)
    return values.reshape(-1, cols).to(torch.uint8)


def pack_cols(values: Tensor, bits: int) -> Tensor:
    """Pack integer ``values`` [R, M] along dim 1 -> int32 [R, M·bits/32] (the qzeros layout)."""
    return pack_rows(values.T, bits).T.contiguous()


def unpack_cols(words: Tensor, bits: int) -> Tensor:
    return unpack_rows(words.T, bits).T.contiguous()


def _require_packable(what: str, size: int, bits: int, prefix: str) -> None:
    per_run = values_per_run(bits)
    if size % per_run:
        raise ValueError(
            f"{prefix or 'tensor'}: {what} = {size} is not a multiple of {per_run}, "
            f"which {bits}-bit GPTQ packing requires"
        )


def check_packable(in_features: int, out_features: int, config: QuantConfig, prefix: str) -> None:
    """Raise before quantizing if a linear of this shape cannot be written in this format."""
    _require_packable("in_features K", in_features, config.bits, prefix)
    _require_packable("out_features N", out_features, config.bits, prefix)


def storable_grid(config: QuantConfig, checkpoint_format: str) -> QuantConfig:
    """The grid a linear must be rounded to so that ``checkpoint_format`` stores it unambiguously."""
    if ZERO_OFFSETS[checkpoint_format] and not config.sym:
        return replace(config, min_zero=ZERO_OFFSETS[checkpoint_format])
    return config


def gptq_tensors(qt: QuantizedTensor, prefix: str, checkpoint_format: str = "gptq") -> dict[str, Tensor]:
    """``{prefix}.qweight/.qzeros/.scales/.g_idx`` for one linear (``prefix`` = its module name)."""
    n, k = qt.shape
    bits = qt.config.bits
    check_packable(k, n, qt.config, prefix)
    offset = ZERO_OFFSETS[checkpoint_format]
    keys = {name: tensor_key(prefix, name) for name in TENSOR_NAMES}
    if int(qt.zeros.min()) < offset:
        raise ValueError(
            f"{prefix or 'linear'}: a zero point of 0 cannot be stored in checkpoint_format {checkpoint_format!r} "
            "(it stores zero - 1, which consumers decode differently); quantkit's gptq format quantizes onto "
            "zero points in [1, maxq], or write format gptq-v2"
        )
    return {
        keys["qweight"]: pack_rows(qt.codes.T, bits),
        keys["qzeros"]: pack_cols(qt.zeros.to(torch.int64) - offset, bits),
        keys["scales"]: qt.scales.contiguous(),
        keys["g_idx"]: qt.g_idx.contiguous(),
    }


def _fetch(tensors: Mapping[str, Tensor], key: str, dtype: torch.dtype) -> Tensor:
    if key not in tensors:
        raise KeyError(f"GPTQ tensor {key!r} is missing")
    tensor = tensors[key]
    if tensor.dtype != dtype:
        raise ValueError(f"GPTQ tensor {key!r} must be {dtype}, got {tensor.dtype}")
    return tensor


def _expect_shape(tensor: Tensor, key: str, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"GPTQ tensor {key!r} must have shape {shape}, got {tuple(tensor.shape)}")


def read_gptq_tensors(tensors: Mapping[str, Tensor], prefix: str, config: QuantConfig,
                      checkpoint_format: str = "gptq") -> QuantizedTensor:
    """Exact inverse of ``gptq_tensors``: validates each tensor, then decodes zeros per field."""
    bits = config.bits
    per_run, words_per_run = _run(bits)
    keys = {name: tensor_key(prefix, name) for name in TENSOR_NAMES}
    qweight = _fetch(tensors, keys["qweight"], torch.int32)
    if qweight.dim() != 2 or qweight.shape[0] % words_per_run:
        raise ValueError(
            f"GPTQ tensor {keys['qweight']!r} must be 2-D with a row count divisible by {words_per_run} "
            f"at {bits} bits, got shape {tuple(qweight.shape)}"
        )
    k = qweight.shape[0] // words_per_run * per_run
    n = qweight.shape[1]
    if n % per_run:
        raise ValueError(
            f"GPTQ tensor {keys['qweight']!r}: out_features {n} is not a multiple of {per_run}, "
            f"so qzeros cannot be packed at {bits} bits"
        )
    groups = config.num_groups(k)
    qzeros = _fetch(tensors, keys["qzeros"], torch.int32)
    _expect_shape(qzeros, keys["qzeros"], (groups, n // per_run * words_per_run))
    scales = _fetch(tensors, keys["scales"], torch.float16)
    _expect_shape(scales, keys["scales"], (groups, n))
    g_idx = _fetch(tensors, keys["g_idx"], torch.int32)
    _expect_shape(g_idx, keys["g_idx"], (k,))

    stored_zeros = unpack_cols(qzeros, bits).to(torch.int64)
    offset = ZERO_OFFSETS[checkpoint_format]
    if offset:
        ambiguous = int((stored_zeros == 2**bits - 1).sum())
        if ambiguous:
            raise ValueError(
                f"GPTQ tensor {keys['qzeros']!r}: {ambiguous} group(s) store a zero field of all ones, which "
                f"checkpoint_format {checkpoint_format!r} leaves ambiguous (zero 0 to AutoGPTQ, {2**bits} to vLLM's "
                "kernels, a carry into the next field in GPTQModel); re-quantize, or write gptq_v2"
            )
    zeros = (stored_zeros + offset).to(torch.uint8)
    codes = unpack_rows(qweight, bits).T.contiguous()
    return QuantizedTensor(codes, scales.contiguous(), zeros, g_idx.contiguous(), config)


def quantization_config(
    config: QuantConfig,
    *,
    desc_act: bool = False,
    static_groups: bool = False,
    damp_percent: float | None = None,
    true_sequential: bool = True,
    quantizer: str | None = None,
    checkpoint_format: str = "gptq",
) -> dict[str, Any]:
    """The ``config.json["quantization_config"]`` / ``quantize_config.json`` dict.

    ``damp_percent`` is left out when None (RTN): AutoGPTQ's loader rejects a null value.
    ``quantizer`` defaults to ``"quantkit:<installed version>"``.
    """
    result: dict[str, Any] = {
        "bits": config.bits,
        "group_size": config.group_size,
        "desc_act": bool(desc_act),
        "sym": config.sym,
        "lm_head": False,
        "quant_method": "gptq",
        "checkpoint_format": checkpoint_format,
        "pack_dtype": "int32",
        "static_groups": bool(static_groups),
        "true_sequential": bool(true_sequential),
        "meta": {"quantizer": [quantizer or f"quantkit:{version('quantkit')}"]},
    }
    if damp_percent is not None:
        result["damp_percent"] = float(damp_percent)
    return result


def checkpoint_format_of(d: Mapping[str, Any]) -> str:
    """``checkpoint_format`` of a GPTQ quantization config; missing means v1 (old AutoGPTQ files omit it)."""
    checkpoint_format = d.get("checkpoint_format", "gptq")
    if checkpoint_format not in ZERO_OFFSETS:
        raise ValueError(
            f"checkpoint_format {checkpoint_format!r} is not supported; only {', '.join(map(repr, ZERO_OFFSETS))} are"
        )
    return checkpoint_format


def parse_quantization_config(d: Mapping[str, Any]) -> tuple[QuantConfig, bool]:
    """(QuantConfig on the format's storable grid, desc_act) from a GPTQ quantization config.

    A missing ``quant_method`` means GPTQ (old AutoGPTQ files omit it).
    """
    method = d.get("quant_method", "gptq")
    if method != "gptq":
        raise ValueError(f"quant_method {method!r} is not supported here; only 'gptq' is")
    if d.get("is_marlin_format"):
        raise ValueError("is_marlin_format: true marks a Marlin checkpoint, not GPTQ v1")
    checkpoint_format = checkpoint_format_of(d)
    if d.get("pack_dtype", "int32") != "int32":
        raise ValueError(f"pack_dtype {d['pack_dtype']!r} is not supported; only 'int32' is")
    if d.get("lm_head", False):
        raise ValueError("lm_head: true (a quantized lm_head) is not supported")
    if d.get("dynamic"):
        raise ValueError("per-module 'dynamic' overrides are not supported")
    missing = [key for key in ("bits", "group_size", "sym", "desc_act") if key not in d]
    if missing:
        raise ValueError(f"GPTQ quantization config lacks required key(s): {', '.join(missing)}")
    if not isinstance(d["desc_act"], bool):
        raise ValueError(f"desc_act must be a bool, got {d['desc_act']!r}")
    config = QuantConfig(bits=d["bits"], group_size=d["group_size"], sym=d["sym"])
    return storable_grid(config, checkpoint_format), d["desc_act"]


class GPTQLayout(Format, abstract=True):
    """The GPTQ tensors, in the ``checkpoint_format`` of a subclass."""

    checkpoint_format: str
    suffixes = TENSOR_NAMES

    def check(self, config, in_features, out_features, desc_act, name):
        check_packable(in_features, out_features, config, name)

    def write_linear(self, record, module):
        return gptq_tensors(record, module, self.checkpoint_format)

    def read_linear(self, tensors, module, config, shape):
        return read_gptq_tensors(tensors, module, config, self.checkpoint_format)

    def quantization_config(self, config, **settings):
        return quantization_config(config, checkpoint_format=self.checkpoint_format, **settings)

    def parse_config(self, quantization_config):
        return parse_quantization_config(quantization_config)[0]

    def target(self, config, linear, layer, model, shape):
        return storable_grid(config, self.checkpoint_format)


class GPTQ(GPTQLayout):
    name = "gptq"
    checkpoint_format = "gptq"
    list_order = 10
    summary = ("AutoGPTQ/GPTQModel checkpoint_format 'gptq' (vLLM, transformers, GPTQModel); "
               "asymmetric zero points kept in [1, maxq], which v1 stores unambiguously")
    reads = (("gptq", "gptq"), ("gptq", None))
    consumers = (TRANSFORMERS, VLLM, SGLANG, QUANTKIT)
    draft_head_fc = "gptq"


class GPTQv2(GPTQLayout):
    name = "gptq-v2"
    checkpoint_format = "gptq_v2"
    list_order = 11
    summary = ("GPTQModel checkpoint_format 'gptq_v2' (zero points stored as they are; GPTQModel, vLLM's gptq "
               "path): the full asymmetric grid")
    reads = (("gptq", "gptq_v2"),)
    consumers = (VLLM, SGLANG, QUANTKIT)
