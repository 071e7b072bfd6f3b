"""4-bit linears on the CPU: PyTorch's packed int4 kernel for decode, AMX bf16 matmuls for prefill.

Measured on this machine's Xeon (2 threads; ``python -m quantkit.eval.bench.bench_linear``): for one row,
``_weight_int4pack_mm_for_cpu`` streams int4 weights 2.6-3.4x faster than a bf16 GEMV. A few rows use
the packed kernel and more rows multiply by the bf16 dequantized weight (``PackedLinear``; kept when
``keep_dequantized``, else rebuilt from the nibbles on each call).

The packed kernel computes ``w = (q - 8) * s + z`` per group of 32/64/128/256 input channels with
bf16 scale and offset; a GPTQ grid ``(q - zero) * s`` is that with ``z = (8 - zero) * s``. Act-order
(``g_idx`` not monotonic) becomes a column permutation applied to the input; a ragged last group
(K = 576 with group 128) is packed in smaller groups that repeat its scale.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from quantkit.kernels.linear.packed import PackedLinear, fused_bias

from quantkit.quant import QuantizedTensor

PACK_GROUP_SIZES = (256, 128, 64, 32)  # what the packed kernel accepts, largest first
INNER_K_TILES = 2


def pack_group_size(group_size: int, in_features: int) -> int:
    """The largest packed-kernel group that tiles the record's groups and K, so that no zero columns
    are needed (K = 576 with group 128 packs as groups of 64, each with its group-128 scale); a K
    that no size divides is padded to the record's own group size (or 256 when per-channel)."""
    span = in_features if group_size == -1 else math.gcd(group_size, in_features)
    fitting = [size for size in PACK_GROUP_SIZES if span % size == 0]
    if fitting:
        return fitting[0]
    return 256 if group_size == -1 else group_size


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def _unpack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    return torch.stack((nibbles & 15, nibbles >> 4), dim=-1).flatten(1)


class Int4Linear(PackedLinear):
    """y = x W^T (+ bias) with W = (q - 8) * s + z per group; q in natural column order after ``perm``."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
                 in_features: int, perm: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 keep_dequantized: bool = True):
        """codes uint8 [N, Kp] (Kp a multiple of group_size, K <= Kp, padding columns ignored);
        scales and offsets float32 [Kp / group_size, N]; perm int64 [K] or None."""
        super().__init__()
        self.out_features, self.padded_in = codes.shape
        self.in_features, self.group_size = in_features, group_size
        self.register_buffer("nibbles", _pack_nibbles(codes))
        self.register_buffer("scale_offset", torch.stack((scales, offsets), dim=-1).float())
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), INNER_K_TILES))
        self.register_buffer("scale_offset_bf16", self.scale_offset.bfloat16())
        self.register_buffer("perm", perm)
        self.register_buffer("bias", None if bias is None else bias.float())
        self.keep_dequantized = keep_dequantized
        self.backend = "cpu"

    @classmethod
    def from_record(cls, record: QuantizedTensor, bias: torch.Tensor | None = None,
                    keep_dequantized: bool = True) -> "Int4Linear":
        if record.config.bits != 4:
            raise ValueError(f"Int4Linear needs 4-bit codes, got {record.config.bits}-bit")
        n, k = record.shape
        g_idx = record.g_idx.long()
        perm = None
        if bool((g_idx[1:] < g_idx[:-1]).any()):  # act-order: sort channels by group
            perm = torch.argsort(g_idx, stable=True)
        pack_group = pack_group_size(record.config.group_size, k)
        padded = -(-k // pack_group) * pack_group
        ordered = g_idx if perm is None else g_idx[perm]
        # group of every padded column: padding columns belong to the last group (their input is 0)
        column_group = F.pad(ordered, (0, padded - k), value=int(ordered[-1]))
        first_of_pack_group = column_group[::pack_group]
        scales = record.scales.float()[first_of_pack_group]                      # [Kp/pg, N]
        offsets = (8 - record.zeros.float()[first_of_pack_group]) * scales
        codes = record.codes if perm is None else record.codes[:, perm]
        codes = F.pad(codes, (0, padded - k), value=8)
        return cls(codes, scales, offsets, pack_group, k, perm, bias, keep_dequantized)

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step reads: the packed codes and the bf16 scale/offset pairs."""
        return self.packed.numel() * self.packed.element_size() + self.scale_offset_bf16.numel() * 2

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, Kp] as the packed kernel computes it (bf16 scale and offset), in ``dtype``."""
        codes = _unpack_nibbles(self.nibbles).float()
        pairs = self.scale_offset_bf16.float().repeat_interleave(self.group_size, dim=0)  # [Kp, N, 2]
        return ((codes - 8) * pairs[..., 0].T + pairs[..., 1].T).to(dtype)

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.padded_in != self.in_features:
            x = F.pad(x, (0, self.padded_in - self.in_features))
        return x

    def decode(self, rows: torch.Tensor) -> torch.Tensor | None:
        if rows.dtype != torch.bfloat16:
            return None
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scale_offset_bf16)

    @classmethod
    def fuse(cls, modules: list["Int4Linear"]) -> "Int4Linear | None":
        """One module for linears sharing an input (q/k/v, gate/up): concatenated output rows.
        Possible when none permutes its input and the groups agree."""
        first = modules[0]
        if any(m.perm is not None or m.group_size != first.group_size or m.padded_in != first.padded_in
               for m in modules):
            return None
        fusable, bias = fused_bias(modules)
        if not fusable:
            return None
        codes = torch.cat([_unpack_nibbles(m.nibbles) for m in modules])
        pairs = torch.cat([m.scale_offset for m in modules], dim=1)
        return cls(codes, pairs[..., 0], pairs[..., 1], first.group_size, first.in_features, None, bias,
                   first.keep_dequantized)
