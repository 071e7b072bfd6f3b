"""What corpora are read out of: R's serialization (quantkit.rdata) and Debian packages (quantkit.cache).

The R objects are written here byte by byte as R's serialize.c lays them out (format 3, symbols after
their first use written as references), the .deb as dpkg-deb lays it out (an ar archive of
debian-binary, control.tar.xz and data.tar.xz).
"""
from __future__ import annotations

import gzip
import hashlib
import io
import struct
import tarfile
import zlib
from dataclasses import dataclass, field

import pytest

from quantkit import corpora, rdata
from quantkit.cache import DebianFile, deb_member, fetch_deb

UTF8_STRING_FLAGS = 0x00008009  # CHARSXP with R's UTF8 mark in its levels, as R writes non-ASCII strings


def _int(*values: int) -> bytes:
    return struct.pack(f">{len(values)}i", *values)


@dataclass
class _Vector:
    kind: int
    values: list
    attributes: list[tuple[str, object]] = field(default_factory=list)


class _RWriter:
    """Serializes _Vector trees and tagged pairlists, in stream order (which numbers the symbols)."""

    def __init__(self):
        self.symbols: list[str] = []

    def header(self) -> bytes:
        return b"X\n" + _int(3, 0x040201, 0x030500, 5) + b"UTF-8"

    def string(self, text: str | None) -> bytes:
        if text is None:
            return _int(rdata.STRING, -1)
        data = text.encode("utf-8")
        return _int(UTF8_STRING_FLAGS, len(data)) + data

    def symbol(self, name: str) -> bytes:
        if name in self.symbols:
            return _int(((self.symbols.index(name) + 1) << 8) | rdata.REFERENCE)
        self.symbols.append(name)
        return _int(rdata.SYMBOL) + self.string(name)

    def pairlist(self, items: list[tuple[str, object]]) -> bytes:
        cells = b"".join(_int(rdata.PAIRLIST | rdata.HAS_TAG) + self.symbol(tag) + self.write(value)
                         for tag, value in items)
        return cells + _int(rdata.NULL)

    def write(self, vector: _Vector) -> bytes:
        flags = vector.kind | (rdata.HAS_ATTRIBUTES if vector.attributes else 0)
        out = _int(flags, len(vector.values))
        if vector.kind == rdata.CHARACTER:
            out += b"".join(self.string(v) for v in vector.values)
        elif vector.kind == rdata.LIST:
            out += b"".join(self.write(v) for v in vector.values)
        else:
            out += struct.pack(f">{len(vector.values)}{rdata.ATOMIC[vector.kind]}", *vector.values)
        return out + (self.pairlist(vector.attributes) if vector.attributes else b"")


def _books_rda(rows: list[tuple[str, str | None]]) -> bytes:
    """``save(books, file=)`` of a data frame like tidytext's: a text column and a title factor."""
    levels = sorted({title for title, _ in rows})
    title = _Vector(rdata.INTEGER, [levels.index(title) + 1 for title, _ in rows],
                    [("levels", _Vector(rdata.CHARACTER, levels)), ("class", _Vector(rdata.CHARACTER, ["factor"]))])
    text = _Vector(rdata.CHARACTER, [line for _, line in rows])
    frame = _Vector(rdata.LIST, [text, title], [
        ("names", _Vector(rdata.CHARACTER, ["text", "title"])),
        ("row.names", _Vector(rdata.INTEGER, [-(2**31), -len(rows)])),
        ("class", _Vector(rdata.CHARACTER, ["tbl_df", "tbl", "data.frame"]))])
    r = _RWriter()
    return gzip.compress(b"RDX3\n" + r.header() + r.pairlist([("books", frame)]), mtime=0)


def test_data_frame_with_factor_references_and_missing_values():
    rda = _books_rda([("Emma", "EMMA"), ("Emma", None), ("Zoë", "café"), ("Emma", "end")])
    objects = rdata.read_rda(rda)
    assert list(objects) == ["books"]
    assert objects["books"].attributes["class"].values == ["tbl_df", "tbl", "data.frame"]
    assert rdata.data_frame(objects["books"]) == {"text": ["EMMA", None, "café", "end"],
                                                  "title": ["Emma", "Emma", "Zoë", "Emma"]}
    with pytest.raises(ValueError, match="not an R .rda file"):
        rdata.read_rda(gzip.compress(b"PK\x03\x04"))
    with pytest.raises(ValueError, match="truncated"):
        rdata.read_rda(gzip.decompress(rda)[:-9])


def test_lazyload_database_and_objects_that_are_not_data():
    r = _RWriter()
    vectors = [["EMMA", "", "By Jane Austen", "café"], ["PERSUASION", None, "line"]]
    blobs = [r.header() + r.write(_Vector(rdata.CHARACTER, v)) for v in vectors]
    database = b"".join(_int(len(blob)) + zlib.compress(blob) for blob in blobs)
    assert [o.values for o in rdata.lazyload_objects(database)] == vectors
    with pytest.raises(ValueError, match="inflates to"):
        rdata.lazyload_objects(_int(len(blobs[0]) + 1) + zlib.compress(blobs[0]))
    closure = 3
    with pytest.raises(ValueError, match="SEXP type 3 is not data"):
        rdata.unserialize(r.header() + _int(closure))
    with pytest.raises(ValueError, match="not an XDR"):
        rdata.unserialize(b"A\n" + blobs[0][2:])


def _deb(files: dict[str, bytes]) -> bytes:
    """A .deb as dpkg-deb builds it, its data tree holding ``files`` (paths under ./)."""
    def tar_xz(entries: dict[str, bytes]) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:xz") as tree:
            for name, data in entries.items():
                info = tarfile.TarInfo("./" + name)
                info.size = len(data)
                tree.addfile(info, io.BytesIO(data))
        return buffer.getvalue()

    archive = b"!<arch>\n"
    for name, data in (("debian-binary", b"2.0\n"), ("control.tar.xz", tar_xz({"control": b"Package: x\n"})),
                       ("data.tar.xz", tar_xz(files))):
        archive += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode("ascii") + data
        archive += b"\n" * (len(data) % 2)
    return archive


def _pin(deb: bytes, member: str) -> DebianFile:
    return DebianFile("r-cran-books", "1.0-1", "pool/main/r/r-cran-books/r-cran-books_1.0-1_all.deb",
                      hashlib.sha256(deb).hexdigest(), member)


def test_debian_package_member_and_pin(tmp_path, monkeypatch):
    deb = _deb({"usr/share/a.txt": b"odd", "usr/share/b/c.txt": b"second file"})
    pin = _pin(deb, "usr/share/b/c.txt")
    (tmp_path / pin.file_name).write_bytes(deb)
    monkeypatch.setenv("QUANTKIT_WHEEL_DIR", str(tmp_path))
    fetched = fetch_deb(pin, tmp_path / "downloads", progress=False, manual="")  # the local copy, no download
    assert fetched == tmp_path / pin.file_name
    assert deb_member(fetched, "usr/share/b/c.txt") == b"second file"
    assert deb_member(fetched, "usr/share/a.txt") == b"odd"  # after an odd-sized member
    with pytest.raises(ValueError, match="has no file usr/share/d.txt"):
        deb_member(fetched, "usr/share/d.txt")
    (tmp_path / "not.deb").write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match="not a Debian package"):
        deb_member(tmp_path / "not.deb", "usr/share/a.txt")
    (tmp_path / pin.file_name).write_bytes(_deb({"usr/share/b/c.txt": b"another release"}))
    with pytest.raises(ValueError, match="expected [0-9a-f]{64}: not the pinned r-cran-books=1.0-1"):
        fetch_deb(pin, tmp_path / "downloads", progress=False, manual="")


def test_novels_corpus_leaves_the_held_out_novel_out(tmp_path, monkeypatch):
    rows = [("The Time Machine", "THE TIME MACHINE"), ("The Time Machine", ""), ("The Time Machine", "The Time"),
            ("The Time Machine", "  Traveller spoke."), ("Pride and Prejudice", "It is a truth"),
            ("Great Expectations", "My father's family name"), ("Great Expectations", None),
            ("Great Expectations", "being Pirrip")]
    deb = _deb({"usr/lib/R/site-library/tidytext/extdata/books.rda": _books_rda(rows)})
    pinned = corpora.DOWNLOADED["novels"]
    source = _pin(deb, pinned.source.member)
    (tmp_path / source.file_name).write_bytes(deb)
    expected = corpora.format_documents(["THE TIME MACHINE\n\nThe Time Traveller spoke.",
                                         "My father's family name\n\nbeing Pirrip"])
    monkeypatch.setitem(corpora.DOWNLOADED, "novels", corpora.DownloadedCorpus(
        source, pinned.documents, hashlib.sha256(expected.encode("utf-8")).hexdigest(), pinned.description))
    monkeypatch.setenv("QUANTKIT_WHEEL_DIR", str(tmp_path))
    path = corpora.corpus_file("novels", cache_dir=tmp_path / "cache", progress=False)
    assert path.read_text(encoding="utf-8") == expected
