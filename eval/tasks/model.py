"""A quantkit model and its tokenizer, seen the way tasks use it: greedy generation with stop strings,
and log-likelihoods of continuations (one batched forward per context).

Both lm-eval's adapter and quantkit's own tasks call these two methods, so a task scored either way
sees the same numbers. The model runs on the device it was loaded to (``TaskModel.load(dir, device)``),
and every tensor these methods create is put there: the same torch code on the CPU or a CUDA GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase
from transformers.cache_utils import DynamicCache

from quantkit.chat_template import render_chat
from quantkit.loading import load_model
from quantkit.models import MiniCPMForCausalLM
from quantkit.tokenizer import load_tokenizer


@dataclass(frozen=True)
class Continuation:
    log_likelihood: float  # summed over the continuation's tokens, float64
    is_greedy: bool  # every token is the argmax given what precedes it


@dataclass
class TaskModel:
    model: MiniCPMForCausalLM
    tokenizer: PreTrainedTokenizerBase

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu") -> "TaskModel":
        """The model of ``model_dir`` on ``device`` (a resolved device: "cpu" or "cuda") and its tokenizer."""
        return cls(load_model(model_dir).to(device), load_tokenizer(model_dir))

    @property
    def device(self) -> torch.device:
        """Where the model runs, and where the token tensors given to it are made."""
        return self.model.device

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``special_tokens`` the tokenizer adds its usual BOS, if any."""
        return self.tokenizer(text, add_special_tokens=special_tokens).input_ids

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The chat template's text for ``messages``, ending in the assistant's turn. Reasoning ("thinking")
        is switched off where the template supports it (MiniCPM4.1's), so the answer comes directly.
        Encode it with ``special_tokens=False``: the template writes its own (as transformers does)."""
        return render_chat(self.tokenizer, messages, tokenize=False, add_generation_prompt=True,
                           enable_thinking=False)

    @cached_property
    def stop_token_ids(self) -> set[int]:
        eos = self.model.config.eos_token_id
        ids = [*eos] if isinstance(eos, list) else [eos]
        return {i for i in [*ids, self.tokenizer.eos_token_id] if i is not None}

    @property
    def prefix_token_id(self) -> int:
        """What an empty context starts from: BOS, else EOS (lm-eval's convention)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], stop: tuple[str, ...] = (), max_new_tokens: int = 256) -> str:
        """Greedy continuation of ``prompt_ids``, cut before the first stop string or at an end token."""
        if not prompt_ids:
            raise ValueError("generation needs a non-empty prompt")
        cache = DynamicCache(config=self.model.config)
        logits = self.model(torch.tensor([prompt_ids], device=self.device), cache=cache, use_cache=True,
                            logits_to_keep=1).logits
        generated, text = [], ""
        for _ in range(max_new_tokens):
            token = int(logits[0, -1].argmax())
            if token in self.stop_token_ids:
                break
            generated.append(token)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            cut = min((text.find(s) for s in stop if s in text), default=-1)
            if cut >= 0:
                return text[:cut]
            logits = self.model(torch.tensor([[token]], device=self.device), cache=cache, use_cache=True).logits
        return text

    @torch.inference_mode()
    def continuation_log_likelihoods(self, context_ids: list[int],
                                     continuations: list[list[int]]) -> list[Continuation]:
        """log P(continuation | context) for each continuation, all in one right-padded batch: causal
        attention never lets a real position see the padding after it, so no mask is needed."""
        if not context_ids:
            context_ids = [self.prefix_token_id]
        if not continuations or any(not c for c in continuations):
            raise ValueError("every continuation needs at least one token")
        rows = [context_ids + c for c in continuations]
        width = max(map(len, rows))
        batch = torch.tensor([row + [0] * (width - len(row)) for row in rows], device=self.device)
        # logits only where a continuation token is predicted: from the context's last position on
        first = len(context_ids) - 1
        logits = self.model(batch, use_cache=False,
                            logits_to_keep=torch.arange(first, width - 1, device=self.device)).logits
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        results = []
        for i, continuation in enumerate(continuations):
            predicting = log_probs[i, :len(continuation)]
            targets = torch.tensor(continuation, device=self.device)
            chosen = predicting.gather(1, targets[:, None]).sum().item()
            results.append(Continuation(chosen, bool((predicting.argmax(-1) == targets).all())))
        return results
