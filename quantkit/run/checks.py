"""Checks of a run's inputs before any work: a run refused late has wasted the work before it."""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from quantkit.checkpoint import CheckpointReader
from quantkit.formats import Format
from quantkit.models import MiniCPMConfig
from quantkit.models.decoder import weight_shapes
from quantkit.models.layers import LINEARS, layer_prefix
from quantkit.quant import QuantConfig
from quantkit.run import RunError


def validate_checkpoint(reader: CheckpointReader, config: MiniCPMConfig, qconfig: QuantConfig, fmt: Format,
                        desc_act: bool, progress: bool = False) -> None:
    """Refuse a bad checkpoint before any work starts: missing or unexpected tensors, wrong shapes,
    NaN/Inf values, and shapes the format cannot pack. (The reader has already held the config's layer
    count to the tensors present, so the shape table is as small as the checkpoint.)"""
    shapes = weight_shapes(config)
    unexpected = [name for name in reader.names if name not in shapes]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise RunError(f"checkpoint {reader.directory} holds tensor {unexpected[0]!r}{more}, which a MiniCPM model "
                       "of its config.json has no place for")
    for name, shape in shapes.items():
        if name not in reader:
            raise RunError(f"checkpoint {reader.directory} lacks tensor '{name}'")
        if reader.shape(name) != shape:
            raise RunError(f"tensor '{name}' has shape {list(reader.shape(name))}, "
                           f"the config implies {list(shape)}")
    for linear in LINEARS:
        out_features, in_features = shapes[f"{layer_prefix(0)}{linear}.weight"]
        fmt.check(qconfig, in_features, out_features, desc_act, linear)
    for name in tqdm(list(shapes), desc="check weights", unit="tensor", disable=not progress, leave=False):
        t = reader.get(name)
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise RunError(f"tensor '{name}' in {reader.directory} contains NaN or Inf values")
