"""A protocol-level stand-in for the Hugging Face Hub, for tests: the real Hub is unreachable here.

It answers exactly the HTTP endpoints huggingface_hub 2.4.0 calls for what quantkit does, with the
Hub's status codes and headers, and keeps repositories in memory:

- publishing: ``POST /api/repos/create``, ``POST /api/models/{repo}/branch/{branch}``,
  ``GET /api/models/{repo}/tree/{rev}``, ``POST /api/validate-yaml``,
  ``POST /api/models/{repo}/preupload/{rev}`` (small files "regular", weights "lfs"), the Git LFS batch
  API ``POST /{repo}.git/info/lfs/objects/batch`` (basic transfer: one ``PUT`` per object, then a
  verify ``POST``; an object already held gets no upload action), and ``POST
  /api/models/{repo}/commit/{rev}`` (the ndjson commit);
- downloading: ``GET /api/models/{repo}/revision/{rev}`` (model info with the commit sha), the tree
  listing, and ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` with ``X-Repo-Commit``, ``ETag`` and, for
  large files, ``X-Linked-Etag``/``X-Linked-Size``: on a 307 redirect to a CDN address (Git LFS), or with
  Xet's headers (below);
- Xet (what huggingface_hub 2.4.0 uses for large files whenever hf_xet is installed, deciding on the client
  side, ``_commit_api._upload_files``): ``GET /api/models/{repo}/xet-write-token/{rev}`` and
  ``xet-read-token/{rev}`` grant a CAS token for one repository (JSON ``accessToken``/``exp``/``casUrl`` for
  hf_xet, the same as ``X-Xet-*`` headers for huggingface_hub); a ``resolve`` of a file stored through Xet
  adds ``X-Xet-Hash`` and a ``Link: <read-token url>; rel="xet-auth"``, so the client downloads it through
  Xet; the commit accepts an ``lfsFile`` whose SHA-256 is a file the repository's CAS verified. The CAS
  itself (xorbs, shards, reconstructions; ``XetCAS`` in tests/xet_cas.py) is served under ``/cas``.

With ``HF_HUB_DISABLE_XET`` set, the client takes the Git LFS path instead (tests/test_hub.py does, to check
that path); tests/test_hub_xet.py leaves Xet on, as users have it.

As strict as the Hub where a publish or a pull can meet it: repository names are checked by the Hub's
rules (400); a new repository's first commit holds the Hub's default ``.gitattributes``, which (with
the file's size and whether its first bytes are binary) decides what goes through LFS, and the commit
adds a rule for an LFS file no pattern covers; Git LFS objects belong to the repository they were
uploaded to; a commit whose ``parentCommit`` is no longer the branch's head is refused (412); the tree
listing comes in pages (``Link: <...>; rel="next"``, ``HubState.tree_page_size`` entries each); Git LFS
files upload to and download from another host (``localhost`` for ``127.0.0.1``), which refuses an
Authorization header as a signed URL's storage does; the card's front matter must parse and its keys
have the Hub's types. Faults are switched on per test: ``HubState.fail`` (any route, any status and
headers, e.g. 429 with ``Retry-After``) and ``HubState.before`` (run something, another writer's commit
say, before a route answers).

Nothing it receives is written to disk; ``auth_headers`` keeps the Authorization values in memory so a
test can check the token was sent.
"""
from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

import yaml

from xet_cas import XetCAS

LFS_THRESHOLD = 10 * 2**20  # the Hub stores larger files in LFS whatever their name

# -- the Hub's own rules (hubstrict) ---------------------------------------------------------------------
GITATTRIBUTES = ".gitattributes"
LFS_RULE = "filter=lfs diff=lfs merge=lfs -text"
# The patterns of the .gitattributes the Hub commits into every new model repository.
DEFAULT_LFS_PATTERNS = ("*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib", "*.lfs.*",
                        "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb",
                        "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors", "saved_model/**/*", "*.tar.*",
                        "*.tar", "*.tflite", "*.tgz", "*.wasm", "*.xz", "*.zip", "*.zst", "*tfevents*")
DEFAULT_GITATTRIBUTES = "".join(f"{pattern} {LFS_RULE}\n" for pattern in DEFAULT_LFS_PATTERNS).encode()
# One part of owner/name as the Hub accepts it: written independently of quantkit's validator, to check it.
HUB_NAME = re.compile(r"(?!.*(?:--|\.\.))(?![-.])[A-Za-z0-9_.-]{1,96}(?<![-.])", re.ASCII)
TREE_PAGE_SIZE = 4  # the Hub's is 1000; small here so that every listing a test makes comes in pages
CDN_PREFIX = "cdn-lfs"


def hub_name_error(owner: str, name: str) -> str | None:
    """Why the Hub would refuse ``owner/name`` as a repository name, or None."""
    if not (HUB_NAME.fullmatch(owner) and HUB_NAME.fullmatch(name)) or name.endswith(".git"):
        return f"Invalid repo name {owner}/{name}: letters, digits, '-', '_' and '.' only, at most 96 characters"
    return None


def lfs_patterns(gitattributes: bytes | None) -> list[str]:
    """The patterns a .gitattributes stores in LFS (``filter=lfs``)."""
    lines = (gitattributes or b"").decode().splitlines()
    return [line.split()[0] for line in lines if "filter=lfs" in line.split()[1:]]


def tracked_by(patterns: list[str], path: str) -> bool:
    """git's matching, as far as the Hub's patterns need it: a pattern without '/' matches the file's name."""
    return any(fnmatch.fnmatchcase(path if "/" in p else path.rsplit("/", 1)[-1], p) for p in patterns)


def is_binary(sample: bytes) -> bool:
    """git's own test for a binary file (a NUL byte among its first bytes), which the Hub applies to the
    sample huggingface_hub sends of each file."""
    return b"\0" in sample


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass
class StoredFile:
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def blob_id(self) -> str:
        return git_blob_id(lfs_pointer(self.sha256, len(self.data)) if self.lfs else self.data)

    def tree_entry(self, path: str) -> dict:
        entry = {"type": "file", "oid": self.blob_id, "size": len(self.data), "path": path}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": len(self.data),
                            "pointerSize": len(lfs_pointer(self.sha256, len(self.data)))}
        return entry


@dataclass
class Repo:
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit oid
    commits: dict[str, dict[str, StoredFile]] = field(default_factory=dict)  # oid -> path -> file
    lfs: dict[str, bytes] = field(default_factory=dict)  # its large-file objects, kept across failed commits

    def resolve(self, revision: str) -> str | None:
        return self.branches.get(revision) or (revision if revision in self.commits else None)


@dataclass
class Failure:
    """Answer ``count`` requests of ``kind`` (a route's handler name with '-' for '_': "lfs-upload",
    "create-repo", "model-info", "tree", "resolve", "commit", ...; for ``oid`` when given: a segment of
    the request's path) with ``status`` and ``headers``."""

    kind: str
    status: int
    count: int
    oid: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Interleaved:
    """Run ``action`` before answering each of the next ``count`` requests of ``kind``."""

    kind: str
    action: Callable[[], None]
    count: int


class HubState:
    def __init__(self, token: str):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.lfs_received: list[str] = []  # oid of every accepted upload, in order
        self.commit_payloads: list[list[dict]] = []
        self.requests: list[tuple[str, str]] = []  # (method, route kind)
        self.auth_headers: list[str] = []
        self.failures: list[Failure] = []
        self.interleaved: list[Interleaved] = []
        self.tree_page_size = TREE_PAGE_SIZE
        self.cdn_requests: list[tuple[str, str | None]] = []  # (path, Authorization) of every CDN download
        self.lock = threading.Lock()
        self._commit_counter = 0
        self.xet = XetCAS()  # Xet storage, per repository (tests/xet_cas.py)

    def fail(self, kind: str, status: int = 500, count: int = 1, oid: str | None = None,
             headers: dict[str, str] | None = None) -> None:
        self.failures.append(Failure(kind, status, count, oid, dict(headers or {})))

    def before(self, kind: str, action: Callable[[], None], count: int = 1) -> None:
        self.interleaved.append(Interleaved(kind, action, count))

    def injected(self, kind: str, segments: list[str] = ()) -> Failure | None:
        for failure in self.failures:
            if failure.kind == kind and failure.count > 0 and (failure.oid is None or failure.oid in segments):
                failure.count -= 1
                return failure
        return None

    def interleave(self, kind: str) -> None:
        for interleaved in self.interleaved:
            if interleaved.kind == kind and interleaved.count > 0:
                interleaved.count -= 1
                interleaved.action()

    def new_commit(self, repo: Repo, branch: str, files: dict[str, StoredFile]) -> str:
        self._commit_counter += 1
        oid = hashlib.sha1(f"commit {self._commit_counter} {sorted(files)}".encode()).hexdigest()
        repo.commits[oid] = files
        repo.branches[branch] = oid
        return oid


class _Handler(BaseHTTPRequestHandler):
    hub: HubState
    base_url: str
    storage_url: str  # the large-file storage: the same server under another host name, as S3 is to the Hub

    def log_message(self, format, *args):  # quiet: tests read the state, not a log
        pass

    # -- plumbing ---------------------------------------------------------------------------------
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, payload=None, headers: dict | None = None, body: bytes | None = None,
              head: bool = False) -> None:
        data = body if body is not None else (b"" if payload is None else json.dumps(payload).encode())
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        if body is None:
            self.send_header("Content-Type", "application/json")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def _error(self, status: int, code: str | None, message: str, headers: dict | None = None) -> None:
        header = message.encode("ascii", "backslashreplace").decode()  # a header is latin-1: keep it ASCII
        headers = {"X-Error-Message": header, **({"X-Error-Code": code} if code else {}), **(headers or {})}
        self._send(status, {"error": message}, headers, head=self.command == "HEAD")

    def _authorized(self) -> bool:
        value = self.headers.get("Authorization")
        if value:
            self.hub.auth_headers.append(value)
        return value == f"Bearer {self.hub.token}"

    def _segments(self) -> tuple[list[str], dict]:
        parts = urlsplit(self.path)
        return [unquote(s) for s in parts.path.strip("/").split("/")], parse_qs(parts.query)

    def _repo(self, repo_id: str, write: bool = False) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        authorized = self._authorized()
        if write and not authorized:
            self._error(401, None, "Invalid credentials in Authorization header")
            return None
        if repo is None or (repo.private and not authorized):
            self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
            return None
        return repo

    def _commit_of(self, repo_id: str, revision: str) -> tuple[Repo, str] | None:
        """The repository and the commit ``revision`` names in it, or None after answering the error."""
        repo = self._repo(repo_id)
        if repo is None:
            return None
        oid = repo.resolve(revision)
        if oid is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo, oid

    def _route(self, method: str) -> None:
        segments, query = self._segments()
        with self.hub.lock:
            for kind, matches, handler in ROUTES:
                if method in kind and matches(segments):
                    self.hub.requests.append((method, handler.__name__))
                    fault_kind = handler.__name__.replace("_", "-")
                    self.hub.interleave(fault_kind)
                    failure = self.hub.injected(fault_kind, segments)
                    if failure is not None:
                        self._body()  # read what was sent, as a server does before it answers
                        return self._error(failure.status, None, f"simulated {failure.status} answer",
                                           failure.headers)
                    return handler(self, segments, query)
        self._error(404, None, f"no route for {method} {self.path}")

    def do_GET(self):
        self._route("GET")

    def do_HEAD(self):
        self._route("HEAD")

    def do_POST(self):
        self._route("POST")

    def do_PUT(self):
        self._route("PUT")

    # -- repositories -----------------------------------------------------------------------------
    def create_repo(self, segments, query):
        payload = json.loads(self._body())
        if not self._authorized():
            return self._error(401, None, "Invalid credentials in Authorization header")
        repo_id = f"{payload['organization']}/{payload['name']}"
        invalid = hub_name_error(payload["organization"], payload["name"])
        if invalid:
            return self._error(400, None, invalid)
        if repo_id in self.hub.repos:  # huggingface_hub reads the url from the 409 answer too
            return self._send(409, {"error": "You already created this model repo",
                                    "url": f"{self.base_url}/{repo_id}"})
        repo = self.hub.repos[repo_id] = Repo(private=payload.get("visibility") == "private")
        self.hub.new_commit(repo, "main", {GITATTRIBUTES: StoredFile(DEFAULT_GITATTRIBUTES, lfs=False)})
        self._send(200, {"url": f"{self.base_url}/{repo_id}", "name": repo_id})

    def create_branch(self, segments, query):
        self._body()
        repo = self._repo(f"{segments[2]}/{segments[3]}", write=True)
        if repo is None:
            return
        branch = segments[5]
        if branch in repo.branches:
            return self._error(409, None, f"Branch {branch} already exists")
        repo.branches[branch] = repo.branches["main"]
        self._send(200, {})

    def model_info(self, segments, query):
        repo_id = f"{segments[2]}/{segments[3]}"
        found = self._commit_of(repo_id, segments[5] if len(segments) > 5 else "main")
        if found is None:
            return
        repo, oid = found
        siblings = [{"rfilename": path} for path in sorted(repo.commits[oid])]
        self._send(200, {"id": repo_id, "modelId": repo_id, "sha": oid, "private": repo.private, "siblings": siblings,
                         "tags": [], "downloads": 0, "likes": 0})

    def tree(self, segments, query):
        found = self._commit_of(f"{segments[2]}/{segments[3]}", segments[5])
        if found is None:
            return
        repo, oid = found
        files = repo.commits[oid]
        start = int(query.get("cursor", ["0"])[0])
        page = sorted(files)[start:start + self.hub.tree_page_size]
        headers = {}
        if start + len(page) < len(files):  # the Hub's cursor pages, announced as GitHub's API does
            following = urlencode({**{k: v[0] for k, v in query.items()}, "cursor": start + len(page)})
            headers["Link"] = f'<{self.base_url}{urlsplit(self.path).path}?{following}>; rel="next"'
        self._send(200, [files[path].tree_entry(path) for path in page], headers)

    def validate_yaml(self, segments, query):
        content = json.loads(self._body())["content"]
        try:
            front = content.split("---\n")[1] if content.startswith("---\n") else ""
            errors = card_metadata_errors(yaml.safe_load(front))
        except (yaml.YAMLError, IndexError) as error:
            errors = [f"Invalid YAML in the metadata: {error}"]
        self._send(400 if errors else 200, {"errors": [{"message": e} for e in errors], "warnings": []})

    # -- uploads ----------------------------------------------------------------------------------
    def preupload(self, segments, query):
        payload = json.loads(self._body())
        repo = self._repo(f"{segments[2]}/{segments[3]}", write=True)
        if repo is None:
            return
        current = repo.commits.get(repo.resolve(segments[5]) or "", {})
        patterns = lfs_patterns(current[GITATTRIBUTES].data if GITATTRIBUTES in current else None)
        answers = []
        for entry in payload["files"]:
            lfs = (tracked_by(patterns, entry["path"]) or entry["size"] > LFS_THRESHOLD
                   or is_binary(base64.b64decode(entry["sample"])))
            held = current.get(entry["path"])
            remote_oid = None if held is None else (held.sha256 if held.lfs else git_blob_id(held.data))
            answers.append({"path": entry["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                            "oid": remote_oid})
        self._send(200, {"files": answers, "commitOid": repo.resolve(segments[5])})

    def lfs_batch(self, segments, query):
        payload = json.loads(self._body())
        repo = self._repo(f"{segments[0]}/{segments[1].removesuffix('.git')}", write=True)
        if repo is None:
            return
        objects = []
        repo_path = f"{segments[0]}/{segments[1].removesuffix('.git')}"
        for obj in payload["objects"]:
            answer = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in repo.lfs:  # this repository's objects: another's are no use to it
                answer["actions"] = {"upload": {"href": f"{self.storage_url}/lfs-upload/{repo_path}/{obj['oid']}"},
                                     "verify": {"href": f"{self.base_url}/lfs-verify/{repo_path}/{obj['oid']}"}}
            objects.append(answer)
        self._send(200, {"transfer": "basic", "objects": objects})

    def lfs_upload(self, segments, query):
        oid = segments[3]
        data = self._body()
        if hashlib.sha256(data).hexdigest() != oid:
            return self._error(400, None, "content does not match its oid")
        self.hub.repos[f"{segments[1]}/{segments[2]}"].lfs[oid] = data
        self.hub.lfs_received.append(oid)
        self._send(200, body=b"")

    def lfs_verify(self, segments, query):
        payload = json.loads(self._body())
        held = self.hub.repos[f"{segments[1]}/{segments[2]}"].lfs.get(payload["oid"])
        if held is None or len(held) != payload["size"]:
            return self._error(404, None, "object not found")
        self._send(200, {})

    def commit(self, segments, query):
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        repo_id = f"{segments[2]}/{segments[3]}"
        repo = self._repo(repo_id, write=True)
        if repo is None:
            return
        branch = segments[5]
        if branch not in repo.branches:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {branch}")
        parent = next((line["value"].get("parentCommit") for line in lines if line["key"] == "header"), None)
        if parent is not None and parent != repo.branches[branch]:
            return self._error(412, None, f"Parent commit {parent} is not the head of {branch} "
                                          f"({repo.branches[branch]}): the branch moved since")
        files = dict(repo.commits[repo.branches[branch]])
        for line in lines:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = StoredFile(base64.b64decode(value["content"]), lfs=False)
            elif line["key"] == "lfsFile":  # its content arrived through Git LFS or through Xet, to this repository
                data = repo.lfs.get(value["oid"], self.hub.xet.file_bytes(repo_id, value["oid"]))
                if data is None:
                    return self._error(422, None, f"large file {value['oid']} was never uploaded to this repository")
                files[value["path"]] = StoredFile(data, lfs=True)
            elif line["key"] == "deletedFile":
                files.pop(value["path"], None)
        track_new_lfs_paths(files)
        self.hub.commit_payloads.append(lines)
        oid = self.hub.new_commit(repo, branch, files)
        self._send(200, {"commitUrl": f"{self.base_url}/{segments[2]}/{segments[3]}/commit/{oid}",
                         "commitOid": oid, "pullRequestUrl": None})

    # -- downloads --------------------------------------------------------------------------------
    def resolve(self, segments, query):
        found = self._commit_of(f"{segments[0]}/{segments[1]}", segments[3])
        if found is None:
            return
        repo, oid = found
        path = "/".join(segments[4:])
        stored = repo.commits[oid].get(path)
        if stored is None:
            return self._error(404, "EntryNotFound", f"{path} does not exist")
        headers = {"X-Repo-Commit": oid, "ETag": f'"{stored.blob_id}"', "Accept-Ranges": "bytes"}
        if stored.lfs:
            headers.update({"X-Linked-Etag": f'"{stored.sha256}"', "X-Linked-Size": str(len(stored.data))})
            xet = self._xet_headers(f"{segments[0]}/{segments[1]}", oid, stored)
            if not xet:  # a Git LFS object: from the storage's host
                return self._redirect_to_cdn(f"{segments[0]}/{segments[1]}", stored, headers)
            headers.update(xet)
        self._send_range(stored.data, headers)

    def _send_range(self, data: bytes, headers: dict) -> None:
        start = int(self.headers.get("Range", "bytes=0-").removeprefix("bytes=").split("-")[0] or 0)
        self._send(206 if start else 200, headers=headers, body=data[start:], head=self.command == "HEAD")

    # -- large files from the CDN (hubstrict) -----------------------------------------------------
    def _redirect_to_cdn(self, repo_id: str, stored: StoredFile, headers: dict) -> None:
        """The Hub answers a large file's resolve with a redirect to its storage's signed address, and the
        file's metadata on the redirect itself; the storage is another host."""
        headers["Location"] = f"{self.storage_url}/{CDN_PREFIX}/{repo_id}/{stored.sha256}?signature=stand-in"
        self._send(307, headers=headers, body=b"", head=self.command == "HEAD")

    def cdn(self, segments, query):
        """A signed address: it carries its own authorization, and the storage refuses a second one (as S3
        refuses a request with both); it serves only objects of the repository it was signed for."""
        authorization = self.headers.get("Authorization")
        self.hub.cdn_requests.append(("/".join(segments), authorization))
        if authorization is not None:
            return self._error(400, None, "Only one auth mechanism allowed")
        repo = self.hub.repos.get(f"{segments[1]}/{segments[2]}")
        data = None if repo is None else repo.lfs.get(segments[3])
        if data is None:
            return self._error(403, None, "Access denied")
        self._send_range(data, {"Accept-Ranges": "bytes", "ETag": f'"{segments[3]}"'})

    # -- Xet: the Hub grants tokens and names files by Xet hash; the CAS (tests/xet_cas.py) stores --------------
    def xet_token(self, segments, query):
        """``xet-write-token``/``xet-read-token``: a CAS token for one repository, as JSON (read by hf_xet) and
        as ``X-Xet-*`` headers (read by huggingface_hub before a download)."""
        repo_id, write = f"{segments[2]}/{segments[3]}", segments[4] == "xet-write-token"
        repo = self._repo(repo_id, write=write)
        if repo is None:
            return
        if repo.resolve(segments[5]) is None and not write:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {segments[5]}")
        grant = self.hub.xet.grant(repo_id, write, f"{self.base_url}/cas")
        self._send(200, grant, {"X-Xet-Cas-Url": grant["casUrl"], "X-Xet-Access-Token": grant["accessToken"],
                                "X-Xet-Token-Expiration": str(grant["exp"])})

    def _xet_headers(self, repo_id: str, commit: str, stored: StoredFile) -> dict:
        """A file stored through Xet is downloaded through Xet: its hash and where to get a read token."""
        xet_hash = self.hub.xet.file_of(repo_id, stored.sha256)
        if xet_hash is None:
            return {}
        refresh = f"{self.base_url}/api/models/{repo_id}/xet-read-token/{commit}"
        return {"X-Xet-Hash": xet_hash, "Link": f'<{refresh}>; rel="xet-auth"'}

    def xet_cas(self, segments, query):
        status, body, headers = self.hub.xet.serve(self.command, segments[1:], query, self.headers, self._body(),
                                                   f"{self.base_url}/cas")
        self._send(status, headers=headers, body=body)


def _api(*shape):
    """A matcher for /api/models/{owner}/{name}/<shape...> (``None`` matches any one segment, ``...`` the rest)."""
    def matches(segments):
        rest = segments[4:]
        if segments[:2] != ["api", "models"] or len(segments) < 4:
            return False
        if shape and shape[-1] is ...:
            return len(rest) >= len(shape) - 1 and all(s is None or s == r for s, r in zip(shape[:-1], rest))
        return len(rest) == len(shape) and all(s is None or s == r for s, r in zip(shape, rest))
    return matches


ROUTES = (
    ("POST", lambda s: s == ["api", "repos", "create"], _Handler.create_repo),
    ("POST", lambda s: s == ["api", "validate-yaml"], _Handler.validate_yaml),
    ("POST", _api("branch", None), _Handler.create_branch),
    ("POST", _api("preupload", None), _Handler.preupload),
    ("POST", _api("commit", None), _Handler.commit),
    ("GET", _api(), _Handler.model_info),
    ("GET", _api("revision", None), _Handler.model_info),
    ("GET", _api("tree", None, ...), _Handler.tree),
    ("POST", lambda s: len(s) == 6 and s[1].endswith(".git") and s[2:] == ["info", "lfs", "objects", "batch"],
     _Handler.lfs_batch),
    ("PUT", lambda s: len(s) == 4 and s[0] == "lfs-upload", _Handler.lfs_upload),
    ("POST", lambda s: len(s) == 4 and s[0] == "lfs-verify", _Handler.lfs_verify),
    ("GET HEAD", lambda s: len(s) >= 5 and s[2] == "resolve", _Handler.resolve),
    ("GET", _api("xet-write-token", None), _Handler.xet_token),
    ("GET", _api("xet-read-token", None), _Handler.xet_token),
    ("GET POST", lambda s: s[0] == "cas", _Handler.xet_cas),
    ("GET HEAD", lambda s: len(s) == 4 and s[0] == CDN_PREFIX, _Handler.cdn),
)


# -- the Hub's checks of what it is sent (hubstrict) -----------------------------------------------------
# The card's front matter keys the Hub checks, and the form each must have.
STRING, STRINGS, EITHER = "a string", "a list of strings", "a string or a list of strings"
CARD_KEYS = {"license": STRING, "library_name": STRING, "pipeline_tag": STRING, "base_model_relation": STRING,
             "language": EITHER, "base_model": EITHER, "tags": STRINGS}


def card_metadata_errors(metadata) -> list[str]:
    """What the Hub says is wrong with a card's front matter (empty: nothing)."""
    if metadata is None:
        return []
    if not isinstance(metadata, dict):
        return ["The metadata must be a YAML mapping"]
    errors = []
    for key, form in CARD_KEYS.items():
        value = metadata.get(key)
        if value is None:
            continue
        is_list = isinstance(value, list) and all(isinstance(item, str) for item in value)
        if not {STRING: isinstance(value, str), STRINGS: is_list, EITHER: isinstance(value, str) or is_list}[form]:
            errors.append(f'"{key}" must be {form}')
    models = metadata.get("base_model") or []
    for model in models if isinstance(models, list) else [models]:
        if isinstance(model, str) and (model.count("/") != 1 or hub_name_error(*model.split("/"))):
            errors.append(f'"base_model" {model!r} is not a valid model id')
    return errors


def track_new_lfs_paths(files: dict[str, StoredFile]) -> None:
    """What the Hub's commit does for an LFS file no .gitattributes pattern covers (one stored in LFS for
    its size or its binary bytes): it adds the file's own path to .gitattributes, in the same commit."""
    held = files.get(GITATTRIBUTES)
    patterns = lfs_patterns(held.data if held else None)
    missing = [path for path, stored in sorted(files.items()) if stored.lfs and not tracked_by(patterns, path)]
    if missing:
        text = (held.data if held else b"") + "".join(f"{path} {LFS_RULE}\n" for path in missing).encode()
        files[GITATTRIBUTES] = StoredFile(text, lfs=False)


class HubServer:
    """The stand-in, serving on 127.0.0.1 from a thread: ``with HubServer(token) as hub: hub.url, hub.state``."""

    def __init__(self, token: str):
        self.state = HubState(token)
        handler = type("Handler", (_Handler,), {"hub": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        handler.base_url = self.url
        handler.storage_url = self.url.replace("127.0.0.1", "localhost")
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def seed(self, repo_id: str, files: dict[str, StoredFile]) -> None:
        """A public repository holding ``files`` on main, as if someone had pushed them."""
        repo = self.state.repos[repo_id] = Repo(private=False)
        repo.lfs.update({stored.sha256: stored.data for stored in files.values() if stored.lfs})
        self.state.new_commit(repo, "main", dict(files))

    def push(self, repo_id: str, changes: dict[str, StoredFile], branch: str = "main") -> str:
        """Another writer's commit on ``branch``: ``changes`` on top of its head."""
        repo = self.state.repos[repo_id]
        for stored in changes.values():
            if stored.lfs:
                repo.lfs[stored.sha256] = stored.data
        return self.state.new_commit(repo, branch, {**repo.commits[repo.branches[branch]], **changes})

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.state.repos[repo_id]
        return {path: stored.data for path, stored in repo.commits[repo.branches[revision]].items()}
