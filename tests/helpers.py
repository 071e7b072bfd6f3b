"""Small builders shared by several test modules."""
import torch
import yaml

from quantkit.quant import QuantConfig, QuantizedTensor, default_g_idx
from quantkit.recipe import Recipe, builtin_dir, load_recipe

SMALL_CALIBRATION = {"n_samples": 8, "seq_len": 64, "batch_size": 4}


def built_cpu_ops():
    """The fused C++ operators (kernels/cpu_ops). A C++ compiler is part of the supported setup, so a
    failed build fails the test instead of quietly testing the PyTorch fallback."""
    from quantkit.kernels import cpu_ops

    ops = cpu_ops.load()
    assert ops is not None, "the fused CPU operators did not build"
    return ops


def random_record(config: QuantConfig, n: int, k: int, seed: int, g_idx=None) -> QuantizedTensor:
    """Random codes, zero points (symmetric: 2^(bits-1); asymmetric: from ``config.min_zero``) and
    positive fp16 scales: a valid record no algorithm produced."""
    gen = torch.Generator().manual_seed(seed)
    groups = config.num_groups(k)
    zeros = torch.randint(config.min_zero, config.maxq + 1, (groups, n), generator=gen, dtype=torch.uint8)
    if config.sym:
        zeros.fill_((config.maxq + 1) // 2)
    return QuantizedTensor(
        codes=torch.randint(0, config.maxq + 1, (n, k), generator=gen, dtype=torch.uint8),
        scales=(torch.rand(groups, n, generator=gen) + 0.01).half(),
        zeros=zeros,
        g_idx=default_g_idx(k, config.group_size) if g_idx is None else g_idx,
        config=config,
    )


def small_recipe(name: str, tmp_path, **changes) -> Recipe:
    """Built-in recipe ``name`` on SMALL_CALIBRATION, with top-level ``changes`` (dicts merge)."""
    raw = yaml.safe_load((builtin_dir() / f"{name}.yaml").read_text())
    raw["calibration"].update(SMALL_CALIBRATION)
    for key, value in changes.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_recipe(path)
