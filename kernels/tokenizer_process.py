"""What text generation asks of a tokenizer, answered in this process or by a child process.

Generation needs a tokenizer for the prompt's ids (a chat template rendered within its budget, or text
encoded), for decoding what it generates, and for the ids that end a turn. ``RuntimeTokenizer`` answers on
a transformers tokenizer in this process. ``TokenizerProcess`` answers the same calls from a child
process forked before the parent imports torch: importing transformers and loading the tokenizer (about
0.6 s here) then run on the second core while the parent imports torch and loads the weights (about
1.3 s). In one process the two take turns on one interpreter lock, and a first answer waits for both.
What crosses the pipe is token ids, text and quantkit's errors, whose one-line messages are the whole
story. No torch here.
"""
from __future__ import annotations

import os
import pickle
import signal
import traceback
from pathlib import Path

from quantkit.errors import QuantkitError

END_OF_TURN = "<|im_end|>"  # MiniCPM4.1's (and ChatML's) end of an assistant turn


class RuntimeTokenizer:
    """A transformers tokenizer, as text generation uses it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, model_dir: str | Path) -> RuntimeTokenizer:
        from quantkit.tokenizer import load_tokenizer

        return cls(load_tokenizer(model_dir))

    def chat_ids(self, messages: list[dict], **template_kwargs) -> list[int]:
        from quantkit.chat_template import render_chat

        return render_chat(self.tokenizer, messages, **template_kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def end_ids(self) -> set[int]:
        """The tokenizer's EOS and, where its vocabulary has one, the chat turn's end."""
        ids = {self.tokenizer.eos_token_id} - {None}
        end_of_turn = self.tokenizer.convert_tokens_to_ids(END_OF_TURN)
        if isinstance(end_of_turn, int) and end_of_turn != self.tokenizer.unk_token_id:
            ids.add(end_of_turn)
        return ids

    def largest_token(self) -> tuple[str, int]:
        """The token with the largest id, and that id."""
        return max(self.tokenizer.get_vocab().items(), key=lambda item: item[1])


# The calls a TokenizerProcess forwards: RuntimeTokenizer's methods.
CALLS = ("chat_ids", "encode", "decode", "end_ids", "largest_token")


class TokenizerProcess:
    """``RuntimeTokenizer.load(model_dir)``'s calls, answered by a child process started now (``start``)."""

    def __init__(self, connection, process):
        self._connection, self._process = connection, process

    @classmethod
    def start(cls, model_dir: str | Path) -> TokenizerProcess | RuntimeTokenizer:
        """The child, forked now; where processes cannot be forked, the tokenizer loaded here."""
        if not hasattr(os, "fork"):
            return RuntimeTokenizer.load(model_dir)
        import multiprocessing

        context = multiprocessing.get_context("fork")
        ours, theirs = context.Pipe()
        process = context.Process(target=_serve, args=(str(model_dir), theirs), daemon=True,
                                  name="quantkit-tokenizer")
        process.start()
        theirs.close()
        return cls(ours, process)

    def _call(self, name: str, *args, **kwargs):
        try:
            self._connection.send((name, args, kwargs))
            answered, value = self._connection.recv()
        except (EOFError, OSError) as error:
            raise QuantkitError(f"the tokenizer process ended (exit code {self._process.exitcode})") from error
        if not answered:
            raise value
        return value

    def __getattr__(self, name: str):
        if name not in CALLS:
            raise AttributeError(name)
        return lambda *args, **kwargs: self._call(name, *args, **kwargs)


def _serve(model_dir: str, connection) -> None:
    """The child: load the tokenizer, then answer calls until the parent closes its end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; its exit ends this
    try:
        tokenizer, failure = RuntimeTokenizer.load(model_dir), None
    except Exception as error:  # every call is answered with it, as a load in the parent would have raised
        tokenizer, failure = None, _sendable(error)
    while True:
        try:
            name, args, kwargs = connection.recv()
        except (EOFError, OSError):
            return
        try:
            if failure is not None:
                raise failure
            answer = (True, getattr(tokenizer, name)(*args, **kwargs))
        except Exception as error:
            answer = (False, _sendable(error))
        connection.send(answer)


def _sendable(error: Exception) -> Exception:
    """quantkit's errors cross as they are, or as a QuantkitError of their message (the whole report);
    anything else is a bug, sent as its traceback."""
    if isinstance(error, QuantkitError):
        try:
            pickle.loads(pickle.dumps(error))
            return error
        except Exception:
            return QuantkitError(str(error))
    return RuntimeError("the tokenizer process failed:\n" + "".join(traceback.format_exception(error)))
