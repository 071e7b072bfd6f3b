"""MiniCPM4 / MiniCPM4.1 as a transformers causal LM (dense attention), loadable without trust_remote_code.

The modules and what sets MiniCPM apart from Llama are in ``quantkit.models.decoder``; this module wraps
them in transformers' ``PreTrainedModel`` (caches, masks, outputs, generation), which calibration,
evaluation and ``AutoModelForCausalLM`` use.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils.output_capturing import capture_outputs

from quantkit.models.configuration_minicpm import MiniCPMConfig
from quantkit.models.decoder import MiniCPMDecoderLayer, add_decoder_modules


class MiniCPMPreTrainedModel(PreTrainedModel):
    config_class = MiniCPMConfig
    base_model_prefix = "model"
    _no_split_modules = ["MiniCPMDecoderLayer"]
    _skip_keys_device_placement = ["cache"]
    _supports_sdpa = True
    _can_record_outputs = {"hidden_states": MiniCPMDecoderLayer}


class MiniCPMModel(MiniCPMPreTrainedModel):
    def __init__(self, config: MiniCPMConfig):
        super().__init__(config)
        add_decoder_modules(self, config)
        self.post_init()

    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            # Official behaviour: only token embeddings get the μP multiplier, not passed-in embeddings.
            inputs_embeds = self.embed_tokens(input_ids) * self.config.scale_emb
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            seen = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(seen, seen + inputs_embeds.shape[1], device=inputs_embeds.device)[None]

        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            # Keywords, not positions: layer-replaying tools (GPTQModel) keep only args[0] and kwargs.
            hidden_states = layer(hidden_states, position_embeddings=position_embeddings, attention_mask=mask,
                                  past_key_values=cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)


def _keep_positions(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """transformers' ``logits_to_keep``: 0 keeps every position, n > 0 the last n, a tensor the
    positions it lists (written here: the helper moved between transformers 5.x releases)."""
    if isinstance(logits_to_keep, int):
        return hidden[:, -logits_to_keep:] if logits_to_keep else hidden
    return hidden[:, logits_to_keep]


class MiniCPMForCausalLM(MiniCPMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MiniCPMConfig):
        super().__init__(config)
        self.model = MiniCPMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def logits_from_hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 logits from hidden states that already went through the final norm."""
        return self.lm_head(hidden_states / self.config.logit_divisor).float()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        logits = self.logits_from_hidden(_keep_positions(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
        )
