"""How much a tensor's rounding error costs the model: ΔKL ≈ ½ Σᵢ Gᵢᵢ (ΔW H ΔWᵀ)ᵢᵢ.

For a small change δ of a linear's outputs, the KL divergence of the model's next-token distributions from
the unquantized ones grows as ½ δᵀ F δ, F the Fisher information of those outputs (the Hessian of the KL at
δ = 0). With Kronecker-factored curvature (K-FAC; Martens & Grosse 2015) F ≈ G ⊗ H over the linear's
weights, G the second moment of the loss gradients at its outputs and H = E[x xᵀ] of its inputs, so a
weight error ΔW costs ½ tr(G ΔW H ΔWᵀ) per token; keeping G's diagonal (one weight per output channel, as
HAWQ-V2 and SqueezeLLM keep one per weight) gives the formula above. The estimate is additive over
tensors, which is what the allocation sums.

One pass over calibration rows gives both factors: H from each linear's inputs, G from the gradients at
its outputs of the log-likelihood of tokens sampled from the model's own predictions (the true Fisher: with
the observed next tokens instead it would be the empirical Fisher, which measures the fit to the text, not
the change of the model's outputs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from quantkit.models.layers import LINEARS, SEQUENTIAL_GROUPS, layer_prefix

# weight [N, K] float32, importance [K] (llama.cpp's imatrix row: mean x² per input channel) -> its rounding
RoundTrip = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass
class LinearStatistics:
    hessian: torch.Tensor  # [K, K] float64, E[x xᵀ] over the calibration tokens (shared within a group)
    fisher: torch.Tensor  # [N] float64, E[g²] per output channel

    @property
    def importance(self) -> np.ndarray:
        return self.hessian.diagonal().float().numpy()


def collect(model: torch.nn.Module, input_ids: torch.Tensor, *, batch_size: int = 4, seed: int = 0,
            progress: bool = False) -> dict[str, LinearStatistics]:
    """H and diag G of every decoder linear of ``model`` (a MiniCPMForCausalLM in float32) over the rows
    ``input_ids`` [n, seq_len], the labels drawn from the model's predictions by a generator seeded with ``seed``."""
    layers = model.config.num_hidden_layers
    firsts = {group[0]: group for group in SEQUENTIAL_GROUPS}  # a group's linears share one input
    sums: dict[str, torch.Tensor] = {}
    squares: dict[str, torch.Tensor] = {}
    handles = []

    def add(store, name, value):
        store[name] = value if name not in store else store[name] + value

    for index in range(layers):
        for linear in LINEARS:
            name = layer_prefix(index) + linear
            module = model.get_submodule(name)
            if linear in firsts:
                def inputs(_module, args, name=name):
                    x = args[0].detach().reshape(-1, args[0].shape[-1])
                    add(sums, name, (x.T @ x).double())  # a batch's sum in float32, the run's in float64
                handles.append(module.register_forward_pre_hook(inputs))

            def outputs(_module, _args, output, name=name):
                output.register_hook(lambda grad, name=name: add(
                    squares, name, grad.detach().reshape(-1, grad.shape[-1]).double().square().sum(0)))
            handles.append(module.register_forward_hook(outputs))
    generator = torch.Generator().manual_seed(seed)
    params = {p: p.requires_grad for p in model.parameters()}
    for p in params:  # gradients flow to the activations only: no weight's own gradient is computed
        p.requires_grad_(False)
    tokens = 0
    try:
        for start in tqdm(range(0, input_ids.shape[0], batch_size), desc="sensitivity", unit="batch",
                          disable=not progress):
            rows = input_ids[start:start + batch_size]
            with torch.no_grad():
                embedded = model.get_input_embeddings()(rows) * model.config.scale_emb  # as input_ids would be
            logits = model(inputs_embeds=embedded.requires_grad_()).logits.float()
            with torch.no_grad():
                labels = torch.multinomial(torch.softmax(logits.reshape(-1, logits.shape[-1]), -1), 1,
                                           generator=generator).squeeze(1)
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels,
                                              reduction="sum").backward()
            tokens += rows.numel()
    finally:
        for handle in handles:
            handle.remove()
        for p, wanted in params.items():
            p.requires_grad_(wanted)
    stats = {}
    for index in range(layers):
        for group in SEQUENTIAL_GROUPS:
            hessian = sums[layer_prefix(index) + group[0]] / tokens
            for linear in group:
                name = layer_prefix(index) + linear
                stats[name] = LinearStatistics(hessian, squares[name] / tokens)
    return stats


def estimated_kl(weight: torch.Tensor, stats: LinearStatistics, round_trip: RoundTrip) -> float:
    """½ Σᵢ Gᵢᵢ (ΔW H ΔWᵀ)ᵢᵢ for ΔW the error ``round_trip`` leaves on ``weight`` [N, K]: the mean KL
    per token that this rounding alone adds."""
    w = weight.float().numpy()
    delta = torch.from_numpy(round_trip(w, stats.importance) - w).double()
    per_row = ((delta @ stats.hessian) * delta).sum(1)
    return 0.5 * float((stats.fisher * per_row).sum())
