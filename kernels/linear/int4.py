"""4-bit linears on the CPU: int8 activations times the 4-bit codes on integer dot products for decode,
speculative verification and (without AMX) prefill; with AMX, prefill multiplies the bf16 weight.

``int4_int8_matmul`` (quantkit/cpu_ops/int4_int8_ops.cpp) quantizes the activations to int8 per row and
weight group and sums each group's products with the codes exactly in int32 (VPDPBUSD on AVX-512 VNNI,
AVX-VNNI, or AVX2's multiply-add pairs), as llama.cpp's Q4_0 x Q8_0 does. The codes are stored in the
order that instruction reads them (``int4_layout``), so a decode step splits nibbles and multiplies,
nothing more. At MiniCPM4.1-8B's gate_up [32768, 4096], 2 threads, this project's Xeon (scratch
measurement, median of 9): one row 3.9 ms (18 GB/s of codes) against 5.7 ms for PyTorch's packed int4
kernel, which it replaced; four rows (a speculative chain's verification) cost what one does; built
for AVX2 (``QUANTKIT_CPU_MARCH=haswell``) 6.0 ms against PyTorch's AVX2 kernel's 11.6 ms. Its error
against the exact product is bounded (each activation is off by at most alpha / 2; tests/test_qlinear.py).

Prefill (more rows than ``PackedLinear``'s decode rows): ``panel.prefill_kernel`` chooses. With AMX a bf16
matmul is faster (oneDNN: 350-590 GMAC/s for 512 x 4096 by 4096 x 4096 here), so prefill multiplies
by the dequantized weight (kept when ``keep_dequantized``, else rebuilt on each call by the compiled
``int4_dequantize_t``, quantkit/cpu_ops/int4_ops.cpp, into a buffer each thread reuses; without the
compiled operators PyTorch's elementwise operators build it in chunks of rows). Without AMX (oneDNN
held to AVX-512 BF16: 37-67 GMAC/s) prefill runs the integer kernel (110-180 GMAC/s).

The weight is ``w = (q - 8) * s + z`` per group of 32/64/128/256 input channels with bf16 scale and
offset; a GPTQ grid ``(q - zero) * s`` is that with ``z = (8 - zero) * s``. Act-order (``g_idx`` not
monotonic) becomes a column permutation applied to the input; a ragged last group (K = 576 with group
128) is packed in smaller groups that repeat its scale.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from quantkit import cpu_ops
from quantkit.kernels.linear.packed import fused_bias
from quantkit.kernels.linear.panel import PANEL, PanelLinear, pack_group_size
from quantkit.quant import QuantizedTensor

# Elements of the weight dequantized at a time: a float32 chunk of 4 MB stays in cache (measured: 256
# rows of K = 4096 ran 1.3x faster than 64 rows or 1024)
DEQUANTIZE_CHUNK = 1 << 20


def int4_layout(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] (K a multiple of 8) as the kernels read them: rows padded with code 8 to a
    multiple of 64; for each panel of 64 rows and each 8 columns, 256 bytes where byte 4 r + c holds row
    r's code of column c (low nibble) and of column c + 4 (high nibble)."""
    n, k = codes.shape
    padded = -(-n // PANEL) * PANEL
    codes = F.pad(codes.to(torch.uint8), (0, 0, 0, padded - n), value=8)
    by_word = codes.view(padded // PANEL, PANEL, k // 8, 2, 4).permute(0, 2, 1, 4, 3)  # panel, 8 columns, row, c, half
    return (by_word[..., 0] | (by_word[..., 1] << 4)).contiguous().view(-1)


def codes_of_layout(packed: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """``int4_layout``'s inverse: codes uint8 [rows, columns] from the bytes of ``rows`` (a multiple of 64)."""
    words = packed.view(rows // PANEL, columns // 8, PANEL, 4)
    halves = torch.stack((words & 15, words >> 4), dim=-2)  # panel, 8 columns, row, half, c
    return halves.permute(0, 2, 1, 3, 4).reshape(rows, columns)


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


class Int4Linear(PanelLinear):
    """y = x W^T (+ bias) with W = (q - 8) * s + z per group; q in natural column order after ``perm``."""

    integer_kernel = "int4_int8_matmul"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
                 in_features: int, perm: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 keep_dequantized: bool = True):
        """codes uint8 [N, Kp] (Kp a multiple of group_size, K <= Kp, padding columns ignored);
        scales and offsets float32 [Kp / group_size, N]; perm int64 [K] or None."""
        super().__init__()
        self.out_features, self.padded_in = codes.shape
        self.in_features, self.group_size = in_features, group_size
        # one copy of the codes, in the kernels' layout (``_codes`` reads them back), rows padded to the
        # layout's panels; the scale/offset pairs in bf16 [G, padded rows, 2], zero for padding rows
        self.register_buffer("packed", int4_layout(codes))
        padding = self.packed.numel() * 2 // self.padded_in - self.out_features
        self.register_buffer("scale_offset_bf16", F.pad(torch.stack((scales, offsets), dim=-1), (0, 0, 0, padding))
                             .bfloat16())
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

    def _codes(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The codes uint8 [end - start, Kp] of rows start..end (``start`` a multiple of ``PANEL``)."""
        end = self.out_features if end is None else end
        stop = min(self.padded_out, -(-end // PANEL) * PANEL)
        width = self.padded_in // 2
        return codes_of_layout(self.packed[start * width:stop * width], stop - start, self.padded_in)[:end - start]

    def _rebuilt(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight for one call, in this thread's reused buffer where the compiled operator writes it."""
        return self._dequantize(dtype, into=_workspace(self.padded_out * self.padded_in, dtype))

    def _dequantize(self, dtype: torch.dtype, into: torch.Tensor | None = None) -> torch.Tensor:
        """W [N, Kp]: (q - 8) * s + z in float32 with the bf16 scale and offset (the product is exact, the
        sum rounds once), then rounded to ``dtype``. In bf16 on a CPU with the compiled operators,
        ``int4_dequantize_t`` writes it transposed (into ``into`` if given, a flat buffer of padded rows x
        Kp; the result is a transposed view); otherwise PyTorch works on chunks of rows, each group's scale
        and offset broadcast over its columns. Both give the same bits (tests/test_qlinear.py)."""
        n, width, size = self.out_features, self.padded_in, self.group_size
        ops = cpu_ops.load() if dtype == torch.bfloat16 and self.packed.device.type == "cpu" else None
        if ops is not None:
            out = torch.empty(self.padded_out * width, dtype=dtype) if into is None else into
            return ops.int4_dequantize_t(self.packed, self.scale_offset_bf16, width, size, out).t()[:n]
        scales, offsets = (self.scale_offset_bf16[..., i].T.float()[..., None] for i in (0, 1))  # [N, G, 1]
        out = torch.empty(n, width, dtype=dtype, device=self.packed.device)
        step = max(PANEL, DEQUANTIZE_CHUNK // width // PANEL * PANEL)
        for start in range(0, n, step):
            end = min(n, start + step)
            codes = self._codes(start, end).view(end - start, -1, size).float().sub_(8)
            out[start:end].view(end - start, -1, size).copy_(
                torch.addcmul(offsets[start:end], codes, scales[start:end]))
        return out

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        return super().prepare(x if self.perm is None else x.index_select(-1, self.perm))

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
        pairs = torch.cat([m.scale_offset_bf16[:, :m.out_features] for m in modules], dim=1).float()
        return cls(codes, pairs[..., 0], pairs[..., 1], first.group_size, first.in_features, None, bias,
                   first.keep_dequantized)
