"""Fake quantization for training: the forward pass sees the grid's weights, the gradient reaches the
latent float weights unchanged (the straight-through estimator of BitNet and BitCPM4).

Any ``QuantConfig`` is a quantizer here: BitCPM4's absmean ternary grid, or the uniform int grid
(symmetric int4 g128 for the EAGLE3 head). The grid's parameters come from ``quant.find_group_params``,
the very function RTN rounds with, applied to every group at once (a group's rows are independent
rows of that function), so a run with zero training steps writes RTN's codes and scales bit for bit.
"""
from __future__ import annotations

import torch
from torch import Tensor

from quantkit.algorithms.rtn import rtn_quantize
from quantkit.quant import QuantConfig, QuantizedTensor, fake_quantize, find_group_params


@torch.no_grad()
def grid_weight(weight: Tensor, config: QuantConfig) -> Tensor:
    """``weight`` [N, K] rounded onto ``config``'s grid, in float32: what ``rtn_quantize(weight,
    config).dequantize()`` holds, with every whole group a row of one ``find_group_params`` call and a
    last, narrower group (K not a multiple of the group size: GPTQ's layout allows it) a row of another."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    width = k if config.group_size == -1 else config.group_size
    whole = k - k % width
    on_grid = torch.empty_like(w)
    for columns, size in ((slice(0, whole), width), (slice(whole, k), k - whole)):
        if size:
            rows = w[:, columns].reshape(-1, size)
            on_grid[:, columns] = fake_quantize(rows, find_group_params(rows, config), config.maxq).reshape(n, -1)
    return on_grid


def quantized_record(weight: Tensor, config: QuantConfig) -> QuantizedTensor:
    """The trained latent weight as the record the formats write (RTN onto the same grid)."""
    return rtn_quantize(weight.detach(), config)


def latent_for(record: QuantizedTensor) -> Tensor:
    """Latent weights that ``record``'s own grid rounds back to exactly the record, to start QAT from a
    post-training solution (e.g. GPTQ's). The absmean ternary grid recomputes its scale from the
    weights, so the dequantized t·s would come back with a smaller scale (mean |t·s| < s when some t
    are 0); t·s·g/nnz per group has mean |w| = s and rounds to t. Other grids: the dequantized weights."""
    if not record.config.ternary:
        return record.dequantize()
    n, k = record.shape
    width = k if record.config.group_size == -1 else record.config.group_size
    trits = (record.codes.to(torch.float32) - 1).reshape(n, k // width, width)
    nonzero = trits.abs().sum(dim=-1, keepdim=True)
    stretch = torch.where(nonzero > 0, width / nonzero.clamp(min=1), torch.ones_like(nonzero))
    return (trits * record.scales.T.to(torch.float32).unsqueeze(-1) * stretch).reshape(n, k)


class _StraightThrough(torch.autograd.Function):
    """Forward: the grid weight. Backward: the gradient passes to the latent weight as it is."""

    @staticmethod
    def forward(ctx, latent: Tensor, on_grid: Tensor) -> Tensor:
        return on_grid

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def straight_through(latent: Tensor, on_grid: Tensor) -> Tensor:
    return _StraightThrough.apply(latent, on_grid.to(latent.dtype))


class FakeQuantLinear(torch.nn.Linear):
    """A linear whose forward multiplies by its weight on the grid. The grid weight is computed once per
    optimizer step (``refresh``), not once per micro-batch: the latent weight changes only at a step."""

    def __init__(self, linear: torch.nn.Linear, config: QuantConfig):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        self.weight = linear.weight
        self.bias = linear.bias
        self.config = config
        self._on_grid: Tensor | None = None

    def refresh(self) -> None:
        self._on_grid = grid_weight(self.weight, self.config)

    def forward(self, x: Tensor) -> Tensor:
        if self._on_grid is None:
            self.refresh()
        return torch.nn.functional.linear(x, straight_through(self.weight, self._on_grid), self.bias)


def wrap_linears(model: torch.nn.Module, grids: dict[str, QuantConfig]) -> None:
    """Replace each named ``nn.Linear`` of ``model`` by a FakeQuantLinear on its grid, sharing its parameters."""
    for name, config in grids.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, FakeQuantLinear(getattr(parent, child), config))


def check_groups(config: QuantConfig, shapes: dict[str, tuple[int, int]]) -> None:
    """A QAT recipe's grid must tile every trained linear: a ragged group would get a scale from fewer
    weights than the recipe says. (The draft head's W4 grid instead follows GPTQ's layout, whose last
    group may be narrower: the EAGLE-3 fc's K = 3·hidden is rarely a multiple of 128.)"""
    if config.group_size == -1:
        return
    ragged = {name: k for name, (_, k) in shapes.items() if k % config.group_size}
    if ragged:
        name, k = next(iter(ragged.items()))
        raise ValueError(f"qat: group size {config.group_size} does not divide K = {k} of {name} "
                         f"({len(ragged)} linears affected); choose a group size that divides every "
                         "linear's input features, or -1 (one scale per output channel)")
