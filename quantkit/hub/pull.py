"""A Hub model repository brought into huggingface_hub's cache: what quantkit reads, nothing else.

Only weights in safetensors, configs, tokenizer files, chat templates and the model card (which
carries the licence a published artifact inherits) are fetched: never pickle weights (``*.bin``,
``*.pt``), which can run code when loaded, and never Python files, so no remote code can run.
With ``HF_HUB_OFFLINE=1`` the cached snapshot is used without any network request.
"""
from __future__ import annotations

from pathlib import Path

from quantkit.hub.repo import RepoRef, hub_endpoint

PULL_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.json", "*.jinja", "tokenizer.model", "*.tiktoken",
                 "merges.txt", "vocab.txt", "README.md")


def download_command(ref: RepoRef) -> str:
    """The shell command that fills the cache with what :func:`pull_model` reads."""
    revision = f" --revision {ref.revision}" if ref.revision else ""
    includes = " ".join(f"--include '{pattern}'" for pattern in PULL_PATTERNS)
    return f"hf download {ref.repo_id}{revision} {includes}"


def pull_model(ref: RepoRef, cache_dir: str | Path | None = None) -> Path:
    """The snapshot folder of ``ref`` in the Hugging Face cache (``HF_HUB_CACHE``, or ``cache_dir``),
    downloading what is missing. Files already cached are not fetched again."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        folder = Path(snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=list(PULL_PATTERNS),
                                        cache_dir=cache_dir, endpoint=hub_endpoint()))
    except RevisionNotFoundError as error:
        raise FileNotFoundError(f"{ref.repo_id} has no revision {ref.revision!r} on {hub_endpoint()}") from error
    except RepositoryNotFoundError as error:
        raise FileNotFoundError(f"no model repository {ref.repo_id} on {hub_endpoint()} (for a private or gated "
                                "one, set HF_TOKEN or run `hf auth login`)") from error
    except LocalEntryNotFoundError as error:
        raise RuntimeError(
            f"{ref} is not in the Hugging Face cache and the Hub cannot be reached ({error.__class__.__name__}). "
            f"Where there is network, download it with\n  {download_command(ref)}\nthen run again; with "
            "HF_HUB_OFFLINE=1 the cached copy is used without any network request.") from error
    if not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"{ref} has no safetensors weights: quantkit never loads pickle weights "
                                "(.bin, .pt). Convert them with a tool you trust and publish safetensors.")
    return folder
