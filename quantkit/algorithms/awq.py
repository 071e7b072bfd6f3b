"""AWQ's weight step: round to nearest on clipped ranges, each range chosen by output error.

AWQ (Lin et al., MLSys 2024; AutoAWQ ``_search_best_clip``) runs in two steps. The smoothing
scales are found and folded in by ``quantkit.algorithms.smooth``; the engine does that for any
recipe with ``smooth.enabled``. This module is the second step. For every group of every output
row it picks the shrink of the group's range that least changes the linear's output on the
calibration inputs, then rounds to nearest on that grid.

AutoAWQ measures the output error on 512 sampled tokens. Group g of row n contributes
Σ_t (x_t,g · Δw_n,g)² = Δw_n,g H_gg Δw_n,gᵀ, so the diagonal blocks of the input Hessian give the
same quantity over every calibration token. The shrink grid is the one GPTQ's clipping search uses
(``quant.search_group_params``): 1 % steps down to 0.21, where AutoAWQ uses 5 % steps down to 0.55.
The grid includes p = 1, which is plain round-to-nearest, so no group ends worse than RTN.
AutoAWQ leaves q_proj and k_proj unclipped. Here they are clipped like every other linear,
because the same output error is the objective for all of them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from quantkit.algorithms.base import Algorithm
from quantkit.quant import QuantConfig, QuantizedTensor, quantize_groups, require_finite, search_group_params


def awq_quantize(weight: Tensor, hessian: Tensor, config: QuantConfig) -> QuantizedTensor:
    """Quantize ``weight`` [N, K] with each group's range clipped to minimise its output error under
    ``hessian`` [K, K] (H = 2/n Σ xᵀx of the linear's calibration inputs)."""
    if weight.dim() != 2 or tuple(hessian.shape) != (weight.shape[1],) * 2:
        raise ValueError(f"expected a linear weight [N, K] and its hessian [K, K], got shapes "
                         f"{tuple(weight.shape)} and {tuple(hessian.shape)}")
    require_finite(weight)
    h = hessian.to(torch.float32)
    return quantize_groups(weight, config,
                           lambda w, columns: search_group_params(w[:, columns], config, h[columns, columns]))


class AWQ(Algorithm):
    """``awq_quantize`` (the clipping step; the smoothing is the ``smooth`` section's). No settings."""

    name = "awq"

    def __call__(self, weight, stats, target, values):
        return awq_quantize(weight, stats.hessian, target)

    def clips(self, values) -> bool:
        return True
