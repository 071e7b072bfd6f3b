"""Marlin W4A16 weight layout: IST-DASLab marlin, vLLM gptq_marlin (after its repack), CPM.cu.

Per linear (K = in_features, N = out_features; see docs/formats.md, "Marlin"):

- ``qweight`` int32 [K/16, 2N]: the GPTQ codes as a [K, N] matrix, cut into 16×16 tiles laid out
  tile by tile; each run of 1024 tiled values (four tiles side by side) is permuted by
  ``WEIGHT_PERM`` so that every warp thread's MMA fragment is contiguous; then 8 values per word,
  LSB first — the same packing as GPTQ's ``qzeros`` columns.
- ``scales`` fp16 [G, N], permuted within runs of 64 (several groups) or 32 (a single group).

The type is symmetric uint4b8 (``w = (q - 8)·scale``) with groups in natural channel order, so
neither ``qzeros`` nor ``g_idx`` is stored.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch import Tensor

from quantkit.formats import gptq
from quantkit.formats.base import Format, fetch_packed, tensor_key
from quantkit.quant import QuantConfig, QuantizedTensor, default_g_idx

BITS = 4
ZERO_POINT = 8  # uint4b8: the zero point every symmetric 4-bit group has
GROUP_SIZES = (128, -1)
K_MULTIPLE, N_MULTIPLE = 128, 64  # the kernels' thread-block tile (vLLM verify_marlin_supports_shape)
TILE = 16

# Nibbles i and i+4 of a word hold fragment entries 2i and 2i+1, so one 0x000F000F mask (a lop3)
# turns a word into an fp16 pair the MMA consumes as is.
NIBBLE_INTERLEAVE = (0, 2, 4, 6, 1, 3, 5, 7)


def _weight_perm() -> Tensor:
    """Thread t of the 32-thread warp owns rows 2(t%4), 2(t%4)+1, 2(t%4)+8, 2(t%4)+9 of tile
    columns t//4 and t//4+8, in each of 4 adjacent tiles (index 16·row + column + 256·tile)."""
    order = []
    for thread in range(32):
        base_row, column = 2 * (thread % 4), thread // 4
        rows = (base_row, base_row + 1, base_row + 8, base_row + 9)
        fragment = [TILE * row + column + 8 * half for half in (0, 1) for row in rows]
        for tile in range(4):
            order.extend(TILE * TILE * tile + index for index in fragment)
    return torch.tensor(order).reshape(-1, 8)[:, list(NIBBLE_INTERLEAVE)].reshape(-1)


WEIGHT_PERM = _weight_perm()  # a permutation of range(1024); WEIGHT_PERM[:4] == [0, 128, 8, 136]
# Several groups: each run of 64 columns is read as an 8×8 block, transposed.
SCALE_PERM_GROUPED = torch.tensor([i + 8 * j for i in range(8) for j in range(8)])
# One group spanning K: runs of 32 columns read in pairs 0,1,8,9,16,17,24,25, then the same +2, +4, +6.
SCALE_PERM_SINGLE = torch.tensor([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)])


class _Facts(NamedTuple):
    bits: int
    sym: bool
    group_size: int
    desc_act: bool
    k: int
    n: int


# (rule, holds?, what was found): every rule a linear must satisfy to be Marlin-packed.
_CONFIG_RULES: tuple[tuple[str, Callable[[_Facts], bool], str], ...] = (
    ("symmetric quantization only", lambda f: f.sym, "sym={sym}"),
    ("4-bit only", lambda f: f.bits == BITS, "bits={bits}"),
    ("group size 128 or -1", lambda f: f.group_size in GROUP_SIZES, "group_size={group_size}"),
    ("no act-order", lambda f: not f.desc_act, "desc_act={desc_act}"),
)
_SHAPE_RULES: tuple[tuple[str, Callable[[_Facts], bool], str], ...] = (
    (f"K % {K_MULTIPLE} == 0", lambda f: f.k % K_MULTIPLE == 0, "in_features K={k}"),
    (f"N % {N_MULTIPLE} == 0", lambda f: f.n % N_MULTIPLE == 0, "out_features N={n}"),
)


def _enforce(rules, facts: _Facts, name: str) -> None:
    broken = [f"{rule} ({found.format(**facts._asdict())})" for rule, holds, found in rules if not holds(facts)]
    if broken:
        raise ValueError(f"{name or 'linear'}: cannot use the Marlin format: " + "; ".join(broken))


def check_marlin(config: QuantConfig, in_features: int, out_features: int, desc_act: bool = False,
                 name: str = "") -> None:
    """Raise a ValueError naming ``name`` and every Marlin rule this linear breaks.

    Called before quantizing, so an unpackable model fails in seconds, not after hours.
    """
    if in_features < 1 or out_features < 1:
        raise ValueError(f"{name or 'linear'}: in/out features must be positive, got K={in_features}, "
                         f"N={out_features}")
    facts = _Facts(config.bits, config.sym, config.group_size, bool(desc_act), in_features, out_features)
    _enforce(_CONFIG_RULES + _SHAPE_RULES, facts, name)


def marlin_shapes(in_features: int, out_features: int, group_size: int) -> dict[str, tuple[int, int]]:
    """Shape of each stored tensor, by tensor name."""
    groups = QuantConfig(BITS, group_size, sym=True).num_groups(in_features)
    return {"qweight": (in_features // TILE, out_features * TILE * BITS // 32), "scales": (groups, out_features)}


def pack_codes(codes: Tensor) -> Tensor:
    """Codes uint8 [N, K] (values 0..15) -> Marlin ``qweight`` int32 [K/16, 2N]."""
    n, k = codes.shape
    tiles = codes.T.reshape(k // TILE, TILE, n // TILE, TILE).permute(0, 2, 1, 3)
    permuted = tiles.reshape(-1, WEIGHT_PERM.numel())[:, WEIGHT_PERM]
    return gptq.pack_cols(permuted.reshape(k // TILE, n * TILE), BITS)


def unpack_codes(qweight: Tensor, in_features: int, out_features: int) -> Tensor:
    """Inverse of ``pack_codes``: int32 [K/16, 2N] -> uint8 [N, K]."""
    k, n = in_features, out_features
    permuted = gptq.unpack_cols(qweight, BITS).reshape(-1, WEIGHT_PERM.numel())
    tiles = torch.empty_like(permuted)
    tiles[:, WEIGHT_PERM] = permuted
    return tiles.reshape(k // TILE, n // TILE, TILE, TILE).permute(1, 3, 0, 2).reshape(n, k)


def _scale_perm(num_groups: int) -> Tensor:
    return SCALE_PERM_GROUPED if num_groups > 1 else SCALE_PERM_SINGLE


def permute_scales(scales: Tensor) -> Tensor:
    """GPTQ scales [G, N] -> Marlin order (G > 1 is the kernels' ``group_size < K`` case)."""
    perm = _scale_perm(scales.shape[0])
    return scales.reshape(-1, perm.numel())[:, perm].reshape(scales.shape)


def unpermute_scales(scales: Tensor) -> Tensor:
    perm = _scale_perm(scales.shape[0])
    restored = torch.empty_like(scales).reshape(-1, perm.numel())
    restored[:, perm] = scales.reshape(-1, perm.numel())
    return restored.reshape(scales.shape)


def _require_natural_sym_grid(qt: QuantizedTensor, prefix: str) -> None:
    """Marlin stores no zeros and no g_idx: refuse a record those would have to carry."""
    n, k = qt.shape
    if not torch.equal(qt.g_idx, default_g_idx(k, qt.config.group_size)):
        raise ValueError(f"{prefix or 'linear'}: Marlin needs g_idx in natural order (k // group_size); "
                         "this record has an act-order g_idx")
    if not bool((qt.zeros == ZERO_POINT).all()):
        raise ValueError(f"{prefix or 'linear'}: Marlin (uint4b8) needs every zero point to be {ZERO_POINT}")


def marlin_tensors(qt: QuantizedTensor, prefix: str) -> dict[str, Tensor]:
    """``{prefix}.qweight`` and ``{prefix}.scales`` for one linear (``prefix`` = its module name)."""
    n, k = qt.shape
    check_marlin(qt.config, k, n, name=prefix)
    _require_natural_sym_grid(qt, prefix)
    return {tensor_key(prefix, "qweight"): pack_codes(qt.codes),
            tensor_key(prefix, "scales"): permute_scales(qt.scales)}


def read_marlin_tensors(tensors: Mapping[str, Tensor], prefix: str, in_features: int, out_features: int,
                        group_size: int) -> tuple[Tensor, Tensor]:
    """Exact inverse of ``marlin_tensors``: (codes uint8 [N, K], scales fp16 [G, N])."""
    check_marlin(QuantConfig(BITS, group_size, sym=True), in_features, out_features, name=prefix)
    shapes = marlin_shapes(in_features, out_features, group_size)
    qweight = fetch_packed(tensors, tensor_key(prefix, "qweight"), torch.int32, shapes["qweight"], "Marlin")
    scales = fetch_packed(tensors, tensor_key(prefix, "scales"), torch.float16, shapes["scales"], "Marlin")
    return unpack_codes(qweight, in_features, out_features), unpermute_scales(scales)


def symmetric_record(codes: Tensor, scales: Tensor, config: QuantConfig) -> QuantizedTensor:
    """Marlin stores neither zero points (always 8) nor g_idx (natural order): restore them."""
    zeros = torch.full_like(scales, ZERO_POINT, dtype=torch.uint8)
    return QuantizedTensor(codes, scales, zeros, default_g_idx(codes.shape[1], config.group_size), config)


def read_record(tensors: Mapping[str, Tensor], prefix: str, config: QuantConfig,
                shape: tuple[int, int]) -> QuantizedTensor:
    """The record behind ``{prefix}.qweight/.scales`` of a linear of ``shape`` (N, K)."""
    n, k = shape
    return symmetric_record(*read_marlin_tensors(tensors, prefix, k, n, config.group_size), config)


def quantization_config(config: QuantConfig, *, desc_act: bool = False, static_groups: bool = True,
                        damp_percent: float | None = None, true_sequential: bool = True,
                        quantizer: str | None = None) -> dict[str, Any]:
    """``config.json["quantization_config"]`` of a Marlin (CPM.cu) checkpoint.

    CPM.cu's own Marlin checkpoints keep the GPTQ source's config unchanged (docs/formats.md, "CPM.cu"); CPM.cu
    reads ``group_size`` from it, and its converter insists on a top-level ``static_groups: true``
    (its guarantee of natural group order, which every Marlin record has). vLLM's legacy
    ``"marlin"`` method would instead want tensors named ``B``/``s`` and is gone from recent vLLM.
    ``static_groups`` is accepted for the formats' common signature: Marlin groups always are.
    """
    _enforce(_CONFIG_RULES, _Facts(config.bits, config.sym, config.group_size, desc_act, 0, 0), "quantization_config")
    return gptq.quantization_config(config, desc_act=False, static_groups=True, damp_percent=damp_percent,
                                    true_sequential=true_sequential, quantizer=quantizer)


def parse_config(d: Mapping[str, Any]) -> QuantConfig:
    """A Marlin artifact keeps its GPTQ source's quantization config."""
    return gptq.parse_quantization_config(d)[0]


SUFFIXES = ("qweight", "scales")


class Marlin(Format):
    name = "marlin"
    list_order = 30
    summary = "Marlin W4A16 tile layout (vLLM gptq_marlin after repack, IST-DASLab kernels)"
    suffixes = SUFFIXES
    draft_head_fc = "marlin"
    stored_layout = "marlin"  # Triton's Marlin kernel reads the tiles as they are
    check = staticmethod(check_marlin)
    write_linear = staticmethod(marlin_tensors)
    read_linear = staticmethod(read_record)
    quantization_config = staticmethod(quantization_config)
    parse_config = staticmethod(parse_config)
