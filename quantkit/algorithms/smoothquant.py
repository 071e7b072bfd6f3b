"""SmoothQuant for W8A8 (Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization
for Large Language Models", ICML 2023): move the activations' outlier channels into the weights.

A few input channels of a linear carry values 10-100x the others; quantizing each token's activations
to INT8 with one scale then leaves the ordinary channels only a few levels. Dividing channel j of the
input by s_j and multiplying column j of the weights by it keeps the product, and with
s_j = max|x_j|^α / max|W_:,j|^(1−α) the two operands share the difficulty. The division is folded into
the op before the linears (an RMSNorm's weight, or a linear's output rows), as AWQ's scales are
(``smooth.apply_scale``), so the unquantized layer computes the same function.

The paper fixes α per model (0.5; llm-compressor's default 0.8). Here α is searched per scaling group
and layer on the calibration rows: each candidate is scored by the group's output error with both
operands quantized as the artifact will be, ‖Q_a(X/s) Q_w(W·s)ᵀ − X Wᵀ‖² (weights rounded to nearest
on the recipe's grid, activations by the scheme's own rule, ``activation_quant``), over a sample of the
calibration rows; no smoothing at all (s = 1, reported as α = 0) is a candidate too, so a group whose
inputs have no outliers is left alone.
"""
from __future__ import annotations

import torch
from torch import Tensor

from quantkit.activation_quant import ActivationGrid
from quantkit.algorithms.smooth import SCALE_FLOOR, ScaleSearch, round_to_nearest
from quantkit.quant import QuantConfig
from quantkit.stats import InputStats

# Calibration rows each search keeps (``InputStats.sample``): enough for the error of every candidate
# to rank them, few enough that an 8B group (K = 4096, N = 6144) costs ~0.2 TFLOP per candidate.
SAMPLE_ROWS = 4096


def migration_scale(act_max: Tensor, weights: list[Tensor], alpha: float) -> Tensor:
    """s = max|x|^α / max|W|^(1−α) per input channel (the largest |w| over the group's linears), floored
    at SCALE_FLOOR; a channel with no input or no weight keeps s = 1."""
    weight_max = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0).float()
    act = act_max.float()
    live = (act > 0) & (weight_max > 0)
    scale = act.clamp(min=SCALE_FLOOR).pow(alpha) / weight_max.clamp(min=SCALE_FLOOR).pow(1 - alpha)
    return torch.where(live, scale.clamp(min=SCALE_FLOOR), torch.ones_like(scale))


def w8a8_error(weights: list[Tensor], inputs: Tensor, scale: Tensor, config: QuantConfig,
               activations: ActivationGrid, act_max: Tensor) -> float:
    """Σ_linears ‖Q_a(X/s) Q_w(W·s)ᵀ − X Wᵀ‖² over the rows of ``inputs`` [T, K] (float32); a static
    activation scale is the one the smoothed calibration inputs would get (``act_max`` / s, every token's)."""
    static = None if activations.dynamic else activations.static_scale(act_max / scale)
    quantized_inputs = activations.fake_quantize(inputs / scale, static)
    total = 0.0
    for weight in weights:
        exact = inputs @ weight.T
        total += float((quantized_inputs @ round_to_nearest(weight * scale, config).T - exact).square().sum())
    return total


@torch.no_grad()
def search_migration(weights: list[Tensor], stats: InputStats, config: QuantConfig, activations: ActivationGrid,
                     grid: int = 20) -> ScaleSearch:
    """The scale with the least W8A8 output error among s = 1 and α ∈ {1/grid, …, (grid−1)/grid}; ties
    keep the earlier candidate, so no smoothing wins a tie."""
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 1:
        raise ValueError(f"grid must be a positive int, got {grid!r}")
    weights = [w.float() for w in weights]
    inputs = stats.sample
    identity = torch.ones_like(stats.abs_max)
    candidates = [(0.0, identity)] + [(step / grid, migration_scale(stats.abs_max, weights, step / grid))
                                      for step in range(1, grid)]
    errors = [(w8a8_error(weights, inputs, scale, config, activations, stats.abs_max), index)
              for index, (_, scale) in enumerate(candidates)]
    best_error, best = min(errors)
    alpha, scale = candidates[best]
    return ScaleSearch(scale, alpha, best_error, errors[0][0])
