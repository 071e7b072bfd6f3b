"""AWQ-style smoothing: per-input-channel scales that make a layer's weights easier to quantize,
folded into the op before the linears so the unquantized layer computes the same function.

For linears sharing one input X (n tokens), smoothing by s then quantizing costs
Σ‖(Q(W·diag(s))·diag(s)⁻¹ − W) Xᵀ‖² = n/2 · Σ tr(Δ H Δᵀ) with H = 2/n Σ xᵀx, so the search needs
only InputStats (H and mean |x|), never the raw activations. Scales follow llm-awq: s = mean|x|^α
for α on a grid over [0, 1), normalised by √(max·min); α = 0 is s = 1, i.e. plain round-to-nearest.
Used on its own (AWQ) and before prefix-aware GPTQ (S-P-GPTQ).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from quantkit.models.decoder import MiniCPMRMSNorm
from quantkit.models.layers import ScalingGroup, scaling_groups_for
from quantkit.quant import QuantConfig, fake_quantize, find_group_params
from quantkit.recipes.fields import Field, Section, positive
from quantkit.stats import InputStats, hessian_norm

SCALE_FLOOR = 1e-4  # AutoAWQ's clamp: a channel that never fires must not get s = 0
# Weight elements quantized per step: the float32 temporaries stay in cache (whole-matrix passes
# are memory-bound: measured 1.6× slower on one core), yet each op is big enough for the threads.
_SLICE_ELEMENTS = 1 << 20
# Multiply-adds per α of the error products (rows × K²) above which α is scored on a subset of rows:
# each of MiniCPM4.1-8B's groups then costs ~17 GFLOP per α instead of up to 2.2 TFLOP.
SEARCH_BUDGET = 1 << 33

# The recipe's ``smooth`` section: whether the engine smooths each layer before any algorithm, and the
# α grid of ``search_scale``
SETTINGS = Section({
    "enabled": Field(bool, default=False, help="AWQ smoothing before quantizing (AWQ, S-GPTQ, S-P-GPTQ)"),
    "method": Field(str, default="awq", choices=("awq", "smoothquant"),
                    help="awq: scales for the weights' grid (mean |x|^α); smoothquant: for W8A8, scales that move "
                         "activation outliers into the weights (max |x|^α / max |w|^(1-α)), scored with both "
                         "quantized (needs quantized activations)"),
    "grid": Field(int, default=20, check=positive, rule="> 0", help="exponent grid points in [0, 1)"),
})

# Ops that can absorb 1/s: dim 0 of their weight (and bias) indexes the channels they output.
_ABSORBERS = (MiniCPMRMSNorm, nn.Linear)


@dataclass(frozen=True)
class ScaleSearch:
    """The chosen smoothing of one scaling group. Errors are Σ_linears tr(Δ H Δᵀ): twice the squared
    output error per calibration token, summed over the group's output channels."""

    scale: Tensor  # [K] float32: multiplies the linears' input columns, divides the previous op
    alpha: float
    error: float  # at the chosen α
    rtn_error: float  # at α = 0 (s = 1): plain round-to-nearest, never below ``error``


def smoothing_scale(abs_mean: Tensor, alpha: float) -> Tensor:
    """s = mean|x|^α floored at SCALE_FLOOR, divided by √(max s · min s) (geometric mid-range 1)."""
    s = abs_mean.float().pow(alpha).clamp(min=SCALE_FLOOR)
    return s / torch.sqrt(s.max() * s.min())


def round_to_nearest(weight: Tensor, config: QuantConfig) -> Tensor:
    """Round to nearest on ``config``'s grid as stored (float32 [N, K]), every full-width group of every row in
    one call instead of one call per group column: ``quant.rtn_quantize(weight, config).dequantize()`` bit for
    bit, except on a float-bias (MLX) grid, where the codes are chosen on the stored scale and bias and
    ``rtn_quantize`` follows ``mx.quantize``'s unrounded ones (a code differs only where a weight lies within
    that rounding of a boundary between two codes)."""
    rows, features = weight.shape
    width = features if config.group_size == -1 else config.group_size
    full = features - features % width
    parts = []
    if full:
        blocks = weight[:, :full].reshape(-1, width)
        parts.append(fake_quantize(blocks, find_group_params(blocks, config), config.maxq).reshape(rows, full))
    if full < features:
        tail = weight[:, full:]
        parts.append(fake_quantize(tail, find_group_params(tail, config), config.maxq))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _quantization_error(weights: list[Tensor], scale: Tensor, hessian: Tensor, config: QuantConfig) -> float:
    """Σ tr(Δ H Δᵀ) with Δ = Q(W·diag(s))·diag(s)⁻¹ − W, Q the round-to-nearest grid of ``config``;
    products in bfloat16 (``hessian_norm``), so every α compared shares the same rounded H."""
    total = 0.0
    for weight in weights:
        slice_rows = max(1, _SLICE_ELEMENTS // weight.shape[1])
        delta = torch.empty(weight.shape, dtype=torch.bfloat16, device=weight.device)
        for rows, out in zip(weight.split(slice_rows), delta.split(slice_rows)):
            out.copy_(round_to_nearest(rows * scale, config).div_(scale).sub_(rows))
        total += hessian_norm(delta, hessian)
    return total


def scored_rows(weights: list[Tensor]) -> tuple[list[Tensor], float]:
    """Every ``stride``-th row of each weight, and the factor that scales their error to all rows.

    Rows quantize independently, so the error of evenly spaced rows estimates the whole group's,
    and every α is scored on the same rows. Groups of up to SEARCH_BUDGET multiply-adds per α (every
    group of the default model) keep all their rows; an 8B down_proj keeps 32 of its 4,096.
    """
    features = weights[0].shape[1]
    rows = sum(w.shape[0] for w in weights)
    stride = max(1, -(-rows * features * features // SEARCH_BUDGET))
    kept = [w[::stride] for w in weights]
    return kept, rows / sum(w.shape[0] for w in kept)


def _check_search_inputs(weights: list[Tensor], stats: InputStats, grid: int) -> None:
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 1:
        raise ValueError(f"grid must be a positive int, got {grid!r}")
    if stats.tokens == 0:
        raise ValueError("input statistics hold no calibration tokens")
    if not weights:
        raise ValueError("a scaling group needs at least one linear weight")
    features = stats.abs_mean.shape[0]
    for i, weight in enumerate(weights):
        if weight.dim() != 2 or weight.shape[1] != features:
            raise ValueError(
                f"weight {i} has shape {tuple(weight.shape)}; the input statistics have {features} channels"
            )


@torch.no_grad()
def search_scale(weights: list[Tensor], stats: InputStats, config: QuantConfig, grid: int = 20) -> ScaleSearch:
    """The smoothing scale with the least total quantization error over α ∈ {0, 1/grid, …, (grid−1)/grid}.

    ``weights``: the group's linear weights [N_i, K] (any float dtype; math in float32);
    ``stats``: statistics of their shared input. Ties keep the smaller α, so RTN wins a tie.
    """
    _check_search_inputs(weights, stats, grid)
    weights, to_all_rows = scored_rows([w.float() for w in weights])
    hessian = stats.hessian.bfloat16()
    errors = []
    for step in range(grid):
        alpha = step / grid
        scale = smoothing_scale(stats.abs_mean, alpha)
        errors.append((to_all_rows * _quantization_error(weights, scale, hessian, config), alpha))
    best_error, best_alpha = min(errors)
    return ScaleSearch(smoothing_scale(stats.abs_mean, best_alpha), best_alpha, best_error, errors[0][0])


def _scale_parameter(parameter: Tensor, factor: Tensor, divide: bool) -> None:
    """One float32 multiply or divide per element, rounded once to the parameter's dtype."""
    value = parameter.float()
    parameter.copy_(value / factor if divide else value * factor)


@torch.no_grad()
def apply_scale(layer: nn.Module, group: ScalingGroup, scale: Tensor) -> None:
    """Fold ``scale`` [K] into ``layer`` in place: the group's linears' columns × s, the previous op's
    output channels ÷ s (an RMSNorm's weight, or a linear's weight rows and bias)."""
    previous = layer.get_submodule(group.previous)
    if not isinstance(previous, _ABSORBERS):
        raise ValueError(f"'{group.previous}' is a {type(previous).__name__}; it cannot absorb a smoothing scale")
    linears = {name: layer.get_submodule(name) for name in group.linears}
    features = previous.weight.shape[0]
    if scale.shape != (features,):
        raise ValueError(f"scale has shape {tuple(scale.shape)}; '{group.previous}' outputs {features} channels")
    for name, linear in linears.items():
        if linear.in_features != features:
            raise ValueError(
                f"'{name}' takes {linear.in_features} inputs but '{group.previous}' outputs {features} channels"
            )
    scale = scale.float()
    if not (torch.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError("scale must be finite and positive")

    for linear in linears.values():
        _scale_parameter(linear.weight, scale, divide=False)
    rows = scale.view(-1, *([1] * (previous.weight.dim() - 1)))
    _scale_parameter(previous.weight, rows, divide=True)
    if getattr(previous, "bias", None) is not None:
        _scale_parameter(previous.bias, scale, divide=True)


def smooth_layer(
    layer: nn.Module,
    stats_by_linear: dict[str, InputStats],
    config: QuantConfig,
    num_attention_heads: int,
    num_key_value_heads: int,
    grid: int = 20,
    search=search_scale,
) -> dict[str, ScaleSearch]:
    """Search and fold a scale for every scaling group of a decoder layer; keyed by each group's
    first linear, whose input statistics (collected on the unsmoothed layer) drive the search
    (``search``: AWQ's ``search_scale`` or another with its signature, SmoothQuant's).

    One set of statistics serves all groups: a group's scale changes only its own linears' input,
    and folding preserves the layer's function, so the other groups' inputs stay the same.
    """
    groups = scaling_groups_for(num_attention_heads, num_key_value_heads)
    for group in groups:  # before touching the layer, so a bad call leaves it as it was
        if group.linears[0] not in stats_by_linear:
            raise ValueError(f"no input statistics for '{group.linears[0]}' (scaling group after '{group.previous}')")
    results = {}
    for group in groups:
        first = group.linears[0]
        weights = [layer.get_submodule(name).weight for name in group.linears]
        results[first] = search(weights, stats_by_linear[first], config, grid)
        apply_scale(layer, group, results[first].scale)
    return results
