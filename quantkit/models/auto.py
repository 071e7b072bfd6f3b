"""MiniCPM registered with transformers' Auto classes, so that ``AutoConfig``/``AutoModel``/
``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained(dir)`` open a ``model_type: minicpm``
checkpoint with no trust_remote_code.

One function per transformers module that defines Auto classes: ``quantkit`` calls each when that module
is first imported, or at once when it already is (its table ``_REGISTRATIONS``), so that opening a
tokenizer does not import the modeling code the model classes need.
"""
from __future__ import annotations

from quantkit.models.configuration_minicpm import MiniCPMConfig


def register_config() -> None:
    from transformers.models.auto.configuration_auto import AutoConfig

    # exist_ok: registering again (importlib.reload in tests) must not fail.
    AutoConfig.register(MiniCPMConfig.model_type, MiniCPMConfig, exist_ok=True)


def register_tokenizer() -> None:
    from transformers import PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import AutoTokenizer

    # Used only when a checkpoint's tokenizer_config.json names no tokenizer_class.
    AutoTokenizer.register(MiniCPMConfig, tokenizer_class=PreTrainedTokenizerFast, exist_ok=True)


def register_models() -> None:
    from transformers.models.auto.modeling_auto import AutoModel, AutoModelForCausalLM

    from quantkit.models.minicpm import MiniCPMForCausalLM, MiniCPMModel

    AutoModel.register(MiniCPMConfig, MiniCPMModel, exist_ok=True)
    AutoModelForCausalLM.register(MiniCPMConfig, MiniCPMForCausalLM, exist_ok=True)

