"""Fake quantization for training: the forward pass sees the grid's weights, and what trains is one of
two things (``qat.trains``, the table ``TRAINS`` at the end):

- ``weights``: latent float weights, rounded onto the grid in the forward pass, the gradient reaching
  them unchanged (the straight-through estimator of BitNet and BitCPM4), ``FakeQuantLinear``;
- ``scales``: the codes are fixed and each group's scale and float bias train (distilled scales and
  biases, mlx-lm's DWQ), ``AffineLinear``.

The recipe's ``qat`` section (``SETTINGS``, with the rules among its keys, ``refusal``) is here, beside the
table it chooses from. Any ``QuantConfig`` is a quantizer here: BitCPM4's absmean ternary grid, the uniform int grid
(symmetric int4 g128 for the EAGLE3 head), or MLX's float-bias grid. The grid's parameters come from
the very functions RTN rounds with, applied to every group at once (a group's rows are independent
rows of those functions), so a run with zero training steps writes RTN's codes and scales bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from quantkit.quant import (
    QuantConfig,
    QuantizedTensor,
    affine_params,
    default_g_idx,
    dequantize_codes,
    fake_quantize,
    find_group_params,
    quantize_codes,
    rtn_quantize,
    stored_affine_params,
)
from quantkit.recipes.fields import Field, Section, fraction, positive, seed_field


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
            rounded = (_on_affine_grid(rows, config) if config.float_bias
                       else fake_quantize(rows, find_group_params(rows, config), config.maxq))
            on_grid[:, columns] = rounded.reshape(n, -1)
    return on_grid


def _on_affine_grid(rows: Tensor, config: QuantConfig) -> Tensor:
    exact = affine_params(rows, config)
    return dequantize_codes(quantize_codes(rows, exact, config.maxq), stored_affine_params(exact, config))


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
    optimizer step (``refresh``), not once per micro-batch: the latent weight changes only at a step. A
    sharded weight (FSDP, ``quantkit.training.sharding``) is whole only inside the forward, and keeping its
    grid weight between steps would keep the whole layer: each forward rounds it anew, and ``refresh`` keeps
    nothing. A ``start`` record (an artifact's) sets the latent weight to one its grid rounds back to it."""

    def __init__(self, linear: torch.nn.Linear, config: QuantConfig, start: QuantizedTensor | None = None):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        self.weight = linear.weight
        self.bias = linear.bias
        self.config = config
        self._on_grid: Tensor | None = None
        if start is not None:
            self.weight.data = latent_for(start).to(self.weight.device)

    @staticmethod
    def check_start(start: QuantConfig | None, config: QuantConfig) -> None:
        """Any artifact can start: its weights are rounded onto ``config``'s grid."""

    def refresh(self) -> None:
        from torch.distributed.tensor import DTensor

        self._on_grid = None if isinstance(self.weight, DTensor) else grid_weight(self.weight, self.config)

    def record(self) -> QuantizedTensor:
        return quantized_record(self.weight, self.config)

    def forward(self, x: Tensor) -> Tensor:
        on_grid = self._on_grid if self._on_grid is not None else grid_weight(self.weight, self.config)
        return torch.nn.functional.linear(x, straight_through(self.weight, on_grid), self.bias)


class AffineLinear(torch.nn.Module):
    """A linear of fixed codes q whose weight is ``scales · q + biases`` per group of input channels, the
    scales and biases [N, G] trainable float32 parameters: distilled scales and biases (mlx-lm's DWQ,
    ``mlx_lm.quant.dwq``), on a float-bias grid (``QuantConfig.float_bias``).

    The codes are the ``start`` record's (an artifact's), else the linear's weight rounded by RTN's rule
    (``quantized_record``), so zero steps are RTN. The forward sees the scales and biases rounded to the
    dtype the format stores them in (``config.scale_dtype``), the gradient reaching the float32 values as
    if unrounded (the straight-through estimator): every step computes with the weights that would be
    written, and the written record dequantizes to exactly the forward's weight."""

    def __init__(self, linear: torch.nn.Linear, config: QuantConfig, start: QuantizedTensor | None = None):
        super().__init__()
        if not config.float_bias:
            raise ValueError(f"training scales and biases needs a float-bias grid (format mlx), not {config}")
        record = quantized_record(linear.weight, config) if start is None else start
        codes, scales, biases = _affine_parts(record, config)
        device = linear.weight.device
        self.in_features, self.out_features, self.config = linear.in_features, linear.out_features, config
        self.register_buffer("codes", codes.to(device))  # uint8 [N, K]
        self.scales = torch.nn.Parameter(scales.T.contiguous().to(device))  # float32 [N, G]
        self.biases = torch.nn.Parameter(biases.T.contiguous().to(device))
        self.bias = linear.bias  # an additive output bias (attention_bias), frozen as it is

    @staticmethod
    def check_start(start: QuantConfig | None, config: QuantConfig) -> None:
        """The codes stay: a starting artifact must be on ``config``'s grid (its bits and group size)."""
        if start is not None and (start.bits, start.group_size) != (config.bits, config.group_size):
            raise ValueError(f"--init: the artifact's grid ({start.bits} bits, group size {start.group_size}) is "
                             f"not the recipe's ({config.bits} bits, group size {config.group_size}); training "
                             "scales and biases keeps the codes, so it starts only from an artifact on its own grid")

    def weight(self) -> Tensor:
        """``scales · codes + biases`` in float32, the scales and biases as stored (straight-through)."""
        n, k = self.codes.shape
        stored = self.config.scale_dtype
        scales = straight_through(self.scales, self.scales.detach().to(stored))
        biases = straight_through(self.biases, self.biases.detach().to(stored))
        codes = self.codes.view(n, scales.shape[1], -1).to(torch.float32)
        return (codes * scales.unsqueeze(-1) + biases.unsqueeze(-1)).view(n, k)

    def record(self) -> QuantizedTensor:
        """The fixed codes with the trained scales and biases in the format's dtype."""
        stored = self.config.scale_dtype
        return QuantizedTensor(self.codes.cpu(), self.scales.detach().T.to(stored).cpu().contiguous(), None,
                               default_g_idx(self.in_features, self.config.group_size), self.config,
                               biases=self.biases.detach().T.to(stored).cpu().contiguous())

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x, self.weight().to(x.dtype), self.bias)


def _affine_parts(record: QuantizedTensor, config: QuantConfig) -> tuple[Tensor, Tensor, Tensor]:
    """(codes uint8 [N, K], scales and biases float32 [G, N]) of ``record`` on ``config``'s grid. An
    integer-zero record means the same weights with bias = −zero · scale (as ``quantkit export mlx``)."""
    if (record.config.bits, record.config.group_size) != (config.bits, config.group_size):
        raise ValueError(f"a start record on {record.config.bits} bits, group size {record.config.group_size} "
                         f"is not on the grid of {config.bits} bits, group size {config.group_size}")
    if not torch.equal(record.g_idx, default_g_idx(record.shape[1], config.group_size)):
        raise ValueError("a start record with an act-order g_idx has no per-group scales to train")
    scales = record.scales.to(torch.float32)
    if record.biases is not None:
        return record.codes, scales, record.biases.to(torch.float32)
    return record.codes, scales, -record.zeros.to(torch.float32) * scales


def wrap_linears(model: torch.nn.Module, grids: dict[str, QuantConfig], linear: type = FakeQuantLinear,
                 starts: dict[str, QuantizedTensor] | None = None) -> None:
    """Replace each named ``nn.Linear`` of ``model`` by ``linear`` (a FakeQuantLinear, sharing its parameters,
    or an AffineLinear) on its grid, starting from ``starts[name]`` where given."""
    for name, config in grids.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        try:
            setattr(parent, child, linear(getattr(parent, child), config, (starts or {}).get(name)))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e


@dataclass(frozen=True)
class Trains:
    """One value of ``qat.trains``: the module every decoder linear becomes, ``linear(nn.Linear, grid, start
    record or None)``; which of its parameters train; whether the RMSNorm gains train too; whether it needs
    a float-bias grid; and the command that runs such recipes."""

    linear: type
    parameters: tuple[str, ...]
    norms: bool
    float_bias_only: bool
    command: str


TRAINS = {
    # QAT (BitCPM4): latent weights through the straight-through estimator, and the norms
    "weights": Trains(FakeQuantLinear, ("weight",), norms=True, float_bias_only=False, command="quantkit qat ternary"),
    # DWQ (mlx-lm): codes fixed, each group's scale and float bias; nothing else
    "scales": Trains(AffineLinear, ("scales", "biases"), norms=False, float_bias_only=True,
                     command="quantkit qat dwq"),
}


# The recipe's ``qat`` section (`quantkit qat`): BitCPM4's recipe shape (re-warmup, WSD schedule,
# distillation from the FP model). Present only in the recipes that train. docs/qat.md says which
# values were measured.
SETTINGS = Section({
    "trains": Field(str, default="weights", choices=tuple(TRAINS),
                    help="weights: latent weights through the grid and the norm gains (QAT); scales: the codes "
                         "fixed, each group's scale and float bias (mlx-lm's DWQ; float-bias grids: format mlx)"),
    "tokens": Field(int, default=400_000, check=positive, rule="> 0",
                    help="training tokens (`--tokens` overrides): steps = tokens / batch_tokens"),
    "batch_tokens": Field(int, default=2048, check=positive, rule="> 0",
                          help="tokens per optimizer step, a multiple of seq_len (gradient accumulation)"),
    "micro_batch": Field(int, default=1, check=positive, rule="> 0",
                         help="sequences per forward/backward (memory, not results)"),
    "seq_len": Field(int, default=512, check=lambda v: v >= 16, rule=">= 16", help="tokens per sequence"),
    "learning_rate": Field(float, default=1e-3, check=positive, rule="> 0",
                           help="peak learning rate (docs/qat.md: 1e-3 beat 4e-3 and 2e-4 on the default model)"),
    "warmup": Field(float, default=0.05, check=fraction, rule="in [0, 1]",
                    help="fraction of steps warming up from 0 (the re-warmup BitCPM4 calls critical)"),
    "stable": Field(float, default=0.75, check=fraction, rule="in [0, 1]",
                    help="fraction of steps at the peak rate (WSD); warmup + stable + decay = 1"),
    "decay": Field(float, default=0.2, check=fraction, rule="in [0, 1]",
                   help="fraction of steps decaying linearly to final_lr x the peak"),
    "final_lr": Field(float, default=0.1, check=fraction, rule="in [0, 1]",
                      help="learning rate at the end, as a fraction of the peak"),
    "weight_decay": Field(float, default=0.0, check=lambda v: v >= 0, rule=">= 0", help="AdamW weight decay"),
    "betas": Field(list, default=[0.9, 0.95],
                   check=lambda v: len(v) == 2 and all(type(b) is float and 0 <= b < 1 for b in v),
                   rule="two floats in [0, 1)", help="AdamW betas"),
    "eps": Field(float, default=1e-8, check=positive, rule="> 0", help="AdamW epsilon"),
    "grad_clip": Field(float, default=1.0, check=positive, rule="> 0", help="gradient norm clipped to this"),
    "distill_weight": Field(float, default=0.5, check=fraction, rule="in [0, 1]",
                            help="loss = (1 - w) x cross-entropy + w x KL to the FP teacher (0: CE alone)"),
    "temperature": Field(float, default=1.0, check=positive, rule="> 0", help="distillation temperature"),
    "top_k": Field(int, default=32, check=positive, rule="> 0",
                   help="teacher logits cached per token (its distribution renormalised over them)"),
    "data": Field(str, default="default", help="training text: a calibration corpus or mix, or a local file"),
    "seed": seed_field("seed of the data order"),
    "eval_interval": Field(int, default=50, check=positive, rule="> 0",
                           help="steps between held-out perplexity measurements"),
    "eval_tokens": Field(int, default=4096, check=lambda v: v >= 2, rule=">= 2",
                         help="held-out tokens per measurement"),
    "checkpoint_interval": Field(int, default=25, check=positive, rule="> 0",
                                 help="steps between resumable checkpoints"),
    "max_loss_growth": Field(float, default=4.0, check=lambda v: v > 1, rule="> 1",
                             help="stop if a step's loss exceeds this multiple of the best loss so far"),
    "keep": Field(str, default="best", choices=("best", "last"),
                  help="the weights written: those of the lowest held-out KL to the FP model measured, the "
                       "start's included (best), or the last step's"),
    "full_rate_excess": Field(float, default=1.0, check=lambda v: v >= 0, rule=">= 0",
                              help="the start's held-out KL to the FP model (nats) at which the full learning "
                                   "rate applies; below it the rate is scaled "
                                   "by sqrt(KL / this), so a good start (GPTQ, block reconstruction, int4) takes "
                                   "small steps (0: always the full rate)"),
}, optional=True)


def refusal(values: dict, grid: QuantConfig) -> str | None:
    """Why a recipe's ``qat`` section cannot be used with the rest of it (``grid``: the run's grid), or None."""
    qat = values["qat"]
    phases = qat["warmup"] + qat["stable"] + qat["decay"]
    step = qat["seq_len"] * qat["micro_batch"]
    rules = (
        (grid.float_bias or not TRAINS[qat["trains"]].float_bias_only,
         f"'qat.trains' = {qat['trains']!r} trains each group's scale and float bias with the codes fixed, which "
         f"needs a float-bias grid (format: mlx), not format '{values['format']}'"),
        (abs(phases - 1) <= 1e-9,
         f"'qat.warmup' + 'qat.stable' + 'qat.decay' must be 1 (the whole run), got {phases:g}"),
        (qat["batch_tokens"] % step == 0,
         f"'qat.batch_tokens' = {qat['batch_tokens']} must be a multiple of qat.seq_len x qat.micro_batch = {step}"),
        (qat["tokens"] >= qat["batch_tokens"],
         f"'qat.tokens' = {qat['tokens']} is less than one step (qat.batch_tokens = {qat['batch_tokens']})"),
    )
    return next((why for holds, why in rules if not holds), None)


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
