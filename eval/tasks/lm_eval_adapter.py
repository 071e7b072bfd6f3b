"""lm-evaluation-harness's model interface over a quantkit model (the optional ``[lm-eval]`` extra).

    from lm_eval import simple_evaluate
    from quantkit.eval.tasks.lm_eval_adapter import QuantkitLM
    simple_evaluate(model=QuantkitLM("path/to/checkpoint-or-artifact"), tasks=[...])

Importing this module also registers the class under lm-eval's model name ``quantkit``
(``simple_evaluate(model="quantkit", model_args="pretrained=DIR")``); run as a module it is lm-eval's
command line with that model available (``python -m quantkit.eval.tasks.lm_eval_adapter run --model
quantkit --model_args pretrained=DIR --tasks ...``). lm-eval fetches most task data
from the Hugging Face hub; tasks whose data is local (``dataset_path: json`` with ``data_files``)
run offline.

Every request goes through :class:`~quantkit.eval.tasks.model.TaskModel`, the code quantkit's own
tasks use: loglikelihood requests that share a context are scored in one batched forward, exactly as
quantkit's multiple-choice scorer scores a question; contexts are encoded with the tokenizer's usual
special tokens (BOS), continuations without. Generation is greedy only. The model runs on lm-eval's
``device`` (``auto``, ``cpu`` or ``cuda``, as quantkit's ``--device``; ``auto`` when not given), and every
tensor the adapter creates is put there.
"""
from __future__ import annotations

from itertools import groupby
from pathlib import Path

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from quantkit.chat_template import render_chat
from quantkit.eval.ppl import window_log_probs, windows
from quantkit.eval.tasks.model import TaskModel

DEFAULT_MAX_GEN_TOKENS = 256


@register_model("quantkit")
class QuantkitLM(LM):
    def __init__(self, pretrained: str | Path | None = None, model: TaskModel | None = None,
                 max_length: int = 2048, progress: bool = False, device: str | None = None, **_ignored):
        """A model directory (``pretrained``, as lm-eval's model_args name it), loaded on ``device``
        (auto, cpu or cuda; auto when None), or a loaded TaskModel, which runs where its model is.
        ``max_length`` is the window of loglikelihood_rolling. lm-eval's other generic arguments
        (batch_size, max_batch_size) are accepted and ignored: quantkit batches per context."""
        from quantkit.device import resolve_device

        super().__init__()
        if (pretrained is None) == (model is None):
            raise ValueError("pass exactly one of pretrained (a model directory) and model")
        if model is not None and device is not None:
            raise ValueError("device is for pretrained; a loaded TaskModel runs on its model's device")
        self.lm = model if model is not None else TaskModel.load(pretrained, resolve_device(device or "auto"))
        self._device = self.lm.device  # lm-eval's LM.device
        self.max_length = int(max_length)
        self.progress = progress
        self._name = str(pretrained or "quantkit-model")

    @property
    def tokenizer_name(self) -> str:
        return self._name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.lm.tokenizer.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not add_generation_prompt:
            return render_chat(self.lm.tokenizer, chat_history, tokenize=False, continue_final_message=True)
        return self.lm.chat_prompt(chat_history)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        results: dict[int, tuple[float, bool]] = {}
        indexed = sorted(enumerate(r.args for r in requests), key=lambda item: item[1][0])
        bar = tqdm(total=len(requests), desc="loglikelihood", disable=not self.progress)
        for context, group in groupby(indexed, key=lambda item: item[1][0]):
            group = list(group)
            continuations = [self.lm.encode(args[1], special_tokens=False) for _, args in group]
            context_ids = self.lm.encode(context) if context else []
            for (i, _), scored in zip(group, self.lm.continuation_log_likelihoods(context_ids, continuations)):
                results[i] = (scored.log_likelihood, scored.is_greedy)
            bar.update(len(group))
        bar.close()
        return [results[i] for i in range(len(requests))]

    @torch.inference_mode()
    def loglikelihood_rolling(self, requests) -> list[float]:
        """Every token of each text scored once (after the BOS/EOS prefix), in windows of max_length
        that overlap by one token, so each window's first prediction has context."""
        totals = []
        for request in tqdm(requests, desc="loglikelihood_rolling", disable=not self.progress):
            tokens = torch.tensor([self.lm.prefix_token_id] + self.lm.encode(request.args[0], special_tokens=False),
                                  device=self.lm.device)
            total = 0.0
            for w in windows(len(tokens), self.max_length, self.max_length - 1):
                for log_probs, targets in window_log_probs(self.lm.model, tokens, w):
                    total += log_probs.gather(1, targets[:, None]).sum().item()
            totals.append(total)
        return totals

    def generate_until(self, requests) -> list[str]:
        outputs = []
        for request in tqdm(requests, desc="generate_until", disable=not self.progress):
            context, settings = request.args
            settings = dict(settings)
            if settings.pop("do_sample", False) or settings.get("temperature", 0.0) > 0.0:
                raise ValueError("QuantkitLM generates greedily only (do_sample=False, temperature=0)")
            until = settings.get("until") or ()
            until = (until,) if isinstance(until, str) else tuple(until)
            max_tokens = int(settings.get("max_gen_toks", DEFAULT_MAX_GEN_TOKENS))
            outputs.append(self.lm.generate(self.lm.encode(context), until, max_tokens))
        return outputs


if __name__ == "__main__":  # lm-eval's own command line, with "quantkit" among its models
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
