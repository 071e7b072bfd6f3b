"""A GGUF block type as the GPTQ solver's rounding grid.

When the solver reaches a block's first column, the type's own quantizer (llama.cpp's scale
search: Q4_K's weighted min/scale fit, Q6_K's 19 candidate grids, Q4_0's signed maximum) runs on
the block's weights as they stand then, with every earlier column's error compensation applied.
Its scales and minimums are kept; every column of the block is then rounded by the solver to that
grid (``weight = level(code) · scale + offset`` per sub-block), and at the end the solver's codes replace
llama.cpp's round-to-nearest ones in the blocks. The result is a file any llama.cpp build reads.
On an affine grid (level = code) rounding is round-half-even and a clamp to 0..maxq; on a codebook
(IQ4_NL, IQ4_XS: 16 uneven levels) it is the nearest level to (w − offset)/scale, found as ggml's
``best_index_int8`` finds it, so that without correlations to compensate the codes are llama.cpp's.

With ``importance`` (one value per input channel: GPTQ passes its Hessian's diagonal, which is
llama.cpp's imatrix, the mean x² of each input channel, times 2) the scale search is ggml's imatrix
path instead, the one ``llama-quantize --imatrix`` runs: each block's scales then fit the weights
whose inputs are loud. The legacy types' σ² is a whole row's (ggml's rule); since the solver sees one
block at a time, it is taken from the weights the solver starts from.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from quantkit.gguf.legacy import row_sigma2
from quantkit.gguf.record import GGUFTensor
from quantkit.gguf.types import TensorType


class BlockGrid:
    def __init__(self, tensor_type: TensorType, weight: Tensor, order: Tensor, importance: Tensor | None = None):
        if tensor_type.codec is None:
            raise ValueError(f"GPTQ cannot solve on {tensor_type.name}: it has no integer grid "
                             "(solvable: the legacy block types, the K-quants, IQ4_NL and IQ4_XS)")
        shape = n, k = tuple(weight.shape)
        if not tensor_type.fits(k):
            raise ValueError(f"{tensor_type.name} needs rows in blocks of {tensor_type.block_size}; K = {k} is not")
        self.type = tensor_type
        self.codec = tensor_type.codec
        self.width = tensor_type.block_size
        self.shape = shape
        self.order = order
        self.blocks = np.zeros((n, k // self.width, tensor_type.block_bytes), dtype=np.uint8)
        # per sub-block of input channels, per row; on the solve's device (the block codecs run on the host)
        self.scale = torch.zeros(k // self.codec.sub_block, n, device=weight.device)
        self.offset = torch.zeros_like(self.scale)
        self.importance = None if importance is None else importance.to(torch.float32).cpu().numpy()
        self.row_sigma2 = None if importance is None else row_sigma2(weight.cpu().numpy())
        values = self.codec.values
        self.levels = None if values is None else torch.from_numpy(values).to(weight.device, torch.float32)

    def round(self, position: int, rows: Tensor) -> tuple[Tensor, Tensor]:
        """(codes, fake-quantized values) of the column at ``position``; ``rows`` [>= block, N] start at it."""
        if position % self.width == 0:
            self._choose_block(position, rows)
        sub_block = int(self.order[position]) // self.codec.sub_block
        scale, offset = self.scale[sub_block], self.offset[sub_block]
        if self.levels is not None:
            return self._nearest_level(rows[0], scale, offset)
        dead = scale == 0  # the block's quantizer found nothing to scale: every code means `offset`
        codes = torch.round((rows[0] - offset) / torch.where(dead, 1.0, scale)).clamp_(0, self.codec.maxq)
        codes = codes.masked_fill_(dead, 0)
        return codes, codes * scale + offset

    def _nearest_level(self, column: Tensor, scale: Tensor, offset: Tensor) -> tuple[Tensor, Tensor]:
        """Codes and values of ``column`` on a codebook grid: the level nearest y = (w − offset) · (1/scale),
        the lower of two only if strictly nearer in float32, the end level beyond either end. 1/scale is
        ggml's ``d ? 1/d : 0``: under a dead scale y = 0, and the code is the one ggml writes there."""
        levels = self.levels
        y = (column - offset) * torch.where(scale == 0, 0.0, 1.0 / scale)
        upper = torch.searchsorted(levels, y, right=True).clamp_(1, len(levels) - 1)
        codes = upper - ((y - levels[upper - 1]) < (levels[upper] - y)).long()
        return codes, levels[codes] * scale + offset

    def _choose_block(self, position: int, rows: Tensor) -> None:
        columns = self.order[position:position + self.width]
        block = int(columns.min()) // self.width
        natural = rows[:self.width][torch.argsort(columns)]  # the block's columns in file order, [width, N]
        channels = slice(block * self.width, (block + 1) * self.width)
        data = self.type.quantize_with(np.ascontiguousarray(natural.T.cpu().numpy()),
                                       None if self.importance is None else self.importance[channels],
                                       self.row_sigma2)
        self.blocks[:, block] = data
        scale, offset = self.codec.grid(data)
        subs = slice(block * scale.shape[1], (block + 1) * scale.shape[1])
        self.scale[subs] = torch.from_numpy(scale.T).to(self.scale.device)
        self.offset[subs] = torch.from_numpy(offset.T).to(self.offset.device)

    def record(self, codes: Tensor) -> GGUFTensor:
        """The blocks with the solver's ``codes`` [N, K] (natural column order) in place of the quantizer's."""
        n, k = self.shape
        blocks = self.codec.with_codes(self.blocks.reshape(-1, self.type.block_bytes),
                                       codes.cpu().numpy().reshape(-1, self.width))
        return GGUFTensor(self.type.name, torch.from_numpy(np.ascontiguousarray(blocks.reshape(n, -1))), (n, k))
