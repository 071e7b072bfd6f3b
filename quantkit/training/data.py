"""Training text: every disjoint row the calibration sources yield, in a fresh order each epoch.

The rows are ``calib.calibration_set``'s (the held-out texts are refused there), drawn to the whole
capacity of the source while keeping its mix's shares. Epoch ``e`` visits them in a permutation
seeded by (seed, e), so the data a step sees depends only on its position: resuming needs only the
position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from quantkit import calib


@dataclass(frozen=True)
class TrainingData:
    rows: Tensor  # int64 [R, seq_len]
    seed: int
    fingerprint: str
    described: dict

    def __len__(self) -> int:
        return self.rows.shape[0]

    def order(self, epoch: int) -> Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self), generator=generator)

    def row_ids(self, position: int, count: int) -> list[int]:
        """Indices of the ``count`` rows starting at global position ``position`` (across epochs)."""
        orders: dict[int, Tensor] = {}
        ids = []
        for p in range(position, position + count):
            epoch, offset = divmod(p, len(self))
            if epoch not in orders:
                orders[epoch] = self.order(epoch)
            ids.append(int(orders[epoch][offset]))
        return ids

    def micro_batch(self, step: int, index: int, rows_per_step: int, size: int) -> list[int]:
        """Indices of micro-batch ``index`` (``size`` rows) of optimizer step ``step`` (``rows_per_step`` rows)."""
        return self.row_ids(step * rows_per_step + index * size, size)

    def batch(self, position: int, count: int) -> Tensor:
        return self.rows[self.row_ids(position, count)]


def training_data(tokenizer, source: str, seq_len: int, seed: int) -> TrainingData:
    data = calib.calibration_set(tokenizer, source=source, n_samples=None, seq_len=seq_len, seed=seed)
    return TrainingData(data.input_ids, seed, data.fingerprint, data.describe())
