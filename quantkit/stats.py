"""Second-moment statistics of a linear layer's inputs: H = 2/n · Σ xᵀx over calibration tokens.

GPTQ needs H as its Hessian, and every method's reconstruction error ‖(W − Ŵ)X‖² is
tr(ΔW H ΔWᵀ)·n/2, so one accumulator serves both. Prefix-aware GPTQ excludes the first
``skip_prefix`` positions of every calibration sequence, which is why inputs keep their
[batch, seq, features] shape until here. ``InputCapture`` collects them from any module's forwards
(a decoder layer's in the engine, a draft head's unrolled steps).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Mapping

import torch


class InputStats:
    """Accumulates H = 2/n Σ xᵀx, the per-channel mean |x| (AWQ's activation scale) and max |x| (a static
    activation scale's range) in float32."""

    def __init__(self, features: int, skip_prefix: int = 0, device: torch.device | str = "cpu", sample_every: int = 0):
        """``sample_every`` > 0 also keeps every such row of the inputs (``sample``), for searches that
        need the activations themselves (SmoothQuant's, which quantizes them)."""
        self.hessian = torch.zeros(features, features, dtype=torch.float32, device=device)
        self.abs_mean = torch.zeros(features, dtype=torch.float32, device=device)
        self.abs_max = torch.zeros(features, dtype=torch.float32, device=device)
        self.tokens = 0
        self.skip_prefix = skip_prefix
        self.sample_every = sample_every
        self._sampled: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        """x: [batch, seq, features]; positions < skip_prefix of each sequence are left out."""
        if x.dim() != 3:
            raise ValueError(f"expected inputs [batch, seq, features], got shape {tuple(x.shape)}")
        rows = x[:, self.skip_prefix:, :].reshape(-1, x.shape[-1])
        if rows.shape[0] == 0:
            return
        # The product's result is fp32 even when the forward is bf16: a bf16 matmul rounds its output to
        # bf16, and on attention outputs (nearly low-rank) that rounding alone left H with eigenvalues
        # of -6 % of its mean diagonal, so Cholesky needed 10x the requested damping.
        exact_bf16 = rows.dtype == torch.bfloat16
        total = self.tokens + rows.shape[0]
        if not (exact_bf16 and _gram_on_cpu_kernel(self.hessian, rows, self.tokens / total, 2.0 / total)):
            gram_by_torch(self.hessian, rows, self.tokens / total, 2.0 / total)
        self.abs_mean.mul_(self.tokens / total).add_(rows.abs().sum(0, dtype=torch.float32), alpha=1.0 / total)
        torch.maximum(self.abs_max, rows.abs().amax(0).float(), out=self.abs_max)
        if self.sample_every:  # rows whose index over the whole stream is a multiple of sample_every
            self._sampled.append(rows[-self.tokens % self.sample_every::self.sample_every].float())
        self.tokens = total

    @property
    def sample(self) -> torch.Tensor:
        """The kept rows [tokens / sample_every, features], float32."""
        if not self._sampled:
            raise ValueError("no input rows were kept: construct with sample_every > 0 and add inputs")
        return torch.cat(self._sampled)


class _StopForward(Exception):
    """Raised by a hook once the inputs a capture waits for are in: the rest of the forward is not needed."""


class InputCapture:
    """The statistics of the inputs reaching named linears of ``module`` while forwards run: a forward
    pre-hook on each adds its input to that linear's ``InputStats`` (mlx-lm's GPTQ "Hessian catcher"),
    in the order the forwards reach them::

        with InputCapture(layer, ("mlp.gate_proj", "mlp.up_proj")) as capture:
            for batch in batches:
                capture.run(layer, batch)
        capture.stats["mlp.gate_proj"].hessian

    ``skip_prefix[name]`` positions of each sequence are left out of that linear's statistics. With
    ``stop_after_last``, a forward ends as soon as the last name (names in forward order) has its input:
    what it would compute after that is not needed."""

    def __init__(self, module: torch.nn.Module, names: tuple[str, ...], skip_prefix: Mapping[str, int] | None = None,
                 stop_after_last: bool = False, sample_every: int = 0):
        self.module, self.names, self.stop_after_last = module, names, stop_after_last
        self.stats = {}
        for name in names:
            linear = module.get_submodule(name)
            self.stats[name] = InputStats(linear.in_features, (skip_prefix or {}).get(name, 0),
                                          device=linear.weight.device, sample_every=sample_every)
        self._handles = []

    def _hook(self, name: str):
        def add(_module, args):
            self.stats[name].add(args[0])
            if self.stop_after_last and name == self.names[-1]:
                raise _StopForward
        return add

    def __enter__(self) -> "InputCapture":
        self._handles = [self.module.get_submodule(name).register_forward_pre_hook(self._hook(name))
                         for name in self.names]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def run(self, forward: Callable, *args, **kwargs) -> None:
        """``forward(*args, **kwargs)``, its output dropped: what counts is what the hooks saw."""
        try:
            forward(*args, **kwargs)
        except _StopForward:
            pass


def gram_by_torch(hessian: torch.Tensor, rows: torch.Tensor, beta: float, alpha: float) -> None:
    """hessian = beta·hessian + alpha·rowsᵀrows in float32 (on the bf16 hardware when rows are bf16): the
    compiled kernel's specification, and the update wherever that kernel declines."""
    wide = rows.float()
    with bf16_multiplies(rows.dtype == torch.bfloat16):
        hessian.mul_(beta).addmm_(wide.T, wide, alpha=alpha)


def _gram_on_cpu_kernel(hessian: torch.Tensor, rows: torch.Tensor, beta: float, alpha: float) -> bool:
    """hessian = beta·hessian + alpha·rowsᵀrows for bf16 rows by the compiled AVX-512 BF16 kernel
    (quantkit/cpu_ops/gram_ops.cpp: half the multiply-adds, the symmetric half, at the bf16 rate), where
    this CPU and build have it; False (nothing done) elsewhere, including on a GPU, where the caller's
    PyTorch product, the kernel's specification, runs."""
    if hessian.device.type != "cpu" or not BF16_IN_HARDWARE:
        return False
    from quantkit import cpu_ops

    ops = cpu_ops.load()
    return ops is not None and ops.bf16_gram_accumulate(hessian, rows, beta, alpha, True)


def _cpu_multiplies_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX tiles or AVX-512 BF16 dot products)."""
    try:
        return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
    except AttributeError:  # a torch without the probes: assume not, the safe (float32) way
        return False


# Without bf16 hardware (AVX2 desktops, many servers) PyTorch's bfloat16 matmul is emulated and ran
# 24x slower than float32 here (AMD EPYC, AVX2, 1536x576 @ 576x576); there the same product is taken
# in float32 from the bfloat16-rounded operands and rounded to bfloat16, which is what the hardware
# computes up to the order of its float32 sums.
BF16_IN_HARDWARE = _cpu_multiplies_bf16()


def compute_dtype(name: str) -> torch.dtype:
    """The calibration forwards' dtype. "auto" is bfloat16 where the CPU multiplies it in hardware and
    float32 elsewhere, where bfloat16 is emulated and many times slower (``BF16_IN_HARDWARE``)."""
    if name == "auto":
        return torch.bfloat16 if BF16_IN_HARDWARE else torch.float32
    return getattr(torch, name)


@contextmanager
def bf16_multiplies(inputs_are_bf16: bool = True):
    """Within: float32 matmuls on the CPU multiply in bfloat16 with float32 accumulation and a float32
    result (oneDNN on AMX tiles or AVX-512 BF16 dot products), where the CPU has them and the caller
    says the inputs are bfloat16 values held in float32. Such inputs convert exactly, so the result is
    float32's up to the order of the sums (tested against a float64 product), at the bf16 rate on Intel
    CPUs (on an AMD EPYC with AVX-512 BF16, oneDNN kept float32 products under the setting)
    (docs/results/quantize-8b.md, "MiniCPM4.1-8B shapes"). Elsewhere, and on a GPU (torch's mkldnn flag does not
    apply there), a plain float32 product."""
    settings = torch.backends.mkldnn.matmul
    if not (inputs_are_bf16 and BF16_IN_HARDWARE):
        yield
        return
    kept = settings.fp32_precision
    settings.fp32_precision = "bf16"
    try:
        yield
    finally:
        settings.fp32_precision = kept


def bf16_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two bfloat16 matrices, rounded to bfloat16, at float32 speed or better on any CPU."""
    if BF16_IN_HARDWARE or a.device.type != "cpu":
        return a @ b
    return (a.float() @ b.float()).bfloat16()


# Elements of M per bfloat16 product M·H: enough rows (≥ 1024 at K = 16384) to amortise repacking H.
_BLOCK_ELEMENTS = 1 << 24
# Elements per float32 dot of the product with M: the temporaries stay in cache.
_DOT_ELEMENTS = 1 << 20


def hessian_norm(matrix: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr(M H Mᵀ) = Σ_i m_i H m_iᵀ over the rows of ``matrix`` [N, K], with M and H in bfloat16.

    The products run on AMX with float32 accumulation (``bf16_product``), several times float32's speed: an 8B
    down_proj's W·H alone is 2.2 TFLOP, ~15 s at float32's ~0.15 TFLOP/s on two cores, and
    ``relative_error`` needs two. Within 1e-3 of the float64 value (tested). Pass H already in
    bfloat16 when calling repeatedly with the same H.
    """
    hessian = hessian.bfloat16()
    dot_rows = max(1, _DOT_ELEMENTS // matrix.shape[1])
    total = 0.0
    for block in matrix.split(max(dot_rows, _BLOCK_ELEMENTS // matrix.shape[1])):
        block = block.bfloat16()
        for p, m in zip(bf16_product(block, hessian).split(dot_rows), block.split(dot_rows)):
            total += torch.dot(p.flatten().float(), m.flatten().float()).item()
    return total


def fast_relative_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """``relative_error`` from bfloat16 products (``hessian_norm``): for per-layer reports."""
    hessian = hessian.bfloat16()
    denom = hessian_norm(weight, hessian)
    return hessian_norm(weight.float() - approx.float(), hessian) / denom if denom > 0 else 0.0


def relative_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """‖(W − Ŵ)X‖² / ‖WX‖² on the inputs summarised by H (both [N, K], H [K, K])."""
    w = weight.float()
    delta = w - approx.float()
    denom = ((w @ hessian) * w).double().sum().item()
    return ((delta @ hessian) * delta).double().sum().item() / denom if denom > 0 else 0.0
