"""Records written as GGUF blocks without re-rounding (``quantkit.gguf.exact``): where Q4_0/Q8_0 hold a record's
grid (symmetric, groups of 32 or a multiple of 32, natural order), the blocks dequantize to the record's weights
bit for bit through ggml's own decoder; any other record is left to re-rounding (None)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from quantkit.gguf.exact import exact_blocks
from quantkit.gguf.types import TYPES
from quantkit.quant import QuantConfig, QuantizedTensor, default_g_idx


def _record(bits: int, group_size: int, sym: bool = True, n: int = 6, k: int = 256, act_order: bool = False,
            seed: int = 0) -> QuantizedTensor:
    generator = torch.Generator().manual_seed(seed)
    config = QuantConfig(bits, group_size, sym)
    groups = config.num_groups(k)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(groups, n, generator=generator) * 0.02 + 1e-3).half()
    zeros = torch.full((groups, n), 2 ** (bits - 1), dtype=torch.uint8) if sym else \
        torch.randint(1, 2 ** bits, (groups, n), generator=generator, dtype=torch.uint8)
    g_idx = default_g_idx(k, group_size)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=generator)]
    return QuantizedTensor(codes, scales, zeros, g_idx, config)


@pytest.mark.parametrize("type_name, bits", [("q4_0", 4), ("q8_0", 8)])
@pytest.mark.parametrize("group_size, k", [(32, 512), (64, 512), (128, 512), (256, 512), (-1, 512),
                                           (128, 576), (256, 1728)])  # the last two: a ragged last group
def test_symmetric_groups_of_32_or_a_multiple_are_the_blocks_bit_for_bit(type_name, bits, group_size, k):
    record = _record(bits, group_size, k=k)
    blocks = exact_blocks(record, type_name)
    assert blocks is not None and blocks.shape == (6, TYPES[type_name].row_bytes(k))
    decoded = TYPES[type_name].dequantize(blocks, k)  # ggml's decoder where llama-cpp-python loads
    np.testing.assert_array_equal(decoded, record.dequantize(torch.float32).numpy())


@pytest.mark.parametrize("record", [
    _record(4, -1, k=200),  # one group a row, but 200 columns are not whole blocks
    _record(4, 128, sym=False),  # a zero point per group: Q4_0 has none
    _record(4, 128, act_order=True),  # groups not in natural order
    _record(8, 128),  # 8-bit codes asked for as Q4_0
], ids=["k200", "asym", "act-order", "8-bit"])
def test_other_grids_are_left_to_re_rounding(record):
    assert exact_blocks(record, "q4_0") is None
