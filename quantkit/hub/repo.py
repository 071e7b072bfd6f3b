"""Hub repositories as quantkit's options name them, and what every Hub call needs: the endpoint and
the token.

A model is ``owner/name`` or ``owner/name@revision`` (a branch, tag or commit); ``owner/name:QUANT``
names one GGUF file of a GGUF repository the way llama.cpp's ``-hf`` option does (``:Q4_K_M``, or
the file's name). The name rules are
the Hub's own (``huggingface_hub.utils.validate_repo_id``): letters, digits, ``_``, ``-`` and
``.``, at most 96 characters a part, starting and ending with a letter, digit or ``_``, and no
``--`` or ``..``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

_PART = r"\w(?:[\w.-]{0,94}\w)?"
# Git forbids ':' in a ref name, so ``owner/name:QUANT@revision`` parses one way only.
_REF = re.compile(rf"(?P<repo_id>{_PART}/{_PART})(?::(?P<gguf>[\w.-]+))?(?:@(?P<revision>[^@:\s]+))?")
DEFAULT_REVISION = "main"
TOKEN_HELP = ("set HF_TOKEN to a token with write access (https://huggingface.co/settings/tokens), or run "
              "`hf auth login` once")


@dataclass(frozen=True)
class RepoRef:
    """One Hub model repository at one revision (``None``: the default branch)."""

    repo_id: str
    revision: str | None = None
    gguf: str | None = None  # one GGUF file: its quantization type (Q4_K_M) or its file name

    def __str__(self) -> str:
        text = self.repo_id if self.gguf is None else f"{self.repo_id}:{self.gguf}"
        return text if self.revision is None else f"{text}@{self.revision}"

    @property
    def name(self) -> str:
        return self.repo_id.split("/")[1]


def is_repo_ref(text: str) -> bool:
    """Whether ``text`` has the shape of ``owner/name[:QUANT][@revision]`` (not whether the repository exists)."""
    match = _REF.fullmatch(text)
    return match is not None and not _doubled(match["repo_id"])


def _doubled(repo_id: str) -> bool:
    return "--" in repo_id or ".." in repo_id


def parse_repo_ref(text: str, revision: str | None = None) -> RepoRef:
    """``owner/name[:QUANT][@revision]`` as a :class:`RepoRef`; ``revision`` (a ``--revision`` option) applies
    when the text names none. Raises ValueError naming the rule a malformed id breaks."""
    match = _REF.fullmatch(text)
    if match is None or _doubled(match["repo_id"]):
        raise ValueError(f"malformed Hub repo id {text!r}: expected owner/name, owner/name@revision or "
                         "owner/name:QUANT (one GGUF file), each part "
                         "letters, digits, '_', '-' or '.' (at most 96, no '--' or '..', not starting or ending "
                         "with '-' or '.')")
    if match["revision"] and revision and match["revision"] != revision:
        raise ValueError(f"{text!r} names revision {match['revision']!r} but --revision is {revision!r}")
    return RepoRef(match["repo_id"], match["revision"] or revision, match["gguf"])


def hub_endpoint() -> str:
    """The Hub's address, read from HF_ENDPOINT at each call: huggingface_hub reads it once, at import,
    and quantkit passes it explicitly so that a value set later (by a test, or a caller) applies."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def hub_token() -> str:
    """The token huggingface_hub would send (HF_TOKEN, else the one `hf auth login` stored). Callers pass
    it to huggingface_hub and nowhere else: it is never printed, logged or written by quantkit."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise RuntimeError(f"no Hugging Face token found: {TOKEN_HELP}")
    return token
