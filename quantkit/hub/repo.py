"""Hub repositories as quantkit's options name them, and what every Hub call needs: the endpoint, the
token, and the retries of an operation the Hub asks to repeat.

A model is ``owner/name`` or ``owner/name@revision`` (a branch, tag or commit); ``owner/name:QUANT``
names one GGUF file of a GGUF repository the way llama.cpp's ``-hf`` option does (``:Q4_K_M``, or
the file's name). Both parts of ``owner/name`` follow the Hub's naming rules, the ones
``huggingface_hub.utils.validate_repo_id`` checks before any request (``PART_RULES``): every text that
names a repository, wherever it is taken, is checked here, so a name the Hub would refuse is one line
naming the broken rule, before any request.
"""
from __future__ import annotations

import itertools
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from quantkit.errors import QuantkitError

MAX_PART = 96  # characters in the owner or the name
_ASCII_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# Each rule of the Hub's, in the order it is checked, and what a part that breaks it is told.
PART_RULES: tuple[tuple[Callable[[str], bool], str], ...] = (
    (lambda part: 0 < len(part) <= MAX_PART, f"must be 1 to {MAX_PART} characters long"),
    (lambda part: _ASCII_NAME.fullmatch(part) is not None, "may hold only ASCII letters, digits, '_', '-' and '.'"),
    (lambda part: part[0] not in "-." and part[-1] not in "-.", "must not start or end with '-' or '.'"),
    (lambda part: "--" not in part and ".." not in part, "must not contain '--' or '..'"),
)
NAME_RULES = (*PART_RULES, (lambda name: not name.endswith(".git"), "must not end in '.git'"))
# owner/name, then a GGUF file (git forbids ':' in a ref name, so ``owner/name:QUANT@revision`` parses one
# way only), then a revision; what the parts may hold is PART_RULES' business, not the shape's.
_REF = re.compile(r"(?P<owner>[^/:@]*)/(?P<name>[^/:@]*)(?::(?P<gguf>[\w.-]+))?(?:@(?P<revision>[^@:\s]+))?")
_SHAPES = "owner/name, owner/name@revision or owner/name:QUANT (one GGUF file)"
DEFAULT_REVISION = "main"
TOKEN_HELP = ("set HF_TOKEN to a token with write access (https://huggingface.co/settings/tokens), or run "
              "`hf auth login` once")


T = TypeVar("T")
RATE_LIMITED, STALE_PARENT = 429, 412  # the Hub's answers that ask for the same operation again
RETRY_TRIES = 4  # quantkit's attempts at one operation (huggingface_hub retries some single requests inside each)
MAX_RETRY_WAIT = 60  # seconds: a Retry-After longer than this is not waited for; the run stops and says so


class RepoIdError(QuantkitError, ValueError):
    """A text that cannot name a Hub repository; ``why`` is the rule it breaks, said without the text."""

    def __init__(self, text: str, why: str):
        super().__init__(f"malformed Hub repo id {text!r}: {why}")
        self.why = why


class HubError(QuantkitError, RuntimeError):
    """The Hub answered, and not with what was asked: a refused token, a rate limit that lasted, a branch
    that kept moving under a commit."""


class RevisionError(QuantkitError, ValueError):
    """A revision that cannot apply: given twice, differently, or to something that is no Hub repository."""


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


def _broken_rule(owner: str, name: str) -> str | None:
    """The first of the Hub's rules ``owner/name`` breaks, said of the part that breaks it."""
    for what, part, rules in (("owner", owner, PART_RULES), ("name", name, NAME_RULES)):
        for holds, rule in rules:
            if not holds(part):
                return f"the {what} {part!r} {rule}"
    return None


def looks_like_repo_ref(text: str) -> bool:
    """Whether ``text`` is written as ``owner/name[:QUANT][@revision]``; whether its parts keep the Hub's
    rules is :func:`parse_repo_ref`'s question."""
    return _REF.fullmatch(text) is not None


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` when it is a plain ``owner/name`` the Hub accepts, else RepoIdError naming the rule."""
    owner, _, name = repo_id.partition("/")
    broken = _broken_rule(owner, name) if repo_id.count("/") == 1 else "expected owner/name"
    if broken:
        raise RepoIdError(repo_id, broken)
    return repo_id


def parse_repo_ref(text: str, revision: str | None = None) -> RepoRef:
    """``owner/name[:QUANT][@revision]`` as a :class:`RepoRef`; ``revision`` (a ``--revision`` option) applies
    when the text names none. Raises RepoIdError naming the rule a malformed id breaks."""
    match = _REF.fullmatch(text)
    if match is None:
        raise RepoIdError(text, f"expected {_SHAPES}")
    broken = _broken_rule(match["owner"], match["name"])
    if broken:
        raise RepoIdError(text, broken)
    if match["revision"] and revision and match["revision"] != revision:
        raise RevisionError(f"{text!r} names revision {match['revision']!r} but --revision is {revision!r}")
    return RepoRef(f"{match['owner']}/{match['name']}", match["revision"] or revision, match["gguf"])


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


def hub_response(error: BaseException | None):
    """The Hub's HTTP answer behind ``error``, looked for along its causes (huggingface_hub wraps some:
    snapshot_download's LocalEntryNotFoundError carries the HfHubHTTPError that made it), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        response = getattr(error, "response", None)
        if hasattr(response, "status_code"):
            return response
        error = error.__cause__ or error.__context__
    return None


def hub_status(error: BaseException) -> int | None:
    response = hub_response(error)
    return None if response is None else response.status_code


def retry_after(response) -> int:
    """The seconds a 429 answer asks to wait (its Retry-After header, in the delay-seconds form; 1 without)."""
    value = response.headers.get("Retry-After", "").strip()
    return int(value) if value.isdigit() else 1


def retrying(operation: Callable[[], T], statuses: tuple[int, ...] = (RATE_LIMITED,)) -> T:
    """``operation()``, run again while the Hub answers one of ``statuses`` to it, at most RETRY_TRIES times
    in all: after the wait a 429 asks for, at once for any other status (the operation itself re-reads
    what the answer says changed). The last error is raised as it came, for the caller to say in one line;
    so is a 429 that asks to wait longer than MAX_RETRY_WAIT. ``operation`` must be safe to repeat."""
    for attempt in itertools.count(1):
        try:
            return operation()
        except Exception as error:
            response = hub_response(error)
            if response is None or response.status_code not in statuses or attempt == RETRY_TRIES:
                raise
            wait = retry_after(response) if response.status_code == RATE_LIMITED else 0
            if wait > MAX_RETRY_WAIT:
                raise
            time.sleep(wait)
