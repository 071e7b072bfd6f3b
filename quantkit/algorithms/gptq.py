"""GPTQ: quantize a linear weight column by column, compensating each rounding error in later columns.

Semantics follow the reference solver (IST-DASLab ``gptq.py``, AutoGPTQ): float32 math; dead input
channels get ``H[i, i] = 1`` and zero weight; dampening ``damp_percent × mean(diag H)``; lazy batch
updates in blocks; act-order (``desc_act``) and ``static_groups``; group-aware reordering
(``group_aware``, GAR: Gafni et al., CVPRW 2025): groups keep their natural columns, so ``g_idx``
stays trivial and Marlin can pack the result, but are processed by descending max Hessian
diagonal, each group's columns in descending order. Group parameters are found when a
group starts, on its columns with every earlier column's compensation applied (the reference reads
block-stale weights for groups that start inside a block; with group = block = 128 both agree).

One reformulation, mathematically identical: the reference uses U, the upper Cholesky factor of H⁻¹
(factorise, invert, factorise). Here ``H = V Vᵀ`` with V upper triangular, so ``U = V⁻¹``: one
Cholesky factorisation of the reversed H, about a third of the work at K = 16384 and no explicit
inverse. Inside a block the reference recursion runs with ``U_bb = V_bb⁻¹`` (a small triangular
inverse). A block's start state, the reference's ``W_b - E_<b U_<b,b``, equals
``W_b + Δ_<b V_<b,b U_bb`` with ``Δ = W - Q`` the finished columns' residuals, one matrix product.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import Tensor

from quantkit.algorithms.base import Algorithm, Target
from quantkit.device import torch_threads
from quantkit.fp8 import FloatGrid, FP8Solver, FP8Tensor
from quantkit.gguf.record import GGUFTensor
from quantkit.gguf.solver_grid import BlockGrid, LatticeGrid, block_grid
from quantkit.gguf.types import TensorType
from quantkit.quant import (
    GroupParams,
    QuantConfig,
    QuantizedTensor,
    default_g_idx,
    dequantize_codes,
    find_group_params,
    group_slices,
    quantize_codes,
    require_finite,
    search_group_params,
)
from quantkit.recipes.fields import Field, Section

logger = logging.getLogger(__name__)

# When H + damp·I is not positive definite in float32, retry with the damping multiplied by this,
# at most DAMP_RETRIES times (0.01 -> 0.02 -> ... -> 10.24 from the default), then give up: small
# steps keep the damping near the least that works, which is what the solution's quality depends on.
DAMP_GROWTH = 2.0
DAMP_RETRIES = 10
# Rows per rank-1-update sub-block inside a block; divides every supported group size.
SUB_BLOCK = 16


def _one_column_order(settings: dict) -> str | None:
    if settings["desc_act"] and settings["group_aware"]:
        return ("'gptq.desc_act' and 'gptq.group_aware' are two column orders: enable one "
                "(group_aware is on by default: set gptq.group_aware: false for act-order)")
    return None


# The recipe's ``gptq`` section: ``gptq_quantize``'s keyword arguments. Not the reference GPTQ settings
# (natural order, damp 0.01, min/max ranges), which gave about 1.7x the KL of these on the default model:
# docs/recipes.md, "GPTQ solver: order, damping, clipping".
SETTINGS = Section({
    "damp_percent": Field(float, default=0.2, check=lambda v: 0 < v < 1, rule="in (0, 1)",
                          help="dampening added to H's diagonal, as a fraction of its mean"),
    "block_size": Field(int, default=128, choices=(32, 64, 128, 256), help="columns solved per lazy batch update"),
    "desc_act": Field(bool, default=False, help="act-order: columns by descending Hessian diagonal"),
    "static_groups": Field(bool, default=False, help="group parameters from the unmodified weights"),
    "group_aware": Field(bool, default=True,
                         help="group-aware reordering (GAR): groups by descending max Hessian diagonal, "
                              "columns within each; keeps g_idx trivial, so Marlin can pack it"),
    "clip_search": Field(bool, default=True,
                         help="reference GPTQ's mse option: each group's range is the best of 80 shrunk "
                              "ranges (least |error|^2.4)"),
}, check=_one_column_order)
# Settings that act on GPTQ's own grid only, which a recipe on GGUF block types refuses: llama.cpp's
# quantizer chooses the blocks' scales (desc_act, which would move the blocks' columns, is refused by
# the format's check, which points to group_aware instead)
UNIFORM_GRID_ONLY = ("clip_search", "static_groups")


class GPTQSolution(NamedTuple):
    quantized: QuantizedTensor | GGUFTensor | FP8Tensor
    weight: Tensor  # [N, K] float32: the fake-quantized weights the solver propagated errors against
    damp_percent: float  # dampening actually used (larger than requested if retries were needed)
    # [N, K] float32: each weight as the solver rounded it, every earlier column's compensation applied
    # (block reconstruction starts from these: a decision GPTQ made narrowly is the cheapest to revisit)
    rounding_point: Tensor


def gptq_quantize(
    weight: Tensor,
    hessian: Tensor,
    config: Target,
    *,
    damp_percent: float = 0.01,
    block_size: int = 128,
    desc_act: bool = False,
    static_groups: bool = False,
    group_aware: bool = False,
    clip_search: bool = False,
    imatrix: bool = True,
) -> QuantizedTensor | GGUFTensor | FP8Tensor:
    """GPTQ-quantize ``weight`` [N, K] against ``hessian`` [K, K] (H = 2/n Σ xᵀx of its inputs).

    The recipes' entry point: on a GGUF block type the block scales come from llama.cpp's imatrix
    search weighted by diag(H) unless ``imatrix`` is off (then llama.cpp's plain search)."""
    return gptq_solve(
        weight, hessian, config,
        damp_percent=damp_percent, block_size=block_size, desc_act=desc_act, static_groups=static_groups,
        group_aware=group_aware, clip_search=clip_search, imatrix=imatrix,
    ).quantized


def gptq_solve(
    weight: Tensor,
    hessian: Tensor,
    config: Target,
    *,
    damp_percent: float = 0.01,
    block_size: int = 128,
    desc_act: bool = False,
    static_groups: bool = False,
    group_aware: bool = False,
    clip_search: bool = False,
    imatrix: bool = True,
) -> GPTQSolution:
    """As ``gptq_quantize``, also returning the solver's fake-quantized weights and the damping used.
    ``imatrix``: on a GGUF block type, choose the block scales with llama.cpp's imatrix search, the
    imatrix being diag(H) (gguf/solver_grid.py); no effect on GPTQ's own grid."""
    _validate(weight, hessian, config, damp_percent, block_size, desc_act, static_groups, clip_search)
    if desc_act and group_aware:
        raise ValueError("desc_act and group_aware are two different column orders: choose one")
    n, k = weight.shape
    w = weight.detach().to(torch.float32, copy=True)
    require_finite(w)
    diag = hessian.diagonal().to(torch.float32)
    dead = diag == 0
    w[:, dead] = 0.0
    importance = diag.masked_fill(dead, 1.0)
    if desc_act:
        order = torch.argsort(importance, descending=True, stable=True)
    elif group_aware:
        order = _group_aware_order(importance, _group_width(config), _unit(config))
    else:
        order = torch.arange(k, device=w.device)
    factor, used_damp = _hessian_factor(hessian, order, dead, damp_percent)
    if isinstance(config, QuantConfig):
        grid = _Grid(w, order, config, up_front=static_groups or config.group_size == -1,
                     groups_follow_columns=not desc_act, clip_search=clip_search)
    elif isinstance(config, FloatGrid):
        grid = FP8Solver(config, w)
    else:  # dead channels weigh 0; a lattice grid weighs its units' errors by V's diagonal, squared
        grid = block_grid(config, w, order, diag if imatrix else None, factor.diagonal().square())

    work = w[:, order].T.contiguous()  # [K, N]: one row per input channel, in processing order
    del w
    residual = work.clone()  # row j: the original w[j] until column j is done, then w[j] - q[j]
    codes = torch.empty(k, n, dtype=torch.uint8, device=work.device)
    rounding_point = torch.empty_like(work)
    for start in range(0, k, block_size):
        stop = min(start + block_size, k)
        block = work[start:stop]  # a view: updates land in ``work``
        identity = torch.eye(stop - start, device=factor.device)
        u_block = torch.linalg.solve_triangular(factor[start:stop, start:stop], identity, upper=True)
        if start:
            block.addmm_(u_block.T, factor[:start, start:stop].T @ residual[:start])
        # The column loop is a chain of small dependent ops: thread hand-offs cost more than they save
        # (measured at 4096 x 4096 on 2 busy cores: 3.9-5.9 s with one thread against 6.5-37 s with
        # two), so it runs on one; the clipping search inside it is big enough to use them all again.
        with torch_threads(1):
            codes[start:stop] = _quantize_block(block, u_block, start, grid, rounding_point[start:stop])
        residual[start:stop] -= block

    weight_hat = torch.empty(n, k, dtype=torch.float32, device=work.device)
    weight_hat[:, order] = work.T
    original_codes = torch.empty(n, k, dtype=torch.uint8, device=codes.device)
    original_codes[:, order] = codes.T
    rounded = torch.empty(n, k, dtype=torch.float32, device=work.device)
    rounded[:, order] = rounding_point.T
    return GPTQSolution(grid.record(original_codes), weight_hat, used_damp, rounded)


def _group_aware_order(importance: Tensor, group_size: int, unit: int = 1) -> Tensor:
    """GAR: whole groups by descending max importance, the units of ``unit`` consecutive columns within
    each group by descending max importance, each unit's columns in natural order (a lattice type
    rounds 8 columns jointly; every scalar grid's unit is one column).

    A ragged last group stays last, so that no group straddles a block of ``block_size`` columns.
    """
    k = importance.numel()
    if group_size == -1:
        return torch.argsort(importance, descending=True, stable=True)
    full = k // group_size * group_size
    by_unit = importance[:full].view(-1, group_size // unit, unit).amax(dim=2)  # [groups, units]
    within = torch.argsort(by_unit, dim=1, descending=True, stable=True)
    columns = (within * unit).unsqueeze(2) + torch.arange(unit, device=importance.device)
    columns += torch.arange(0, full, group_size, device=importance.device).view(-1, 1, 1)
    groups = torch.argsort(by_unit.amax(dim=1), descending=True, stable=True)
    tail = full + torch.argsort(importance[full:], descending=True, stable=True)
    return torch.cat([columns[groups].reshape(-1), tail])


class _Grid:
    """Every group's scale and zero point ([groups, N]) and the group of each processing position.

    Groups follow their columns (natural and group-aware order, static groups) or, for plain
    act-order, are runs of consecutive processing positions, as the GPTQ format's g_idx allows.
    """

    def __init__(self, w: Tensor, order: Tensor, config: QuantConfig, up_front: bool, groups_follow_columns: bool,
                 clip_search: bool):
        k = w.shape[1]
        self.find = search_group_params if clip_search else find_group_params
        self.threads = torch.get_num_threads()
        natural_groups = default_g_idx(k, config.group_size, device=w.device).long()
        self.config = config
        self.order = order
        self.scales = torch.empty(config.num_groups(k), w.shape[0], dtype=torch.float32, device=w.device)
        self.zeros = torch.empty_like(self.scales)
        self.biases = torch.empty_like(self.scales) if config.float_bias else None
        self.group_starts: set[int] = set()
        self.position_group = natural_groups[order] if up_front or groups_follow_columns else natural_groups
        if up_front:  # from the unmodified weights in natural column order, whatever the processing order
            for group, columns in enumerate(group_slices(k, config.group_size)):
                self.keep(group, self.find(w[:, columns], config))
        else:  # each group's columns are consecutive positions; parameters are found as it starts
            changes = torch.nonzero(self.position_group[1:] != self.position_group[:-1]).flatten() + 1
            self.group_starts = {0, *changes.tolist()}

    def params(self, position: int, rows: Tensor) -> GroupParams:
        """Parameters for the column at ``position``; ``rows`` [>= group width, N] start at it."""
        group = int(self.position_group[position])
        if position in self.group_starts:
            width = min(self.config.group_size, len(self.position_group) - position)
            with torch_threads(self.threads):
                self.keep(group, self.find(rows[:width].T, self.config))
        return GroupParams(self.scales[group], self.zeros[group], None if self.biases is None else self.biases[group])

    def keep(self, group: int, params: GroupParams) -> None:
        self.scales[group], self.zeros[group] = params.scale, params.zero
        if self.biases is not None:
            self.biases[group] = params.bias

    def round(self, position: int, rows: Tensor) -> tuple[Tensor, Tensor]:
        """(codes, fake-quantized values) of the column at ``position``."""
        params = self.params(position, rows)
        codes = quantize_codes(rows[0], params, self.config.maxq)
        return codes, dequantize_codes(codes, params)

    def record(self, codes: Tensor) -> QuantizedTensor:
        """The record of the solver's ``codes`` [N, K] (natural column order) on this grid."""
        g_idx = torch.empty(codes.shape[1], dtype=torch.int32, device=codes.device)
        g_idx[self.order] = self.position_group.to(torch.int32)
        dtype = self.config.scale_dtype  # exact: the parameters were found on the stored grid
        scales = self.scales.to(dtype)
        if self.biases is not None:
            return QuantizedTensor(codes, scales, None, g_idx, self.config, biases=self.biases.to(dtype))
        return QuantizedTensor(codes, scales, self.zeros.to(torch.uint8), g_idx, self.config)


def _quantize_block(block: Tensor, u_block: Tensor, start: int,
                    grid: _Grid | BlockGrid | LatticeGrid | FP8Solver, rounding_point: Tensor) -> Tensor:
    """Quantize ``block`` [B, N] in place to its fake-quantized rows; return their codes (uint8), and keep
    each row as it was rounded in ``rounding_point`` [B, N].

    The reference recursion, with the rank-1 updates confined to sub-blocks of SUB_BLOCK rows and each
    finished sub-block applied to the rest of the block in one product. Sub-blocks divide the group
    size, so a group's rows have every earlier error applied when its parameters are found.
    """
    width = block.shape[0]
    codes = torch.empty(block.shape, dtype=torch.uint8, device=block.device)
    scaled_errors = torch.empty_like(block)
    for sub_start in range(0, width, SUB_BLOCK):
        sub_stop = min(sub_start + SUB_BLOCK, width)
        for c in range(sub_start, sub_stop):
            column_codes, fake = grid.round(start + c, block[c:])
            rounding_point[c] = block[c]
            torch.div(block[c] - fake, u_block[c, c], out=scaled_errors[c])
            block[c + 1:sub_stop].addr_(u_block[c, c + 1:sub_stop], scaled_errors[c], alpha=-1.0)
            block[c] = fake
            codes[c] = column_codes
        block[sub_stop:].addmm_(u_block[sub_start:sub_stop, sub_stop:].T, scaled_errors[sub_start:sub_stop], alpha=-1.0)
    return codes


def _unit(target: Target) -> int:
    """Consecutive columns the grid rounds jointly: 8 on a lattice type, else one."""
    return LatticeGrid.unit if isinstance(target, TensorType) and target.lattice is not None else 1


def _group_width(target: Target) -> int:
    """Columns that share grid parameters: a group, a GGUF block (whose sub-blocks share a scale), or
    every column (an FP8 row's one scale)."""
    if isinstance(target, FloatGrid):
        return -1
    return target.group_size if isinstance(target, QuantConfig) else target.block_size


def _validate(weight: Tensor, hessian: Tensor, target: Target, damp_percent: float, block_size: int,
              desc_act: bool, static_groups: bool, clip_search: bool) -> None:
    if not isinstance(target, (QuantConfig, TensorType, FloatGrid)):
        raise TypeError(f"config must be a QuantConfig, a GGUF TensorType or an FP8 FloatGrid, "
                        f"got {type(target).__name__}")
    if isinstance(target, TensorType) and (desc_act or static_groups or clip_search):
        raise ValueError(f"desc_act, static_groups and clip_search apply to GPTQ's own grid; on {target.name} the "
                         "blocks keep their columns and llama.cpp's quantizer chooses the scales")
    if isinstance(target, FloatGrid) and (static_groups or clip_search):
        raise ValueError(f"static_groups and clip_search apply to GPTQ's integer grid; on {target.name} each "
                         "row's scale maps its largest |w| to E4M3's 448")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or 0 in weight.shape:
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"expected a linear weight [out_features, in_features], got shape {shape}")
    k = weight.shape[1]
    if not isinstance(hessian, Tensor) or tuple(hessian.shape) != (k, k):
        shape = tuple(hessian.shape) if isinstance(hessian, Tensor) else type(hessian).__name__
        raise ValueError(f"hessian must have shape {(k, k)} to match weight {tuple(weight.shape)}, got {shape}")
    if not torch.isfinite(hessian).all():
        raise ValueError(f"hessian of shape {(k, k)} contains NaN or Inf")
    if not (isinstance(damp_percent, (int, float)) and 0 < damp_percent < float("inf")):
        raise ValueError(f"damp_percent must be a positive finite number, got {damp_percent!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    width = _group_width(target)
    if width != -1 and block_size % width:
        # A group must never straddle blocks, so that its parameters see every earlier column's error.
        raise ValueError(f"block_size {block_size} must be a multiple of the group width {width}")


def _hessian_factor(hessian: Tensor, order: Tensor, dead: Tensor, damp_percent: float) -> tuple[Tensor, float]:
    """Upper triangular V with ``H = V Vᵀ`` for the damped H in processing order, and the damping used.

    V is the ordinary lower Cholesky factor of H with rows and columns reversed, read back reversed.
    """
    reverse = order.flip(0)
    h = hessian[reverse[:, None], reverse[None, :]].to(torch.float32)  # a copy: the caller's H is untouched
    diagonal = h.diagonal().clone()
    diagonal[dead[reverse]] = 1.0
    mean_diagonal = diagonal.mean()
    damp = float(damp_percent)
    for _ in range(DAMP_RETRIES + 1):
        h.diagonal().copy_(diagonal + damp * mean_diagonal)
        lower, info = torch.linalg.cholesky_ex(h)
        if info.item() == 0:
            break
        damp *= DAMP_GROWTH
    else:
        raise ValueError(
            f"hessian of shape {tuple(h.shape)} is not positive definite even with damp_percent="
            f"{damp / DAMP_GROWTH:g} (tried {damp_percent:g} x {DAMP_GROWTH:g}^0..{DAMP_RETRIES})"
        )
    if damp != damp_percent:
        logger.warning("hessian %s needed damp_percent=%g (requested %g)", tuple(h.shape), damp, damp_percent)
    del h
    return lower.flip(0, 1), damp


class GPTQ(Algorithm):
    """``gptq_quantize`` with the recipe's ``gptq`` section."""

    name = "gptq"
    solves_block_types = True

    def __call__(self, weight, stats, target, values):
        return gptq_quantize(weight, stats.hessian, target, **values["gptq"])

    def solve(self, weight, stats, target, values):
        solution = gptq_solve(weight, stats.hessian, target, **values["gptq"])
        return solution.quantized, solution.rounding_point

    def clips(self, values) -> bool:
        return values["gptq"]["clip_search"]

    def uniform_grid_settings(self, values) -> tuple[str, ...]:
        return tuple(f"gptq.{key}" for key in UNIFORM_GRID_ONLY if values["gptq"][key])

    def recorded_settings(self, values) -> dict:
        settings = values["gptq"]
        return {"desc_act": settings["desc_act"], "static_groups": settings["static_groups"],
                "damp_percent": settings["damp_percent"]}
