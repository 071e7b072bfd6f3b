"""Round-to-nearest: every group's grid from its own min/max, each weight rounded independently."""
from __future__ import annotations

import torch
from torch import Tensor

from quantkit.quant import (
    QuantConfig,
    QuantizedTensor,
    default_g_idx,
    find_group_params,
    group_slices,
    quantize_codes,
)


def rtn_quantize(weight: Tensor, config: QuantConfig) -> QuantizedTensor:
    """Quantize a linear weight [N, K] group by group (float32 math whatever the input dtype)."""
    if weight.dim() != 2:
        raise ValueError(f"expected a linear weight [out_features, in_features], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.to(torch.float32)
    slices = group_slices(k, config.group_size)
    codes = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(len(slices), n, dtype=torch.float16)
    zeros = torch.empty(len(slices), n, dtype=torch.uint8)
    for group, columns in enumerate(slices):
        params = find_group_params(w[:, columns], config)
        codes[:, columns] = quantize_codes(w[:, columns], params, config.maxq).to(torch.uint8)
        scales[group] = params.scale.to(torch.float16)
        zeros[group] = params.zero.to(torch.uint8)
    return QuantizedTensor(codes, scales, zeros, default_g_idx(k, config.group_size), config)
