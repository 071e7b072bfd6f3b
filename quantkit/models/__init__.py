"""MiniCPM4/4.1's architecture: its configuration (``settings``; ``configuration_minicpm`` as transformers'
config), its decoder in plain PyTorch (``decoder``), the same as a transformers model (``minicpm``), the
table of its linears (``layers``), InfLLM v2's settings (``sparse_attention``) and the EAGLE-3 draft head
(``eagle3``).

The names below are imported when first used (PEP 562), so that what needs only the settings or the
plain-PyTorch decoder (the runtime) never waits for transformers. Registration with transformers' Auto
classes is ``quantkit.models.auto``'s.
"""
from __future__ import annotations

import importlib
from importlib.resources import files

from quantkit.models.settings import MiniCPMSettings
from quantkit.models.sparse_attention import SparseAttentionConfig

CHAT_TEMPLATE: str = files(__package__).joinpath("chat_template.jinja").read_text(encoding="utf-8")

# name -> the module defining it
_LAZY = {
    "MiniCPMConfig": "quantkit.models.configuration_minicpm",
    **dict.fromkeys(("MiniCPMDecoderLayer", "MiniCPMRMSNorm", "MiniCPMRotaryEmbedding", "MiniCPMSkeleton",
                     "sdpa_attention_core"), "quantkit.models.decoder"),
    **dict.fromkeys(("MiniCPMForCausalLM", "MiniCPMModel", "MiniCPMPreTrainedModel"), "quantkit.models.minicpm"),
}

__all__ = ["CHAT_TEMPLATE", "MiniCPMSettings", "SparseAttentionConfig", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
