"""The neutral quantized-tensor record and the uniform integer grid that every algorithm shares.

Algorithms (RTN, GPTQ, AWQ) produce a ``QuantizedTensor``; formats only turn that record into bytes
and back. The grid follows the reference GPTQ quantizer (IST-DASLab ``quant.py``, AutoGPTQ): per
group and output row, ``q = clamp(round(w / scale) + zero, 0, maxq)`` and ``w ≈ (q - zero) * scale``.
A float-bias grid (``QuantConfig.float_bias``, MLX's affine mode) replaces the integer zero point
with a float bias: ``q = clamp(round((w - bias) / scale), 0, maxq)`` and ``w ≈ scale * q + bias``.
Parameter search (``find_group_params``) and rounding (``quantize_codes``) are separate functions
because the GPTQ solver picks parameters per group but rounds one column at a time.

Round-to-nearest (``rtn_quantize``) is here too, not among the algorithms, because formats need it
as well: MLX quantizes the embedding and LM head the way ``mlx_lm.convert`` does. On a float-bias
grid it is mlx-lm's own quantizer, ``mx.quantize``: the codes are rounded with the float32 min-max
parameters and the scale and bias are then stored in the model dtype, so the result equals
``mlx_lm.convert -q`` bit for bit. (The solvers instead choose codes on the grid as stored:
``find_group_params``.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import Tensor

SUPPORTED_BITS = (2, 3, 4, 8)  # what the integer-zero formats (GPTQ, AWQ, ...) store
FLOAT_BIAS_BITS = (2, 3, 4, 5, 6, 8)  # what MLX's affine grid stores
FLOAT_BIAS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # MLX keeps scales in the model dtype
# GPTQ, AWQ and Marlin store integer grids' scales in float16; compressed-tensors in the model's dtype
INTEGER_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128, 256)  # -1: one group spanning every input channel

# Smallest positive float16 (subnormal): scales below it would round to 0 in the checkpoint.
_MIN_FP16_SCALE = 2.0**-24
# The least scale each stored dtype keeps from rounding to 0
_MIN_SCALE = {torch.float16: _MIN_FP16_SCALE, torch.bfloat16: torch.finfo(torch.bfloat16).tiny,
              torch.float32: torch.finfo(torch.float32).tiny}


@dataclass(frozen=True)
class QuantConfig:
    """A uniform grid per group of input channels. ``ternary`` is BitCPM4's grid {-s, 0, +s} with
    s = mean|w| of the group (BitCPM-CANN §3.2), stored as GPTQ's asymmetric 2-bit codes t + 1 with
    zero point 1, so every writer, reader and solver of the uniform grid handles it unchanged.

    ``min_zero`` is the smallest zero point the target format can store. GPTQ's v1 checkpoints store
    zero − 1 in ``bits`` bits, so a zero of 0 has no encoding there that every consumer decodes
    alike (docs/formats.md, "GPTQ zero points"); their asymmetric grid is therefore [1, maxq]. The
    solvers choose parameters on this grid, so nothing is re-rounded when the record is written.

    ``float_bias`` is MLX's affine grid: a float bias per group instead of an integer zero point, the
    scale and bias both stored in ``scale_dtype`` (the model's dtype), the scale possibly negative.
    It is asymmetric by nature (``sym`` False) and also holds 5 and 6 bits.

    ``scale_dtype`` is what the format stores scales in: float16 for GPTQ, AWQ and Marlin; the model's
    dtype for compressed-tensors and MLX. The solvers round each scale to it before choosing codes."""

    bits: int
    group_size: int
    sym: bool
    ternary: bool = False
    min_zero: int = 0
    float_bias: bool = False
    scale_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        allowed_bits = FLOAT_BIAS_BITS if self.float_bias is True else SUPPORTED_BITS
        if isinstance(self.bits, bool) or self.bits not in allowed_bits:
            raise ValueError(f"bits must be one of {allowed_bits}, got {self.bits!r}")
        if isinstance(self.group_size, bool) or self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {self.group_size!r}")
        if not isinstance(self.sym, bool):
            raise ValueError(f"sym must be a bool, got {self.sym!r}")
        if not isinstance(self.ternary, bool):
            raise ValueError(f"ternary must be a bool, got {self.ternary!r}")
        if self.ternary and (self.bits != 2 or self.sym):
            raise ValueError("a ternary grid stores codes t + 1 in 0..2 with zero point 1 (GPTQ's asymmetric "
                             f"2-bit layout): it needs bits=2 and sym=False, got bits={self.bits}, sym={self.sym}")
        if isinstance(self.min_zero, bool) or self.min_zero not in (0, 1):
            raise ValueError(f"min_zero must be 0 or 1, got {self.min_zero!r}")
        if not isinstance(self.float_bias, bool):
            raise ValueError(f"float_bias must be a bool, got {self.float_bias!r}")
        if self.float_bias and (self.sym or self.ternary or self.min_zero):
            raise ValueError("a float-bias grid has no integer zero point: it needs sym=False, ternary=False and "
                             f"min_zero=0, got sym={self.sym}, ternary={self.ternary}, min_zero={self.min_zero}")
        allowed_dtypes = FLOAT_BIAS_DTYPES if self.float_bias else INTEGER_SCALE_DTYPES
        if self.scale_dtype not in allowed_dtypes:
            raise ValueError(f"scale_dtype must be one of {allowed_dtypes} on this grid, got {self.scale_dtype!r}")

    @property
    def maxq(self) -> int:
        return 2 if self.ternary else 2**self.bits - 1

    def num_groups(self, in_features: int) -> int:
        """Groups per output row; a ragged last group counts (576 channels at g128 -> 5)."""
        return 1 if self.group_size == -1 else math.ceil(in_features / self.group_size)


def default_g_idx(in_features: int, group_size: int, device: torch.device | str = "cpu") -> Tensor:
    """Group of each input channel without act-order: ``k // group_size`` (all 0 for group_size -1)."""
    if in_features < 1:
        raise ValueError(f"in_features must be positive, got {in_features}")
    if group_size == -1:
        return torch.zeros(in_features, dtype=torch.int32, device=device)
    return torch.div(torch.arange(in_features, dtype=torch.int32, device=device), group_size, rounding_mode="floor")


def group_slices(in_features: int, group_size: int) -> list[slice]:
    """Input-channel ranges of the natural (non-act-order) groups, the last one possibly narrower."""
    width = in_features if group_size == -1 else group_size
    return [slice(start, min(start + width, in_features)) for start in range(0, in_features, width)]


def require_finite(weights: Tensor) -> None:
    bad = (~torch.isfinite(weights)).sum().item()
    if bad:
        raise ValueError(
            f"cannot quantize weights of shape {tuple(weights.shape)}: {bad} value(s) are NaN or Inf"
        )


class GroupParams(NamedTuple):
    """Grid of one group, one entry per output row (float32; scales exact in the stored ``scale_dtype``).

    A float-bias grid has ``bias`` and no meaningful ``zero`` (all 0)."""

    scale: Tensor
    zero: Tensor  # integers in [0, maxq]
    bias: Tensor | None = None


def find_group_params(weights: Tensor, config: QuantConfig) -> GroupParams:
    """Scale and zero point per row of ``weights`` [rows, group_width], reference-GPTQ semantics.

    The range always includes 0. Sym: ``zero = 2^(bits-1)``, ``scale = 2·max|w| / maxq``, except that a
    row with no negative value keeps ``xmin = 0`` (``scale = max / maxq``), as the reference does.
    Asym: ``scale = (xmax - xmin) / maxq``, ``zero = round(-xmin / scale)``. Where that zero falls
    below ``config.min_zero`` (a row with no value under −scale/2), the zero is raised to it and the
    scale widened to ``max(xmax / (maxq - min_zero), -xmin / min_zero)``, the least that still
    covers the row's range. An all-zero row gets the range [-1, 1]. The scale is rounded to the stored
    dtype (``config.scale_dtype``) *before* the zero point and the codes are derived,
    so the stored checkpoint dequantizes to exactly the weights the algorithm saw.
    """
    if weights.dim() != 2 or weights.shape[1] == 0:
        raise ValueError(f"expected a [rows, group_width] weight slice, got shape {tuple(weights.shape)}")
    if config.float_bias:  # affine_params checks finiteness itself
        return stored_affine_params(affine_params(weights, config), config)
    w = weights.to(torch.float32)
    require_finite(w)
    if config.ternary:
        return _absmean_params(w)
    xmin = w.amin(dim=1).clamp(max=0.0)
    xmax = w.amax(dim=1).clamp(min=0.0)
    if config.sym:
        xmax = torch.maximum(-xmin, xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    empty = (xmin == 0) & (xmax == 0)
    xmin = torch.where(empty, -1.0, xmin)
    xmax = torch.where(empty, 1.0, xmax)

    scale = (xmax - xmin) / config.maxq
    if not config.sym and config.min_zero:
        floor = config.min_zero
        below = torch.round(-xmin / scale) < floor
        widened = torch.maximum(xmax / (config.maxq - floor), -xmin / floor)
        scale = torch.where(below, widened, scale)
    stored = scale.clamp(min=_MIN_SCALE[config.scale_dtype]).to(config.scale_dtype)
    if not torch.isfinite(stored).all():
        raise ValueError(
            f"weight range up to {float(xmax.max()):.4g} / down to {float(xmin.min()):.4g} "
            f"gives a scale beyond {config.scale_dtype}'s range ({torch.finfo(config.scale_dtype).max:.4g})"
        )
    scale = stored.to(torch.float32)
    if config.sym:
        zero = torch.full_like(scale, float((config.maxq + 1) // 2))
    else:
        zero = torch.round(-xmin / scale).clamp(config.min_zero, config.maxq)
    return GroupParams(scale, zero)


# mx.quantize's floor on a group's step (float32 1e-7): a constant group still gets a finite scale
_AFFINE_EPS = torch.tensor(1e-7, dtype=torch.float32)


def affine_params(weights: Tensor, config: QuantConfig) -> GroupParams:
    """MLX's min-max rule (``mx.quantize``, mlx/backend/cpu/quantized.cpp), in float32, unrounded.

    step = max((max − min) / maxq, 1e-7). The extreme of larger magnitude (the edge) becomes code 0:
    the bias is the edge and the scale points from it into the group (negative when the edge is the
    maximum). The scale is then adjusted to edge / round(edge / scale), so that 0 also falls exactly
    on the grid. ``mx.quantize`` rounds the codes with these float32 values and stores the scale and
    bias in the model dtype; ``stored_affine_params`` gives the grid as stored.
    """
    w = weights.to(torch.float32)
    require_finite(w)
    xmin, xmax = w.amin(dim=1), w.amax(dim=1)
    bins = torch.full_like(xmin, float(config.maxq))
    step = torch.maximum((xmax - xmin) / bins, _AFFINE_EPS)
    min_is_edge = xmin.abs() > xmax.abs()
    scale = torch.where(min_is_edge, step, -step)
    edge = torch.where(min_is_edge, xmin, xmax)
    q0 = torch.round(edge / scale)
    on_grid = q0 != 0
    scale = torch.where(on_grid, edge / q0, scale)
    bias = torch.where(on_grid, edge, torch.zeros_like(edge))
    return GroupParams(scale, torch.zeros_like(scale), bias)


def stored_affine_params(params: GroupParams, config: QuantConfig) -> GroupParams:
    """``params`` rounded to the dtype the format stores them in, back in float32: the exact grid."""
    def stored(t: Tensor) -> Tensor:
        return t.to(config.scale_dtype).to(torch.float32)

    scale = stored(params.scale)
    if not torch.isfinite(scale).all() or bool((scale == 0).any()):
        raise ValueError(f"a group's scale does not fit {config.scale_dtype} (0 or beyond its range)")
    return GroupParams(scale, params.zero, stored(params.bias))


def _absmean_params(w: Tensor) -> GroupParams:
    """BitCPM4's ternary grid: s = mean|w| per row (float16, never 0), codes round(w / s) + 1 in 0..2."""
    scale = w.abs().mean(dim=1).clamp(min=_MIN_FP16_SCALE).to(torch.float16).to(torch.float32)
    return GroupParams(scale, torch.ones_like(scale))


# Clipping search after the reference GPTQ quantizer (``Quantizer.configure(mse=True)``): shrink
# each row's range by p = 1 - i/100, i < 80, keeping the p whose |error|^2.4 sum is least. Rather
# than all 80 shrinks, every 5th is tried, then the 8 neighbours of each row's best: a third of the
# work, and within 0.2 % of the exhaustive search's error on the tests' weights.
CLIP_STEPS = 80
CLIP_COARSE = 5
CLIP_NORM = 2.4
_CLIP_CHUNK_ELEMENTS = 1 << 20  # candidates x rows x columns per step: 4 MB of float32 temporaries


def search_group_params(weights: Tensor, config: QuantConfig, hessian: Tensor | None = None) -> GroupParams:
    """``find_group_params`` of ``p · weights`` for the best shrink p of each row (see CLIP_STEPS).

    Without ``hessian`` a candidate's cost is Σ |error|^CLIP_NORM (reference GPTQ). With the
    group's block of the input Hessian [width, width] it is the row's output error over the
    calibration tokens, ``Δ H Δᵀ`` (AWQ's clipping search, which measures exactly that).
    Parameters depend only on each row's extremes, and ``max(p·w) = p·max(w)`` exactly in floating
    point for p > 0, so every candidate's parameters come from the scaled extremes.
    """
    if config.ternary:
        raise ValueError("the clipping search shrinks a min/max range; a ternary grid's scale is the group's "
                         "mean |w|, so it has no range to clip (turn gptq.clip_search off, or use gptq/rtn, not awq)")
    w = weights.to(torch.float32)
    require_finite(w)
    rows, width = w.shape
    if hessian is not None and tuple(hessian.shape) != (width, width):
        raise ValueError(f"hessian block must be {width} x {width} for a group of {width} columns, "
                         f"got {tuple(hessian.shape)}")
    extremes = torch.stack([w.amin(dim=1), w.amax(dim=1)], dim=1)  # [rows, 2]

    def best_of(steps: Tensor) -> Tensor:
        return steps.gather(0, _clip_errors(w, extremes, steps, config, hessian).argmin(dim=0, keepdim=True))

    best_step = best_of(torch.arange(0, CLIP_STEPS, CLIP_COARSE, device=w.device).unsqueeze(1).expand(-1, rows))
    offsets = torch.tensor([d for d in range(1 - CLIP_COARSE, CLIP_COARSE) if d], device=w.device).unsqueeze(1)
    best_step = best_of(torch.cat([best_step, (best_step + offsets).clamp(0, CLIP_STEPS - 1)])).squeeze(0)
    return find_group_params(_shrink(best_step).unsqueeze(1) * extremes, config)


def _shrink(steps: Tensor) -> Tensor:
    """p = 1 - step/100, rounded once to float32 (as a Python float multiplying a float32 tensor is)."""
    return (1 - steps.to(torch.float64) / 100).to(torch.float32)


def _clip_errors(w: Tensor, extremes: Tensor, steps: Tensor, config: QuantConfig, hessian: Tensor | None) -> Tensor:
    """Cost per row (see ``search_group_params``) of each candidate shrink step; steps [C, rows].

    ``fake_quantize``'s arithmetic, written in place over [chunk, rows, columns] temporaries.
    """
    rows, width = w.shape
    errors = []
    for chunk in steps.split(max(1, _CLIP_CHUNK_ELEMENTS // (rows * width))):
        shrink = _shrink(chunk).unsqueeze(2)  # [c, rows, 1]
        params = find_group_params((shrink * extremes).reshape(-1, 2), config)
        scale, zero = params.scale.view(shrink.shape), params.zero.view(shrink.shape)
        if params.bias is None:
            codes = torch.round(w / scale).add_(zero).clamp_(0, config.maxq)
            delta = codes.sub_(zero).mul_(scale).sub_(w)
        else:
            bias = params.bias.view(shrink.shape)
            codes = torch.round((w - bias).div_(scale)).clamp_(0, config.maxq)
            delta = codes.mul_(scale).add_(bias).sub_(w)
        if hessian is None:
            errors.append(delta.abs_().pow_(CLIP_NORM).sum(dim=2))
        else:
            errors.append((delta @ hessian).mul_(delta).sum(dim=2))
    return torch.cat(errors)


def _per_row(param: Tensor, like: Tensor) -> Tensor:
    """Broadcast a per-row parameter [rows] over a column [rows] or a block [rows, cols]."""
    return param.reshape(-1, *([1] * (like.dim() - 1)))


def quantize_codes(weights: Tensor, params: GroupParams, maxq: int) -> Tensor:
    """Integer codes (as float32) of ``weights`` [rows] or [rows, cols] on the grid ``params``."""
    w = weights.to(torch.float32)
    scale = _per_row(params.scale, w)
    if params.bias is not None:
        return torch.clamp(torch.round((w - _per_row(params.bias, w)) / scale), 0, maxq)
    return torch.clamp(torch.round(w / scale) + _per_row(params.zero, w), 0, maxq)


def dequantize_codes(codes: Tensor, params: GroupParams) -> Tensor:
    """``(codes - zero) * scale``, or ``codes * scale + bias``, in float32: the same arithmetic as
    ``QuantizedTensor.dequantize``."""
    c = codes.to(torch.float32)
    if params.bias is not None:
        return c * _per_row(params.scale, c) + _per_row(params.bias, c)
    return (c - _per_row(params.zero, c)) * _per_row(params.scale, c)


def fake_quantize(weights: Tensor, params: GroupParams, maxq: int) -> Tensor:
    return dequantize_codes(quantize_codes(weights, params, maxq), params)


def _check_tensor(tensor: Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")


@dataclass(eq=False)
class QuantizedTensor:
    """One quantized linear weight, independent of any checkpoint format.

    ``codes`` uint8 [N, K] in the original input-channel order; ``scales`` [G, N] in
    ``config.scale_dtype`` (float16 unless the format stores another); ``zeros`` uint8 [G, N] (the true
    integer zero point, no GPTQ-v1 offset); ``g_idx`` int32 [K] (group of each input channel;
    non-monotonic under act-order). On a float-bias grid ``zeros`` is None and ``biases`` [G, N] holds
    each group's bias.
    """

    codes: Tensor
    scales: Tensor
    zeros: Tensor | None
    g_idx: Tensor
    config: QuantConfig
    biases: Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.config, QuantConfig):
            raise TypeError(f"config must be a QuantConfig, got {type(self.config).__name__}")
        if not isinstance(self.codes, Tensor) or self.codes.dim() != 2 or 0 in self.codes.shape:
            shape = tuple(self.codes.shape) if isinstance(self.codes, Tensor) else type(self.codes).__name__
            raise ValueError(f"codes must be a non-empty [N, K] tensor, got {shape}")
        n, k = self.codes.shape
        groups = self.config.num_groups(k)
        _check_tensor(self.codes, "codes", torch.uint8, (n, k))
        _check_tensor(self.scales, "scales", self.config.scale_dtype, (groups, n))
        _check_tensor(self.g_idx, "g_idx", torch.int32, (k,))
        maxq = self.config.maxq
        if int(self.codes.max()) > maxq:
            raise ValueError(f"codes exceed maxq={maxq} for {self.config.bits}-bit: max {int(self.codes.max())}")
        if int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= groups:
            raise ValueError(
                f"g_idx values must lie in [0, {groups}), got [{int(self.g_idx.min())}, {int(self.g_idx.max())}]"
            )
        if self.config.float_bias:
            self._check_biases(groups, n)
        else:
            self._check_zeros(groups, n)

    def _check_biases(self, groups: int, n: int) -> None:
        if self.zeros is not None or self.biases is None:
            raise ValueError("a float-bias record has biases and no zero points")
        _check_tensor(self.biases, "biases", self.config.scale_dtype, (groups, n))
        if not (torch.isfinite(self.scales).all() and torch.isfinite(self.biases).all()):
            raise ValueError("scales and biases must be finite")

    def _check_zeros(self, groups: int, n: int) -> None:
        if self.biases is not None:
            raise ValueError(f"biases belong to a float-bias grid, not to {self.config}")
        _check_tensor(self.zeros, "zeros", torch.uint8, (groups, n))
        maxq = self.config.maxq
        if int(self.zeros.max()) > maxq:
            raise ValueError(f"zeros exceed maxq={maxq} for {self.config.bits}-bit: max {int(self.zeros.max())}")
        if int(self.zeros.min()) < self.config.min_zero:
            raise ValueError(f"zeros below min_zero={self.config.min_zero}: min {int(self.zeros.min())}")
        if not (torch.isfinite(self.scales).all() and (self.scales >= 0).all()):
            raise ValueError("scales must be finite and not negative")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight [N, K]: ``(codes - zeros[g_idx].T) * scales[g_idx].T``, or on a float-bias grid
        ``codes * scales[g_idx].T + biases[g_idx].T``, in float32, then cast. Groups in their natural
        order whose size divides K are broadcast over [N, G, size] instead of gathered to [N, K] (the
        same arithmetic; an 8B gate_proj in 0.24 s instead of 2.9 s on one thread)."""
        n, k = self.codes.shape
        size = k if self.config.group_size == -1 else self.config.group_size
        if k % size == 0 and torch.equal(self.g_idx, default_g_idx(k, self.config.group_size, self.g_idx.device)):
            codes = self.codes.to(torch.float32).view(n, k // size, size)
            scales = self.scales.T.to(torch.float32).unsqueeze(2)
            if self.biases is not None:
                weight = codes.mul_(scales).add_(self.biases.T.to(torch.float32).unsqueeze(2))
            else:
                weight = codes.sub_(self.zeros.T.to(torch.float32).unsqueeze(2)).mul_(scales)
            return weight.view(n, k).to(dtype)
        g = self.g_idx.long()
        scales = self.scales[g].T.to(torch.float32)
        if self.biases is not None:
            return (self.codes.to(torch.float32) * scales + self.biases[g].T.to(torch.float32)).to(dtype)
        zeros = self.zeros[g].T.to(torch.float32)
        return ((self.codes.to(torch.float32) - zeros) * scales).to(dtype)


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
    """Round-to-nearest: every group's grid from its own min/max, each weight rounded independently
    (float32 math whatever the input dtype)."""
    find = affine_params if config.float_bias else find_group_params
    return quantize_groups(weight, config, lambda w, columns: find(w[:, columns], config))
