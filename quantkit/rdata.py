"""Read R's XDR serialization: the data vectors of `.rds`/`.rda` files and R lazy-load databases.

Some public-domain texts reach this machine only inside R packages from Debian (janeaustenr's novels,
tidytext's books), stored as R objects. This reader knows the part of the format those objects use
(R Internals, "Serialization Formats"; R's src/main/serialize.c): pairlists, symbols, strings and the
atomic and generic vectors, with their attributes. Anything else (closures, environments, bytecode)
raises, so a file that holds more than data is refused rather than half-read.
"""
from __future__ import annotations

import gzip
import struct
import zlib
from dataclasses import dataclass, field

# SEXP type codes (the low byte of an item's flags) and the pseudo-types of the stream.
SYMBOL, PAIRLIST, STRING, LOGICAL, INTEGER, DOUBLE, CHARACTER, LIST = 1, 2, 9, 10, 13, 14, 16, 19
REFERENCE, NULL = 255, 254
HAS_ATTRIBUTES, HAS_TAG = 1 << 9, 1 << 10
NA_STRING_LENGTH = -1
RDA_MAGIC, XDR_MAGIC = b"RDX", b"X\n"
ATOMIC = {LOGICAL: "i", INTEGER: "i", DOUBLE: "d"}  # struct codes of their elements


@dataclass
class RVector:
    """An R vector: its SEXP type, elements (str/None, int, float or nested objects) and attributes."""

    kind: int
    values: list
    attributes: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Symbol:
    name: str


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.position, self.references = data, 0, []

    def take(self, count: int) -> bytes:
        if self.position + count > len(self.data):
            raise ValueError("truncated R serialization")
        chunk = self.data[self.position:self.position + count]
        self.position += count
        return chunk

    def integers(self, count: int, code: str = "i") -> list:
        size = struct.calcsize(code)
        return list(struct.unpack(f">{count}{code}", self.take(size * count)))

    def item(self):
        (flags,) = self.integers(1)
        kind = flags & 0xFF
        if kind == NULL:
            return None
        if kind == REFERENCE:
            return self.references[(flags >> 8) - 1]
        if kind == SYMBOL:
            symbol = Symbol(self.item())
            self.references.append(symbol)
            return symbol
        if kind == STRING:
            (length,) = self.integers(1)
            return None if length == NA_STRING_LENGTH else self.take(length).decode("utf-8")
        if kind == PAIRLIST:  # attributes, tag, head, then the rest of the list as one more item
            attributes = self.item() if flags & HAS_ATTRIBUTES else None
            tag = self.item() if flags & HAS_TAG else None
            head = self.item()
            rest = self.item()
            if attributes is not None:
                raise ValueError("pairlist cells with attributes are not supported")
            return [(tag.name if tag is not None else None, head), *(rest or [])]
        if kind in ATOMIC or kind in (CHARACTER, LIST):
            (count,) = self.integers(1)
            values = (self.integers(count, ATOMIC[kind]) if kind in ATOMIC
                      else [self.item() for _ in range(count)])
            attributes = dict(self.item()) if flags & HAS_ATTRIBUTES else {}
            return RVector(kind, values, attributes)
        raise ValueError(f"R object of SEXP type {kind} is not data this reader supports")


def unserialize(blob: bytes):
    """One serialized R object (XDR format, version 2 or 3)."""
    reader = _Reader(blob)
    if reader.take(2) != XDR_MAGIC:
        raise ValueError("not an XDR-format R serialization")
    version, _, _ = reader.integers(3)  # format, writer's R version, oldest R that reads it
    if version == 3:  # the writer's native encoding follows
        (length,) = reader.integers(1)
        reader.take(length)
    elif version != 2:
        raise ValueError(f"R serialization format {version} is not supported")
    return reader.item()


def read_rda(data: bytes) -> dict[str, object]:
    """The named objects of an ``.rda`` file (``save()``): gzip-compressed "RDX2"/"RDX3" then a pairlist."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    if data[:3] != RDA_MAGIC:
        raise ValueError("not an R .rda file (or not gzip-compressed)")
    return dict(unserialize(data[data.index(b"\n") + 1:]))


def lazyload_objects(data: bytes) -> list:
    """Every object of an R lazy-load database (a package's ``data/Rdata.rdb``): each a big-endian length,
    then a zlib stream of that many bytes of serialization."""
    position, objects = 0, []
    while position < len(data):
        (expected,) = struct.unpack(">i", data[position:position + 4])
        stream = zlib.decompressobj()
        raw = stream.decompress(data[position + 4:])
        if len(raw) != expected:
            raise ValueError(f"object at byte {position} inflates to {len(raw)} bytes, its header says {expected}")
        objects.append(unserialize(raw))
        position = len(data) - len(stream.unused_data)
    return objects


def data_frame(frame: RVector) -> dict[str, list]:
    """A data.frame's columns by name; factor columns become their labels."""
    if frame.kind != LIST or "names" not in frame.attributes:
        raise ValueError("not an R data.frame")
    columns = {}
    for name, column in zip(frame.attributes["names"].values, frame.values):
        levels = column.attributes.get("levels")
        columns[name] = ([None if code is None or code < 1 else levels.values[code - 1] for code in column.values]
                         if levels is not None else column.values)
    return columns
