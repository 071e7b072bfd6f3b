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
  large files, ``X-Linked-Etag``/``X-Linked-Size``;
- Xet (what huggingface_hub 2.4.0 uses for large files whenever hf_xet is installed, deciding on the client
  side, ``_commit_api._upload_files``): ``GET /api/models/{repo}/xet-write-token/{rev}`` and
  ``xet-read-token/{rev}`` grant a CAS token for one repository (JSON ``accessToken``/``exp``/``casUrl`` for
  hf_xet, the same as ``X-Xet-*`` headers for huggingface_hub); a ``resolve`` of a file stored through Xet
  adds ``X-Xet-Hash`` and a ``Link: <read-token url>; rel="xet-auth"``, so the client downloads it through
  Xet; the commit accepts an ``lfsFile`` whose SHA-256 is a file the repository's CAS verified. The CAS
  itself (xorbs, shards, reconstructions; ``XetCAS`` in tests/xet_cas.py) is served under ``/cas``.

With ``HF_HUB_DISABLE_XET`` set, the client takes the Git LFS path instead (tests/test_hub.py does, to check
that path); tests/test_hub_xet.py leaves Xet on, as users have it.

Nothing it receives is written to disk; ``auth_headers`` keeps the Authorization values in memory so a
test can check the token was sent.
"""
from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

from xet_cas import XetCAS

LFS_SUFFIXES = (".safetensors", ".gguf")
LFS_THRESHOLD = 10 * 2**20  # the Hub stores larger files in LFS whatever their name


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

    def resolve(self, revision: str) -> str | None:
        return self.branches.get(revision) or (revision if revision in self.commits else None)


@dataclass
class Failure:
    """Answer ``count`` requests of ``kind`` (for ``oid``, when given) with ``status``."""

    kind: str
    status: int
    count: int
    oid: str | None = None


class HubState:
    def __init__(self, token: str):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}  # kept across failed commits, as on the Hub
        self.lfs_received: list[str] = []  # oid of every accepted upload, in order
        self.commit_payloads: list[list[dict]] = []
        self.requests: list[tuple[str, str]] = []  # (method, route kind)
        self.auth_headers: list[str] = []
        self.failures: list[Failure] = []
        self.lock = threading.Lock()
        self._commit_counter = 0
        self.xet = XetCAS()  # Xet storage, per repository (tests/xet_cas.py)

    def fail(self, kind: str, status: int = 500, count: int = 1, oid: str | None = None) -> None:
        self.failures.append(Failure(kind, status, count, oid))

    def injected(self, kind: str, oid: str | None = None) -> int | None:
        for failure in self.failures:
            if failure.kind == kind and failure.count > 0 and failure.oid in (None, oid):
                failure.count -= 1
                return failure.status
        return None

    def new_commit(self, repo: Repo, branch: str, files: dict[str, StoredFile]) -> str:
        self._commit_counter += 1
        oid = hashlib.sha1(f"commit {self._commit_counter} {sorted(files)}".encode()).hexdigest()
        repo.commits[oid] = files
        repo.branches[branch] = oid
        return oid


class _Handler(BaseHTTPRequestHandler):
    hub: HubState
    base_url: str

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

    def _error(self, status: int, code: str | None, message: str) -> None:
        headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {})}
        self._send(status, {"error": message}, headers)

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
        if repo_id in self.hub.repos:  # huggingface_hub reads the url from the 409 answer too
            return self._send(409, {"error": "You already created this model repo",
                                    "url": f"{self.base_url}/{repo_id}"})
        repo = self.hub.repos[repo_id] = Repo(private=payload.get("visibility") == "private")
        self.hub.new_commit(repo, "main", {})
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
        self._send(200, [files[path].tree_entry(path) for path in sorted(files)])

    def validate_yaml(self, segments, query):
        content = json.loads(self._body())["content"]
        try:
            front = content.split("---\n")[1] if content.startswith("---\n") else ""
            yaml.safe_load(front)
        except (yaml.YAMLError, IndexError) as error:
            return self._send(400, {"errors": [{"message": str(error)}], "warnings": []})
        self._send(200, {"errors": [], "warnings": []})

    # -- uploads ----------------------------------------------------------------------------------
    def preupload(self, segments, query):
        payload = json.loads(self._body())
        repo = self._repo(f"{segments[2]}/{segments[3]}", write=True)
        if repo is None:
            return
        current = repo.commits.get(repo.resolve(segments[5]) or "", {})
        answers = []
        for entry in payload["files"]:
            lfs = entry["path"].endswith(LFS_SUFFIXES) or entry["size"] > LFS_THRESHOLD
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
        for obj in payload["objects"]:
            answer = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.hub.lfs_objects:
                answer["actions"] = {"upload": {"href": f"{self.base_url}/lfs-upload/{obj['oid']}"},
                                     "verify": {"href": f"{self.base_url}/lfs-verify/{obj['oid']}"}}
            objects.append(answer)
        self._send(200, {"transfer": "basic", "objects": objects})

    def lfs_upload(self, segments, query):
        oid = segments[1]
        data = self._body()
        status = self.hub.injected("lfs-upload", oid)
        if status is not None:
            return self._error(status, None, "simulated failure of the storage backend")
        if hashlib.sha256(data).hexdigest() != oid:
            return self._error(400, None, "content does not match its oid")
        self.hub.lfs_objects[oid] = data
        self.hub.lfs_received.append(oid)
        self._send(200, body=b"")

    def lfs_verify(self, segments, query):
        payload = json.loads(self._body())
        held = self.hub.lfs_objects.get(payload["oid"])
        if held is None or len(held) != payload["size"]:
            return self._error(404, None, "object not found")
        self._send(200, {})

    def commit(self, segments, query):
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        repo_id = f"{segments[2]}/{segments[3]}"
        repo = self._repo(repo_id, write=True)
        if repo is None:
            return
        status = self.hub.injected("commit")
        if status is not None:
            return self._error(status, None, "simulated failure of the commit")
        branch = segments[5]
        if branch not in repo.branches:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {branch}")
        files = dict(repo.commits[repo.branches[branch]])
        for line in lines:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = StoredFile(base64.b64decode(value["content"]), lfs=False)
            elif line["key"] == "lfsFile":  # its content arrived through Git LFS or through Xet
                data = self.hub.lfs_objects.get(value["oid"], self.hub.xet.file_bytes(repo_id, value["oid"]))
                if data is None:
                    return self._error(422, None, f"large file {value['oid']} was never uploaded")
                files[value["path"]] = StoredFile(data, lfs=True)
            elif line["key"] == "deletedFile":
                files.pop(value["path"], None)
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
            headers.update(self._xet_headers(f"{segments[0]}/{segments[1]}", oid, stored))
        start = int(self.headers.get("Range", "bytes=0-").removeprefix("bytes=").split("-")[0] or 0)
        self._send(206 if start else 200, headers=headers, body=stored.data[start:], head=self.command == "HEAD")

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
    ("PUT", lambda s: len(s) == 2 and s[0] == "lfs-upload", _Handler.lfs_upload),
    ("POST", lambda s: len(s) == 2 and s[0] == "lfs-verify", _Handler.lfs_verify),
    ("GET HEAD", lambda s: len(s) >= 5 and s[2] == "resolve", _Handler.resolve),
    ("GET", _api("xet-write-token", None), _Handler.xet_token),
    ("GET", _api("xet-read-token", None), _Handler.xet_token),
    ("GET POST", lambda s: s[0] == "cas", _Handler.xet_cas),
)


class HubServer:
    """The stand-in, serving on 127.0.0.1 from a thread: ``with HubServer(token) as hub: hub.url, hub.state``."""

    def __init__(self, token: str):
        self.state = HubState(token)
        handler = type("Handler", (_Handler,), {"hub": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        handler.base_url = self.url
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
        self.state.new_commit(repo, "main", dict(files))

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.state.repos[repo_id]
        return {path: stored.data for path, stored in repo.commits[repo.branches[revision]].items()}
