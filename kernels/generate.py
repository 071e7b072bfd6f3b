"""Text generation on the runtime: chunked prefill, decode, sampling, stop tokens, streaming.

    generator = load_text_generator("path/to/artifact")    # or load_text_generator("default")
    for piece in generator.stream("Hello", max_new_tokens=32):
        print(piece, end="", flush=True)
    result = generator.generate(generator.chat_prompt([{"role": "user", "content": "Hi"}], enable_thinking=False))
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import torch

from quantkit.errors import QuantkitError
from quantkit.kernels.attention import make_attention, sparse_config_for
from quantkit.kernels.kv_cache import KVCache
from quantkit.kernels.model import RuntimeModel
from quantkit.kernels.sampling import Sampler, Sampling
from quantkit.kernels.speculative import (
    AUTO,
    AUTO_LONGEST,
    Acceptance,
    AutoChain,
    Drafter,
    FixedChain,
    ModelDrafter,
    TreeShape,
    speculative_tokens,
)
from quantkit.kernels.tokenizer_process import RuntimeTokenizer, TokenizerProcess

DEFAULT_PREFILL_CHUNK = 512
DEFAULT_DRAFT_TOKENS = 3  # vLLM's num_speculative_tokens in OpenBMB's serving recipe for the EAGLE-3 head
CONTEXT_LIMIT = "context limit"  # a stop reason: the model's context (max_position_embeddings) is full


class PromptError(QuantkitError, ValueError):
    """A prompt the runtime cannot take: text that is not valid UTF-8, or more tokens than the context holds."""


def checked_text(text: str, what: str = "the prompt") -> str:
    """``text`` if it is valid Unicode text. Bytes that are not UTF-8 reach Python's arguments and streams as
    lone surrogates (surrogateescape), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(f"{what} is not valid UTF-8: an undecodable byte at character {e.start}") from None
    return text


@dataclass
class Generation:
    text: str
    tokens: list[int]
    prompt_tokens: int
    stop_reason: str  # "stop token", "length" or CONTEXT_LIMIT
    prefill_seconds: float
    decode_seconds: float
    acceptance: dict | None = None  # speculative decoding: Acceptance.to_dict()

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # the first new token comes out of prefill: decode steps are the rest
        steps = max(len(self.tokens) - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


class TextStream:
    """Incremental detokenization: emits text only once it is final. A piece is held back while it
    ends in an incomplete UTF-8 sequence (U+FFFD), and re-decoding starts a few tokens back so that
    tokenizers whose pieces depend on their neighbours (SentencePiece's leading space) stay exact."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token: int) -> str:
        self._tokens.append(token)
        decode = self._tokenizer.decode
        prefix = decode(self._tokens[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        text = decode(self._tokens[self._prefix_offset:], skip_special_tokens=True)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return text[len(prefix):]


class TextGenerator:
    def __init__(self, runtime: RuntimeModel, tokenizer, stop_tokens: set[int],
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, drafter: Drafter | None = None,
                 draft_tokens: int | str = DEFAULT_DRAFT_TOKENS, draft_tree: TreeShape | None = None):
        """``drafter``: decode speculatively, ``draft_tokens`` drafts a round (``"auto"``: the chain length
        each round that commits the most tokens a second, ``AutoChain``), or a ``draft_tree``
        (``kernels/speculative.py``)."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if draft_tokens != AUTO and (not isinstance(draft_tokens, int) or draft_tokens < 1):
            raise ValueError(f"draft_tokens must be >= 1 or {AUTO!r}, got {draft_tokens!r}")
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.stop_tokens = stop_tokens
        self.prefill_chunk = prefill_chunk
        self.drafter = drafter
        self.draft_tokens = draft_tokens
        self.draft_tree = draft_tree

    def new_cache(self) -> KVCache:
        return self.runtime.new_cache(self.runtime.attention.compressed_keys)

    def chat_prompt(self, messages: list[dict], enable_thinking: bool = True) -> list[int]:
        """MiniCPM4.1's chat template with its hybrid-reasoning switch, as token ids."""
        for message in messages:
            if isinstance(message.get("content"), str):
                checked_text(message["content"], f"the {message.get('role', 'chat')} message")
        return self.tokenizer.chat_ids(messages, add_generation_prompt=True, enable_thinking=enable_thinking)

    def encode(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(checked_text(prompt))

    @property
    def context(self) -> int:
        return self.runtime.config.max_position_embeddings

    def prefill(self, tokens: list[int], cache: KVCache) -> torch.Tensor:
        """Runs the prompt through the model in chunks; returns the last position's logits."""
        if not tokens:
            raise ValueError("the prompt is empty")
        if len(tokens) + cache.length > self.context:
            raise PromptError(f"the prompt ({cache.length + len(tokens)} tokens) does not fit the model's context "
                              f"of {self.context} tokens (max_position_embeddings)")
        ids = torch.tensor(tokens, dtype=torch.long)
        for start in range(0, len(tokens), self.prefill_chunk):
            logits = self.runtime.forward(ids[start:start + self.prefill_chunk], cache)
        return logits

    def tokens(self, prompt: str | list[int], max_new_tokens: int = 128, sampling: Sampling = Sampling(),
               cache: KVCache | None = None, timings: dict | None = None) -> Iterator[int]:
        """Yields new token ids until a stop token (not yielded), max_new_tokens, or the model's context is
        full: as llama.cpp stops at n_ctx, generation ends there (stop reason CONTEXT_LIMIT) rather than run
        positions the model was never trained on."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        cache = cache if cache is not None else self.new_cache()
        sampler = Sampler(sampling)
        timings = timings if timings is not None else {}
        prompt = self.encode(prompt)
        room = self.context - cache.length - len(prompt)  # new tokens whose positions the context holds
        if room < 1:
            raise PromptError(f"the prompt ({cache.length + len(prompt)} tokens) leaves no room for a new token in "
                              f"the model's context of {self.context} tokens (max_position_embeddings)")
        limit = "length" if max_new_tokens <= room else CONTEXT_LIMIT
        max_new_tokens = min(max_new_tokens, room)
        if self.drafter is not None:
            yield from self._speculative(prompt, max_new_tokens, sampler, cache, timings)
            if timings["stop_reason"] == "length":
                timings["stop_reason"] = limit
            return
        start = time.perf_counter()
        logits = self.prefill(prompt, cache)
        timings["prefill_seconds"] = time.perf_counter() - start
        timings["stop_reason"] = limit
        start = time.perf_counter()
        for step in range(max_new_tokens):
            token = sampler(logits)
            if token in self.stop_tokens:
                timings["stop_reason"] = "stop token"
                break
            yield token
            if step + 1 < max_new_tokens:
                logits = self.runtime.forward(torch.tensor([token]), cache)
        timings["decode_seconds"] = time.perf_counter() - start

    def _speculative(self, prompt: list[int], max_new_tokens: int, sampler: Sampler, cache: KVCache,
                     timings: dict) -> Iterator[int]:
        """``tokens`` with the drafter; the prefill's time is the first token's (it ends in it)."""
        tree, auto = self.draft_tree, self.draft_tokens == AUTO
        longest = tree.depth if tree is not None else AUTO_LONGEST if auto else self.draft_tokens
        acceptance = timings["acceptance"] = Acceptance(longest)
        chain = AutoChain(acceptance) if auto else FixedChain(self.draft_tokens)
        if auto:
            timings["chain_lengths"] = chain.chosen
        start, first = time.perf_counter(), True
        steps = speculative_tokens(self.runtime, self.drafter, prompt, max_new_tokens, sampler, cache,
                                   chain, self.stop_tokens, self.prefill_chunk, acceptance, tree)
        try:
            while True:
                token = next(steps)
                if first:
                    timings["prefill_seconds"], start, first = time.perf_counter() - start, time.perf_counter(), False
                yield token
        except StopIteration as stop:
            timings["stop_reason"] = stop.value
        if first:
            timings["prefill_seconds"], start = time.perf_counter() - start, time.perf_counter()
        timings["decode_seconds"] = time.perf_counter() - start

    def stream(self, prompt: str | list[int], **kwargs) -> Iterator[str]:
        text = TextStream(self.tokenizer)
        for token in self.tokens(prompt, **kwargs):
            piece = text.push(token)
            if piece:
                yield piece

    def generate(self, prompt: str | list[int], **kwargs) -> Generation:
        timings: dict = {}
        prompt_ids = self.encode(prompt)
        new = list(self.tokens(prompt_ids, timings=timings, **kwargs))
        acceptance = timings.get("acceptance")
        speculative = None if acceptance is None else acceptance.to_dict()
        if "chain_lengths" in timings:  # --draft-tokens auto: how many rounds drafted each length (0: plain steps)
            speculative["rounds_per_chain_length"] = dict(sorted(timings["chain_lengths"].items()))
        return Generation(self.tokenizer.decode(new, skip_special_tokens=True), new, len(prompt_ids),
                          timings["stop_reason"], timings["prefill_seconds"], timings["decode_seconds"], speculative)


class TextGeneratorLM:
    """The text generator behind the two calls the evaluation harness makes of a transformers model, so
    that perplexity and needle retrieval measure the runtime itself (quantized linears, sparse attention)."""

    def __init__(self, generator: TextGenerator):
        self.generator = generator

    def __call__(self, input_ids: torch.Tensor) -> SimpleNamespace:
        """input_ids [1, T] -> logits [1, T, V] of a fresh sequence, prefilled in chunks."""
        cache, ids = self.generator.new_cache(), input_ids[0]
        chunk = self.generator.prefill_chunk
        logits = [self.generator.runtime.forward(ids[start:start + chunk], cache, all_logits=True)
                  for start in range(0, len(ids), chunk)]
        return SimpleNamespace(logits=torch.cat(logits)[None])

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False, **_) -> torch.Tensor:
        if do_sample:
            raise ValueError("TextGeneratorLM.generate is greedy only")
        prompt = input_ids[0].tolist()
        new = list(self.generator.tokens(prompt, max_new_tokens=max_new_tokens))
        return torch.tensor([prompt + new])


def stop_tokens_of(model_dir: Path, tokenizer: RuntimeTokenizer, config) -> set[int]:
    """EOS ids from the config, generation_config.json and the tokenizer, and the chat turn's end."""
    from quantkit.json_files import read_json_object

    ids = tokenizer.end_ids()
    sources = [config.eos_token_id]
    if (model_dir / "generation_config.json").is_file():
        sources.append(read_json_object(model_dir / "generation_config.json").get("eos_token_id"))
    for source in sources:
        ids.update(source if isinstance(source, (list, tuple)) else [] if source is None else [source])
    return ids


def load_text_generator(model_dir: str | Path, *, sparse: str = "auto", sparse_overrides: dict | None = None,
                        device: str = "cpu", dtype: torch.dtype = torch.bfloat16, linear_backend: str = "cpu",
                        lm_head: str = "auto", prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                        draft: str | Path | None = None, draft_tokens: int | str = DEFAULT_DRAFT_TOKENS,
                        draft_tree: TreeShape | None = None, draft_window: int | None = None,
                        tokenizer: RuntimeTokenizer | TokenizerProcess | None = None) -> TextGenerator:
    """A text generator for any checkpoint quantkit reads: unquantized, or an artifact it wrote; with ``draft``
    (``load_drafter``) it decodes speculatively, ``draft_tokens`` drafts a round or, greedy, a
    ``draft_tree``; an EAGLE-3 head attends the last ``draft_window`` positions (all when None).
    ``tokenizer``: the model's, already started (the command line forks a ``TokenizerProcess`` before it
    imports torch); by default it is loaded here, beside the weights."""
    from quantkit.device import resolve_device
    from quantkit.kernels.load import load_runtime_model

    device = resolve_device(device)
    model_dir = Path(model_dir)
    # The tokenizer is read (Python, holding the GIL) while the weights are (torch, releasing it).
    with ThreadPoolExecutor(1) as reading:
        tokenizer_read = reading.submit(RuntimeTokenizer.load, model_dir) if tokenizer is None else None
        model = load_runtime_model(model_dir, dtype, "triton" if device == "cuda" else linear_backend, device, lm_head)
        sparse_config = sparse_config_for(sparse, model.config.sparse_attention, sparse_overrides)
        attention = make_attention(sparse_config, "triton" if device == "cuda" else "cpu")
        runtime = RuntimeModel(model, attention)
        tokenizer = tokenizer if tokenizer_read is None else tokenizer_read.result()
    refuse_tokens_beyond_vocabulary(model_dir, tokenizer, model.config.vocab_size)
    drafter = None if draft is None else load_drafter(draft, runtime, device, linear_backend, draft_window)
    return TextGenerator(runtime, tokenizer, stop_tokens_of(model_dir, tokenizer, model.config), prefill_chunk,
                         drafter, draft_tokens, draft_tree)


def refuse_tokens_beyond_vocabulary(model_dir: Path, tokenizer, vocab_size: int) -> None:
    """A token id the embedding has no row for would fail deep in the first forward pass that meets it."""
    from quantkit.checkpoint import CheckpointError

    token, largest = tokenizer.largest_token()
    if largest >= vocab_size:
        raise CheckpointError(f"{model_dir}: the tokenizer's token {token[:40]!r} has id {largest}, beyond the model's "
                              f"vocab_size of {vocab_size} (config.json)")


def load_drafter(draft: str | Path, target: RuntimeModel, device: str = "cpu", linear_backend: str = "cpu",
                 window: int | None = None) -> Drafter:
    """A drafter for ``target``: an EAGLE-3 head's directory, or any model quantkit reads that shares the
    target's tokenizer (a smaller model, or the target itself), run in the target's dtype."""
    from quantkit.kernels.load import load_runtime_model
    from quantkit.models.eagle3 import is_draft_head
    from quantkit.reader import load_head

    if is_draft_head(draft):
        from quantkit.kernels.eagle3 import Eagle3Drafter

        head = load_head(draft, target.config, target.dtype).to(device)
        return Eagle3Drafter(head, target.model.model.embed_tokens, window)
    model = load_runtime_model(draft, target.dtype, "triton" if device == "cuda" else linear_backend, device)
    return ModelDrafter(RuntimeModel(model, make_attention(None)), target.config.vocab_size)
