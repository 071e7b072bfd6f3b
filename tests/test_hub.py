"""The Hub, both ways, against a protocol-level stand-in for the Hub (tests/hub_server.py): the real Hub
is unreachable here, so huggingface_hub 2.4.0 itself talks HTTP to a local server that answers its
endpoints. What arrives must be the artifact's bytes; a second run sends nothing; an interrupted
upload resumes; a download gives the same bytes back and loads; bad inputs send nothing."""
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.formats import FORMATS, consumers
from quantkit.hub.check import ArtifactCheckError, check_artifact
from quantkit.hub.publish import NOT_CONSULTED, UNCHANGED, UPLOAD, check, publish, render_card
from quantkit.hub.pull import PULL_PATTERNS, choose_gguf, pull_model
from quantkit.hub.repo import RETRY_TRIES, RepoIdError, RepoRef, looks_like_repo_ref, parse_repo_ref
from quantkit.models import MiniCPMConfig
from quantkit.models.decoder import weight_shapes
from quantkit.zoo import resolve_model

from helpers import small_recipe
from hub_server import DEFAULT_GITATTRIBUTES, TREE_PAGE_SIZE, HubServer, StoredFile

TOKEN = "hf_quantkitTestToken0123456789abcdef"
BASE = "openbmb/MiniCPM4.1-8B"
REPO = RepoRef("someone/tiny-w4")


def _quantize(model: Path, recipe: str, out: Path, **changes) -> Path:
    from quantkit.engine import quantize

    quantize(model, small_recipe(recipe, out.parent, **changes), out, progress=False)
    return out


@pytest.fixture(scope="module")
def artifact(tiny_checkpoint, tmp_path_factory) -> Path:
    return _quantize(tiny_checkpoint, "rtn-w4g128", tmp_path_factory.mktemp("hub") / "tiny-w4")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The stand-in Hub, with huggingface_hub pointed at it: HF_ENDPOINT (quantkit reads it at each call),
    a private cache, no stored login, and the LFS upload path (huggingface_hub picks Xet on the client
    side whenever hf_xet is installed; the stand-in speaks LFS)."""
    from huggingface_hub import constants

    with HubServer(TOKEN) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
        yield server


def _artifact_bytes(directory: Path) -> dict[str, bytes]:
    """Every file's bytes (an artifact's are all what a pull fetches, PULL_PATTERNS: its model code too)."""
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def _sent(server, method="PUT"):
    return [kind for m, kind in server.state.requests if m == method]


def test_publish_sends_exactly_the_artifact_and_a_second_run_sends_nothing(hub, artifact):
    result = publish(artifact, REPO, base_model=BASE)
    arrived = hub.files(REPO.repo_id)
    assert arrived == {**_artifact_bytes(artifact), "README.md": result.card.encode(),
                       ".gitattributes": DEFAULT_GITATTRIBUTES}  # the Hub's, from the new repository's first commit
    shards = sorted(p for p in artifact.glob("*.safetensors"))
    assert sorted(hub.state.lfs_received) == sorted(hashlib.sha256(p.read_bytes()).hexdigest()
                                                    for p in shards)
    (payload,) = hub.state.commit_payloads  # one commit; weights through LFS, the rest inline
    assert {line["value"]["path"] for line in payload if line["key"] == "lfsFile"} == {p.name for p in shards}
    assert {line["value"]["path"] for line in payload if line["key"] == "file"} == \
        set(arrived) - {p.name for p in shards} - {".gitattributes"}
    assert result.commit == hub.state.repos[REPO.repo_id].branches["main"]
    assert set(hub.state.auth_headers) == {f"Bearer {TOKEN}"}

    before = list(hub.state.requests)
    again = publish(artifact, REPO, base_model=BASE)
    assert again.commit is None and {f.action for f in again.files} == {UNCHANGED}
    new = [kind for _, kind in hub.state.requests[len(before):]]
    pages = -(-len(arrived) // TREE_PAGE_SIZE)  # the listing came in pages, and every page was read
    assert new == ["create_repo", "model_info", *["tree"] * pages] and pages > 1  # looked, sent nothing
    assert len(hub.state.commit_payloads) == 1


def test_only_a_changed_file_is_sent(hub, artifact):
    publish(artifact, REPO, base_model=BASE)
    result = publish(artifact, REPO, base_model="someone-else/other-base")  # the card changes, nothing else
    assert [f.path_in_repo for f in result.files if f.action == UPLOAD] == ["README.md"]
    assert hub.files(REPO.repo_id)["README.md"] == result.card.encode()
    assert len(hub.state.lfs_received) == 3 and len(hub.state.commit_payloads) == 2
    assert [line["value"]["path"] for line in hub.state.commit_payloads[1] if line["key"] != "header"] == ["README.md"]


def test_a_failed_upload_is_retried_by_the_client(hub, artifact):
    shard = max(artifact.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    oid = hashlib.sha256(shard.read_bytes()).hexdigest()
    hub.state.fail("lfs-upload", status=500, count=1, oid=oid)  # a transient storage error
    publish(artifact, REPO, base_model=BASE)
    assert _sent(hub).count("lfs_upload") == 4  # three objects, one of them twice
    assert hub.state.lfs_received.count(oid) == 1
    assert hub.files(REPO.repo_id)[shard.name] == shard.read_bytes()


def test_an_interrupted_upload_resumes_and_sends_only_what_is_missing(hub, artifact):
    shard = max(artifact.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    oid = hashlib.sha256(shard.read_bytes()).hexdigest()
    hub.state.fail("lfs-upload", status=403, count=1, oid=oid)  # not retried: the run stops
    with pytest.raises(RuntimeError, match="nothing was committed.*Run the same command again"):
        publish(artifact, REPO, base_model=BASE)
    assert hub.files(REPO.repo_id).keys() == {".gitattributes"} and hub.state.commit_payloads == []
    assert len(hub.state.repos[REPO.repo_id].lfs) == 2  # the other two objects arrived before the run stopped

    received = len(hub.state.lfs_received)
    publish(artifact, REPO, base_model=BASE)
    assert hub.state.lfs_received[received:] == [oid]  # only the missing object is sent again
    assert hub.files(REPO.repo_id)[shard.name] == shard.read_bytes()


def test_a_failed_commit_is_resumed_without_sending_the_weights_again(hub, artifact):
    hub.state.fail("commit", status=500, count=1)
    with pytest.raises(RuntimeError, match="nothing was committed"):
        publish(artifact, REPO, base_model=BASE)
    assert len(hub.state.lfs_received) == 3
    publish(artifact, REPO, base_model=BASE)
    assert len(hub.state.lfs_received) == 3  # the Hub held them: no upload action, no PUT
    assert hub.files(REPO.repo_id).keys() == {*_artifact_bytes(artifact), "README.md", ".gitattributes"}


def test_a_pulled_repository_has_the_same_bytes_and_loads(hub, artifact):
    from quantkit.loading import load_model

    publish(artifact, REPO, base_model=BASE)
    pulled = resolve_model(REPO.repo_id)
    assert pulled.parents[1].name == "models--someone--tiny-w4"  # huggingface_hub's own cache
    assert _artifact_bytes(pulled) == {**_artifact_bytes(artifact),
                                       "README.md": hub.files(REPO.repo_id)["README.md"]}
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        assert torch.equal(load_model(pulled)(ids).logits, load_model(artifact)(ids).logits)


def test_pull_fetches_weights_configs_tokenizer_and_model_code_but_no_pickle_or_other_code(hub, artifact):
    """The model code an artifact carries (quantkit never runs it) comes with it; other Python files and
    pickles do not."""
    files = {name: StoredFile(data, lfs=name.endswith(".safetensors"))
             for name, data in _artifact_bytes(artifact).items()}
    unsafe = {"pytorch_model.bin": StoredFile(b"pickle", lfs=True), "training_args.pt": StoredFile(b"pickle", lfs=True),
              "tokenization_minicpm.py": StoredFile(b"import os", lfs=False)}
    hub.seed("someone/mixed", files | unsafe)
    pulled = pull_model(parse_repo_ref("someone/mixed"))
    assert {p.name for p in pulled.iterdir()} == set(_artifact_bytes(artifact))
    assert {"configuration_minicpm.py", "modeling_minicpm.py"} <= {p.name for p in pulled.iterdir()}
    hub.seed("someone/pickles-only", {"config.json": files["config.json"], **unsafe})
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        pull_model(parse_repo_ref("someone/pickles-only"))
    assert "*.py" not in PULL_PATTERNS and not any(p.endswith((".bin", ".pt")) for p in PULL_PATTERNS)


def test_a_revision_is_published_to_and_pulled_from_its_branch(hub, artifact):
    result = publish(artifact, parse_repo_ref(REPO.repo_id, "w4-rtn"), base_model=BASE)
    assert result.revision == "w4-rtn" and hub.files(REPO.repo_id, "main").keys() == {".gitattributes"}
    assert "quantkit generate --model someone/tiny-w4@w4-rtn" in result.card
    pulled = resolve_model(f"{REPO.repo_id}@w4-rtn")
    assert (pulled / "quantkit.json").read_bytes() == (artifact / "quantkit.json").read_bytes()
    with pytest.raises(FileNotFoundError, match="no revision 'v9'"):
        resolve_model(f"{REPO.repo_id}@v9")


def test_the_revision_option_picks_the_branch_of_a_hub_model_and_only_of_one(hub, artifact):
    publish(artifact, parse_repo_ref(REPO.repo_id, "w4-rtn"), base_model=BASE)
    conformance = ["eval", "conformance", "--model"]
    result = CliRunner().invoke(main, [*conformance, REPO.repo_id, "--revision", "w4-rtn", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["passed"]
    result = CliRunner().invoke(main, [*conformance, REPO.repo_id, "--revision", "v9"])
    assert result.exit_code == 1 and "no revision 'v9'" in result.output
    result = CliRunner().invoke(main, [*conformance, f"{REPO.repo_id}@v1", "--revision", "w4-rtn"])
    assert result.exit_code == 1 and "names revision 'v1' but --revision is 'w4-rtn'" in result.output
    requests = len(hub.state.requests)
    result = CliRunner().invoke(main, [*conformance, str(artifact), "--revision", "w4-rtn"])
    assert result.output.strip() == (f"Error: --revision w4-rtn applies to a Hub repo id, and {artifact} is a local "
                                     "directory")
    assert len(hub.state.requests) == requests


def test_a_model_neither_here_nor_on_the_hub_is_one_clear_line(hub):
    result = CliRunner().invoke(main, ["roofline", "--hardware", "orin", "--model", "someone/absent"])
    assert result.exit_code == 1
    assert result.output.strip() == (f"Error: someone/absent is no local directory, so it was looked up on the Hub: no "
                                     f"model repository someone/absent on {hub.url} (for a private or gated one, set "
                                     "HF_TOKEN or run `hf auth login`)")


def test_offline_uses_the_cache_and_says_how_to_fill_it(hub, artifact, monkeypatch):
    from huggingface_hub import constants

    publish(artifact, REPO, base_model=BASE)
    online = resolve_model(REPO.repo_id)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    requests = len(hub.state.requests)
    assert resolve_model(REPO.repo_id) == online
    assert len(hub.state.requests) == requests  # no network request at all
    with pytest.raises(RuntimeError, match=r"not in the Hugging Face cache[\s\S]*hf download someone/never-pulled "
                                           r"--revision v1 --include '\*.safetensors'[\s\S]*HF_HUB_OFFLINE=1"):
        resolve_model("someone/never-pulled@v1")


# Every form the Hub's rules refuse, each with the rule quantkit names (huggingface_hub's validate_repo_id
# refuses each too: the test checks). The first two are no repo id shape at all.
REFUSED_IDS = {
    "no-slash": "expected owner/name", "a/b/c": "expected owner/name",
    "me/démo-w4": "the name 'démo-w4' may hold only ASCII letters", "o/文件": "may hold only ASCII letters",
    "owner/na me": "may hold only ASCII letters", "owner/name-": "must not start or end with '-' or '.'",
    "-owner/name": "the owner '-owner' must not start", ".o/name": "must not start or end",
    "own--er/name": "must not contain '--' or '..'", "owner/na..me": "must not contain '--' or '..'",
    "owner/" + "x" * 97: "must be 1 to 96 characters long", "x" * 97 + "/name": "the owner 'xxx",
    "owner/name.git": "must not end in '.git'", "owner/": "the name '' must be 1 to 96",
}
VALID_IDS = ["a/b", "_o/_x", "Org-1/Model.v2_final-w4", "o/" + "x" * 96, "x" * 96 + "/y", "owner/name.gi"]


def _one_line_error(result) -> str:
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


@pytest.mark.parametrize("text", list(REFUSED_IDS))
def test_a_repo_id_the_hub_refuses_is_one_line_before_any_request(hub, artifact, text):
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    rule = REFUSED_IDS[text]
    if text != "no-slash":  # the Hub's validator refuses it too (it takes a bare name, quantkit wants owner/name)
        with pytest.raises(HFValidationError):
            validate_repo_id(text)
    with pytest.raises(RepoIdError, match=re.escape(rule)):
        parse_repo_ref(text)
    for dry_run in ([], ["--dry-run"]):
        line = _one_line_error(CliRunner().invoke(main, ["publish", str(artifact), "--repo-id", text,
                                                         "--base-model", BASE, *dry_run]))
        assert line.startswith(f"Error: malformed Hub repo id {text!r}") and rule in line
    if looks_like_repo_ref(text):  # --model and inspect: not a directory here, so it must be a repo id
        for argv in (["eval", "ppl", "--model", text], ["inspect", "--", text]):
            line = _one_line_error(CliRunner().invoke(main, argv))
            assert "it is no local directory either" in line and rule in line
    with pytest.raises(RepoIdError, match=re.escape(rule)):
        publish(artifact, RepoRef(text), base_model=BASE)  # a RepoRef made in Python is held to the rules too
    line = _one_line_error(CliRunner().invoke(main, ["publish", str(artifact), "--repo-id", REPO.repo_id,
                                                     "--base-model", text, "--dry-run"]))
    assert rule in line
    assert hub.state.requests == []


@pytest.mark.parametrize("text", VALID_IDS)
def test_a_repo_id_the_hub_accepts_passes(hub, artifact, text):
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(text)
    assert parse_repo_ref(f"{text}@v1") == RepoRef(text, "v1")
    result = CliRunner().invoke(main, ["publish", str(artifact), "--repo-id", text, "--base-model", BASE,
                                       "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["repo_id"] == text and hub.state.requests == []


def test_the_stand_in_refuses_names_and_cards_as_the_hub_does(hub):
    """The stand-in's own checks (written apart from quantkit's validator): what the Hub answers 400 to."""
    import httpx2

    auth = {"Authorization": f"Bearer {TOKEN}"}
    for text in [t for t in REFUSED_IDS if t.count("/") == 1 and t.split("/")[1]] + VALID_IDS:
        owner, name = text.split("/")
        answer = httpx2.post(f"{hub.url}/api/repos/create", json={"organization": owner, "name": name,
                                                                  "type": "model"}, headers=auth)
        assert answer.status_code == (200 if text in VALID_IDS else 400), text
    cards = {"---\nlicense: mit\nbase_model: a/b\ntags: [x]\n---\n# ok": 200,
             "---\nlicense: [mit, apache-2.0]\n---\n": 400, "---\nbase_model: not a model\n---\n": 400,
             "---\ntags: x\n---\n": 400, "---\n- a list\n---\n": 400, "---\nkey: [unclosed\n---\n": 400}
    for card, status in cards.items():
        answer = httpx2.post(f"{hub.url}/api/validate-yaml", json={"content": card, "repoType": "model"})
        assert answer.status_code == status, card


def test_large_files_download_from_another_host_without_the_token(hub, artifact):
    """The Hub redirects a large file's resolve (307) to its storage's signed address: the client follows
    it without the Authorization header, and the listing it pulls by comes in pages."""
    publish(artifact, REPO, base_model=BASE)
    requests = len(hub.state.requests)
    pulled = resolve_model(REPO.repo_id)
    assert _artifact_bytes(pulled) == {**_artifact_bytes(artifact),
                                       "README.md": hub.files(REPO.repo_id)["README.md"]}
    shards = {hashlib.sha256(p.read_bytes()).hexdigest() for p in artifact.glob("*.safetensors")}
    assert {path.rsplit("/", 1)[-1] for path, _ in hub.state.cdn_requests} == shards
    assert {authorization for _, authorization in hub.state.cdn_requests} == {None}
    assert [kind for _, kind in hub.state.requests[requests:]].count("tree") > 1


def test_large_file_objects_belong_to_their_repository(hub, artifact):
    import httpx2

    publish(artifact, REPO, base_model=BASE)
    other = RepoRef("someone-else/copy")
    shards = sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in artifact.glob("*.safetensors"))
    for oid in shards:  # an address signed for the other repository does not reach this one's objects
        assert httpx2.get(f"{hub.url.replace('127.0.0.1', 'localhost')}/cdn-lfs/{other.repo_id}/{oid}").status_code \
            == 403
    publish(artifact, other, base_model=BASE)
    assert sorted(hub.state.lfs_received) == sorted(shards * 2)  # the second repository was sent its own copies
    assert hub.files(other.repo_id).keys() == hub.files(REPO.repo_id).keys()
    for path in (artifact / name for name in ("model-00001-of-00003.safetensors", "config.json")):
        assert (resolve_model(other.repo_id) / path.name).read_bytes() == path.read_bytes()


def test_what_goes_through_lfs_follows_the_repositorys_gitattributes(hub, artifact):
    """The Hub decides, not the client: its .gitattributes patterns, a file's size, binary bytes. An LFS
    file no pattern covers gets its own line in the same commit; either kind is compared right on the
    next run."""
    hub.seed(REPO.repo_id, {".gitattributes": StoredFile(b"*.json filter=lfs diff=lfs merge=lfs -text\n", lfs=False)})
    publish(artifact, REPO, base_model=BASE)
    (payload,) = hub.state.commit_payloads
    lfs = {line["value"]["path"] for line in payload if line["key"] == "lfsFile"}
    shards = {p.name for p in artifact.glob("*.safetensors")}
    assert lfs == shards | {p.name for p in artifact.glob("*.json")}  # binary shards, and the pattern's files
    attributes = hub.files(REPO.repo_id)[".gitattributes"].decode().splitlines()
    assert attributes == ["*.json filter=lfs diff=lfs merge=lfs -text",
                          *[f"{name} filter=lfs diff=lfs merge=lfs -text" for name in sorted(shards)]]
    again = publish(artifact, REPO, base_model=BASE)
    assert again.commit is None and {f.action for f in again.files} == {UNCHANGED}


def _waits(monkeypatch) -> list[float]:
    """quantkit's own waits between attempts, recorded instead of slept."""
    import types

    import quantkit.hub.repo

    waits: list[float] = []
    monkeypatch.setattr(quantkit.hub.repo, "time", types.SimpleNamespace(sleep=waits.append))
    return waits


def test_a_rate_limited_publish_and_pull_wait_as_asked_and_succeed(hub, artifact, monkeypatch):
    waits = _waits(monkeypatch)
    hub.state.fail("create-repo", 429, headers={"Retry-After": "7"})  # huggingface_hub does not retry this call
    result = publish(artifact, REPO, base_model=BASE)
    assert result.commit == hub.state.repos[REPO.repo_id].branches["main"] and waits == [7]
    hub.state.fail("model-info", 429, headers={"Retry-After": "3"})  # snapshot_download's first request
    pulled = resolve_model(REPO.repo_id)
    assert (pulled / "config.json").read_bytes() == (artifact / "config.json").read_bytes() and waits == [7, 3]


@pytest.mark.parametrize("retry_after, attempts", [("0", RETRY_TRIES), ("3600", 1)])
def test_a_lasting_rate_limit_is_one_line(hub, artifact, monkeypatch, retry_after, attempts):
    """Retried RETRY_TRIES times in all, or not at all when the Hub asks to wait longer than quantkit waits."""
    _waits(monkeypatch)
    hub.state.fail("create-repo", 429, count=99, headers={"Retry-After": retry_after})
    line = _one_line_error(CliRunner().invoke(main, ["publish", str(artifact), "--repo-id", REPO.repo_id,
                                                     "--base-model", BASE]))
    assert f"429 Too Many Requests to publishing {REPO.repo_id} after {RETRY_TRIES} attempts (it asks to wait " \
           f"{retry_after} s). Nothing was committed" in line
    assert _sent(hub, "POST").count("create_repo") == attempts
    hub.seed("someone/seeded", {"config.json": StoredFile(b"{}", lfs=False)})
    hub.state.fail("model-info", 429, count=99, headers={"Retry-After": retry_after})
    line = _one_line_error(CliRunner().invoke(main, ["inspect", "someone/seeded"]))
    assert f"the Hub at {hub.url} still answers 429 Too Many Requests for someone/seeded" in line


def test_a_commit_on_a_branch_that_moved_is_planned_again(hub, artifact):
    """Another writer commits between quantkit's listing and its commit: the Hub refuses the commit (412,
    its parent is stale), and quantkit compares again, so the file the other commit changed is sent too."""
    publish(artifact, REPO, base_model=BASE)
    hub.state.before("commit", lambda: hub.push(REPO.repo_id, {"config.json": StoredFile(b"{}", lfs=False)}))
    result = publish(artifact, REPO, base_model="someone-else/other-base")  # only the card differs, at first
    assert hub.files(REPO.repo_id)["config.json"] == (artifact / "config.json").read_bytes()
    assert sorted(f.path_in_repo for f in result.files if f.action == UPLOAD) == ["README.md", "config.json"]
    assert _sent(hub, "POST").count("commit") == 3 and len(hub.state.commit_payloads) == 2  # one refused


def test_a_branch_that_keeps_moving_is_one_line(hub, artifact):
    publish(artifact, REPO, base_model=BASE)
    hub.state.before("commit", lambda: hub.push(REPO.repo_id, {"config.json": StoredFile(b"{}", lfs=False)}),
                     count=99)
    line = _one_line_error(CliRunner().invoke(main, ["publish", str(artifact), "--repo-id", REPO.repo_id,
                                                     "--base-model", "someone-else/other-base"]))
    assert line == (f"Error: the branch main of {REPO.repo_id} moved under each of {RETRY_TRIES} attempts to publish "
                    "(412 Precondition Failed: another writer commits to it). Nothing was committed: run the same "
                    "command again.")
    assert len(hub.state.commit_payloads) == 1  # the first run's


def test_a_card_the_hub_refuses_is_one_line(hub, artifact, tmp_path):
    """A base model card whose licence is a list: the Hub's metadata check refuses the card (400) before
    anything is uploaded, and says why."""
    base_card = "---\nlicense: [apache-2.0, mit]\n---\n# A base\n"
    copy = _broken_copy(artifact, tmp_path, lambda d: (d / "README.md").write_text(base_card))
    line = _one_line_error(CliRunner().invoke(main, ["publish", str(copy), "--repo-id", REPO.repo_id,
                                                     "--base-model", BASE]))
    assert line.startswith(f"Error: the Hub refused to publish {REPO.repo_id}: Invalid metadata in README.md.")
    assert '"license" must be a string' in line and line.endswith("Nothing was committed.")
    assert hub.state.lfs_received == [] and hub.state.commit_payloads == []


def test_inspect_takes_what_model_takes(hub, artifact):
    repo = "Org_1/tiny.w4-rtn"  # a valid id at the edges of the rules
    publish(artifact, RepoRef(repo), base_model=BASE)
    here = json.loads(CliRunner().invoke(main, ["inspect", str(artifact), "--json"]).stdout)
    result = CliRunner().invoke(main, ["inspect", repo, "--json"])
    assert result.exit_code == 0, result.output
    there = json.loads(result.stdout)
    assert there.pop("model") == repo and "model" not in here
    assert there.pop("path") == str(resolve_model(repo)) and here.pop("path") == str(artifact)
    assert there == here and there["quantization"].startswith("gptq 4-bit")
    publish(artifact, parse_repo_ref(repo, "v2"), base_model=BASE)
    assert CliRunner().invoke(main, ["inspect", repo, "--revision", "v2"]).exit_code == 0
    line = _one_line_error(CliRunner().invoke(main, ["inspect", repo, "--revision", "v9"]))
    assert line == f"Error: {repo} is no local directory, so it was looked up on the Hub: {repo} has no revision " \
                   f"'v9' on {hub.url}"


def test_a_missing_token_is_refused_before_any_request(hub, artifact, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(RuntimeError, match="no Hugging Face token found: set HF_TOKEN.*hf auth login"):
        publish(artifact, REPO, base_model=BASE)
    assert hub.state.requests == []
    plan = publish(artifact, REPO, base_model=BASE, dry_run=True)  # the plan still shows, and says so
    assert any("a real run would stop here: no Hugging Face token" in note for note in plan.notes)


def test_a_refused_token_is_said_so_and_nothing_is_committed(hub, artifact, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_wrongToken")
    with pytest.raises(RuntimeError, match="the Hub refused the token for someone/tiny-w4: set HF_TOKEN") as raised:
        publish(artifact, REPO, base_model=BASE)
    assert "hf_wrongToken" not in str(raised.value) and hub.state.repos == {}


def _broken_copy(artifact: Path, tmp_path: Path, change) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    change(copy)
    return copy


def _rewrite_records(directory: Path) -> None:
    """Make the manifest's file records match the (changed) files, so a deeper check must catch it."""
    from quantkit.artifact import FILES_KEY, REPORT_FILE, file_records

    manifest = json.loads((directory / "quantkit.json").read_text())
    manifest[FILES_KEY] = file_records(directory, {"quantkit.json", REPORT_FILE})
    (directory / "quantkit.json").write_text(json.dumps(manifest))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def _wrong_bits(directory: Path) -> None:
    for name in ("config.json", "quantize_config.json"):
        config = json.loads((directory / name).read_text())
        (config.get("quantization_config") or config)["bits"] = 8
        (directory / name).write_text(json.dumps(config))
    _rewrite_records(directory)


def _no_template(directory: Path) -> None:
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    _rewrite_records(directory)


BROKEN = {
    "a shard missing": (lambda d: (d / "model-00002-of-00003.safetensors").unlink(), "incomplete artifact"),
    "a shard changed": (lambda d: _flip_byte(d / "model-00001-of-00003.safetensors"), "SHA-256 differs"),
    "a shard truncated": (lambda d: (d / "model-00003-of-00003.safetensors").write_bytes(b"\0" * 8),
                          "corrupt safetensors file"),
    "a config file deleted": (lambda d: (d / "generation_config.json").unlink(), "generation_config.json is missing"),
    "quantization_config vs tensors": (_wrong_bits, "does not describe the tensors of layer 0"),
    "no tokenizer": (lambda d: ((d / "tokenizer.json").unlink(), _rewrite_records(d)), "no tokenizer"),
    "no chat template": (_no_template, "no chat template"),
    "a pickle file": (lambda d: (d / "optimizer.pt").write_bytes(b"x"), "pickle files"),
    "an unfinished run": (lambda d: (d / "progress.json").write_text("{}"), "unfinished run"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_an_incomplete_or_tampered_artifact_is_refused_and_nothing_sent(hub, artifact, tmp_path, case):
    change, message = BROKEN[case]
    broken = _broken_copy(artifact, tmp_path, change)
    with pytest.raises(ArtifactCheckError, match=message):
        publish(broken, REPO, base_model=BASE)
    assert hub.state.requests == []


def test_the_check_passes_the_artifact_as_written(artifact):
    checked = check_artifact(artifact)
    assert [f.path_in_repo for f in checked.files] == sorted(_artifact_bytes(artifact))
    assert checked.notes == []


def test_dry_run_plans_every_file_with_its_hash_and_sends_nothing(hub, artifact):
    result = CliRunner().invoke(main, ["publish", str(artifact), "--repo-id", "someone/tiny-w4", "--revision", "v1",
                                       "--base-model", BASE, "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["repo_id"] == "someone/tiny-w4" and plan["revision"] == "v1" and plan["dry_run"]
    files = {f["path_in_repo"]: f for f in plan["files"]}
    assert plan["files"][0]["path_in_repo"] == "README.md"
    for name, data in _artifact_bytes(artifact).items():
        assert files[name]["size"] == len(data)
        assert files[name]["sha256"] == hashlib.sha256(data).hexdigest()
        assert files[name]["action"] == NOT_CONSULTED
    assert hub.state.requests == []


def _front_matter(card: str) -> dict:
    from huggingface_hub import ModelCard

    parsed = ModelCard(card)
    assert ModelCard(str(parsed)).data.to_dict() == parsed.data.to_dict()  # round-trips
    return parsed.data.to_dict()


def test_the_card_front_matter_parses_with_huggingface_hub(artifact):
    ref = REPO
    card = render_card(check(artifact, ref), ref, BASE)
    data = _front_matter(card)
    assert data["base_model"] == BASE and data["base_model_relation"] == "quantized"
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert data["license"] == "unknown"  # the tiny checkpoint carries no base model card
    assert {"quantkit", "rtn", "gptq", "4-bit"} <= set(data["tags"])
    manifest = json.loads((artifact / "quantkit.json").read_text())
    assert manifest["calibration"]["fingerprint"] in card
    assert "name: rtn-w4g128" in card and "No evaluation report" in card
    # the artifact carries MiniCPM's code (auto_map): stock transformers needs no quantkit, vLLM reads the config
    assert 'from_pretrained("someone/tiny-w4", device_map="auto", trust_remote_code=True)' in card
    assert "import quantkit" not in card and "vllm serve someone/tiny-w4 --trust-remote-code" in card


def test_the_card_says_what_is_quantized_and_the_bits_of_each(artifact):
    """gptq W4 g128: a linear [N, K] stores K·N/2 bytes of codes, K/128·N float16 scales and 4-bit zeros,
    and K int32 g_idx; the embedding, the norms and the LM head stay float32, which is why the whole files
    come to twice the linears' bits per weight here (13.9 for the default model)."""
    shapes = weight_shapes(MiniCPMConfig.from_pretrained(artifact))
    linears = [shape for name, shape in shapes.items() if name.startswith("model.layers.") and "norm" not in name]
    codes = sum(n * k // 2 + k // 128 * n * 2 + k // 128 * n // 2 + 4 * k for n, k in linears)
    quantized, total = sum(n * k for n, k in linears), sum(math.prod(shape) for shape in shapes.values())
    files = sum(p.stat().st_size for p in artifact.glob("*.safetensors"))
    card = render_card(check(artifact, REPO), REPO, BASE)
    assert (f"| bits per weight | {8 * codes / quantized:.3f} in the quantized tensors (the decoder layers' "
            f"linears: {quantized:,} of {total:,} parameters); {8 * files / total:.3f} over the whole weight files, "
            f"which keep the embedding, the norms and the LM head ({total - quantized:,} parameters) in F32 |") in card
    assert 4 < 8 * codes / quantized < 4.5 and 8 * files / total > 8


def test_remote_code_the_config_names_is_used_in_the_usage_and_noted_when_missing(artifact, tmp_path):
    def add_auto_map(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_minicpm.MiniCPMForCausalLM",
                              "AutoTokenizer": ["tokenization_minicpm.MiniCPMTokenizer", None]}
        (directory / "config.json").write_text(json.dumps(config))
        (directory / "tokenization_minicpm.py").write_text("")
        (directory / "modeling_minicpm.py").unlink()
        _rewrite_records(directory)

    checked = check_artifact(_broken_copy(artifact, tmp_path, add_auto_map))
    assert len(checked.notes) == 1 and "modeling_minicpm.py" in checked.notes[0]
    assert "tokenization_minicpm.py" not in checked.notes[0]
    card = render_card(checked, REPO, BASE)
    assert 'from_pretrained("someone/tiny-w4", device_map="auto", trust_remote_code=True)' in card
    assert "vllm serve someone/tiny-w4 --trust-remote-code" in card


def test_the_base_models_card_gives_licence_and_languages(artifact, tmp_path):
    base_card = "---\nlicense: apache-2.0\nlanguage:\n- zh\n- en\n---\n# MiniCPM4.1\n"
    copy = _broken_copy(artifact, tmp_path, lambda d: (d / "README.md").write_text(base_card))
    checked = check_artifact(copy)
    assert "README.md" not in [f.path_in_repo for f in checked.files]  # replaced by the published card
    data = _front_matter(render_card(checked, REPO, BASE))
    assert data["license"] == "apache-2.0" and data["language"] == ["zh", "en"]


def test_a_quantkit_built_in_model_names_its_upstream(artifact, tmp_path):
    copy = _broken_copy(artifact, tmp_path, lambda d: (d / "quantkit_source.json").write_text(
        json.dumps({"source": {"model": "smollm2-135m"}})))
    data = _front_matter(render_card(check(copy, REPO), REPO))
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and data["license"] == "apache-2.0"
    with pytest.raises(ValueError, match="pass --base-model"):
        render_card(check(artifact, REPO), REPO)


def test_the_evaluation_table_comes_from_report_json(artifact, tmp_path):
    variant = {"bits_per_parameter": 4.6, "perplexity": 12.5, "delta_ppl_pct": 3.25, "mean_kl": 0.0421,
               "top1": 0.912, "tasks": {"gsm": 0.31}, "tau": 2.5, "layer_errors": [], "size_mb": 1.0}
    report = {"setup": {"tokens": 4096, "data": "austen", "window": 2048, "tokens_sha256": "ab" * 32, "kl_top_k": 256},
              "variants": [{**variant, "name": "fp (reference)", "path": "/x/fp", "perplexity": 12.1, "mean_kl": 0.0},
                           {**variant, "name": "tiny-w4", "path": str(artifact)}]}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    card = render_card(check(artifact, REPO), REPO, BASE, path)
    table = card.split("## Evaluation")[1].split("##")[0]
    assert "0.0421" in table and "0.912" in table and "gsm" in table and "τ" in table and "4096" in table


def _headings(card: str) -> list[str]:
    usage = card.split("## Use it")[1].split("\n## ")[0]
    return [line.removeprefix("### ") for line in usage.splitlines() if line.startswith("### ")]


USAGE_MARKERS = {consumers.TRANSFORMERS: "AutoModelForCausalLM", consumers.VLLM: "vllm serve",
                 consumers.SGLANG: "sglang.launch_server", consumers.CPMCU: "cpmcu.cli",
                 consumers.QUANTKIT: "quantkit generate", consumers.LLAMA_CPP: "llama-cli",
                 consumers.MLX_LM: "mlx_lm.generate"}
FORMAT_ARTIFACTS = {  # format -> (recipe, changes, fixture)
    "awq": ("awq-w4g128", {}, "tiny_checkpoint"),
    "cpmcu": ("cpmcu", {"smooth": {"enabled": False}}, "marlin_legal"),
    "ternary": ("rtn-ternary-g32", {}, "tiny_checkpoint"),
    "mlx": ("mlx-rtn-w4g64", {}, "tiny_checkpoint"),
}
LIBRARY = {"gptq": "transformers", "awq": "transformers", "cpmcu": "quantkit", "ternary": "quantkit", "mlx": "mlx"}


@pytest.mark.parametrize("fmt", ["gptq", *FORMAT_ARTIFACTS])
def test_each_format_card_shows_only_its_consumers(fmt, artifact, tmp_path, request):
    if fmt == "gptq":
        directory = artifact
    else:
        recipe, changes, fixture = FORMAT_ARTIFACTS[fmt]
        directory = _quantize(request.getfixturevalue(fixture), recipe, tmp_path / f"tiny-{fmt}", **changes)
    ref = RepoRef(f"someone/tiny-{fmt}")
    card = render_card(check(directory, ref), ref, BASE)
    readers = FORMATS[fmt].consumers
    assert _headings(card) == [consumer.title for consumer in readers]
    usage = card.split("## Use it")[1]
    for consumer, marker in USAGE_MARKERS.items():
        assert (marker in usage) == (consumer in readers), (fmt, consumer.title)
    from huggingface_hub import ModelCard

    assert ModelCard(card).data.to_dict()["library_name"] == LIBRARY[fmt]
    if fmt == "cpmcu":
        assert "--model-path models/tiny-cpmcu-marlin" in card


@pytest.fixture(scope="module")
def gguf_files(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    from quantkit.gguf.export import export_gguf

    out = tmp_path_factory.mktemp("gguf")
    return {t: export_gguf(tiny_checkpoint, out / f"tiny-{t}.gguf", t, progress=False) and out / f"tiny-{t}.gguf"
            for t in ("q8_0", "q4_0")}


def test_gguf_files_follow_llama_cpp_naming_in_one_repo(hub, gguf_files):
    ref = RepoRef("someone/Tiny-MiniCPM-GGUF")
    first = publish(gguf_files["q8_0"], ref, base_model=BASE)
    assert [f.path_in_repo for f in first.files] == ["README.md", "Tiny-MiniCPM-Q8_0.gguf"]
    second = publish(gguf_files["q4_0"], ref, base_model=BASE)
    arrived = hub.files(ref.repo_id)
    assert arrived["Tiny-MiniCPM-Q8_0.gguf"] == gguf_files["q8_0"].read_bytes()
    assert arrived["Tiny-MiniCPM-Q4_0.gguf"] == gguf_files["q4_0"].read_bytes()
    card = arrived["README.md"].decode()
    assert card == second.card and "Tiny-MiniCPM-Q8_0.gguf" in card and "Tiny-MiniCPM-Q4_0.gguf" in card
    data = _front_matter(card)
    assert data["library_name"] == "gguf" and {"gguf", "Q4_0"} <= set(data["tags"])
    assert _headings(card) == [consumers.LLAMA_CPP.title]
    assert "llama-cli -hf someone/Tiny-MiniCPM-GGUF:Q4_0" in card
    assert "vllm serve" not in card and "from_pretrained" not in card and "quantkit generate" not in card


GGUF_REPO = "someone/SmolLM2-135M-Instruct-GGUF"


def test_one_gguf_file_is_pulled_alone_and_converted_like_the_built_in_model(hub, default_model, tmp_path,
                                                                             monkeypatch):
    """``owner/name:QUANT`` (llama.cpp's -hf naming) downloads that file only and converts it exactly as
    the default model is converted from the same file; offline, the cached file and checkpoint serve."""
    from huggingface_hub import constants

    from quantkit.zoo import SOURCE_FILE, fetch_gguf

    original = fetch_gguf(progress=False).read_bytes()
    hub.seed(GGUF_REPO, {"SmolLM2-135M-Instruct-Q4_1.gguf": StoredFile(original, lfs=True),
                         "SmolLM2-135M-Instruct-Q8_0.gguf": StoredFile(b"never fetched", lfs=True)})
    pulled = resolve_model(f"{GGUF_REPO}:q4_1", cache_dir=tmp_path / "quantkit", progress=False)
    snapshot = next((tmp_path / "hf-cache").glob("models--someone--SmolLM2-135M-Instruct-GGUF/snapshots/*"))
    assert [p.name for p in snapshot.iterdir()] == ["SmolLM2-135M-Instruct-Q4_1.gguf"]
    assert (pulled / "model.safetensors").read_bytes() == (default_model / "model.safetensors").read_bytes()
    source = json.loads((pulled / SOURCE_FILE).read_text())["source"]
    assert source == {"hub": {"repo_id": GGUF_REPO, "revision": None, "file": "SmolLM2-135M-Instruct-Q4_1.gguf"}}
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    requests = len(hub.state.requests)
    assert resolve_model(f"{GGUF_REPO}:Q4_1", cache_dir=tmp_path / "quantkit", progress=False) == pulled
    assert len(hub.state.requests) == requests


def test_a_gguf_repository_without_a_quant_lists_its_files(hub):
    hub.seed(GGUF_REPO, {"M-Q4_0.gguf": StoredFile(b"a", lfs=True), "M-Q8_0.gguf": StoredFile(b"b", lfs=True)})
    with pytest.raises(FileNotFoundError, match=rf"holds GGUF files, not safetensors weights: name one as "
                                                rf"{GGUF_REPO}:QUANT \(files: M-Q4_0.gguf, M-Q8_0.gguf\)"):
        resolve_model(GGUF_REPO)


FILES = ["M-Q4_K_M.gguf", "M-Q4_K_S.gguf", "m.q8_0.gguf", "M-Q5_0.gguf", "N-Q5_0.gguf", "M-Q2_K-00001-of-00002.gguf",
         "M-Q2_K-00002-of-00002.gguf"]


@pytest.mark.parametrize("quant, chosen", [("Q4_K_M", "M-Q4_K_M.gguf"), ("q4_k_m", "M-Q4_K_M.gguf"),
                                           ("Q8_0", "m.q8_0.gguf"), ("M-Q4_K_S.gguf", "M-Q4_K_S.gguf")])
def test_a_quant_tag_chooses_one_file_whatever_its_case(quant, chosen):
    assert choose_gguf(RepoRef("o/M-GGUF", gguf=quant), FILES) == chosen


@pytest.mark.parametrize("quant, error", [("Q4_K", "no GGUF file of o/M-GGUF matches 'Q4_K' \\(files: M-Q4_K_M"),
                                          ("Q6_K", "no GGUF file"), ("Q5_0", "several GGUF files")])
def test_a_quant_tag_that_names_no_single_file_lists_the_files(quant, error):
    with pytest.raises(FileNotFoundError, match=error):
        choose_gguf(RepoRef("o/M-GGUF", gguf=quant), FILES)


def test_a_split_gguf_part_is_refused_with_the_merge_command():
    with pytest.raises(ValueError, match="llama-gguf-split --merge"):
        choose_gguf(RepoRef("o/M-GGUF", gguf="Q2_K"), FILES)


def test_a_repo_ref_with_a_quant_parses_and_is_refused_as_a_publish_target(hub, gguf_files):
    assert parse_repo_ref("o/M-GGUF:Q4_K_M@v2") == RepoRef("o/M-GGUF", "v2", "Q4_K_M")
    assert str(RepoRef("o/M-GGUF", "v2", "Q4_K_M")) == "o/M-GGUF:Q4_K_M@v2"
    with pytest.raises(ValueError, match="malformed"):
        parse_repo_ref("o/M-GGUF@v2:Q4_K_M")
    with pytest.raises(ValueError, match="not to one file of it"):
        publish(gguf_files["q4_0"], parse_repo_ref("o/M-GGUF:Q4_0"), base_model=BASE)
    assert hub.state.requests == []


def test_no_token_appears_in_any_output_log_or_file(hub, artifact, tmp_path):
    """The real CLI in a subprocess, configured through the environment only: publish, then read it back."""
    home = tmp_path / "home"
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1",
           "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_DEBUG": "1", "QUANTKIT_DEBUG": "1",
           "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "quantkit.cli"]
    runs = [subprocess.run(cli + args, capture_output=True, text=True, env=env, cwd=tmp_path) for args in (
        ["publish", str(artifact), "--repo-id", REPO.repo_id, "--base-model", BASE, "--private"],
        ["roofline", "--hardware", "orin", "--model", REPO.repo_id, "--json"])]
    for run in runs:
        assert run.returncode == 0, run.stderr
        assert TOKEN not in run.stdout and TOKEN not in run.stderr
    commit = hub.state.repos[REPO.repo_id].branches["main"]
    assert f"commit {commit}" in runs[0].stdout and hub.state.repos[REPO.repo_id].private
    assert json.loads(runs[1].stdout)["model"].endswith(commit)  # pulled (private: with the token) and read
    assert set(hub.state.auth_headers) == {f"Bearer {TOKEN}"}  # it was sent, to the Hub only
    written = [p for root in (home, tmp_path, artifact) for p in Path(root).rglob("*") if p.is_file()]
    assert written and not [p for p in written if TOKEN.encode() in p.read_bytes()]
