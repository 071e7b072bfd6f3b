"""llama.cpp's importance matrix from quantkit's calibration set, as the GGUF file ``llama-imatrix``
writes and ``llama-quantize --imatrix`` reads.

For every decoder linear the file holds the sum of x² over the calibration tokens per input channel
(``<GGUF tensor name>.in_sum2``, F32 [K]) and the number of tokens (``.counts``, F32 [1]: one expert);
``llama-quantize`` divides one by the other, the mean x² that weighs each channel in the block scale
search. That mean is what quantkit's Hessian H = 2/n Σ xᵀx holds on its diagonal, halved.
Key and tensor names, dtypes and order follow llama.cpp's ``IMatrixCollector::save_imatrix``
(tools/imatrix/imatrix.cpp) and its loader (common/imatrix-loader.cpp), which requires the three
``imatrix.*`` keys and F32 sums and counts. Like ``llama-imatrix`` without ``--process-output``, the
output matrix is left out (and the token embedding, which is a lookup, not a product).

``prefix_tokens`` is P-GPTQ's cut (MiniCPM4 report, §4.1.2) for llama.cpp users: the first positions of
every sequence carry the attention sink's massive activations, so they are left out of the sums, as
P-GPTQ leaves them out of H. ``llama-imatrix`` has no such option; the counts record what was summed.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

from quantkit.atomic import atomic_path, refuse_existing
from quantkit.gguf.names import gguf_name
from quantkit.gguf.reader import open_gguf
from quantkit.models.layers import LINEARS, layer_prefix

GENERAL_TYPE = "imatrix"
SUMS, COUNTS = ".in_sum2", ".counts"
DATASETS, CHUNK_COUNT, CHUNK_SIZE = "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"


@dataclass
class Imatrix:
    sums: dict[str, np.ndarray]  # GGUF weight name (blk.N.attn_q.weight) -> Σ x² per input channel, float64
    counts: dict[str, int]  # GGUF weight name -> tokens summed
    datasets: list[str]
    chunk_count: int  # calibration sequences
    chunk_size: int  # tokens per sequence

    def importance(self, name: str) -> np.ndarray:
        """The per-channel mean x² that ``llama-quantize`` hands ggml for tensor ``name``: the file's
        float32 sum divided by its float32 count, in float32, as llama.cpp's loader divides."""
        return (self.sums[name].astype(np.float32) / np.float32(self.counts[name])).astype(np.float32)

    def describe(self) -> dict:
        return {"tensors": len(self.sums), "datasets": self.datasets, "chunk_count": self.chunk_count,
                "chunk_size": self.chunk_size, "tokens": max(self.counts.values(), default=0)}


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


def write_imatrix(imatrix: Imatrix, out: str | Path) -> Path:
    """Write ``imatrix`` as llama.cpp's GGUF imatrix file; the file appears under its name only when complete."""
    out = Path(out)
    with atomic_path(out) as tmp:
        writer = gguf.GGUFWriter(tmp, GENERAL_TYPE)
        # gguf-py always records an architecture; llama-imatrix's files have none, only general.type
        writer.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE)
        writer.add_type(GENERAL_TYPE)
        writer.add_array(DATASETS, imatrix.datasets)
        writer.add_uint32(CHUNK_COUNT, imatrix.chunk_count)
        writer.add_uint32(CHUNK_SIZE, imatrix.chunk_size)
        for name in sorted(imatrix.sums):  # llama-imatrix sorts its entries
            writer.add_tensor(name + SUMS, imatrix.sums[name].astype(np.float32))
            writer.add_tensor(name + COUNTS, np.array([imatrix.counts[name]], dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out


def read_imatrix(path: str | Path) -> Imatrix:
    """A GGUF imatrix file (quantkit's or ``llama-imatrix``'s) read back, as llama.cpp's loader reads it."""
    reader = open_gguf(path)  # every stated length checked against the file's size first
    missing = [key for key in (DATASETS, CHUNK_COUNT, CHUNK_SIZE) if reader.get_field(key) is None]
    if missing:
        raise ValueError(f"{path}: not an imatrix file, it lacks {', '.join(missing)}")
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    names = [name.removesuffix(SUMS) for name in tensors if name.endswith(SUMS)]
    datasets = reader.get_field(DATASETS)
    return Imatrix({name: tensors[name + SUMS].astype(np.float64) for name in names},
                   {name: int(round(float(tensors[name + COUNTS][0]))) for name in names},
                   [str(bytes(datasets.parts[i]), "utf-8") for i in datasets.data],
                   int(reader.get_field(CHUNK_COUNT).contents()), int(reader.get_field(CHUNK_SIZE).contents()))
