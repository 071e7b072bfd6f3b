"""A Hub model repository brought into huggingface_hub's cache: what quantkit reads, nothing else.

Only weights in safetensors, configs, tokenizer files, chat templates and the model card (which
carries the licence a published artifact inherits) are fetched: never pickle weights (``*.bin``,
``*.pt``), which can run code when loaded, and never Python files, so no remote code can run.
With ``HF_HUB_OFFLINE=1`` the cached snapshot is used without any network request.

A GGUF repository (``owner/name:QUANT``, llama.cpp's ``-hf`` naming) gives one file: the one whose
name ends in ``-QUANT.gguf`` (or ``.QUANT.gguf``, ``_QUANT.gguf``; any case), or the one named.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from quantkit.hub.repo import RATE_LIMITED, RETRY_TRIES, HubError, RepoRef, hub_endpoint, hub_status, retrying
from quantkit.models.remote_code import BUNDLE

# The weights, configs and tokenizer, and the model code an artifact carries for stock transformers
# (quantkit.models.remote_code: its manifest records it, so a copy without it is incomplete; quantkit never runs it).
PULL_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.json", "*.jinja", "tokenizer.model", "*.tiktoken",
                 "merges.txt", "vocab.txt", "README.md", *BUNDLE)


def download_command(ref: RepoRef) -> str:
    """The shell command that fills the cache with what :func:`pull_model` reads."""
    revision = f" --revision {ref.revision}" if ref.revision else ""
    includes = " ".join(f"--include '{pattern}'" for pattern in PULL_PATTERNS)
    return f"hf download {ref.repo_id}{revision} {includes}"


@contextmanager
def _hub_errors(ref: RepoRef, download: str) -> Iterator[None]:
    """huggingface_hub's errors as one line that says what to do; ``download`` is the command that
    fills the cache where there is network. A rate limit is told apart from an unreachable Hub:
    snapshot_download reports both as a LocalEntryNotFoundError, the 429 behind it as its cause."""
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except RevisionNotFoundError as error:
        raise FileNotFoundError(f"{ref.repo_id} has no revision {ref.revision!r} on {hub_endpoint()}") from error
    except RepositoryNotFoundError as error:
        raise FileNotFoundError(f"no model repository {ref.repo_id} on {hub_endpoint()} (for a private or gated "
                                "one, set HF_TOKEN or run `hf auth login`)") from error
    except (HfHubHTTPError, LocalEntryNotFoundError) as error:
        if hub_status(error) == RATE_LIMITED:
            raise HubError(f"the Hub at {hub_endpoint()} still answers 429 Too Many Requests for {ref} after "
                           f"{RETRY_TRIES} attempts: wait, then run the same command again") from error
        if isinstance(error, HfHubHTTPError):
            raise
        raise RuntimeError(
            f"{ref} is not in the Hugging Face cache and the Hub cannot be reached ({error.__class__.__name__}). "
            f"Where there is network, download it with\n  {download}\nthen run again; with "
            "HF_HUB_OFFLINE=1 the cached copy is used without any network request.") from error


def pull_model(ref: RepoRef, cache_dir: str | Path | None = None) -> Path:
    """The snapshot folder of ``ref`` in the Hugging Face cache (``HF_HUB_CACHE``, or ``cache_dir``),
    downloading what is missing. Files already cached are not fetched again."""
    from huggingface_hub import snapshot_download

    with _hub_errors(ref, download_command(ref)):
        folder = Path(retrying(lambda: snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=cache_dir,
                                                         allow_patterns=list(PULL_PATTERNS), endpoint=hub_endpoint())))
    if not any(folder.glob("*.safetensors")):
        ggufs = _gguf_files(ref, cache_dir)
        if ggufs:
            raise FileNotFoundError(f"{ref} holds GGUF files, not safetensors weights: name one as "
                                    f"{ref.repo_id}:QUANT ({_choices(ggufs)})")
        raise FileNotFoundError(f"{ref} has no safetensors weights: quantkit never loads pickle weights "
                                "(.bin, .pt). Convert them with a tool you trust and publish safetensors.")
    return folder


def _gguf_files(ref: RepoRef, cache_dir: str | Path | None) -> list[str]:
    """The .gguf files of ``ref``: listed by the Hub, or offline, those in the cached snapshot."""
    from huggingface_hub import HfApi, constants, snapshot_download

    if constants.HF_HUB_OFFLINE:
        folder = Path(snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=["*.gguf"],
                                        cache_dir=cache_dir, local_files_only=True))
        return sorted(p.name for p in folder.glob("*.gguf"))
    files = HfApi(endpoint=hub_endpoint()).list_repo_files(ref.repo_id, revision=ref.revision)
    return sorted(f for f in files if f.endswith(".gguf"))


def _choices(files: list[str]) -> str:
    return "files: " + ", ".join(files)


def choose_gguf(ref: RepoRef, files: list[str]) -> str:
    """The one file of ``files`` that ``ref.gguf`` names (a file name, or a quantization type)."""
    if ref.gguf in files:
        return ref.gguf
    quant = re.compile(rf"(?:^|[-._]){re.escape(ref.gguf)}(?P<part>-\d{{5}}-of-\d{{5}})?\.gguf$", re.IGNORECASE)
    matching = [match for match in map(quant.search, files) if match]
    if matching and all(match["part"] for match in matching):
        raise ValueError(f"{ref} is a GGUF split into parts ({', '.join(m.string for m in matching)}); join them "
                         "with llama.cpp's `llama-gguf-split --merge` and use the joined file")
    if len(matching) != 1:
        found = "no GGUF file" if not matching else "several GGUF files"
        listed = _choices(files) if files else "the repository has no .gguf file"
        raise FileNotFoundError(f"{found} of {ref.repo_id} matches {ref.gguf!r} ({listed})")
    return matching[0].string


def pull_gguf(ref: RepoRef, cache_dir: str | Path | None = None) -> Path:
    """The GGUF file ``ref`` names, in the Hugging Face cache (downloaded if missing; only that file)."""
    from huggingface_hub import hf_hub_download

    name = ref.gguf
    revision = f" --revision {ref.revision}" if ref.revision else ""
    with _hub_errors(ref, f"hf download {ref.repo_id}{revision} --include '*{ref.gguf}*.gguf'"):
        if not name.endswith(".gguf"):
            name = choose_gguf(ref, retrying(lambda: _gguf_files(ref, cache_dir)))
        return Path(retrying(lambda: hf_hub_download(ref.repo_id, name, revision=ref.revision, cache_dir=cache_dir,
                                                     endpoint=hub_endpoint())))
