"""4-bit linears on the CPU: PyTorch's packed int4 kernel for decode; for prefill, bf16 matmuls on AMX,
or int8 activations times the codes on integer dot products where the CPU has no AMX.

Measured on this machine's Xeon (2 threads; ``python -m quantkit.eval.bench.bench_linear``): for one row,
``_weight_int4pack_mm_for_cpu`` streams int4 weights 2.6-3.4x faster than a bf16 GEMV. A few rows use
the packed kernel and more rows multiply by the bf16 dequantized weight (``PackedLinear``; kept when
``keep_dequantized``, else rebuilt from the packed codes on each call).

A module holds its codes once, in the packed kernel's layout (``_unpack_packed`` reads them back
exactly), and its scale/offset pairs in bf16. A weight rebuilt for one call (a model too large to keep
them) is written by the compiled ``int4_dequantize_t`` (kernels/cpu_ops/int4_ops.cpp) into a buffer each
thread reuses; without the compiled operators, PyTorch's elementwise operators build it on chunks of
rows viewed as [rows, groups, group size], each group's scale and offset broadcast. Both are
bit-identical to the formula (tests/test_qlinear.py). At MiniCPM4.1-8B's gate_up [32768, 4096] (random
codes, group 128, 1 thread, with another process busy on both cores): 0.81 s with PyTorch's operators,
0.20 s compiled into a new buffer (0.15 s of it page faults) and 0.067 s into the reused one
(``OMP_NUM_THREADS=1 python -m quantkit.eval.bench.bench_dequantize``).

Without AMX a bf16 matmul is slow (oneDNN held to AVX-512 BF16: 37 GMAC/s for 512 x 4096 by 4096 x
4096 on this project's Xeon, against 349 on AMX), so prefill there runs ``int4_int8_matmul``
(kernels/cpu_ops/int4_int8_ops.cpp): activations quantized to int8 per row and group, exact integer
sums per group on VNNI (161-174 GMAC/s at MiniCPM4.1-8B's shapes, 2 threads), as llama.cpp's Q4_0 x
Q8_0 does. ``prefill_kernel`` makes the choice.

The packed kernel computes ``w = (q - 8) * s + z`` per group of 32/64/128/256 input channels with
bf16 scale and offset; a GPTQ grid ``(q - zero) * s`` is that with ``z = (8 - zero) * s``. Act-order
(``g_idx`` not monotonic) becomes a column permutation applied to the input; a ragged last group
(K = 576 with group 128) is packed in smaller groups that repeat its scale.
"""
from __future__ import annotations

import functools
import math
import os
import threading

import torch
import torch.nn.functional as F
from quantkit.kernels import cpu_ops
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


# Elements of the weight dequantized at a time: a float32 chunk of 4 MB stays in cache (measured: 256
# rows of K = 4096 ran 1.3x faster than 64 rows or 1024)
DEQUANTIZE_CHUNK = 1 << 20


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def _unpack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    return torch.stack((nibbles & 15, nibbles >> 4), dim=-1).flatten(1)


def _unpack_packed(packed: torch.Tensor, rows: int, columns: int, block: int) -> torch.Tensor:
    """codes uint8 [rows, columns] from bytes of ``_convert_weight_to_int4pack_for_cpu``'s layout (the first
    row a multiple of ``block``): whole blocks of ``block`` rows are bytes [columns, block / 2], the low
    nibbles rows 0..block/2-1 and the high ones the rest (aten/src/ATen/native/cpu/int4mm_kernel.cpp,
    ``weight_to_int4pack_kernel``: block 64 with AVX-512, 32 with AVX2); a last, smaller block (or every
    row without either, ``block`` 0) is bytes [columns, rows / 2] pairing rows 2i (low) and 2i + 1."""
    flat = packed.reshape(-1)
    whole = rows // block * block if block else 0
    parts = []
    if whole:
        b = flat[:whole * columns // 2].view(whole // block, columns, block // 2)
        parts.append(torch.cat((b & 15, b >> 4), dim=-1).transpose(1, 2).reshape(whole, columns))
    if rows > whole:
        b = flat[whole * columns // 2:].view(columns, (rows - whole) // 2)
        parts.append(torch.stack((b & 15, b >> 4), dim=-1).view(columns, rows - whole).T)
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


_scratch = threading.local()


def _workspace(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat buffer of ``numel`` elements, reused by this thread's weights rebuilt for one call (a model
    that keeps no dequantized weight): a fresh buffer for an 8B gate_up (268 MB) costs 0.15 s of page
    faults, more than rebuilding the weight into it (measured, one thread)."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
        buffer = _scratch.buffer = None  # free the old one before allocating
        buffer = _scratch.buffer = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


@functools.cache
def packed_block() -> int | None:
    """The row block of this PyTorch's CPU int4 layout (64, 32 or 0, see ``_unpack_packed``), found by
    packing random codes (whole blocks and a smaller last one) and unpacking them; None when no known
    layout matches: modules then keep their codes as nibbles too."""
    generator = torch.Generator().manual_seed(0)
    probes = [torch.randint(0, 16, shape, generator=generator, dtype=torch.int32) for shape in ((144, 64), (112, 128))]
    packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES) for codes in probes]
    for block in (64, 32, 0):
        if all(torch.equal(_unpack_packed(p, *codes.shape, block), codes.to(torch.uint8))
               for p, codes in zip(packed, probes)):
            return block
    return None


PREFILL_KERNELS = ("bf16", "int8")
PREFILL_OVERRIDE = "QUANTKIT_CPU_PREFILL"  # bf16 | int8; unset or "auto": prefill_kernel() chooses


def onednn_uses_amx() -> bool:
    """Whether oneDNN runs bf16 matmuls on AMX here: the CPU has AMX tiles and ONEDNN_MAX_CPU_ISA (if set)
    does not hold oneDNN below its AMX instruction sets."""
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return bool(torch.cpu._is_amx_tile_supported()) and (limit in ("ALL", "DEFAULT") or "AMX" in limit)


@functools.cache
def prefill_kernel() -> str:
    """How an int4 linear multiplies more rows than the packed kernel takes: "bf16" (the bf16 weight on
    oneDNN) where oneDNN has AMX, else "int8" (``int4_int8_matmul``) when the compiled operators have
    vector integer dot products, else "bf16". ``QUANTKIT_CPU_PREFILL`` overrides the choice."""
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
        # one copy of the codes: the packed kernel's, which ``_codes`` unpacks (nibbles only when the
        # layout is unknown); the scale/offset pairs in bf16, all that the kernel and ``_dequantize`` read
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), INNER_K_TILES))
        self.register_buffer("nibbles", _pack_nibbles(codes) if packed_block() is None else None)
        self.register_buffer("scale_offset_bf16", torch.stack((scales, offsets), dim=-1).bfloat16())
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

    def _codes(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The codes uint8 [end - start, Kp] of rows start..end (``start`` a multiple of ``packed_block()``)."""
        end = self.out_features if end is None else end
        if self.nibbles is not None:
            return _unpack_nibbles(self.nibbles[start:end])
        width = self.padded_in // 2
        return _unpack_packed(self.packed.view(-1)[start * width:end * width], end - start, self.padded_in,
                              packed_block())

    def _rebuilt(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight for one call, in this thread's reused buffer where the compiled operator writes it."""
        return self._dequantize(dtype, into=_workspace(self.out_features * self.padded_in, dtype))

    def _dequantize(self, dtype: torch.dtype, into: torch.Tensor | None = None) -> torch.Tensor:
        """W [N, Kp] as the packed kernel computes it: (q - 8) * s + z in float32 with its bf16 scale and
        offset (the product is exact, the sum rounds once), then rounded to ``dtype``. In bf16 on a CPU
        with the compiled operators, ``int4_dequantize_t`` writes it transposed (into ``into`` if given,
        a flat buffer of N x Kp; the result is a transposed view); otherwise PyTorch works on chunks of
        rows, each group's scale and offset broadcast over its columns. Both give the same bits
        (tests/test_qlinear.py)."""
        n, width, size = self.out_features, self.padded_in, self.group_size
        ops = cpu_ops.load() if dtype == torch.bfloat16 and self.packed.device.type == "cpu" else None
        if ops is not None and self.nibbles is None:
            out = torch.empty(n * width, dtype=dtype) if into is None else into
            return ops.int4_dequantize_t(self.packed.view(-1), self.scale_offset_bf16, n, width, size, packed_block(),
                                         out).t()
        scales, offsets = (self.scale_offset_bf16[..., i].T.float()[..., None] for i in (0, 1))  # [N, G, 1]
        out = torch.empty(n, width, dtype=dtype, device=self.packed.device)
        block = packed_block() or 2
        step = max(block, DEQUANTIZE_CHUNK // width // block * block)
        for start in range(0, n, step):
            end = min(n, start + step)
            codes = self._codes(start, end).view(end - start, -1, size).float().sub_(8)
            out[start:end].view(end - start, -1, size).copy_(
                torch.addcmul(offsets[start:end], codes, scales[start:end]))
        return out

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.padded_in != self.in_features:
            x = F.pad(x, (0, self.padded_in - self.in_features))
        return x

    def _dense(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows beyond the packed kernel's: on integer dot products when ``prefill_kernel`` says so (and
        the packed layout is known), else by the bf16 weight."""
        if (prefill_kernel() == "int8" and rows.device.type == "cpu" and self.nibbles is None
                and rows.dtype in (torch.bfloat16, torch.float32)):
            return cpu_ops.load().int4_int8_matmul(rows.contiguous(), self.packed.view(-1), self.scale_offset_bf16,
                                                   self.out_features, self.padded_in, self.group_size,
                                                   packed_block())
        return super()._dense(rows)

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
        codes = torch.cat([m._codes() for m in modules])
        pairs = torch.cat([m.scale_offset_bf16 for m in modules], dim=1).float()
        return cls(codes, pairs[..., 0], pairs[..., 1], first.group_size, first.in_features, None, bias,
                   first.keep_dequantized)
