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
the change of the model's outputs). The output matrix is one more linear. The input embedding is a linear
over one-hot token vectors, so its H is diagonal: each token's share of the text (``EmbeddingStatistics``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from quantkit.models.layers import EMBEDDING as EMBEDDING_WEIGHT
from quantkit.models.layers import LINEARS, LM_HEAD, SEQUENTIAL_GROUPS, layer_prefix

# weight [N, K] float32, importance [K] (llama.cpp's imatrix row: mean x² per input channel) or None -> its
# rounding
RoundTrip = Callable[[np.ndarray, "np.ndarray | None"], np.ndarray]


@dataclass
class LinearStatistics:
    hessian: torch.Tensor  # [K, K] float64, E[x xᵀ] over the calibration tokens (shared within a group)
    fisher: torch.Tensor  # [N] float64, E[g²] per output channel

    @property
    def importance(self) -> np.ndarray:
        return self.hessian.diagonal().float().numpy()

    def loss(self, delta: torch.Tensor) -> float:
        """½ Σᵢ Gᵢᵢ (ΔW H ΔWᵀ)ᵢᵢ of a weight error ``delta`` [N, K] float64."""
        per_row = ((delta @ self.hessian) * delta).sum(1)
        return 0.5 * float((self.fisher * per_row).sum())


@dataclass
class EmbeddingStatistics:
    """The input embedding [V, D] as a linear over one-hot tokens: H = diag(frequency), and G the second
    moment of the gradient at a token's embedding row, per channel (its factor shared by all tokens)."""

    frequency: torch.Tensor  # [V] float64, each token id's share of text (``token_frequency``)
    fisher: torch.Tensor  # [D] float64

    importance = None  # llama.cpp rounds the embedding without importance statistics

    def loss(self, delta: torch.Tensor) -> float:
        """½ Σ_t frequency_t Σ_d G_d ΔE[t, d]² of an embedding error ``delta`` [V, D] float64."""
        return 0.5 * float(self.frequency @ (delta.square() @ self.fisher))


def token_frequency(counts: torch.Tensor) -> torch.Tensor:
    """Each token id's share of text from its ``counts`` [V] in the calibration rows, Good–Turing smoothed:
    ids never seen share the mass of ids seen once (n₁ / n, at least one token's), the others keep their
    shares scaled to the rest. A held-out text uses many ids that 16 K calibration tokens never show, and
    their embedding rows' errors cost as well."""
    counts = counts.double()
    total, unseen = float(counts.sum()), int((counts == 0).sum())
    if unseen == 0:
        return counts / total
    spare = min(max(float((counts == 1).sum()), 1.0) / total, 0.5)
    return torch.where(counts == 0, spare / unseen, counts / total * (1 - spare))


# the statistics' keys of the output matrix and the input embedding: their modules' names
OUTPUT, EMBEDDING = LM_HEAD.removesuffix(".weight"), EMBEDDING_WEIGHT.removesuffix(".weight")


def collect(model: torch.nn.Module, input_ids: torch.Tensor, *, batch_size: int = 4, seed: int = 0,
            progress: bool = False) -> dict[str, LinearStatistics | EmbeddingStatistics]:
    """H and diag G of every decoder linear and of the output matrix of ``model`` (a MiniCPMForCausalLM in
    float32), and the input embedding's statistics, over the rows ``input_ids`` [n, seq_len], the labels
    drawn from the model's predictions by a generator seeded with ``seed``. Keyed by module name."""
    layers = model.config.num_hidden_layers
    firsts = {group[0]: group for group in SEQUENTIAL_GROUPS}  # a group's linears share one input
    sums: dict[str, torch.Tensor] = {}
    squares: dict[str, torch.Tensor] = {}
    handles = []

    def add(store, name, value):
        store[name] = value if name not in store else store[name] + value

    watched = [(layer_prefix(index) + linear, linear in firsts) for index in range(layers) for linear in LINEARS]
    for name, reads_input in [*watched, (OUTPUT, True)]:
        module = model.get_submodule(name)
        if reads_input:
            def inputs(_module, args, name=name):
                x = args[0].detach().reshape(-1, args[0].shape[-1])
                add(sums, name, (x.T @ x).double())  # a batch's sum in float32, the run's in float64
            handles.append(module.register_forward_pre_hook(inputs))

        def outputs(_module, _args, output, name=name):
            # squared in the gradient's own dtype, summed in float64: the output's [tokens, vocabulary] gradient
            # is not copied to float64 whole
            output.register_hook(lambda grad, name=name: add(
                squares, name, grad.detach().reshape(-1, grad.shape[-1]).square().sum(0, dtype=torch.float64)))
        handles.append(module.register_forward_hook(outputs))
    generator = torch.Generator().manual_seed(seed)
    params = {p: p.requires_grad for p in model.parameters()}
    for p in params:  # gradients flow to the activations only: no weight's own gradient is computed
        p.requires_grad_(False)
    counts = torch.zeros(model.config.vocab_size, dtype=torch.int64)
    tokens = 0
    try:
        for start in tqdm(range(0, input_ids.shape[0], batch_size), desc="sensitivity", unit="batch",
                          disable=not progress):
            rows = input_ids[start:start + batch_size]
            with torch.no_grad():
                embedded = model.get_input_embeddings()(rows) * model.config.scale_emb  # as input_ids would be
            embedded.requires_grad_()
            logits = model(inputs_embeds=embedded).logits.float()
            with torch.no_grad():
                labels = torch.multinomial(torch.softmax(logits.reshape(-1, logits.shape[-1]), -1), 1,
                                           generator=generator).squeeze(1)
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels,
                                              reduction="sum").backward()
            # an embedding row enters scaled by scale_emb: its gradient is scale_emb times the input's
            add(squares, EMBEDDING, (embedded.grad * model.config.scale_emb).reshape(-1, embedded.shape[-1])
                .double().square().sum(0))
            counts += torch.bincount(rows.flatten(), minlength=counts.numel())
            tokens += rows.numel()
    finally:
        for handle in handles:
            handle.remove()
        for p, wanted in params.items():
            p.requires_grad_(wanted)
    stats: dict[str, LinearStatistics | EmbeddingStatistics] = {}
    for index in range(layers):
        for group in SEQUENTIAL_GROUPS:
            hessian = sums[layer_prefix(index) + group[0]] / tokens
            for linear in group:
                name = layer_prefix(index) + linear
                stats[name] = LinearStatistics(hessian, squares[name] / tokens)
    stats[OUTPUT] = LinearStatistics(sums[OUTPUT] / tokens, squares[OUTPUT] / tokens)
    stats[EMBEDDING] = EmbeddingStatistics(token_frequency(counts), squares[EMBEDDING] / tokens)
    return stats


def estimated_kl(weight: torch.Tensor, uses: Sequence[LinearStatistics | EmbeddingStatistics],
                 round_trip: RoundTrip) -> float:
    """The mean KL per token that rounding ``weight`` [N, K] by ``round_trip`` alone adds, summed over the
    ``uses`` of the tensor (two for an embedding tied to the output). The rounding is weighted by the first
    use's importance."""
    w = weight.float().numpy()
    delta = torch.from_numpy(round_trip(w, uses[0].importance) - w).double()
    return sum(use.loss(delta) for use in uses)
