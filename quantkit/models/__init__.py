"""Native MiniCPM4/4.1 model code, registered with transformers' Auto classes on import.

After ``import quantkit``, ``AutoConfig``/``AutoModel``/``AutoModelForCausalLM``/``AutoTokenizer``
``.from_pretrained(dir)`` work on a ``model_type: minicpm`` checkpoint with no trust_remote_code.
"""
from __future__ import annotations

from importlib.resources import files

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

from quantkit.models.configuration_minicpm import MiniCPMConfig, SparseAttentionConfig
from quantkit.models.minicpm import (
    MiniCPMDecoderLayer,
    MiniCPMForCausalLM,
    MiniCPMModel,
    MiniCPMPreTrainedModel,
    MiniCPMRMSNorm,
    MiniCPMRotaryEmbedding,
    sdpa_attention_core,
)

CHAT_TEMPLATE: str = files(__package__).joinpath("chat_template.jinja").read_text(encoding="utf-8")

# exist_ok: re-importing (e.g. importlib.reload in tests) must not fail.
AutoConfig.register(MiniCPMConfig.model_type, MiniCPMConfig, exist_ok=True)
AutoModel.register(MiniCPMConfig, MiniCPMModel, exist_ok=True)
AutoModelForCausalLM.register(MiniCPMConfig, MiniCPMForCausalLM, exist_ok=True)
# Used only when a checkpoint's tokenizer_config.json names no tokenizer_class.
AutoTokenizer.register(MiniCPMConfig, tokenizer_class=PreTrainedTokenizerFast, exist_ok=True)

__all__ = [
    "CHAT_TEMPLATE",
    "MiniCPMConfig",
    "MiniCPMDecoderLayer",
    "MiniCPMForCausalLM",
    "MiniCPMModel",
    "MiniCPMPreTrainedModel",
    "MiniCPMRMSNorm",
    "MiniCPMRotaryEmbedding",
    "SparseAttentionConfig",
    "sdpa_attention_core",
]
