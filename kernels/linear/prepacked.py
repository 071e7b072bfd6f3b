"""bf16 matmuls on the CPU with the weight reordered once into oneDNN's blocked layout.

``F.linear`` hands oneDNN a plain [N, K] bf16 weight on every call; given the weight already in its
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, as PyTorch's frozen graphs do), the
same AMX matmul runs faster, most of all for a few rows. Measured on the default model's FP runtime
(one thread, interleaved in one process): a forward of 4 / 13 tokens took 1.11x / 1.31x a decode step
with ``F.linear``, 1.00x / 1.15x with the weights reordered once, and the decode step itself got 1.3x
faster. That is what speculative decoding needs: verifying k + 1 tokens should cost one decode step.
It holds without AMX too: with oneDNN held to AVX-512-BF16 (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``)
the default model's linears ran 1.3-1.7x faster for 1 to 13 rows. The results are bit-identical to
``F.linear`` up to 16 rows (tests/test_qlinear.py). Other devices, dtypes, CPUs without oneDNN's bf16
path (AVX2 only) and PyTorch builds without oneDNN keep ``nn.Linear``.
"""
from __future__ import annotations

import torch
from torch import nn

# Rows the blocked layout is chosen for: oneDNN's layout for 64 rows serves 1 to 16 rows as fast as
# the one for a single row, and prefill chunks (hundreds of rows) no slower than F.linear (measured).
LAYOUT_ROWS = 64


def prepackable(weight: torch.Tensor) -> bool:
    """A bf16 CPU weight oneDNN can reorder: its bf16 path needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, which
    a desktop CPU with only AVX2 lacks (there the reorder raises, and ``nn.Linear`` converts as before)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PrepackedLinear(nn.Module):
    """y = x W^T (+ bias) on oneDNN's reordered copy of W (the copy is all it keeps)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), LAYOUT_ROWS)
        self.bias = None if bias is None else bias.detach()
        self.weight_bytes = weight.numel() * weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self._packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def prepacked(module: nn.Module) -> nn.Module:
    """``module`` as a ``PrepackedLinear`` when it is a bf16 ``nn.Linear`` on the CPU, else unchanged."""
    if type(module) is not nn.Linear or not prepackable(module.weight):
        return module
    return PrepackedLinear(module.weight, module.bias)
