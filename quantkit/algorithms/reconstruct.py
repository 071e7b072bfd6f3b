"""Block-wise output reconstruction: learn each weight's rounding and each group's scale so that a whole
decoder layer's output matches the unquantized layer's, starting from any solver's records.

The method is AutoRound's (Cheng et al., "Optimize Weight Rounding via Signed Gradient Descent for the
Quantization of LLMs", arXiv:2309.05516): a rounding offset V in [-1/2, 1/2] per weight and a correction
per group scale, trained by signed gradient descent with a linearly decaying step on the squared error of
the layer's output, the rounding passed straight through. Two differences:

- the start is the solver's decision, not round-to-nearest's. The offsets are added to the weights as the
  solver rounded them (its rounding point: GPTQ's weights with every earlier column's compensation
  applied, the weights themselves for round-to-nearest), ``q = clamp(round(w' / s + z + V) + D)``, D the
  integer shift that makes the start's codes exact where the solver did not round to nearest (a clamp).
  At V = 0 and the record's scales the codes are the record's bit for bit, and a decision the solver made
  narrowly is the first to be revisited (AutoRound's offsets around the unquantized weights would
  undo GPTQ's compensation wherever it moved a weight across a rounding boundary);
- the layer's inputs are the quantized model's (what it will see), optionally mixed per sequence with the
  unquantized model's (``fp_input_fraction``; AutoRound offers the two, not a mix);
- the iterate kept is the best by the error on every calibration row, measured on the record as stored
  (scales rounded to the format's dtype), at the start and every ``eval_every`` steps: the result is
  never worse than the start on the calibration rows.

The codes stay on the record's grid at every step (zero points fixed, scales in the stored dtype when
measured), so the formats write the result unchanged. Pure math on a layer: the caller supplies the
layer's forward as a function of its linears' weights, the layer's inputs and the outputs to match.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from quantkit.gguf.record import GGUFTensor
from quantkit.gguf.types import TYPES
from quantkit.quant import QuantizedTensor
from quantkit.recipes.fields import Field, Section, fraction, positive, seed_field

SETTINGS = Section({
    "iterations": Field(int, default=200, check=lambda v: 0 <= v <= 100_000, rule="in [0, 100000]",
                        help="signed-gradient steps per decoder layer (0: the solver's records unchanged)"),
    "learning_rate": Field(float, default=0.005, check=lambda v: 0 < v <= 0.5, rule="in (0, 0.5]",
                           help="first step of every offset and scale correction, decaying linearly to 0 "
                                "(AutoRound's 1 / iterations at its 200)"),
    "batch_size": Field(int, default=4, check=positive, rule="> 0",
                        help="calibration sequences per step (at most calibration.n_samples)"),
    "scale_range": Field(float, default=0.25, check=lambda v: 0 <= v < 1, rule="in [0, 1)",
                         help="each group scale moves within this fraction of the solver's (0: rounding only)"),
    "optimizer": Field(str, default="sign-sgd", choices=("sign-sgd", "adam"),
                       help="signed gradient descent (AutoRound's) or Adam, the step decaying linearly to 0"),
    "fp_input_fraction": Field(float, default=0.0, check=fraction, rule="in [0, 1]",
                               help="share of each step's sequences fed the unquantized model's input to the layer "
                                    "instead of the quantized model's (1: AutoRound's enable_quanted_input off); "
                                    "the iterate kept is still measured on the quantized model's inputs"),
    "eval_every": Field(int, default=50, check=positive, rule="> 0",
                        help="steps between measurements of the error on every calibration row; the best "
                             "measured iterate is kept"),
    "seed": seed_field("seed of the order in which calibration sequences are drawn"),
}, optional=True)

# layer weights (linear name -> [N, K]) and a batch of inputs [B, T, H] -> the layer's outputs [B, T, H]
LayerForward = Callable[[Mapping[str, Tensor], Tensor], Tensor]

# optimizer name -> (its torch optimizer from parameters and learning rate, what it is given of each gradient)
OPTIMIZERS = {
    "sign-sgd": (torch.optim.SGD, torch.sign),
    "adam": (torch.optim.Adam, lambda gradient: gradient),
}


def _columns(per_group: Tensor, g_idx: Tensor) -> Tensor:
    """A [groups, N] parameter expanded to [N, K] by each column's group (contiguous: every use is elementwise)."""
    return per_group.T.index_select(1, g_idx)


def _round_through(u: Tensor) -> Tensor:
    """round(u) forward, identity backward (the straight-through estimator)."""
    return u + (torch.round(u) - u).detach()


class _Rounding:
    """One linear's trainable rounding: offsets V [N, K], scale factors [G, N] (and bias shifts in steps,
    [G, N], on a float-bias grid) around a start record."""

    def __init__(self, rounding_point: Tensor, start: QuantizedTensor, scale_range: float):
        self.rounding_point, self.start, self.scale_range = rounding_point.to(torch.float32), start, scale_range
        self.config = start.config
        self.g_idx = start.g_idx.long()
        self.scales = start.scales.to(torch.float32)
        self.biases = None if start.biases is None else start.biases.to(torch.float32)
        self.zeros = None if start.zeros is None else _columns(start.zeros.to(torch.float32), self.g_idx)
        self.offset = torch.zeros_like(self.rounding_point, requires_grad=True)
        self.scale_factor = torch.ones_like(self.scales, requires_grad=True)
        self.bias_shift = None if self.biases is None else torch.zeros_like(self.biases, requires_grad=True)
        with torch.no_grad():  # the start's codes as a shift from round-to-nearest under its own grid
            scale = _columns(self.scales, self.g_idx)
            self.shift = start.codes.to(torch.float32) - torch.round(self._grid_units(scale))

    def parameters(self) -> list[Tensor]:
        return [p for p in (self.offset, self.scale_factor, self.bias_shift) if p is not None]

    def parameter_groups(self, learning_rate: float) -> list[dict]:
        """The optimizer's groups: every parameter in grid steps at ``learning_rate``, except the scale factors,
        whose step moves a group's outermost code (maxq / 2 steps from its middle) by that much."""
        steps = [p for p in (self.offset, self.bias_shift) if p is not None]
        return [{"params": steps, "lr": learning_rate},
                {"params": [self.scale_factor], "lr": learning_rate * 2 / self.config.maxq}]

    def _grid_units(self, scale: Tensor, bias: Tensor | None = None) -> Tensor:
        """w' / s + z (or (w' - b) / s): the rounding point in grid steps."""
        if self.biases is None:
            return self.rounding_point / scale + self.zeros
        return (self.rounding_point - _columns(self.biases if bias is None else bias, self.g_idx)) / scale

    def _group_scales(self) -> Tensor:
        return self.scales * self.scale_factor

    def _group_biases(self, scales: Tensor) -> Tensor:
        return self.biases + self.bias_shift * scales

    def fake(self) -> Tensor:
        """The weight [N, K] the current parameters give, differentiable in them (float32)."""
        group_scales = self._group_scales()
        scale = _columns(group_scales, self.g_idx)
        bias = None if self.biases is None else self._group_biases(group_scales)
        units = self._grid_units(scale, bias) + self.offset
        codes = torch.clamp(_round_through(units) + self.shift, 0, self.config.maxq)
        if bias is None:
            return (codes - self.zeros) * scale
        return codes * scale + _columns(bias, self.g_idx)

    @torch.no_grad()
    def record(self) -> QuantizedTensor:
        """The current parameters as the record a format stores: scales (and biases) in the stored dtype,
        the codes rounded under them."""
        dtype = self.config.scale_dtype
        group_scales = self._group_scales().to(dtype)
        scale = _columns(group_scales.to(torch.float32), self.g_idx)
        biases = None
        if self.biases is not None:
            biases = self._group_biases(self._group_scales()).to(dtype)
        bias = None if biases is None else biases.to(torch.float32)
        units = self._grid_units(scale, bias) + self.offset
        codes = torch.clamp(torch.round(units) + self.shift, 0, self.config.maxq).to(torch.uint8)
        return QuantizedTensor(codes, group_scales, self.start.zeros, self.start.g_idx, self.config, biases=biases)

    @torch.no_grad()
    def bound(self) -> None:
        """Every parameter back within its bounds after a step."""
        self.offset.clamp_(-0.5, 0.5)
        self.scale_factor.clamp_(1 - self.scale_range, 1 + self.scale_range)
        if self.bias_shift is not None:
            self.bias_shift.clamp_(-0.5, 0.5)


class _BlockRounding:
    """A GGUF block type's trainable rounding: offsets V [N, K] only. Its scales and offsets stay the ones
    llama.cpp's search chose for the solver (they are stored as small integers under a super-block scale,
    a grid of their own); the codes ``clamp(round((w' - offset) / scale + V) + D, 0, maxq)`` are written back
    into the same blocks. Affine block types only (the level of a code is the code)."""

    def __init__(self, rounding_point: Tensor, start: GGUFTensor):
        tensor_type = TYPES[start.type_name]
        self.start, self.codec, self.block_bytes = start, tensor_type.codec, tensor_type.block_bytes
        n, k = start.shape
        self.blocks = start.data.cpu().numpy().reshape(-1, self.block_bytes)
        sub_scales, sub_offsets = self.codec.grid(self.blocks)  # [rows x blocks, sub-blocks] each
        device = rounding_point.device

        def columns(per_sub_block):
            return torch.from_numpy(per_sub_block).reshape(n, -1).repeat_interleave(self.codec.sub_block, 1).to(device)

        self.scale, self.offset = columns(sub_scales), columns(sub_offsets)
        self.dead = self.scale == 0  # the quantizer found nothing to scale: every code means the offset
        self.units = (rounding_point.to(torch.float32) - self.offset) / torch.where(self.dead, 1.0, self.scale)
        codes = torch.from_numpy(self.codec.codes(self.blocks).astype(np.float32)).reshape(n, k).to(device)
        self.shift = codes - torch.round(self.units)
        self.offset_v = torch.zeros_like(self.units, requires_grad=True)

    def parameters(self) -> list[Tensor]:
        return [self.offset_v]

    def parameter_groups(self, learning_rate: float) -> list[dict]:
        return [{"params": [self.offset_v], "lr": learning_rate}]

    def _codes(self, rounded) -> Tensor:
        return torch.clamp(rounded(self.units + self.offset_v) + self.shift, 0, self.codec.maxq)

    def fake(self) -> Tensor:
        return torch.where(self.dead, self.offset, self._codes(_round_through) * self.scale + self.offset)

    @torch.no_grad()
    def record(self) -> GGUFTensor:
        codes = self._codes(torch.round).to(torch.uint8).cpu().numpy().reshape(self.blocks.shape[0], -1)
        blocks = np.ascontiguousarray(self.codec.with_codes(self.blocks, codes).reshape(self.start.data.shape))
        return GGUFTensor(self.start.type_name, torch.from_numpy(blocks), self.start.shape)

    @torch.no_grad()
    def bound(self) -> None:
        self.offset_v.clamp_(-0.5, 0.5)


def _rounding(rounding_point: Tensor, start: QuantizedTensor | GGUFTensor, scale_range: float):
    """The trainable rounding of a record: the uniform grid's, or a GGUF block type's."""
    if isinstance(start, QuantizedTensor):
        return _Rounding(rounding_point, start, scale_range)
    if not TYPES[start.type_name].codes_are_levels:
        raise ValueError(f"block reconstruction cannot train {start.type_name}: its codes are not their levels "
                         "(a codebook or lattice type); use a K-quant or legacy block type")
    return _BlockRounding(rounding_point, start)


@dataclass
class Reconstruction:
    """What a layer's reconstruction gives: the records kept and how the output error went (mean squared
    error of the layer's output on every calibration row, measured on the stored records)."""

    records: dict[str, QuantizedTensor | GGUFTensor]
    start_error: float
    error: float
    best_step: int  # 0: the start was kept
    errors: list[tuple[int, float]] = field(default_factory=list)  # (step, error) at every measurement

    def summary(self) -> dict:
        return {"start_error": self.start_error, "error": self.error, "best_step": self.best_step}


def _output_error(forward: LayerForward, weights: Mapping[str, Tensor], inputs: Tensor, targets: Tensor,
                  batch_size: int, device: torch.device) -> float:
    """Mean squared error of the layer's output over every row of ``inputs``, in float64 sums."""
    total = 0.0
    with torch.no_grad():
        for start in range(0, inputs.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            out = forward(weights, inputs[rows].to(device, torch.float32))
            total += float((out - targets[rows].to(device, torch.float32)).square().sum(dtype=torch.float64))
    return total / targets.numel()


def reconstruct(forward: LayerForward, rounding_points: Mapping[str, Tensor], records: Mapping[str, QuantizedTensor],
                inputs: Tensor, targets: Tensor, settings: Mapping, *, eval_batch_size: int, seed: int,
                fp_inputs: Tensor | None = None) -> Reconstruction:
    """Train the rounding of every linear in ``records`` (the weights its solver rounded in ``rounding_points``)
    so that ``forward`` of ``inputs`` [S, T, H] matches ``targets`` [S, T, H]; ``settings`` is the recipe's
    ``reconstruct`` section, ``seed`` orders the sequences drawn (one permutation per pass over them) and which
    of them are fed ``fp_inputs`` (the unquantized model's inputs, needed when ``fp_input_fraction`` is not 0)."""
    iterations, batch_size, fp_fraction = settings["iterations"], settings["batch_size"], settings["fp_input_fraction"]
    if batch_size > inputs.shape[0]:
        raise ValueError(f"reconstruct.batch_size {batch_size} exceeds the {inputs.shape[0]} calibration sequences")
    if fp_fraction and (fp_inputs is None or fp_inputs.shape != inputs.shape):
        raise ValueError("reconstruct.fp_input_fraction needs the unquantized model's inputs, shaped as the inputs")
    device = next(iter(rounding_points.values())).device
    start_error = _output_error(forward, {n: r.dequantize() for n, r in records.items()}, inputs,
                                targets, eval_batch_size, device)
    result = Reconstruction(dict(records), start_error, start_error, 0, [(0, start_error)])
    if iterations == 0:
        return result
    roundings = {name: _rounding(rounding_points[name], record, settings["scale_range"])
                 for name, record in records.items()}
    parameters = [p for rounding in roundings.values() for p in rounding.parameters()]
    make_optimizer, gradient_of = OPTIMIZERS[settings["optimizer"]]
    optimizer = make_optimizer([group for rounding in roundings.values()
                                for group in rounding.parameter_groups(settings["learning_rate"])])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1 - done / iterations)
    generator = torch.Generator().manual_seed(seed)
    fp_draws = torch.Generator().manual_seed(seed + 1)  # its own stream: the order does not depend on the fraction
    order: list[int] = []
    for step in range(1, iterations + 1):
        if len(order) < batch_size:
            order += torch.randperm(inputs.shape[0], generator=generator, device="cpu").tolist()
        rows, order = order[:batch_size], order[batch_size:]
        batch = inputs[rows].to(device, torch.float32)
        if fp_fraction:
            from_fp = (torch.rand(len(rows), generator=fp_draws) < fp_fraction).to(device)
            batch = torch.where(from_fp[:, None, None], fp_inputs[rows].to(device, torch.float32), batch)
        out = forward({name: rounding.fake() for name, rounding in roundings.items()}, batch)
        loss = (out - targets[rows].to(device, torch.float32)).square().mean()
        for parameter, gradient in zip(parameters, torch.autograd.grad(loss, parameters)):
            parameter.grad = gradient_of(gradient)
        optimizer.step()
        schedule.step()
        for rounding in roundings.values():
            rounding.bound()
        if step % settings["eval_every"] and step != iterations:
            continue
        candidate = {name: rounding.record() for name, rounding in roundings.items()}
        error = _output_error(forward, {n: r.dequantize() for n, r in candidate.items()}, inputs, targets,
                              eval_batch_size, device)
        result.errors.append((step, error))
        if error < result.error:
            result.records, result.error, result.best_step = candidate, error, step
    return result
