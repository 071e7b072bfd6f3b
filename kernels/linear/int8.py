"""Weight-only int8 for the LM head of a quantized model: symmetric codes per group of input columns
(128 where they divide the width) with a bf16 scale, w = (q - 128) * s.

The head is the largest single matrix a decode step reads (49152 x 576 on the default model,
73448 x 4096 on MiniCPM4.1-8B) and quantizing it is what llama.cpp does too (its Q4_0 files store
``output.weight`` as Q6_K). Decode multiplies int8 activations by the codes on integer dot products,
``int8_int8_matmul`` (quantkit/cpu_ops/int4_int8_ops.cpp, the int4 linears' kernel on 8-bit codes, stored
in the order it reads them: ``int8_layout``); more rows (a draft tree's verification) stay on it where the
int4 linears' prefill does (no AMX: ``panel.prefill_kernel``), else multiply by the bf16 dequantized weight,
kept. At
the 8B head, 2 threads, this project's AMD EPYC: 9.7-11.7 ms a row against 11.9-13.8 ms for PyTorch's
int8 weight-only kernel, which it replaced (docs/results/runtime.md, "CPU linears at MiniCPM4.1-8B's shapes").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.kernels.linear.panel import PANEL, PanelLinear, pack_group_size

GROUP_SIZE = 128
CENTRE = 128  # the code of a zero weight


def int8_layout(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] (K a multiple of 8) as the kernel reads them: rows padded with code 128 to a
    multiple of 64; for each panel of 64 rows and each 8 columns, 512 bytes where byte 4 r + c of the
    first 256 holds row r's code of column c and of the next 256 its code of column c + 4."""
    n, k = codes.shape
    padded = -(-n // PANEL) * PANEL
    codes = F.pad(codes.to(torch.uint8), (0, 0, 0, padded - n), value=CENTRE)
    # panel, 8 columns, half, row, c
    return codes.view(padded // PANEL, PANEL, k // 8, 2, 4).permute(0, 2, 3, 1, 4).contiguous().view(-1)


def codes_of_int8_layout(packed: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """``int8_layout``'s inverse: codes uint8 [rows, columns] from the bytes of ``rows`` (a multiple of 64)."""
    return packed.view(rows // PANEL, columns // 8, 2, PANEL, 4).permute(0, 3, 1, 2, 4).reshape(rows, columns)


def bf16_at_least(values: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 number not below each positive float32 value (as float32): a scale rounded
    up, so that no weight's quotient leaves [-127, 127]."""
    rounded = values.bfloat16()
    below = rounded.float() < values
    return (rounded.view(torch.int16) + below.to(torch.int16)).view(torch.bfloat16).float()


class Int8Linear(PanelLinear):
    integer_kernel = "int8_int8_matmul"

    def __init__(self, weight: torch.Tensor, group_size: int = GROUP_SIZE):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = pack_group_size(group_size, self.in_features)
        self.padded_in = -(-self.in_features // self.group_size) * self.group_size
        grouped = F.pad(weight.float(), (0, self.padded_in - self.in_features)).view(self.out_features, -1,
                                                                                  self.group_size)
        scales = bf16_at_least(grouped.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny) / 127)  # [N, G]
        codes = torch.round(grouped / scales[..., None]).add_(CENTRE).to(torch.uint8).view(self.out_features, -1)
        self.register_buffer("packed", int8_layout(codes))
        # (scale, offset) pairs in bf16 [G, padded rows, 2], the kernels' form; offsets are 0 (symmetric)
        pairs = torch.stack((scales.T, torch.zeros_like(scales.T)), dim=-1)
        padding = -self.out_features % PANEL
        self.register_buffer("scale_offset_bf16", F.pad(pairs, (0, 0, 0, padding)).bfloat16())
        self.bias = None
        self.keep_dequantized = True

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, padded columns] = (q - 128) * s."""
        codes = codes_of_int8_layout(self.packed, self.padded_out, self.padded_in)[:self.out_features]
        scales = self.scale_offset_bf16[:, :self.out_features, 0].T.float()
        grouped = (codes.float() - CENTRE).view(self.out_features, -1, self.group_size) * scales[..., None]
        return grouped.view(self.out_features, self.padded_in).to(dtype)
