"""INT8 W8A8 on the CPU's integer dot products: a compressed-tensors ``int-quantized`` linear (8-bit
symmetric codes, one scale per output row) with dynamic per-token int8 activations.

``int8_int8_matmul`` (quantkit/cpu_ops/int4_int8_ops.cpp) quantizes each row of its input per group of
columns, scale max|x| / 127, rounded to nearest even, and multiplies the int8 values by the stored codes
on integer dot products. With a single group spanning the whole (padded) row, that is exactly the
scheme the artifact declares: a scale per token. The kernel's bf16 (scale, offset) pairs are (1, 0) and
each row's float32 weight scale multiplies the output, so a float16 scale (a float32 model's artifact)
is applied unrounded. Its input arrives already quantized by ``quantkit.loading.quantize_activations``
(what the dense path multiplies): the kernel's own quantization of that input gives back the same
codes, since its largest magnitude is 127 scales.

Static per-tensor activation scales are not this kernel's (it picks each token's scale itself): those
linears run on the dequantized weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit import cpu_ops
from quantkit.activation_quant import ActivationGrid
from quantkit.kernels.linear.int8 import CENTRE, codes_of_int8_layout, int8_layout
from quantkit.kernels.linear.packed import fused_bias
from quantkit.kernels.linear.panel import PANEL, PanelLinear
from quantkit.quant import QuantizedTensor


def int8_channel_refusal(record) -> str | None:
    """Why ``record`` is not what the INT8 W8A8 kernels (this one and Triton's) multiply, 8-bit symmetric
    codes with one scale per row around the zero point 128, or None."""
    if not isinstance(record, QuantizedTensor):
        return f"integer codes, got {type(record).__name__}"
    config = record.config
    for setting, value, needed in (("bits", config.bits, 8), ("sym", config.sym, True),
                                   ("group_size", config.group_size, -1), ("float_bias", config.float_bias, False),
                                   ("ternary", config.ternary, False)):
        if value != needed:
            return f"{setting}={needed}, got {setting}={value}"
    if not bool((record.zeros == CENTRE).all()):
        return f"the zero point {CENTRE} on every row"
    return None


def runs_on_integer_kernel(record, activations: ActivationGrid | None) -> bool:
    """Whether ``W8A8Linear`` computes exactly what ``record`` with ``activations`` means."""
    return (activations is not None and activations.kind == "int8" and activations.dynamic
            and int8_channel_refusal(record) is None)


class W8A8Linear(PanelLinear):
    integer_kernel = "int8_int8_matmul"

    def __init__(self, codes: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None = None,
                 keep_dequantized: bool = True):
        """codes uint8 [N, K] (weight = (code - 128) · scale), row_scales float32 [N]."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.padded_in = self.group_size = -(-self.in_features // 8) * 8  # the kernel's steps are 8 columns
        codes = F.pad(codes, (0, self.padded_in - self.in_features), value=CENTRE)
        self.register_buffer("packed", int8_layout(codes))
        padding = -self.out_features % PANEL
        pairs = torch.zeros(1, self.out_features + padding, 2)
        pairs[..., 0] = 1.0
        self.register_buffer("scale_offset_bf16", pairs.bfloat16())
        self.register_buffer("row_scales", row_scales.float().reshape(-1))
        self.register_buffer("bias", None if bias is None else bias.float())
        self.keep_dequantized = keep_dequantized

    @classmethod
    def from_record(cls, record: QuantizedTensor, bias: torch.Tensor | None = None,
                    keep_dequantized: bool = True) -> W8A8Linear:
        refusal = int8_channel_refusal(record)
        if refusal:
            raise ValueError(f"W8A8Linear needs 8-bit symmetric per-channel codes: {refusal}")
        return cls(record.codes, record.scales.float()[0], bias, keep_dequantized)

    @property
    def weight_bytes(self) -> int:
        return self.packed.numel() + self.row_scales.numel() * 4

    def _codes(self) -> torch.Tensor:
        return codes_of_int8_layout(self.packed, self.padded_out, self.padded_in)[:self.out_features]

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, padded columns] = (q - 128) · s in float32, then rounded to ``dtype``."""
        return ((self._codes().float() - CENTRE) * self.row_scales[:, None]).to(dtype)

    def _integer_product(self, rows: torch.Tensor) -> torch.Tensor | None:
        """rows W^T for bf16 or float32 rows on the CPU when the operators are compiled, else None. The
        kernel runs on float32 rows and gives float32 sums (exact integer sums, scaled once by the token's
        scale), each row's weight scale is applied before the one rounding to the rows' dtype."""
        ops = cpu_ops.load() if rows.dtype in (torch.bfloat16, torch.float32) and rows.device.type == "cpu" else None
        if ops is None:
            return None
        out = ops.int8_int8_matmul(rows.float().contiguous(), self.packed, self.scale_offset_bf16, self.out_features,
                                   self.padded_in, self.group_size)
        return (out * self.row_scales).to(rows.dtype)

    @classmethod
    def fuse(cls, modules: list[W8A8Linear]) -> W8A8Linear | None:
        """One module for linears sharing an input (q/k/v, gate/up): their rows concatenated."""
        fusable, bias = fused_bias(modules)
        if not fusable or len({m.in_features for m in modules}) != 1:
            return None
        return cls(torch.cat([m._codes()[:, :m.in_features] for m in modules]),
                   torch.cat([m.row_scales for m in modules]), bias, modules[0].keep_dequantized)
