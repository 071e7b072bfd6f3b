"""MiniCPM4 / MiniCPM4.1's configuration as transformers reads and writes it: ``MiniCPMSettings``'s fields
(``quantkit.models.settings``) on a ``PretrainedConfig``.

transformers 5.x standardises RoPE settings into ``rope_parameters``; official MiniCPM loaders read
``rope_theta`` and ``rope_scaling`` instead. This config keeps both official keys as plain fields
(shadowing the base class's deprecated ``rope_scaling`` property), so ``config.json`` round-trips
unchanged and transformers' RoPE machinery never rewrites it: the model computes LongRoPE itself.
"""
from __future__ import annotations

from transformers import PretrainedConfig

from quantkit.models.settings import MODEL_TYPE, MiniCPMSettings, checked_values


class MiniCPMConfig(MiniCPMSettings, PretrainedConfig):
    """The settings first among the bases, so that their defaults are the fields' (transformers makes the
    class a dataclass whose fields are both bases')."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["cache"]
    __repr__ = PretrainedConfig.__repr__  # transformers' (the JSON), not the settings' dataclass one

    def __post_init__(self, **kwargs):
        MiniCPMSettings.__post_init__(self)
        PretrainedConfig.__post_init__(self, **kwargs)

    @classmethod
    def _dict_from_json_file(cls, json_file) -> dict:
        return checked_values(json_file, cls._decode_special_floats)  # transformers' {"__float__": "NaN"}
