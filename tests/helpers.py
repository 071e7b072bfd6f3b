"""Small builders shared by several test modules."""
import torch

from quantkit.quant import QuantConfig, QuantizedTensor, default_g_idx


def random_record(config: QuantConfig, n: int, k: int, seed: int, g_idx=None) -> QuantizedTensor:
    """Random codes, zero points and positive fp16 scales: a valid record no algorithm produced."""
    gen = torch.Generator().manual_seed(seed)
    groups = config.num_groups(k)
    return QuantizedTensor(
        codes=torch.randint(0, config.maxq + 1, (n, k), generator=gen, dtype=torch.uint8),
        scales=(torch.rand(groups, n, generator=gen) + 0.01).half(),
        zeros=torch.randint(0, config.maxq + 1, (groups, n), generator=gen, dtype=torch.uint8),
        g_idx=default_g_idx(k, config.group_size) if g_idx is None else g_idx,
        config=config,
    )
