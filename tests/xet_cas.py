"""Xet storage for the Hub stand-in (tests/hub_server.py): the content-addressed storage (CAS) server that
the ``hf_xet`` client uploads to and downloads from, verifying everything it receives.

What the client speaks (read from xet-core's Rust sources, crates xet_client, xet_core_structures; and its
OpenAPI description, openapi/cas.openapi.yaml), with every request authorized by the short-lived token the
Hub grants (``Authorization: Bearer``, a write or read grant for one repository):

- ``POST /v1/xorbs/default/{hash}``: a xorb, i.e. a run of chunks (each an 8-byte header and its data:
  uncompressed, LZ4 frame, or LZ4 frame of the bytes regrouped in four planes, "BG4") followed by a footer
  listing every chunk's hash, packed and unpacked boundaries. Answer ``{"was_inserted": bool}``.
- ``POST /v2/shards``: a shard, i.e. file entries (which chunk ranges of which xorbs make each file, a
  verification hash per range and the file's SHA-256) and xorb entries. Answer NDJSON progress frames
  ending in ``{"type": "result"}``. (``/v1/shards`` is the older form the client falls back to on a 404;
  this server does not need it.)
- ``GET /v2/reconstructions/{file hash}`` (optionally with ``Range``): the terms that rebuild a file and,
  for each xorb, a signed URL and the byte range of its chunks to fetch; ``GET`` on that URL with exactly
  that ``Range`` answers the packed chunks.
- ``GET /v1/chunks/default-merkledb/{hash}`` (global deduplication: 404, not offered) and
  ``POST /v1/telemetry`` (accepted, ignored).

Hashes are BLAKE3 keyed hashes (implemented here with numpy from the BLAKE3 specification; checked
against its published test vectors in tests/test_hub_xet.py): a chunk's hash keys its bytes with
``DATA_KEY``; a xorb's hash is the root of a tree that merges 2 to 9 ``"{hash} : {size}"`` lines at a time
under ``INTERNAL_NODE_KEY``, cutting after a node whose last 64-bit word is divisible by 4; a file's hash
is that root keyed once more with 32 zero bytes; a term's verification hash keys the concatenated chunk
hashes of its range with ``VERIFICATION_KEY``. Hashes travel as text in Xet's own order: the four
little-endian 64-bit words, each as 16 hex digits.

The server trusts nothing it is told: a xorb's chunks are decompressed, hashed and checked against its
footer and the hash in the URL; a shard is accepted only if every xorb it names is held by the same
repository with the same chunks, every term's size and verification hash match, the file hash recomputes,
and the reconstructed bytes have the SHA-256 it states. Storage is per repository: a grant for one
repository neither reads nor builds on another's xorbs.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import struct
import time
from dataclasses import dataclass, field
from urllib.parse import quote

import numpy as np

# -- BLAKE3 (keyed mode, 32-byte output), vectorised over many messages --------------------------------------
_IV = np.array([0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19],
               dtype=np.uint32)
_PERMUTATION = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
_CHUNK_START, _CHUNK_END, _PARENT, _ROOT, _KEYED_HASH = 1, 2, 4, 8, 16
_BLOCK, _CHUNK = 64, 1024
# (a, b, c, d) state indices of the eight G applications of a round: four columns, then four diagonals
_G_ORDER = ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
            (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14))


def _rotr(x: np.ndarray, n: int) -> np.ndarray:
    return (x >> np.uint32(n)) | (x << np.uint32(32 - n))


def _compress(cv: np.ndarray, block: np.ndarray, counter: np.ndarray, block_len: np.ndarray,
              flags: np.ndarray) -> np.ndarray:
    """BLAKE3's compression function on N lanes at once: cv (8, N), block (16, N) words -> new cv (8, N)."""
    lanes = cv.shape[1]
    v = [cv[i].copy() for i in range(8)] + [np.full(lanes, _IV[i], dtype=np.uint32) for i in range(4)]
    v += [(counter & 0xFFFFFFFF).astype(np.uint32), (counter >> 32).astype(np.uint32),
          block_len.astype(np.uint32), flags.astype(np.uint32)]
    m = [block[i] for i in range(16)]
    for round_ in range(7):
        for g, (a, b, c, d) in enumerate(_G_ORDER):
            x, y = m[2 * g], m[2 * g + 1]
            v[a] = v[a] + v[b] + x
            v[d] = _rotr(v[d] ^ v[a], 16)
            v[c] = v[c] + v[d]
            v[b] = _rotr(v[b] ^ v[c], 12)
            v[a] = v[a] + v[b] + y
            v[d] = _rotr(v[d] ^ v[a], 8)
            v[c] = v[c] + v[d]
            v[b] = _rotr(v[b] ^ v[c], 7)
        if round_ < 6:
            m = [m[i] for i in _PERMUTATION]
    return np.stack([v[i] ^ v[i + 8] for i in range(8)])


def blake3_keyed(key: bytes, messages: list[bytes]) -> list[bytes]:
    """The 32-byte BLAKE3 keyed hash of each message (all messages' 1 KiB chunks are compressed together)."""
    key_words = np.frombuffer(key, dtype="<u4").astype(np.uint32)
    counts = [max(1, -(-len(m) // _CHUNK)) for m in messages]
    padded = b"".join(m.ljust(n * _CHUNK, b"\0") for m, n in zip(messages, counts))
    words = np.frombuffer(padded, dtype="<u4").reshape(-1, _CHUNK // 4)
    lengths = np.concatenate([np.clip(len(m) - _CHUNK * np.arange(n), 0, _CHUNK) for m, n in zip(messages, counts)])
    counters = np.concatenate([np.arange(n, dtype=np.uint64) for n in counts])
    single = np.repeat(np.array(counts) == 1, counts)
    last_block = np.maximum(1, -(-lengths // _BLOCK)) - 1
    lanes = len(lengths)
    cv = np.repeat(key_words[:, None], lanes, axis=1)
    for b in range(_CHUNK // _BLOCK):
        active = b <= last_block
        if not active.any():
            break
        is_last = b == last_block
        flags = _KEYED_HASH | np.where(b == 0, _CHUNK_START, 0) | np.where(is_last, _CHUNK_END, 0) \
            | np.where(is_last & single, _ROOT, 0)
        block_len = np.clip(lengths - _BLOCK * b, 0, _BLOCK)
        out = _compress(cv, np.ascontiguousarray(words[:, 16 * b:16 * b + 16].T), counters, block_len, flags)
        cv = np.where(active, out, cv)
    # The chunk chaining values of each message merge pairwise, level by level (an odd last node moves up
    # unchanged): the same tree as BLAKE3's "largest power of two on the left" rule.
    nodes = list(cv.T)
    trees, start = [], 0
    for n in counts:
        trees.append(list(range(start, start + n)))
        start += n
    while any(len(t) > 1 for t in trees):
        pairs = [(t[i], t[i + 1], len(t) == 2) for t in trees if len(t) > 1 for i in range(0, len(t) - 1, 2)]
        block = np.stack([np.concatenate([nodes[left], nodes[right]]) for left, right, _ in pairs], axis=1)
        root = np.array([is_root for _, _, is_root in pairs])
        out = _compress(np.repeat(key_words[:, None], len(pairs), axis=1), block, np.zeros(len(pairs), np.uint64),
                        np.full(len(pairs), _BLOCK), _KEYED_HASH | _PARENT | np.where(root, _ROOT, 0))
        parents = iter(range(len(nodes), len(nodes) + len(pairs)))
        nodes.extend(out.T)
        trees = [[next(parents) for _ in range(len(t) // 2)] + t[len(t) - len(t) % 2:] if len(t) > 1 else t
                 for t in trees]
    return [nodes[t[0]].astype("<u4").tobytes() for t in trees]


# -- Xet's hashes ----------------------------------------------------------------------------------------------
# Keys from xet-core (xet_core_structures: merklehash/data_hash.rs, metadata_shard/chunk_verification.rs).
DATA_KEY = bytes([102, 151, 245, 119, 91, 149, 80, 222, 49, 53, 203, 172, 165, 151, 24, 28, 157, 228, 33, 16,
                  155, 235, 43, 88, 180, 208, 176, 75, 147, 173, 242, 41])
INTERNAL_NODE_KEY = bytes([1, 126, 197, 199, 165, 71, 41, 150, 253, 148, 102, 102, 180, 138, 2, 230, 93, 221, 83,
                           111, 55, 199, 109, 210, 248, 99, 82, 230, 74, 83, 113, 63])
VERIFICATION_KEY = bytes([127, 24, 87, 214, 206, 86, 237, 102, 18, 127, 249, 19, 231, 165, 195, 243, 164, 205, 38,
                          213, 181, 219, 73, 230, 65, 36, 152, 127, 40, 251, 148, 195])
FILE_KEY = bytes(32)
BRANCHING, MAX_GROUP = 4, 9


def xet_hex(digest: bytes) -> str:
    """Xet's text form of a hash: its four little-endian 64-bit words, each as 16 hex digits."""
    return "".join(f"{word:016x}" for word in struct.unpack("<4Q", digest))


def _group_end(level: list[tuple[bytes, int]], start: int) -> int:
    """Where the group starting at ``start`` ends: after the first node from its third on whose last word is
    divisible by the branching factor, or after 9 nodes, or at the end."""
    end = min(start + MAX_GROUP, len(level))
    if end - start <= 2:
        return end
    for i in range(start + 2, end):
        if int.from_bytes(level[i][0][24:], "little") % BRANCHING == 0:
            return i + 1
    return end


def merkle_root(nodes: list[tuple[bytes, int]]) -> bytes:
    """The aggregated hash of (hash, size) nodes: a xorb's hash; keyed again, a file's."""
    level = list(nodes)
    while len(level) > 1:
        groups, start = [], 0
        while start < len(level):
            end = _group_end(level, start)
            groups.append(level[start:end])
            start = end
        lines = ["".join(f"{xet_hex(h)} : {size}\n" for h, size in group).encode() for group in groups]
        level = [(digest, sum(size for _, size in group))
                 for digest, group in zip(blake3_keyed(INTERNAL_NODE_KEY, lines), groups)]
    return level[0][0] if level else bytes(32)


def file_hash(chunks: list[tuple[bytes, int]]) -> bytes:
    return blake3_keyed(FILE_KEY, [merkle_root(chunks)])[0] if chunks else bytes(32)


# -- chunk decompression -----------------------------------------------------------------------------------------
class Refused(ValueError):
    """Input the CAS refuses; the message says what is wrong (answered with 400)."""


def _lz4_length(data: bytes, i: int, nibble: int) -> tuple[int, int]:
    """An LZ4 length: the token's 4-bit ``nibble``, and when that is 15, the bytes from ``i`` added to it up
    to and including the first that is not 255. Returns the length and the position after it."""
    length = nibble
    if nibble == 15:
        while True:
            extra = data[i]
            i += 1
            length += extra
            if extra != 255:
                break
    return length, i


def _lz4_block(data: bytes, out: bytearray) -> None:
    """Append the LZ4 block ``data`` decodes to ``out`` (earlier output may be referenced: linked blocks)."""
    i, n = 0, len(data)
    while i < n:
        token = data[i]
        i += 1
        literals, i = _lz4_length(data, i, token >> 4)
        out += data[i:i + literals]
        i += literals
        if i >= n:  # the last sequence has literals only
            return
        offset = data[i] | data[i + 1] << 8
        i += 2
        length, i = _lz4_length(data, i, token & 15)
        length += 4  # a match is at least 4 bytes long
        if offset == 0 or offset > len(out):
            raise Refused("LZ4 match points before the start of the data")
        start = len(out) - offset
        if offset >= length:
            out += out[start:start + length]
        else:  # overlapping copy: the last `offset` bytes repeat
            out += (bytes(out[start:]) * (length // offset + 1))[:length]


def lz4_frame(data: bytes) -> bytes:
    """The content of one LZ4 frame (the frame format lz4_flex writes; checksums are skipped: the chunk hash
    checks the content)."""
    if data[:4] != b"\x04\x22\x4d\x18":
        raise Refused("chunk is not an LZ4 frame")
    flags = data[4]
    i = 7 + (8 if flags & 0x08 else 0) + (4 if flags & 0x01 else 0)  # magic, FLG, BD, [size], [dict id], HC
    out = bytearray()
    while True:
        (size,) = struct.unpack_from("<I", data, i)
        i += 4
        if size == 0:
            return bytes(out)
        raw, size = size & 0x80000000, size & 0x7FFFFFFF
        block = data[i:i + size]
        if len(block) != size:
            raise Refused("LZ4 block runs past the chunk")
        if raw:
            out += block
        else:
            _lz4_block(block, out)
        i += size + (4 if flags & 0x10 else 0)


def bg4_regroup(grouped: bytes) -> bytes:
    """Undo the BG4 split: byte k of every 4 was stored in plane k (planes 0..3 one after another)."""
    n = len(grouped)
    sizes = [n // 4 + (1 if k < n % 4 else 0) for k in range(4)]
    out, start = bytearray(n), 0
    for k, size in enumerate(sizes):
        out[k::4] = grouped[start:start + size]
        start += size
    return bytes(out)


DECOMPRESS = {0: bytes, 1: lz4_frame, 2: lambda data: bg4_regroup(lz4_frame(data))}  # by the header's scheme byte


# -- xorbs ------------------------------------------------------------------------------------------------------
MAX_CHUNK_BYTES, MAX_XORB_BYTES, MAX_XORB_CHUNKS = 128 * 1024, 64 * 2**20, 8 * 1024  # xet-core's limits
CHUNK_HEADER = 8
FOOTER_IDENT = b"XETBLOB"  # never the start of a chunk header (its version byte is 0)


class _Reader:
    """Little-endian fields off a byte string, refusing to read past its end."""

    def __init__(self, data: bytes, what: str):
        self.data, self.at, self.what = data, 0, what

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise Refused(f"{self.what} ends early")
        self.at += n
        return self.data[self.at - n:self.at]

    def expect(self, value: bytes, name: str) -> None:
        if self.take(len(value)) != value:
            raise Refused(f"{self.what}: bad {name}")


@dataclass
class Xorb:
    serialized: bytes
    hashes: list[bytes]
    sizes: list[int]  # unpacked size of each chunk
    ends: list[int]  # offset just past each packed chunk (header included)
    chunks: list[bytes] = field(repr=False)  # unpacked, to rebuild files

    def byte_range(self, start: int, end: int) -> tuple[int, int]:
        """The packed bytes of chunks [start, end), as an inclusive HTTP byte range."""
        return (self.ends[start - 1] if start else 0), self.ends[end - 1] - 1


def parse_xorb(body: bytes, claimed: str) -> Xorb:
    """The xorb ``body``: its chunks, each decompressed and hashed, their tree hash checked against ``claimed``
    and, when the client sent one, against the footer (hf_xet sends the chunks alone; the footer is optional).
    """
    chunks, ends, at = [], [], 0
    while at < len(body) and body[at:at + len(FOOTER_IDENT)] != FOOTER_IDENT:
        header = body[at:at + CHUNK_HEADER]
        version, scheme = header[0], header[4] if len(header) == CHUNK_HEADER else -1
        packed, unpacked = int.from_bytes(header[1:4], "little"), int.from_bytes(header[5:8], "little")
        if version != 0 or scheme not in DECOMPRESS or unpacked > MAX_CHUNK_BYTES:
            raise Refused(f"xorb chunk {len(chunks)} has a bad header")
        data = DECOMPRESS[scheme](body[at + CHUNK_HEADER:at + CHUNK_HEADER + packed])
        if len(data) != unpacked:
            raise Refused(f"xorb chunk {len(chunks)} does not decompress to the size its header states")
        at += CHUNK_HEADER + packed
        chunks.append(data)
        ends.append(at)
    sizes = [len(c) for c in chunks]
    if not 0 < len(chunks) <= MAX_XORB_CHUNKS or sum(sizes) > MAX_XORB_BYTES:
        raise Refused(f"xorb has {len(chunks)} chunks and {sum(sizes)} bytes")
    hashes = blake3_keyed(DATA_KEY, chunks)
    actual = merkle_root(list(zip(hashes, sizes)))
    if at < len(body):
        _check_footer(body[at:], actual, hashes, ends, np.cumsum(sizes).tolist())
    if xet_hex(actual) != claimed:
        raise Refused(f"xorb hash is {xet_hex(actual)}, not {claimed}")
    return Xorb(body, hashes, sizes, ends, chunks)


def _check_footer(footer: bytes, xorb_hash: bytes, hashes: list[bytes], ends: list[int],
                  unpacked_ends: list[int]) -> None:
    """A xorb footer (format version 1, then its own length) must state exactly what the chunks are."""
    count = len(hashes)
    info = _Reader(footer, "xorb footer")
    info.expect(FOOTER_IDENT + b"\x01", "ident or version")
    info.expect(xorb_hash, "xorb hash")
    info.expect(b"XBLBHSH\x00", "hash section")
    info.expect(struct.pack("<I", count) + b"".join(hashes), "chunk hashes")
    info.expect(b"XBLBBND\x01", "boundary section")
    info.expect(struct.pack(f"<{2 * count + 2}I", count, *ends, *unpacked_ends, count), "chunk boundaries")
    length = len(footer) - 4
    info.expect(struct.pack("<II", length - 40, length - 52 - 32 * count), "section offsets")
    info.take(16)  # reserved (a per-upload nonce), not part of the hash
    info.expect(struct.pack("<I", length), "length")
    if info.at != len(footer):
        raise Refused("xorb has bytes after its footer")


# -- shards -------------------------------------------------------------------------------------------------------
SHARD_TAG = b"HFRepoMetaData\0" + bytes([85, 105, 103, 69, 106, 123, 129, 87, 131, 165, 189, 217, 92, 205, 209, 74,
                                          169])
BOOKEND = b"\xff" * 32
WITH_VERIFICATION, WITH_SHA256 = 1 << 31, 1 << 30


@dataclass
class Term:
    xorb: str
    start: int
    end: int
    size: int
    verification: bytes | None = None


@dataclass
class FileEntry:
    hash: str
    terms: list[Term]
    sha256: str | None


@dataclass
class XorbEntry:
    hash: str
    chunks: list[tuple[bytes, int, int]]  # (hash, unpacked start, unpacked size)


def parse_shard(body: bytes) -> tuple[list[FileEntry], list[XorbEntry]]:
    """The file and xorb sections of an uploaded shard (the lookup tables and footer, if any, are not needed)."""
    shard = _Reader(body, "shard")
    shard.expect(SHARD_TAG, "header tag")
    if struct.unpack("<QQ", shard.take(16))[0] != 2:
        raise Refused("shard header version is not 2")
    files = []
    while (head := shard.take(48))[:32] != BOOKEND:
        flags, count = struct.unpack_from("<II", head, 32)
        entries = [shard.take(48) for _ in range(count)]
        terms = [Term(xet_hex(e[:32]), *struct.unpack_from("<II", e, 40), struct.unpack_from("<I", e, 36)[0])
                 for e in entries]
        if flags & WITH_VERIFICATION:
            for term in terms:
                term.verification = shard.take(48)[:32]
        sha256 = xet_hex(shard.take(48)[:32]) if flags & WITH_SHA256 else None
        files.append(FileEntry(xet_hex(head[:32]), terms, sha256))
    xorbs = []
    while (head := shard.take(48))[:32] != BOOKEND:
        (count,) = struct.unpack_from("<I", head, 36)
        chunks = []
        for _ in range(count):
            entry = shard.take(48)
            start, size = struct.unpack_from("<II", entry, 32)
            chunks.append((entry[:32], start, size))
        xorbs.append(XorbEntry(xet_hex(head[:32]), chunks))
    return files, xorbs


# -- the server ------------------------------------------------------------------------------------------------
TOKEN_LIFETIME = 3600  # seconds; the client refreshes through the Hub's token endpoint before expiry


@dataclass
class Grant:
    repo_id: str
    write: bool
    expires: int


@dataclass
class RepoStore:
    xorbs: dict[str, Xorb] = field(default_factory=dict)
    files: dict[str, FileEntry] = field(default_factory=dict)  # by Xet file hash
    by_sha256: dict[str, str] = field(default_factory=dict)  # SHA-256 -> Xet file hash

    def rebuild(self, entry: FileEntry) -> bytes:
        return b"".join(c for t in entry.terms for c in self.xorbs[t.xorb].chunks[t.start:t.end])


def _is_hash(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def _byte_range(value: str | None, size: int) -> tuple[int, int] | None:
    """``Range: bytes=a-b`` (inclusive) as (a, b) clipped to ``size``; None without the header."""
    if value is None:
        return None
    first, _, last = value.removeprefix("bytes=").partition("-")
    if not first.isdigit() or int(first) >= size:
        raise IndexError(value)
    return int(first), min(int(last), size - 1) if last.isdigit() else size - 1


@dataclass
class Request:
    path: list[str]
    query: dict
    headers: object  # the request's headers (an email.message.Message: .get by name)
    body: bytes
    cas_url: str
    repo_id: str = ""  # the repository the token grants, for requests that carry one
    store: RepoStore | None = None


class XetCAS:
    """Per-repository Xet storage answering the hf_xet client; ``events`` records what it accepted and served
    (``("xorb", hash)``, ``("file", hash)``, ``("reconstruction", hash)``, ``("fetch", xorb hash)``) and
    ``refusals`` what it refused, for the tests to read."""

    def __init__(self):
        self.repos: dict[str, RepoStore] = {}
        self.grants: dict[str, Grant] = {}
        self.events: list[tuple[str, str]] = []
        self.refusals: list[str] = []
        self._secret = secrets.token_bytes(32)  # signs fetch URLs, as a storage bucket signs its URLs

    # -- what the Hub side asks -------------------------------------------------------------------------------
    def grant(self, repo_id: str, write: bool, cas_url: str) -> dict:
        """A fresh access token for ``repo_id``, in the token endpoint's JSON shape."""
        token, expires = f"xet_{secrets.token_hex(16)}", int(time.time()) + TOKEN_LIFETIME
        self.grants[token] = Grant(repo_id, write, expires)
        return {"accessToken": token, "exp": expires, "casUrl": cas_url}

    def file_of(self, repo_id: str, sha256: str) -> str | None:
        """The Xet file hash of the content with this SHA-256 that ``repo_id`` holds, if any."""
        return self.repos.get(repo_id, RepoStore()).by_sha256.get(sha256)

    def file_bytes(self, repo_id: str, sha256: str) -> bytes | None:
        store = self.repos.get(repo_id, RepoStore())
        file = store.files.get(store.by_sha256.get(sha256, ""))
        return None if file is None else store.rebuild(file)

    # -- HTTP ------------------------------------------------------------------------------------------------------
    def serve(self, method: str, path: list[str], query: dict, headers, body: bytes,
              cas_url: str) -> tuple[int, bytes, dict]:
        """Answer one CAS request: (status, body, headers)."""
        for route_method, shape, handler, scope in CAS_ROUTES:
            if method == route_method and len(path) == len(shape) and \
                    all(s == p or (s is HASH and _is_hash(p)) for s, p in zip(shape, path)):
                request = Request(path, query, headers, body, cas_url)
                if scope is None:
                    return handler(self, request)
                grant = self.grants.get(headers.get("Authorization", "").removeprefix("Bearer "))
                if grant is None or grant.expires < time.time():
                    return _json(401, {"error": "missing or expired Xet access token"})
                if scope == "write" and not grant.write:
                    return _json(403, {"error": "this token may only read"})
                request.repo_id, request.store = grant.repo_id, self.repos.setdefault(grant.repo_id, RepoStore())
                try:
                    return handler(self, request)
                except Refused as refused:
                    self.refusals.append(str(refused))
                    return _json(400, {"error": str(refused)})
        return _json(404, {"error": f"no CAS route for {method} /{'/'.join(path)}"})

    def upload_xorb(self, request: Request):
        claimed, store = request.path[-1], request.store
        if claimed in store.xorbs:
            return _json(200, {"was_inserted": False})
        store.xorbs[claimed] = parse_xorb(request.body, claimed)
        self.events.append(("xorb", claimed))
        return _json(200, {"was_inserted": True})

    def upload_shard(self, request: Request):
        store = request.store
        files, xorbs = parse_shard(request.body)
        for entry in xorbs:
            held = store.xorbs.get(entry.hash)
            if held is None:
                raise Refused(f"shard lists xorb {entry.hash}, which this repository does not hold")
            starts = np.cumsum([0] + held.sizes[:-1]).tolist()
            if entry.chunks != list(zip(held.hashes, starts, held.sizes)):
                raise Refused(f"shard describes xorb {entry.hash} with other chunks than it holds")
        for file in files:
            self._verify(store, file)
        for file in files:  # registered only once the whole shard verified
            store.files[file.hash] = file
            if file.sha256:
                store.by_sha256[file.sha256] = file.hash
            self.events.append(("file", file.hash))
        frames = [{"type": "validating", "verified": len(files), "total": len(files)}, {"type": "result"}]
        return 200, "".join(json.dumps(f) + "\n" for f in frames).encode(), {"Content-Type": "application/x-ndjson"}

    def _verify(self, store: RepoStore, file: FileEntry) -> None:
        chunks = []
        for term in file.terms:
            xorb = store.xorbs.get(term.xorb)
            if xorb is None:
                raise Refused(f"file {file.hash} is built from xorb {term.xorb}, which this repository does not hold")
            if not 0 <= term.start < term.end <= len(xorb.hashes):
                raise Refused(f"file {file.hash} names chunks {term.start}..{term.end} of a {len(xorb.hashes)}-chunk "
                              "xorb")
            if term.size != sum(xorb.sizes[term.start:term.end]):
                raise Refused(f"file {file.hash} states a wrong size for a range of xorb {term.xorb}")
            if term.verification is None:
                raise Refused(f"file {file.hash} carries no verification hashes")
            chunks += zip(xorb.hashes[term.start:term.end], xorb.sizes[term.start:term.end])
        ranges = [b"".join(store.xorbs[t.xorb].hashes[t.start:t.end]) for t in file.terms]
        if blake3_keyed(VERIFICATION_KEY, ranges) != [t.verification for t in file.terms]:
            raise Refused(f"file {file.hash}: a verification hash does not match the chunks it names")
        if xet_hex(file_hash(chunks)) != file.hash:
            raise Refused(f"file hash {file.hash} does not match its chunks")
        if file.sha256 is not None and hashlib.sha256(store.rebuild(file)).hexdigest() != file.sha256:
            raise Refused(f"file {file.hash} does not have the SHA-256 it states")

    def reconstruction(self, request: Request):
        store, range_value = request.store, request.headers.get("Range")
        file = store.files.get(request.path[-1])
        if file is None:
            return _json(404, {"error": f"file {request.path[-1]} not found"})
        size = sum(t.size for t in file.terms)
        try:
            first, last = _byte_range(range_value, size) or (0, size - 1)
        except IndexError:
            return _json(416, {"error": f"range {range_value} starts past the file's {size} bytes"})
        terms, fetch, offset, at = [], {}, 0, 0
        for term in file.terms:  # the chunks overlapping [first, last], term by term
            xorb, kept = store.xorbs[term.xorb], []
            for index in range(term.start, term.end):
                if at + xorb.sizes[index] > first and at <= last:
                    offset = first - at if not terms and not kept else offset
                    kept.append(index)
                at += xorb.sizes[index]
            if kept:
                start, end = kept[0], kept[-1] + 1
                terms.append({"hash": term.xorb, "unpacked_length": sum(xorb.sizes[start:end]),
                              "range": {"start": start, "end": end}})
                fetch.setdefault(term.xorb, {})[(start, end)] = xorb.byte_range(start, end)
        xorbs = {h: [self._signed_fetch(request, h, chunks, span)
                     for chunks, span in sorted(ranges.items())] for h, ranges in fetch.items()}
        self.events.append(("reconstruction", file.hash))
        return _json(200, {"offset_into_first_range": offset, "terms": terms, "xorbs": xorbs})

    def _signature(self, repo_id: str, xorb: str, range_value: str) -> str:
        return hmac.new(self._secret, f"{repo_id}\n{xorb}\n{range_value}".encode(), hashlib.sha256).hexdigest()

    def _signed_fetch(self, request: Request, xorb: str, chunks: tuple[int, int], span: tuple[int, int]) -> dict:
        signature = self._signature(request.repo_id, xorb, f"bytes={span[0]}-{span[1]}")
        return {"url": f"{request.cas_url}/fetch/{xorb}?repo={quote(request.repo_id, safe='')}&sig={signature}",
                "ranges": [{"chunks": {"start": chunks[0], "end": chunks[1]},
                            "bytes": {"start": span[0], "end": span[1]}}]}

    def fetch(self, request: Request):
        """A signed URL from a reconstruction: the packed chunks of exactly the signed range, no token needed."""
        repo_id, xorb_hash = request.query.get("repo", [""])[0], request.path[-1]
        range_value = request.headers.get("Range", "")
        expected = self._signature(repo_id, xorb_hash, range_value)
        if not hmac.compare_digest(expected, request.query.get("sig", [""])[0]):
            return _json(403, {"error": "signature does not match this URL and Range"})
        xorb = self.repos[repo_id].xorbs[xorb_hash]
        first, last = _byte_range(range_value, len(xorb.serialized))
        self.events.append(("fetch", xorb_hash))
        return 206, xorb.serialized[first:last + 1], {"Content-Type": "application/octet-stream",
                                                      "Content-Range": f"bytes {first}-{last}/{len(xorb.serialized)}"}

    def no_global_dedup(self, request: Request):
        return _json(404, {"error": "global deduplication is not offered"})

    def telemetry(self, request: Request):
        return _json(200, {})


def _json(status: int, payload: dict) -> tuple[int, bytes, dict]:
    return status, json.dumps(payload).encode(), {"Content-Type": "application/json"}


HASH = object()  # a path segment that must be a 64-hex-digit hash
CAS_ROUTES = (  # method, path, handler, token scope (None: a signed URL, no token)
    ("POST", ("v1", "xorbs", "default", HASH), XetCAS.upload_xorb, "write"),
    ("POST", ("v2", "shards"), XetCAS.upload_shard, "write"),
    ("GET", ("v2", "reconstructions", HASH), XetCAS.reconstruction, "read"),
    ("GET", ("v1", "chunks", "default-merkledb", HASH), XetCAS.no_global_dedup, "read"),
    ("POST", ("v1", "telemetry"), XetCAS.telemetry, "read"),
    ("GET", ("fetch", HASH), XetCAS.fetch, None),
)
