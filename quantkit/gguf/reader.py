"""Opening a GGUF file that may come from anywhere (the Hub, a user's disk) with one clear error.

gguf-py meets a malformed file with whatever its parsing hits (IndexError, ValueError from NumPy,
struct errors, a memory map past the end), so every reader in quantkit opens files here and names
the file and the cause in an error of its own choosing.

Before gguf-py parses it, the header, metadata and tensor table are walked here once, checking that
every length they state lies inside the file: gguf-py reads an array item by item, and past the end
of its memory map each item is silently empty, so an array that claims 2^62 items (a 165-byte file)
would have it loop, growing without end.
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # those gguf-py reads; it refuses the others itself
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 8  # arrays of arrays: GGUF writers nest at most once
# GGUF's metadata value types: fixed-size scalars by id, and the two of variable size
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
SMALLEST = {STRING: 8, ARRAY: 12}  # the fewest bytes a string or an array can take: its length fields


class _Malformed(Exception):
    pass


class _Walk:
    """A cursor over the file's bytes that never reads past their end."""

    def __init__(self, data, order: str):
        self.data, self.order, self.offset = data, order, 0

    def skip(self, size: int, what: str) -> int:
        start = self.offset
        if size > len(self.data) - start:
            raise _Malformed(f"{what} at byte {start} claims {size:,} bytes, past the end of the file "
                             f"({len(self.data):,} bytes)")
        self.offset += size
        return start

    def number(self, fmt: str, what: str) -> int:
        return struct.unpack_from(self.order + fmt, self.data, self.skip(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> None:
        self.skip(self.number("Q", f"{what}'s length"), what)

    def value(self, kind: int, what: str, depth: int = 0) -> None:
        if kind in SCALAR_BYTES:
            self.skip(SCALAR_BYTES[kind], what)
        elif kind == STRING:
            self.string(what)
        elif kind == ARRAY:
            if depth >= MAX_NESTING:
                raise _Malformed(f"{what} nests arrays more than {MAX_NESTING} deep")
            item = self.number("I", f"{what}'s item type")
            count = self.number("Q", f"{what}'s length")
            if item in SCALAR_BYTES:
                self.skip(count * SCALAR_BYTES[item], what)
                return
            if item not in SMALLEST:
                raise _Malformed(f"{what} has items of unknown type {item}")
            self.skip(count * SMALLEST[item], what)  # the least the items take: refuse a count beyond it
            self.offset -= count * SMALLEST[item]
            for index in range(count):
                self.value(item, f"{what}[{index}]", depth + 1)
        else:
            raise _Malformed(f"{what} has unknown type {kind}")


def check_layout(data) -> None:
    """Raises _Malformed unless every length in the header, metadata and tensor table of the GGUF bytes
    ``data`` lies inside them (the version's byte order as gguf-py detects it)."""
    if bytes(data[:4]) != MAGIC:
        raise _Malformed("no GGUF magic")
    walk = _Walk(data, "<")
    walk.skip(4, "the magic")
    version = walk.number("I", "the version")
    if version & 0xFFFF == 0:  # written big-endian
        walk.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in VERSIONS:
        return  # gguf-py refuses it with its own message
    tensors = walk.number("Q", "the tensor count")
    fields = walk.number("Q", "the metadata count")
    walk.skip(fields * 12, "the metadata")  # a key's length and a type, at least, per field
    walk.offset -= fields * 12
    for index in range(fields):
        walk.string(f"metadata key {index}")
        walk.value(walk.number("I", f"metadata {index}'s type"), f"metadata {index}")
    walk.skip(tensors * 24, "the tensor table")  # a name's length, dimensions, type and offset, at least
    walk.offset -= tensors * 24
    for index in range(tensors):
        walk.string(f"tensor {index}'s name")
        dims = walk.number("I", f"tensor {index}'s dimension count")
        if dims > MAX_DIMS:
            raise _Malformed(f"tensor {index} has {dims} dimensions (at most {MAX_DIMS})")
        walk.skip(8 * dims + 12, f"tensor {index}'s shape, type and offset")


def open_gguf(path: str | Path, error: type[Exception] = ValueError):
    """``gguf.GGUFReader`` of ``path``, or ``error`` naming the file if it is not a readable GGUF file."""
    from gguf import GGUFReader

    try:
        with open(path, "rb") as file:
            if file.seek(0, 2) == 0:
                raise _Malformed("the file is empty")
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                check_layout(data)
        return GGUFReader(path)
    except _Malformed as cause:
        raise error(f"{path} is not a readable GGUF file ({cause})") from None
    except Exception as cause:
        raise error(f"{path} is not a readable GGUF file ({type(cause).__name__}: {cause})") from cause
