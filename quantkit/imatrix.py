"""llama.cpp's importance matrix from quantkit's calibration set (the file: ``quantkit.gguf.imatrix_file``).

The file's mean x² per input channel is what quantkit's Hessian H = 2/n Σ xᵀx holds on its diagonal,
halved. Like ``llama-imatrix`` without ``--process-output``, the output matrix is left out (and the token
embedding, which is a lookup, not a product).

``prefix_tokens`` is P-GPTQ's cut (MiniCPM4 report, §4.1.2) for llama.cpp users: the first positions of
every sequence carry the attention sink's massive activations, so they are left out of the sums, as
P-GPTQ leaves them out of H. ``llama-imatrix`` has no such option; the counts record what was summed.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from quantkit.atomic import refuse_existing
from quantkit.gguf.imatrix_file import Imatrix, write_imatrix
from quantkit.gguf.names import gguf_name
from quantkit.models.layers import LINEARS, layer_prefix


def collect(model_dir: str | Path, input_ids: torch.Tensor, datasets: list[str], *, prefix_tokens: int = 0,
            batch_size: int = 8, dtype: torch.dtype = torch.float32, progress: bool = False) -> Imatrix:
    """Σ x² of every decoder linear's inputs over the calibration rows ``input_ids`` [n, seq_len], run
    through the model as it is (an unquantized checkpoint, as for ``llama-imatrix``, or an artifact),
    leaving out the first ``prefix_tokens`` positions of every row.

    The whole model is loaded at ``dtype``; the sums accumulate in float64 (llama.cpp's in float32)."""
    from quantkit.loading import load_model

    if not 0 <= prefix_tokens < input_ids.shape[1]:
        raise ValueError(f"prefix_tokens must be in [0, {input_ids.shape[1]}) for sequences of "
                         f"{input_ids.shape[1]} tokens, got {prefix_tokens}")
    model = load_model(model_dir, dtype)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    handles = []
    for index in range(model.config.num_hidden_layers):
        for linear in LINEARS:
            name = gguf_name(f"{layer_prefix(index)}{linear}.weight")

            def accumulate(_module, args, name=name):
                x = args[0][:, prefix_tokens:].reshape(-1, args[0].shape[-1]).double()
                sums[name] = sums.get(name, 0) + (x * x).sum(0)
                counts[name] = counts.get(name, 0) + x.shape[0]

            handles.append(model.get_submodule(f"{layer_prefix(index)}{linear}").register_forward_pre_hook(accumulate))
    try:
        with torch.no_grad():
            for start in tqdm(range(0, input_ids.shape[0], batch_size), desc="imatrix", unit="batch",
                              disable=not progress):
                model.model(input_ids[start:start + batch_size])  # the decoder only: the LM head adds nothing
    finally:
        for handle in handles:
            handle.remove()
    return Imatrix({name: s.numpy() for name, s in sums.items()}, counts, list(datasets), int(input_ids.shape[0]),
                   int(input_ids.shape[1]))


def imatrix_for(model_dir: str | Path, out: str | Path, *, source: str = "default", n_samples: int = 128,
                seq_len: int = 512, seed: int = 0, chat: bool = False, prefix_tokens: int = 0,
                batch_size: int = 8, progress: bool = False) -> Imatrix:
    """Write ``out`` from the calibration rows a recipe with these ``calibration`` settings uses (the
    recipes' defaults unless told), so llama-quantize weighs channels as quantkit's GPTQ does."""
    from quantkit import calib
    from quantkit.tokenizer import load_tokenizer

    out = Path(out)
    refuse_existing(out)
    rows = calib.calibration_set(load_tokenizer(model_dir), source=source, n_samples=n_samples,
                                 seq_len=seq_len, seed=seed, chat=chat)
    cut = f", first {prefix_tokens} positions left out" if prefix_tokens else ""
    dataset = f"quantkit calibration {source} (seed {seed}, fingerprint {rows.fingerprint[:12]}{cut})"
    imatrix = collect(model_dir, rows.input_ids, [dataset], prefix_tokens=prefix_tokens, batch_size=batch_size,
                      progress=progress)
    write_imatrix(imatrix, out)
    return imatrix
