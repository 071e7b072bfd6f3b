"""What the linears on quantkit's integer kernel share (``int4_int8_matmul`` and ``int8_int8_matmul``,
quantkit/cpu_ops/int4_int8_ops.cpp): codes stored in panels of 64 output rows in the order the kernel
reads them, a bf16 (scale, offset) pair per row and group of input columns, and int8 activations
multiplied by the codes on integer dot products.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

from quantkit import cpu_ops
from quantkit.kernels.linear.packed import PackedLinear

PACK_GROUP_SIZES = (256, 128, 64, 32)  # the groups a module packs, largest first
PANEL = 64  # output rows per panel of the codes' layout
PREFILL_KERNELS = ("bf16", "int8")
PREFILL_OVERRIDE = "QUANTKIT_CPU_PREFILL"  # bf16 | int8; unset or "auto": prefill_kernel() chooses


def onednn_uses_amx() -> bool:
    """Whether oneDNN runs bf16 matmuls on AMX here: the CPU has AMX tiles and ONEDNN_MAX_CPU_ISA (if set)
    does not hold oneDNN below its AMX instruction sets."""
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return bool(torch.cpu._is_amx_tile_supported()) and (limit in ("ALL", "DEFAULT") or "AMX" in limit)


@functools.cache
def prefill_kernel() -> str:
    """How a panel linear (int4, the int8 head, W8A8) multiplies more rows than its decode rows: "bf16" (the
    bf16 weight on oneDNN) where oneDNN has AMX, else "int8" (its integer kernel) when the compiled operators
    have vector integer dot products, else "bf16". ``QUANTKIT_CPU_PREFILL`` overrides the choice."""
    chosen = os.environ.get(PREFILL_OVERRIDE, "auto")
    if chosen not in ("auto", *PREFILL_KERNELS):
        raise ValueError(f"{PREFILL_OVERRIDE} must be auto, bf16 or int8, got {chosen!r}")
    ops = cpu_ops.load()
    if chosen == "int8" and ops is None:
        raise RuntimeError(f"{PREFILL_OVERRIDE}=int8 needs the compiled CPU operators, which did not build")
    if chosen != "auto":
        return chosen
    if onednn_uses_amx() or ops is None or ops.int4_int8_isa() == "scalar":
        return "bf16"
    return "int8"


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

    def _dense(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows beyond the decode rows: on integer dot products where ``prefill_kernel`` says so (no AMX),
        else by the dequantized weight."""
        out = self._integer_product(rows) if prefill_kernel() == "int8" else None
        return super()._dense(rows) if out is None else out
