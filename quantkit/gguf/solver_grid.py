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

The lattice types (IQ1–IQ3) round 4 or 8 weights jointly onto a fixed set of points: ``LatticeGrid``
solves them a unit of 8 columns at a time.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from quantkit.gguf.lattice import QK_K
from quantkit.gguf.legacy import row_sigma2
from quantkit.gguf.record import GGUFTensor
from quantkit.gguf.types import TensorType


def block_grid(tensor_type: TensorType, weight: Tensor, order: Tensor, importance: Tensor | None,
               metric: Tensor) -> BlockGrid | LatticeGrid:
    """The solver's grid for a GGUF type: ``metric`` is the solver's weight of each column's error, in
    processing order (a lattice grid's joint rounding uses it)."""
    if tensor_type.lattice is not None:
        return LatticeGrid(tensor_type, weight, order, importance, metric)
    if tensor_type.codec is None:
        raise ValueError(f"GPTQ cannot solve on {tensor_type.name}: it has no grid to round to (solvable: the "
                         "legacy block types, the K-quants, IQ4_NL, IQ4_XS and the IQ1–IQ3 lattice types)")
    return BlockGrid(tensor_type, weight, order, importance)


def _block_at(order: Tensor, position: int, width: int, rows: Tensor) -> tuple[int, Tensor, slice]:
    """The block of ``width`` columns whose processing starts at ``position``: its index, its rows
    ([>= width, N] from that position) in file order [width, N], and its input channels."""
    columns = order[position:position + width]
    block = int(columns.min()) // width
    return block, rows[:width][torch.argsort(columns)], slice(block * width, (block + 1) * width)


class BlockGrid:
    def __init__(self, tensor_type: TensorType, weight: Tensor, order: Tensor, importance: Tensor | None = None):
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
        block, natural, channels = _block_at(self.order, position, self.width, rows)
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


class LatticeGrid:
    """A lattice type (IQ1–IQ3) as the solver's grid, after GPTVQ (van Baalen et al., 2024): a unit of 8
    consecutive columns is rounded jointly, each row onto one grid point (two 4-value points on IQ3),
    and the solver then propagates the unit's error column by column to the columns not yet quantized,
    which is the optimal update for the unit's values held fixed.

    When a super-block's first column is reached, llama.cpp's search (its importance-weighted scale
    trials, importance = diag(H) as an imatrix) runs on the block's compensated weights; its sub-block
    scales, fp16 scale and IQ1's ±1/8 shifts are kept. On the signed lattices (IQ2/IQ3) each unit takes
    llama.cpp's signs (with 7 sign bits per 8 weights, an odd count of minus signs leaves the least
    important weight's sign wrong). Per row the unit then gets the point with the least
    Σ m·(x − step·(point + shift))² over every point of the grid, where m is the solver's metric for
    each column: the precision of that column given the columns not yet quantized (the squared
    diagonal of the factor ``H = V Vᵀ`` it runs on), so a unit's rounding weighs errors as the
    propagation will leave them. Steps and shifts are the stored ones, so the solver's values are the
    file's.

    Units must start at multiples of 8 in processing order with their columns in natural order, and
    blocks of 256 must be whole in it: ``unit`` tells the column order so.
    """

    unit = 8

    def __init__(self, tensor_type: TensorType, weight: Tensor, order: Tensor, importance: Tensor | None,
                 metric: Tensor):
        n, k = shape = tuple(weight.shape)
        if not tensor_type.fits(k):
            raise ValueError(f"{tensor_type.name} needs rows in blocks of {tensor_type.block_size}; K = {k} is not")
        self.type = tensor_type
        self.codec = tensor_type.lattice
        self.shape = shape
        self.order = order
        self.metric = torch.empty_like(metric, dtype=torch.float32)  # per input channel, natural order
        self.metric[order] = metric.to(torch.float32)
        self.importance = None if importance is None else importance.to(torch.float32).cpu().numpy()
        self.points = torch.from_numpy(self.codec.points).to(weight.device)  # [points, 4 or 8]
        self.found: dict[int, object] = {}  # super-block -> llama.cpp's search result
        self.index: dict[int, Tensor] = {}  # super-block -> grid indices [N, subs, points per sub-block]
        self.signs: dict[int, Tensor] = {}  # super-block -> sign bytes [N, subs, units] (signed lattices)
        self.steps: dict[int, Tensor] = {}  # super-block -> steps [N, subs]
        self.shifts: dict[int, Tensor] = {}  # super-block -> shifts [N, subs, units]
        self.pending: Tensor | None = None  # the current unit's values [8, N], handed out column by column

    def round(self, position: int, rows: Tensor) -> tuple[Tensor, Tensor]:
        """(placeholder codes, value) of the column at ``position``; ``rows`` [>= unit, N] start at it.
        The grid keeps the unit's real codes (grid points, signs) itself, for ``record``."""
        if position % QK_K == 0:
            self._search_block(position, rows[:QK_K])
        if position % self.unit == 0:  # on the solver's one thread: the unit's products are small
            self.pending = self._round_unit(int(self.order[position]), rows[:self.unit])
        values = self.pending[position % self.unit]
        return torch.zeros_like(values, dtype=torch.uint8), values

    def _search_block(self, position: int, rows: Tensor) -> None:
        block, natural, channels = _block_at(self.order, position, QK_K, rows)
        found = self.codec.read(self.type.quantize_fast(np.ascontiguousarray(natural.T.cpu().numpy()),
                                                        None if self.importance is None else self.importance[channels]))
        device = rows.device
        self.found[block] = found
        self.index[block] = torch.from_numpy(found.index.astype(np.int64)).to(device)
        if self.codec.signed:
            self.signs[block] = torch.from_numpy(found.signs.astype(np.int64)).to(device)
        self.steps[block] = torch.from_numpy(self.codec.steps(found)).to(device)
        self.shifts[block] = torch.from_numpy(self.codec.shifts(found)).to(device)

    def _round_unit(self, column: int, rows: Tensor) -> Tensor:
        """The unit of 8 columns from ``column`` (rows [8, N]) at its sub-block's step: values [8, N]."""
        block, within = divmod(column, QK_K)
        sub, offset = divmod(within, self.codec.sub_block)
        unit = offset // self.unit
        step = self.steps[block][:, sub]  # [N]
        shift = self.shifts[block][:, sub, unit]  # [N]
        metric = self.metric[column:column + self.unit]
        x = rows.T  # [N, 8]
        negative = torch.zeros_like(x, dtype=torch.bool)
        if self.codec.signed:
            negative = x < 0
            x = x.abs()
            if self.codec.even_signs:  # an odd octet's least important weight keeps the wrong sign
                odd = negative.sum(dim=1) % 2 == 1
                least = torch.nn.functional.one_hot((metric * x * x).argmin(dim=1), self.unit).bool() & odd[:, None]
                negative ^= least
                x = torch.where(least, -x, x)
        dim = self.points.shape[1]
        chosen = []
        for part in range(self.unit // dim):  # IQ3's two 4-value points per unit are independent
            columns = slice(part * dim, (part + 1) * dim)
            m = metric[columns]
            # Σ m·(x − s·(p + c))² over points p, per row: up to terms without p, s·(Σ m·p² + 2c·Σ m·p) − 2·Σ m·x·p
            cost = step[:, None] * ((self.points * self.points) @ m + 2 * shift[:, None] * (self.points @ m))
            cost -= 2 * ((x[:, columns] * m) @ self.points.T)
            chosen.append(cost.argmin(dim=1))
        index = torch.stack(chosen, dim=1)  # [N, 8 / dim]
        empty = step == 0  # an empty super-block: point 0, no signs, as llama.cpp writes it
        index = index.masked_fill(empty[:, None], 0)
        first = offset // dim
        self.index[block][:, sub, first:first + len(chosen)] = index
        values = (self.points[index].reshape(len(x), self.unit) + shift[:, None]) * step[:, None]
        if self.codec.signed:
            negative &= ~empty[:, None]
            sign_bits = (negative.long() << torch.arange(self.unit, device=x.device)).sum(dim=1)
            self.signs[block][:, sub, unit] = sign_bits & 127 if self.codec.even_signs else sign_bits
            values = torch.where(negative, -values, values)
        return values.T

    def record(self, codes: Tensor) -> GGUFTensor:
        """The super-blocks with the solver's grid points and signs (``codes`` are placeholders)."""
        n, k = self.shape
        data = np.concatenate([
            self.codec.pack(self.found[block], self.index[block].cpu().numpy(),
                            self.signs[block].cpu().numpy() if self.codec.signed else None)
            for block in range(k // QK_K)], axis=1)
        return GGUFTensor(self.type.name, torch.from_numpy(np.ascontiguousarray(data)), (n, k))
