"""llama.cpp's importance-matrix file: the GGUF ``llama-imatrix`` writes and ``llama-quantize --imatrix``
reads, one entry per decoder linear.

For every decoder linear the file holds the sum of x² over the calibration tokens per input channel
(``<GGUF tensor name>.in_sum2``, F32 [K]) and the number of tokens (``.counts``, F32 [1]: one expert);
``llama-quantize`` divides one by the other, the mean x² that weighs each channel in the block scale
search. Key and tensor names, dtypes and order follow llama.cpp's ``IMatrixCollector::save_imatrix``
(tools/imatrix/imatrix.cpp) and its loader (common/imatrix-loader.cpp), which requires the three
``imatrix.*`` keys and F32 sums and counts. ``quantkit.imatrix`` computes one; ``export gguf --imatrix``
quantizes with one.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from quantkit.atomic import atomic_path
from quantkit.gguf.reader import open_gguf

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
