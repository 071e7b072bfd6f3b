"""What the linears on quantkit's integer kernel share (``int4_int8_matmul`` and ``int8_int8_matmul``,
quantkit/cpu_ops/int4_int8_ops.cpp): codes stored in panels of 64 output rows in the order the kernel
reads them, a bf16 (scale, offset) pair per row and group of input columns, and int8 activations
multiplied by the codes on integer dot products.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from quantkit import cpu_ops
from quantkit.kernels.linear.packed import PackedLinear

PACK_GROUP_SIZES = (256, 128, 64, 32)  # the groups a module packs, largest first
PANEL = 64  # output rows per panel of the codes' layout


def pack_group_size(group_size: int, in_features: int) -> int:
    """The largest packed-kernel group that tiles the record's groups and K, so that no zero columns
    are needed (K = 576 with group 128 packs as groups of 64, each with its group-128 scale); a K
    that no size divides is padded to the record's own group size (or 256 when per-channel)."""
    span = in_features if group_size == -1 else math.gcd(group_size, in_features)
    fitting = [size for size in PACK_GROUP_SIZES if span % size == 0]
    if fitting:
        return fitting[0]
    return 256 if group_size == -1 else group_size


class PanelLinear(PackedLinear):
    """Subclasses set ``integer_kernel`` (the compiled operator's name), and the buffers ``packed`` (the
    codes in its layout) and ``scale_offset_bf16`` ([groups, padded rows, 2]), with ``out_features``,
    ``in_features``, ``padded_in`` (a multiple of ``group_size``) and ``group_size``."""

    integer_kernel: str

    @property
    def padded_out(self) -> int:
        return self.scale_offset_bf16.shape[1]

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step reads: the codes and the bf16 scale/offset pairs."""
        return self.packed.numel() * self.packed.element_size() + self.scale_offset_bf16.numel() * 2

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """x with zero columns up to the packed width (their codes are padding)."""
        return F.pad(x, (0, self.padded_in - self.in_features)) if self.padded_in != self.in_features else x

    def _integer_product(self, rows: torch.Tensor) -> torch.Tensor | None:
        """rows W^T on the integer kernel for bf16 rows on the CPU when the operators are compiled, else None
        (float32 rows, what the evaluation's engines run, keep the exact product of the dequantized weight)."""
        ops = cpu_ops.load() if rows.dtype == torch.bfloat16 and rows.device.type == "cpu" else None
        if ops is None:
            return None
        return getattr(ops, self.integer_kernel)(rows.contiguous(), self.packed, self.scale_offset_bf16,
                                                 self.out_features, self.padded_in, self.group_size)

    def decode(self, rows: torch.Tensor) -> torch.Tensor | None:
        return self._integer_product(rows)
