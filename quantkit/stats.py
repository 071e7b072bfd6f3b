"""Second-moment statistics of a linear layer's inputs: H = 2/n · Σ xᵀx over calibration tokens.

GPTQ needs H as its Hessian, and every method's reconstruction error ‖(W − Ŵ)X‖² is
tr(ΔW H ΔWᵀ)·n/2, so one accumulator serves both. Prefix-aware GPTQ excludes the first
``skip_prefix`` positions of every calibration sequence, which is why inputs keep their
[batch, seq, features] shape until here.
"""
from __future__ import annotations

import torch


class InputStats:
    """Accumulates H = 2/n Σ xᵀx and the per-channel mean |x| (AWQ's activation scale) in float32."""

    def __init__(self, features: int, skip_prefix: int = 0):
        self.hessian = torch.zeros(features, features, dtype=torch.float32)
        self.abs_mean = torch.zeros(features, dtype=torch.float32)
        self.tokens = 0
        self.skip_prefix = skip_prefix

    def add(self, x: torch.Tensor) -> None:
        """x: [batch, seq, features]; positions < skip_prefix of each sequence are left out."""
        if x.dim() != 3:
            raise ValueError(f"expected inputs [batch, seq, features], got shape {tuple(x.shape)}")
        rows = x[:, self.skip_prefix:, :].reshape(-1, x.shape[-1])
        if rows.shape[0] == 0:
            return
        # The product runs in fp32 even when the forward is bf16: a bf16 matmul rounds its output to
        # bf16, and on attention outputs (nearly low-rank) that rounding alone left H with eigenvalues
        # of -6 % of its mean diagonal, so Cholesky needed 10x the requested damping.
        rows = rows.float()
        total = self.tokens + rows.shape[0]
        self.hessian.mul_(self.tokens / total).addmm_(rows.T, rows, alpha=2.0 / total)
        self.abs_mean.mul_(self.tokens / total).add_(rows.abs().sum(0), alpha=1.0 / total)
        self.tokens = total


def relative_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """‖(W − Ŵ)X‖² / ‖WX‖² on the inputs summarised by H (both [N, K], H [K, K])."""
    w = weight.float()
    delta = w - approx.float()
    denom = ((w @ hessian) * w).double().sum().item()
    return ((delta @ hessian) * delta).double().sum().item() / denom if denom > 0 else 0.0
