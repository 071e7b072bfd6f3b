"""Publishing an artifact directory or a GGUF file to a Hub model repository, idempotently.

Order: check the artifact (nothing is sent for one that fails), render the card, find the token,
create the repository if needed, list what the revision already holds, and send only the files
that are missing or differ (by the SHA-256 of large-file objects, the git blob id of small ones), in
one commit through huggingface_hub (``HfApi.create_commit``: pre-upload, large files through the
Hub's large-file path, then the commit). An interrupted run commits nothing; run it again and the
large-file objects the Hub already received are not sent again.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.hub.card import artifact_card, base_model_of, gguf_base_model, gguf_card, load_report
from quantkit.hub.check import CARD_FILE, CheckedArtifact, CheckedGGUF, check_artifact, check_gguf
from quantkit.hub.repo import (
    DEFAULT_REVISION,
    RATE_LIMITED,
    RETRY_TRIES,
    STALE_PARENT,
    TOKEN_HELP,
    HubError,
    RepoRef,
    check_repo_id,
    hub_endpoint,
    hub_response,
    hub_token,
    retry_after,
    retrying,
)

# What happens to each file: the plan's vocabulary.
UPLOAD, UNCHANGED, NOT_CONSULTED = "upload", "unchanged", "upload (remote not consulted: dry run)"
_REFUSED_TOKEN = "the Hub refused the token for {repo}: " + TOKEN_HELP
# What a run that stopped on each answer of the Hub says (the fields: _stopped's), else _FAILED.
_ANSWERS = {
    401: _REFUSED_TOKEN,
    403: _REFUSED_TOKEN,
    400: "the Hub refused to publish {ref}: {error}. Nothing was committed.",
    RATE_LIMITED: "the Hub still answers 429 Too Many Requests to publishing {ref} after {tries} attempts (it asks to "
                  "wait {wait} s). Nothing was committed: wait, then run the same command again.",
    STALE_PARENT: "the branch {revision} of {repo} moved under each of {tries} attempts to publish (412 Precondition "
                  "Failed: another writer commits to it). Nothing was committed: run the same command again.",
}
_FAILED = ("publishing to {ref} on {endpoint} failed, nothing was committed ({error}). Run the same command again: "
           "it sends only what the Hub does not hold yet.")


@dataclass(frozen=True)
class PlannedFile:
    path_in_repo: str
    size: int
    sha256: str
    action: str
    source: Path | bytes = field(repr=False, compare=False)


@dataclass
class Publication:
    """The plan (``--dry-run``) or what a run did: every file with its action, and the commit made."""

    repo_id: str
    revision: str
    private: bool
    card: str
    files: list[PlannedFile]
    notes: list[str]
    dry_run: bool
    commit: str | None = None
    commit_url: str | None = None

    @property
    def sent(self) -> list[PlannedFile]:
        return [f for f in self.files if f.action == UPLOAD]

    def to_dict(self) -> dict:
        files = [{k: v for k, v in asdict(f).items() if k != "source"} for f in self.files]
        return {"repo_id": self.repo_id, "revision": self.revision, "private": self.private, "dry_run": self.dry_run,
                "files": files, "notes": self.notes, "commit": self.commit, "commit_url": self.commit_url}


def _card_file(card: str) -> PlannedFile:
    data = card.encode("utf-8")
    return PlannedFile(CARD_FILE, len(data), hashlib.sha256(data).hexdigest(), UPLOAD, data)


def check(target: Path, ref: RepoRef) -> CheckedArtifact | CheckedGGUF:
    """``target`` checked: a .gguf file, or an artifact directory."""
    return check_gguf(target, ref.name) if target.suffix == ".gguf" else check_artifact(target)


def render_card(checked: CheckedArtifact | CheckedGGUF, ref: RepoRef, base_model: str | None = None,
                report: Path | None = None, remote_ggufs: list[tuple[str, int]] = ()) -> str:
    """The README.md of ``ref`` for ``checked`` (``remote_ggufs``: the GGUF files the repository holds)."""
    if isinstance(checked, CheckedGGUF):
        return gguf_card(checked, ref, gguf_base_model(checked, base_model), list(remote_ggufs))
    return artifact_card(checked, ref, base_model_of(checked, base_model), load_report(report, checked.directory))


def _planned(checked: CheckedArtifact | CheckedGGUF, card: str) -> list[PlannedFile]:
    local = [checked.file] if isinstance(checked, CheckedGGUF) else checked.files
    return [_card_file(card)] + [PlannedFile(f.path_in_repo, f.size, f.sha256, UPLOAD, f.path) for f in local]


def _remote_files(api, repo_id: str, commit: str) -> dict:
    """path -> RepoFile of what ``commit`` holds (every page of the Hub's listing)."""
    from huggingface_hub import RepoFile

    return {f.path: f for f in api.list_repo_tree(repo_id, revision=commit, recursive=True) if isinstance(f, RepoFile)}


def _unchanged(planned: PlannedFile, remote) -> bool:
    """The remote file has these bytes: same large-file SHA-256, or same git blob id for a small file."""
    from huggingface_hub.utils.sha import git_hash

    if remote is None or remote.size != planned.size:
        return False
    if remote.lfs is not None:
        return remote.lfs.sha256 == planned.sha256
    data = planned.source if isinstance(planned.source, bytes) else planned.source.read_bytes()
    return remote.blob_id == git_hash(data)


def _operation(planned: PlannedFile):
    from huggingface_hub import CommitOperationAdd

    source = planned.source if isinstance(planned.source, bytes) else str(planned.source)
    operation = CommitOperationAdd(path_in_repo=planned.path_in_repo, path_or_fileobj=source)
    operation.upload_info.sha256 = bytes.fromhex(planned.sha256)  # already computed by the check: not again
    return operation


def _send(api, checked: CheckedArtifact | CheckedGGUF, ref: RepoRef, revision: str, private: bool, notes: list[str],
          card_for) -> Publication:
    """One attempt: compare with what the branch's head commit holds, and commit what differs on top of that
    commit only (``parent_commit``): when another writer moved the branch in between, the Hub answers 412
    and nothing is committed, so the next attempt compares again instead of keeping a file the other
    commit changed. Safe to repeat: the repository and branch are created if missing, and large-file
    objects the Hub already holds are not sent again."""
    api.create_repo(ref.repo_id, private=private, exist_ok=True)
    if revision != DEFAULT_REVISION:
        api.create_branch(ref.repo_id, branch=revision, exist_ok=True)
    head = api.model_info(ref.repo_id, revision=revision).sha
    remote = _remote_files(api, ref.repo_id, head)
    card = card_for([(path, f.size) for path, f in remote.items() if path.endswith(".gguf")])
    files = [PlannedFile(f.path_in_repo, f.size, f.sha256, UNCHANGED if _unchanged(f, remote.get(f.path_in_repo))
                         else UPLOAD, f.source) for f in _planned(checked, card)]
    publication = Publication(ref.repo_id, revision, private, card, files, notes, dry_run=False)
    if publication.sent:
        commit = api.create_commit(ref.repo_id, [_operation(f) for f in publication.sent], revision=revision,
                                   parent_commit=head,
                                   commit_message=f"quantkit publish: {len(publication.sent)} files")
        publication.commit, publication.commit_url = commit.oid, commit.commit_url
    return publication


def _stopped(error: Exception, ref: RepoRef, revision: str) -> HubError:
    """A run that stopped on ``error``, in one line saying what to do."""
    response = hub_response(error)
    status = None if response is None else response.status_code
    if status in (401, 403) and not str(response.request.url).startswith(hub_endpoint()):
        status = None  # the large-file storage's refusal (an expired upload address, say) says nothing of the token
    wait = retry_after(response) if status == RATE_LIMITED else None
    return HubError(_ANSWERS.get(status, _FAILED).format(
        repo=ref.repo_id, ref=ref, revision=revision, endpoint=hub_endpoint(), tries=RETRY_TRIES, wait=wait,
        error=" ".join(str(error).split())))


def publish(target: str | Path, ref: RepoRef, *, base_model: str | None = None, report: str | Path | None = None,
            private: bool = False, dry_run: bool = False) -> Publication:
    """Publish ``target`` (an artifact directory or a .gguf file) to ``ref``; ``dry_run`` checks and
    plans without any network request. The Hub's 429 (rate limit) and 412 (the branch moved under the
    commit) repeat the attempt (:func:`quantkit.hub.repo.retrying`)."""
    from httpx2 import HTTPError  # huggingface_hub 2.x's HTTP client
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    target, report = Path(target), Path(report) if report else None
    check_repo_id(ref.repo_id)  # a RepoRef made in Python skips parse_repo_ref
    if base_model is not None:
        check_repo_id(base_model)
    if ref.gguf is not None:
        raise ValueError(f"publish to a repository ({ref.repo_id}), not to one file of it (:{ref.gguf}): a GGUF "
                         "file's name in the repository follows from the file")
    revision = ref.revision or DEFAULT_REVISION
    checked = check(target, ref)  # nothing is read from or sent to the Hub for an artifact that fails
    notes = [] if isinstance(checked, CheckedGGUF) else list(checked.notes)
    if dry_run:
        card = render_card(checked, ref, base_model, report)
        try:
            hub_token()
        except RuntimeError as missing:
            notes.append(f"a real run would stop here: {missing}")
        files = [PlannedFile(f.path_in_repo, f.size, f.sha256, NOT_CONSULTED, f.source)
                 for f in _planned(checked, card)]
        return Publication(ref.repo_id, revision, private, card, files, notes, dry_run=True)

    card = render_card(checked, ref, base_model, report)  # fails on a bad --base-model or report before sending

    def card_for(ggufs: list[tuple[str, int]]) -> str:  # a GGUF repository's card lists every type it holds
        return render_card(checked, ref, base_model, report, ggufs) if ggufs else card

    api = HfApi(endpoint=hub_endpoint(), token=hub_token())
    try:
        return retrying(lambda: _send(api, checked, ref, revision, private, notes, card_for),
                        (RATE_LIMITED, STALE_PARENT))
    except (HfHubHTTPError, HTTPError, RuntimeError, OSError, ValueError) as error:  # HTTP, transport, upload thread
        if isinstance(error, QuantkitError) or (isinstance(error, ValueError) and hub_response(error) is None):
            raise  # quantkit's own error, already one line
        raise _stopped(error, ref, revision) from error
