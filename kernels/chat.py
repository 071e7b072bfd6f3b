"""A multi-turn chat that keeps its KV cache: each turn re-renders the conversation with the chat
template, keeps the cached positions whose tokens did not change, and prefills only the rest."""
from __future__ import annotations

from typing import Iterator

from quantkit.kernels.generate import TextGenerator, TextStream, checked_text


class ChatSession:
    def __init__(self, generator: TextGenerator, enable_thinking: bool = False, system: str | None = None):
        self.generator = generator
        self.enable_thinking = enable_thinking
        self.system = system
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.cache = self.generator.new_cache()
        self.cached_tokens: list[int] = []  # the tokens whose keys and values the cache holds

    def reply(self, text: str, **generation) -> Iterator[str]:
        """Streams the model's answer to a user message; the turn joins the conversation once answered. The
        message is checked and the conversation rendered here, before the first piece is asked for, so that a
        message that is not text, or a template that fails, is refused while the conversation goes on."""
        user = {"role": "user", "content": checked_text(text, "the message")}
        prompt = self.generator.chat_prompt([*self.messages, user], enable_thinking=self.enable_thinking)
        return self._answer(user, prompt, generation)

    def _answer(self, user: dict, prompt: list[int], generation: dict) -> Iterator[str]:
        reused = 0
        for cached, new in zip(self.cached_tokens, prompt[:-1]):  # at least one token is prefilled
            if cached != new:
                break
            reused += 1
        if self.generator.drafter is not None:
            # a draft head's entry at a position read the token after it, which may be what changed: the
            # target recomputes the last kept position's states for the draft to observe again
            reused = max(reused - 1, 0)
        self.cache.crop(reused)
        stream, answer = TextStream(self.generator.tokenizer), []
        for token in self.generator.tokens(prompt[reused:], cache=self.cache, **generation):
            answer.append(token)
            piece = stream.push(token)
            if piece:
                yield piece
        self.cached_tokens = (prompt + answer)[:self.cache.length]
        self.messages += [user, {"role": "assistant",
                                 "content": self.generator.tokenizer.decode(answer, skip_special_tokens=True)}]
