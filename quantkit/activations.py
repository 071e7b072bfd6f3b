"""Where the engine keeps calibration activations: in memory where they fit, in files on disk where not.

A layer's work holds its input, the residual stream after attention (which its output overwrites) and
o_proj's or down_proj's input for every calibration token: at MiniCPM4.1-8B's sizes and 128 x 2048
tokens that is 12.9 GB of bf16, beside one layer's weights and the largest Hessian. A machine (or a
GPU) without that room still runs: the activations become shared memory maps of files in a spill
directory, and the layer's work reads and writes them a batch at a time, moving each batch to the
layer's device. The kernel writes mapped pages back to the file
under memory pressure instead of the OOM killer ending the run.

Each file is unlinked as soon as it is mapped, so its disk space returns when the tensor is freed and
an interrupted run leaves no file behind. The arithmetic is the same either way, so the artifact is
byte-identical.
"""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import torch


class Activations:
    """Allocates activation tensors: on ``device``, or with ``spill_dir`` as host memory maps of files there."""

    def __init__(self, device: torch.device, spill_dir: Path | None = None):
        self.device = device
        self.spill_dir = spill_dir

    @property
    def spilled(self) -> bool:
        return self.spill_dir is not None

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.spill_dir is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        handle, path = tempfile.mkstemp(prefix=".quantkit-activations-", suffix=".bin", dir=self.spill_dir)
        os.close(handle)
        try:
            mapped = torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype)
        finally:
            os.unlink(path)  # the mapping keeps the pages; the name is not needed
        return mapped.view(shape)

    def empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.empty(tuple(tensor.shape), tensor.dtype)
