"""Round-to-nearest: every group's grid from its own min/max, each weight rounded independently.

On a float-bias grid (MLX) RTN is mlx-lm's own quantizer, ``mx.quantize``: the codes are rounded
with the float32 min-max parameters and the scale and bias are then stored in the model dtype, so
the result equals ``mlx_lm.convert -q`` bit for bit. (The solvers instead choose codes on the grid
as stored: ``find_group_params``.)"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from quantkit.quant import (
    GroupParams,
    QuantConfig,
    QuantizedTensor,
    affine_params,
    default_g_idx,
    find_group_params,
    group_slices,
    quantize_codes,
)

# (float32 weight [N, K], one group's columns) -> that group's grid
GridChooser = Callable[[Tensor, slice], GroupParams]


def quantize_groups(weight: Tensor, config: QuantConfig, choose_grid: GridChooser) -> QuantizedTensor:
    """Round every group of ``weight`` [N, K] to nearest on the grid ``choose_grid`` picks for it."""
    if weight.dim() != 2:
        raise ValueError(f"expected a linear weight [out_features, in_features], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.to(torch.float32)
    slices = group_slices(k, config.group_size)
    codes = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    scales = torch.empty(len(slices), n, dtype=config.scale_dtype, device=w.device)
    offsets = torch.empty(len(slices), n, dtype=config.scale_dtype if config.float_bias else torch.uint8,
                          device=w.device)
    for group, columns in enumerate(slices):
        params = choose_grid(w, columns)
        codes[:, columns] = quantize_codes(w[:, columns], params, config.maxq).to(torch.uint8)
        scales[group] = params.scale.to(config.scale_dtype)
        offsets[group] = params.bias if config.float_bias else params.zero
    g_idx = default_g_idx(k, config.group_size, device=w.device)
    if config.float_bias:
        return QuantizedTensor(codes, scales, None, g_idx, config, biases=offsets)
    return QuantizedTensor(codes, scales, offsets, g_idx, config)


def rtn_quantize(weight: Tensor, config: QuantConfig) -> QuantizedTensor:
    """Quantize a linear weight [N, K] group by group (float32 math whatever the input dtype)."""
    find = affine_params if config.float_bias else find_group_params
    return quantize_groups(weight, config, lambda w, columns: find(w[:, columns], config))
