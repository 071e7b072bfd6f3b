"""Files' SHA-256, read whole (``sha256_file``) or once per version of a file (``remembered_sha256s``). No torch.

Holding an artifact to its manifest at every start means hashing its weights: 5 GB for an 8B model at
4 bits, about 7 s at this machine's 1.4 s a GiB, against a first answer of about 2 s. So each digest is
remembered under the cache root, by the file's device and inode with its size, modification and change
times: the change time moves on every write and no call sets it back (unlike the modification time),
so a file is hashed when quantkit writes its manifest or first reads it, and again only once it changed.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from quantkit import atomic
from quantkit.cache import cache_root
from quantkit.errors import CheckpointError
from quantkit.json_files import read_json_object


def sha256_file(path: str | os.PathLike) -> str:
    """The SHA-256 of one file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


HASHED_FILES = "hashed-files.json"  # under the cache root
HASHED_FILES_KEPT = 10_000  # the most recently hashed; an older file is hashed again when next read


def sha256_files(paths: list[Path]) -> list[str]:
    """``sha256_file`` of each of ``paths``: every byte read, every time."""
    return [sha256_file(path) for path in paths]


def remembered_sha256s(paths: list[Path]) -> list[str]:
    """``sha256_file`` of each of ``paths``, read only for a version of a file not hashed before; the
    remembered digests are read once and written at most once, however many files."""
    store_path = cache_root() / HASHED_FILES
    try:
        store = read_json_object(store_path)
    except CheckpointError:  # none yet, or unreadable: it only saves work
        store = {}
    digests, hashed = [], False
    for path in paths:
        status = os.stat(path)
        key, version = f"{status.st_dev}:{status.st_ino}", [status.st_size, status.st_mtime_ns, status.st_ctime_ns]
        entry = store.get(key)
        if isinstance(entry, list) and entry[:3] == version and isinstance(entry[-1], str):
            digests.append(entry[-1])
            continue
        digests.append(sha256_file(path))  # hashed after the stat: a write meanwhile moves the change time on
        store.pop(key, None)
        store[key] = [*version, digests[-1]]
        hashed = True
    if hashed:
        try:
            atomic.write_json(store_path, dict(list(store.items())[-HASHED_FILES_KEPT:]))
        except atomic.OutputWriteError:  # a read-only cache: hashed again next time
            pass
    return digests
