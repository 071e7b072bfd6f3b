"""Publishing and pulling through Xet, the storage the real Hub uses, against the Hub stand-in
(tests/hub_server.py) and its Xet CAS (tests/xet_cas.py): with hf_xet installed and HF_HUB_DISABLE_XET unset,
`quantkit publish` uploads the weights as xorbs and a shard, and `--model owner/name` downloads them by
reconstruction; the bytes come back identical, nothing goes through Git LFS, and the CAS refuses what does not
verify and keeps repositories apart."""
import hashlib
import json
import os
import struct
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers import small_recipe
from hub_server import HubServer
from xet_cas import (
    DATA_KEY,
    DECOMPRESS,
    VERIFICATION_KEY,
    bg4_regroup,
    blake3_keyed,
    file_hash,
    lz4_frame,
    merkle_root,
    xet_hex,
)

TOKEN = "hf_quantkitXetToken0123456789abcdef"
BASE = "openbmb/MiniCPM4.1-8B"
REPO = "someone/tiny-w4-xet"


@pytest.fixture(scope="module")
def artifact(tiny_checkpoint, tmp_path_factory) -> Path:
    from quantkit.engine import quantize

    out = tmp_path_factory.mktemp("xet") / "tiny-w4"
    quantize(tiny_checkpoint, small_recipe("rtn-w4g128", out.parent), out, progress=False)
    return out


def _cli(hub: HubServer, home: Path, *args: str) -> subprocess.CompletedProcess:
    """The real CLI in its own process, as a user runs it: hf_xet installed, HF_HUB_DISABLE_XET unset, its own
    HF_HOME (so its own Xet chunk cache)."""
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_DISABLE_XET"}
    env.update(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HOME=str(home), HF_HUB_CACHE=str(home / "hub"),
               HF_HUB_DISABLE_PROGRESS_BARS="1", OMP_NUM_THREADS="1")
    home.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "quantkit.cli", *args], capture_output=True, text=True, env=env,
                          cwd=home)


@pytest.fixture(scope="module")
def published(artifact, tmp_path_factory):
    """The stand-in Hub after `quantkit publish` of the artifact with Xet on."""
    with HubServer(TOKEN) as hub:
        run = _cli(hub, tmp_path_factory.mktemp("publisher"), "publish", str(artifact), "--repo-id", REPO,
                   "--base-model", BASE)
        assert run.returncode == 0, run.stderr
        yield hub


def _weights(artifact: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(artifact.glob("*.safetensors"))}


def test_publish_and_pull_go_through_xet_and_give_back_the_same_bytes(published, artifact, tmp_path):
    hub, cas = published, published.state.xet
    weights = _weights(artifact)
    held = hub.files(REPO)
    assert {name: held[name] for name in weights} == weights
    assert all(held[p.name] == p.read_bytes() for p in artifact.iterdir() if p.is_file() and p.name != "README.md")
    # the weights arrived as xorbs and a verified shard, none through Git LFS
    xet_files = {name: cas.file_of(REPO, hashlib.sha256(data).hexdigest()) for name, data in weights.items()}
    assert None not in xet_files.values()
    assert {h for kind, h in cas.events if kind == "file"} == set(xet_files.values())
    assert [kind for kind, _ in cas.events].count("xorb") >= 1 and cas.refusals == []
    assert hub.state.lfs_received == [] and not {"lfs_batch", "lfs_upload"} & {k for _, k in hub.state.requests}

    before = len(hub.state.requests)
    run = _cli(hub, tmp_path / "puller", "roofline", "--hardware", "orin", "--model", REPO, "--json")
    assert run.returncode == 0, run.stderr
    snapshot = Path(json.loads(run.stdout)["model"])
    assert {name: (snapshot / name).read_bytes() for name in weights} == weights  # byte-identical, through Xet
    served = [h for kind, h in cas.events if kind == "reconstruction"]
    assert sorted(served) == sorted(xet_files.values())
    assert {h for kind, h in cas.events if kind == "fetch"} == {h for kind, h in cas.events if kind == "xorb"}
    downloads = [kind for method, kind in hub.state.requests[before:] if method == "GET" and kind == "resolve"]
    assert len(downloads) == len([p for p in snapshot.iterdir() if p.name not in weights])  # weights: no HTTP GET


def test_blake3_matches_the_published_test_vectors():
    """BLAKE3's keyed-hash vectors (BLAKE3-team/BLAKE3, test_vectors/test_vectors.json: input i % 251, first 32
    bytes of the output), covering one block, one chunk, and trees of 2 to 100 chunks."""
    key = b"whats the Elvish word for friend"
    vectors = {0: "92b2b75604ed3c761f9d6f62392c8a9227ad0ea3f09573e783f1498a4ed60d26",
               1: "6d7878dfff2f485635d39013278ae14f1454b8c0a3a2d34bc1ab38228a80c95b",
               1023: "c951ecdf03288d0fcc96ee3413563d8a6d3589547f2c2fb36d9786470f1b9d6e",
               1024: "75c46f6f3d9eb4f55ecaaee480db732e6c2105546f1e675003687c31719c7ba4",
               1025: "357dc55de0c7e382c900fd6e320acc04146be01db6a8ce7210b7189bd664ea69",
               3073: "68dede9bef00ba89e43f31a6825f4cf433389fedae75c04ee9f0cf16a427c95a",
               7169: "ed9b1a922c046fdb3d423ae34e143b05ca1bf28b710432857bf738bcedbfa511",
               31744: "efa53b389ab67c593dba624d898d0f7353ab99e4ac9d42302ee64cbf9939a419",
               102400: "1c35d1a5811083fd7119f5d5d1ba027b4d01c0c6c49fb6ff2cf75393ea5db4a7"}
    digests = blake3_keyed(key, [bytes(i % 251 for i in range(n)) for n in vectors])
    assert [d.hex() for d in digests] == list(vectors.values())


def test_chunks_decompress_from_lz4_frames_and_bg4_planes():
    """An LZ4 frame as lz4_flex writes one: "abcabcabcabcX" as 3 literals, a 9-byte match at distance 3
    (overlapping), then the literal tail; a block stored raw (high bit of its size); and BG4's byte planes
    (bytes 0, 4, 8.. first, then 1, 5, 9..) put back in order, for a length that is not a multiple of 4."""
    block = bytes([0x35]) + b"abc" + bytes([3, 0]) + bytes([0x10]) + b"X"
    frame = b"\x04\x22\x4d\x18" + bytes([0x60, 0x40, 0x82]) + struct.pack("<I", len(block)) + block
    assert lz4_frame(frame + bytes(4)) == b"abcabcabcabcX"
    raw = b"\x04\x22\x4d\x18" + bytes([0x60, 0x40, 0x82]) + struct.pack("<I", 0x80000003) + b"xyz" + bytes(4)
    assert lz4_frame(raw) == b"xyz"
    data = bytes(range(11))
    assert bg4_regroup(b"".join(data[k::4] for k in range(4))) == data
    assert DECOMPRESS[2](frame + bytes(4)) == bg4_regroup(b"abcabcabcabcX")


def _hash_bytes(text: str) -> bytes:
    return struct.pack("<4Q", *(int(text[i:i + 16], 16) for i in range(0, 64, 16)))


def _shard(file_id: bytes, xorb: str, chunks: int, size: int, verification: bytes, sha256: str) -> bytes:
    """A shard with one file made of chunks [0, chunks) of one xorb, laid out as xet-core writes it."""
    tag = b"HFRepoMetaData\0" + bytes([85, 105, 103, 69, 106, 123, 129, 87, 131, 165, 189, 217, 92, 205, 209, 74,
                                       169])
    bookend = b"\xff" * 32 + bytes(16)
    file_entry = file_id + struct.pack("<IIQ", 3 << 30, 1, 0) + _hash_bytes(xorb) + struct.pack("<IIII", 0, size, 0,
                                                                                                  chunks)
    return tag + struct.pack("<QQ", 2, 0) + file_entry + verification + bytes(16) + _hash_bytes(sha256) + \
        bytes(16) + bookend + bookend


def _http(method: str, url: str, body: bytes = b"", token: str | None = None, headers: dict | None = None):
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, data=body if method == "POST" else None, method=method,
                                     headers={**auth, **(headers or {})})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _cas(hub, method: str, path: str, body: bytes = b"", token: str | None = None):
    return _http(method, f"{hub.url}/cas/{path}", body, token)


def test_the_cas_refuses_what_does_not_verify_and_keeps_repositories_apart(published):
    hub, cas = published, published.state.xet
    xorb_id, xorb = next(iter(cas.repos[REPO].xorbs.items()))
    write = cas.grant("someone/other", write=True, cas_url="")["accessToken"]
    read_other = cas.grant("someone/third", write=False, cas_url="")["accessToken"]
    n, size = len(xorb.hashes), sum(xorb.sizes)
    data = b"".join(xorb.chunks)
    chunk_pairs = list(zip(xorb.hashes, xorb.sizes))
    verification = blake3_keyed(VERIFICATION_KEY, [b"".join(xorb.hashes)])[0]
    file_id = file_hash(chunk_pairs)
    shard = _shard(file_id, xorb_id, n, size, verification, hashlib.sha256(data).hexdigest())
    assert xet_hex(merkle_root(chunk_pairs)) == xorb_id and blake3_keyed(DATA_KEY, xorb.chunks) == xorb.hashes

    # another repository cannot build a file from this repository's xorb without uploading it itself
    assert _cas(hub, "POST", "v2/shards", shard, write)[0] == 400
    assert "which this repository does not hold" in cas.refusals[-1]
    tampered = bytearray(xorb.serialized)
    tampered[len(tampered) // 2] ^= 1
    assert _cas(hub, "POST", f"v1/xorbs/default/{xorb_id}", bytes(tampered), write)[0] == 400
    assert _cas(hub, "POST", f"v1/xorbs/default/{'0' * 64}", xorb.serialized, write)[0] == 400
    assert cas.repos["someone/other"].xorbs == {}
    assert _cas(hub, "POST", f"v1/xorbs/default/{xorb_id}", xorb.serialized, read_other)[0] == 403
    assert _cas(hub, "POST", f"v1/xorbs/default/{xorb_id}", xorb.serialized)[0] == 401
    status, answer = _cas(hub, "POST", f"v1/xorbs/default/{xorb_id}", xorb.serialized, write)
    assert (status, json.loads(answer)) == (200, {"was_inserted": True})

    # a shard must prove it knows the chunks (verification hash) and state the content's true SHA-256
    wrong = [_shard(file_id, xorb_id, n, size, bytes(32), hashlib.sha256(data).hexdigest()),
             _shard(file_id, xorb_id, n, size, verification, hashlib.sha256(data + b"!").hexdigest()),
             _shard(bytes(32), xorb_id, n, size, verification, hashlib.sha256(data).hexdigest()),
             _shard(file_id, xorb_id, n, size + 1, verification, hashlib.sha256(data).hexdigest())]
    assert [_cas(hub, "POST", "v2/shards", body, write)[0] for body in wrong] == [400] * 4
    assert cas.repos["someone/other"].files == {}
    assert _cas(hub, "POST", "v2/shards", shard, write)[0] == 200
    assert cas.file_bytes("someone/other", hashlib.sha256(data).hexdigest()) == data

    # reading: only with a grant for the repository, and only the signed byte range
    assert _cas(hub, "GET", f"v2/reconstructions/{xet_hex(file_id)}", token=read_other)[0] == 404
    status, answer = _cas(hub, "GET", f"v2/reconstructions/{xet_hex(file_id)}", token=write)
    assert status == 200
    (fetch,) = json.loads(answer)["xorbs"][xorb_id]
    ((span,),) = [[r["bytes"] for r in fetch["ranges"]]]
    assert _http("GET", fetch["url"], headers={"Range": f"bytes={span['start']}-{span['end']}"}) == \
        (206, xorb.serialized[span["start"]:span["end"] + 1])
    assert _http("GET", fetch["url"], headers={"Range": f"bytes=0-{len(xorb.serialized) + 9}"})[0] == 403
