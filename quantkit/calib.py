"""Calibration and held-out evaluation text, and tokenized calibration sets built from it.

The bundled texts live in the data package ``quantkit.calib_data`` (see its README and
manifest.json). Calibration rows are cut from disjoint runs of text that start at a paragraph
(or, inside very long paragraphs, at a line); each row is fed to the model as a sequence of its own.

Held-out text has one of two roles. Validation texts (``VALIDATION_TEXTS``) are what defaults are
chosen on: ablations, damping, clip ranges, alpha grids, QAT and draft-head hyperparameters. Test
texts (``TEST_TEXTS``) are for reported figures only and must never be used to choose anything.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from quantkit.chat_template import render_chat
from quantkit.corpora import DOWNLOADED, corpus_file, split_documents

DATA_PACKAGE = "quantkit.calib_data"
HF_PREFIX = "hf:"
FINGERPRINT_FORMAT = 1  # bump when the row-building procedure changes
# Disjoint runs collected before sampling, as a multiple of the rows asked for: enough for
# variety without tokenizing a whole large corpus.
POOL_FACTOR = 4
# A first guess of characters per token, used only to size text prefixes before tokenizing.
CHARS_PER_TOKEN_GUESS = 6
# Tokens this close to where a text prefix was cut may differ from the full text's tokens.
CUT_MARGIN_TOKENS = 16
BLANK_LINE = re.compile(r"\n[ \t]*\n+")


CALIBRATION, VALIDATION, TEST = "calibration", "validation", "test"


@dataclass(frozen=True)
class Corpus:
    file: str
    description: str
    role: str = CALIBRATION  # held-out text: VALIDATION or TEST


CORPORA: dict[str, Corpus] = {
    "en": Corpus("en_calib.txt", "English: US State of the Union addresses since 1900"),
    "zh": Corpus("zh_calib.txt", "Chinese: LibreOffice help pages (zh-CN)"),
    "code": Corpus("code_calib.txt", "Python: CPython standard library modules"),
    "math": Corpus("math_calib.txt", "GSM-style word problems with worked answers"),
}

# Every held-out text, validation and test alike: what heldout_tokens reads and calibration refuses.
HELDOUT: dict[str, Corpus] = {
    "austen": Corpus("en_heldout.txt", "English: Jane Austen, Pride and Prejudice", VALIDATION),
    "zh-heldout": Corpus("zh_heldout.txt", "Chinese: LibreOffice help pages held out from 'zh'", VALIDATION),
    "test-fiction": Corpus("test_fiction.txt", "English fiction: Herman Melville, Moby-Dick, chapters 1-67",
                           TEST),
    "test-manual": Corpus("test_manual.txt", "English technical prose: The Debian Administrator's Handbook, "
                          "preface to section 11.3", TEST),
    "test-code": Corpus("test_code.txt", "Python: NetworkX library modules (not the standard library)", TEST),
    "test-zh": Corpus("test_zh.txt", "Chinese: Debian Reference (zh-CN), not LibreOffice help", TEST),
}
VALIDATION_TEXTS: tuple[str, ...] = tuple(name for name, c in HELDOUT.items() if c.role == VALIDATION)
TEST_TEXTS: tuple[str, ...] = tuple(name for name, c in HELDOUT.items() if c.role == TEST)

# Shares of calibration rows. MiniCPM4.1 is a bilingual chat model that also writes code and math.
MIXES: dict[str, dict[str, float]] = {
    "default": {"en": 0.35, "zh": 0.35, "code": 0.15, "math": 0.15},
    "bilingual": {"en": 0.5, "zh": 0.5},
    **{name: {name: 1.0} for name in (*CORPORA, *DOWNLOADED)},
}


def _bundled(corpus: Corpus) -> list[str]:
    return split_documents(resources.files(DATA_PACKAGE).joinpath(corpus.file).read_text("utf-8"))


def _corpus_documents(name: str) -> list[str]:
    """A corpus of a mix: bundled, or downloaded on first use (``quantkit.corpora``)."""
    if name in DOWNLOADED:
        return _read_txt(corpus_file(name))
    return _bundled(CORPORA[name])


def _read_txt(path: Path) -> list[str]:
    """A plain text file is one document unless it uses the bundled separator."""
    return split_documents(path.read_text(encoding="utf-8"))


def _read_jsonl(path: Path) -> list[str]:
    documents = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{number}: expected a JSON object with a string 'text' field")
            documents.append(record["text"])
    return documents


def _read_parquet(path: Path) -> list[str]:
    import pyarrow.parquet

    schema = pyarrow.parquet.read_schema(path)
    if "text" not in schema.names:
        raise ValueError(f"{path}: no 'text' column (columns: {schema.names})")
    return [t for t in pyarrow.parquet.read_table(path, columns=["text"]).column("text").to_pylist()
            if t]


LOCAL_READERS = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}


def _read_hf(spec: str) -> list[str]:
    """``hf:<dataset>[:<config>][:<split>]``; the split defaults to train."""
    parts = spec[len(HF_PREFIX):].split(":")
    if not parts[0] or len(parts) > 3:
        raise ValueError(f"{spec!r}: expected hf:<dataset>[:<config>][:<split>]")
    dataset, config, split = (parts + ["", ""])[:3]
    config, split = config or None, split or "train"
    import datasets

    try:
        table = datasets.load_dataset(dataset, config, split=split)
    except Exception as error:  # offline, unknown dataset, bad config: all surface here
        raise RuntimeError(
            f"cannot load Hugging Face dataset {dataset!r} (config {config}, split {split}): "
            f"{type(error).__name__}: {error}. hf: sources need the Hub or its local cache; "
            f"bundled corpora ({', '.join(_known_names())}) and local .txt/.jsonl/.parquet files "
            "work offline") from error
    if "text" not in table.column_names:
        raise ValueError(f"{spec}: no 'text' column (columns: {table.column_names})")
    return [t for t in table["text"] if t and t.strip()]


def _known_names() -> list[str]:
    return sorted(set(MIXES) | set(CORPORA) | set(HELDOUT))


def load_documents(source: str) -> list[str]:
    """Documents of a bundled corpus, mix (its corpora in table order) or held-out set, a local
    .txt/.jsonl/.parquet file, or ``hf:<dataset>[:<config>][:<split>]``."""
    if source in HELDOUT:
        documents = _bundled(HELDOUT[source])
    elif source in MIXES:
        documents = [d for name in MIXES[source] for d in _corpus_documents(name)]
    elif source.startswith(HF_PREFIX):
        documents = _read_hf(source)
    else:
        path = Path(source)
        reader = LOCAL_READERS.get(path.suffix.lower())
        if reader is None:
            raise ValueError(f"unknown calibration source {source!r}: not one of "
                             f"{_known_names()}, not hf:<dataset>, and not a "
                             f"{'/'.join(LOCAL_READERS)} file")
        if not path.is_file():
            raise FileNotFoundError(f"calibration source file not found: {path}")
        documents = reader(path)
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise ValueError(f"calibration source {source!r} holds no text")
    return documents


def _source_identity(source: str) -> str:
    """What the fingerprint records for a source: local files by content, not by path."""
    if source in DOWNLOADED:  # the same identity as a local copy of its corpus file
        return "file:" + DOWNLOADED[source].sha256
    if source in MIXES or source in HELDOUT or source.startswith(HF_PREFIX):
        return source
    return "file:" + hashlib.sha256(Path(source).read_bytes()).hexdigest()


class _Encoder:
    """Turns a run of text into the ids of one calibration row, plain or as a chat user turn."""

    def __init__(self, tokenizer, chat: bool):
        if chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"chat=True but tokenizer {type(tokenizer).__name__} has no chat template")
        self.tokenizer, self.chat = tokenizer, chat

    def plain_lengths(self, lines: list[str]) -> list[int]:
        encoded = self.tokenizer(lines, add_special_tokens=False, verbose=False)["input_ids"]
        return [len(ids) for ids in encoded]

    def row(self, text: str) -> list[int]:
        if self.chat:
            # Like apply_chat_template(tokenize=True): the template itself places any BOS.
            wrapped = render_chat(self.tokenizer, [{"role": "user", "content": text}], tokenize=False)
            return self.tokenizer(wrapped, add_special_tokens=False, verbose=False)["input_ids"]
        return self.tokenizer(text, verbose=False)["input_ids"]  # the tokenizer's own BOS/EOS


def _blocks(document: str) -> list[list[str]]:
    """A document's blank-line separated blocks (paragraphs, functions, problems), as lines."""
    return [block.split("\n") for block in BLANK_LINE.split(document) if block.strip()]


def _runs(documents: list[str], encoder: _Encoder, seq_len: int, wanted: int | None) -> list[list[int]]:
    """Rows cut from consecutive, disjoint runs of ``documents`` (in the given order), stopping once
    ``wanted`` exist (all of them for None). A run starts at a block start, or at a line start inside
    a block too long to waste; it is extended line by line until it yields ``seq_len`` tokens, then
    truncated."""
    overhead = len(encoder.row(""))
    rows: list[list[int]] = []
    pending: list[str] = []
    estimate = overhead  # per-line token counts summed: a cheap guess before tokenizing the run
    for document in documents:
        blocks = _blocks(document)
        lengths = iter(encoder.plain_lengths([line for block in blocks for line in block]))
        for block in blocks:
            block_lengths = [next(lengths) for _ in block]
            if pending:
                pending.append("")  # keep the blank line between blocks
            for index, line in enumerate(block):
                pending.append(line)
                estimate += block_lengths[index] + 1  # +1 for the newline
                if estimate < seq_len:
                    continue
                ids = encoder.row("\n".join(pending))
                if len(ids) < seq_len:  # joining merged tokens: re-guess from the true count
                    estimate = len(ids)
                    continue
                rows.append(ids[:seq_len])
                pending, estimate = [], overhead
                if len(rows) == wanted:
                    return rows
                if sum(block_lengths[index + 1:]) < seq_len:
                    break  # drop the block's tail so that the next run starts at a block
    return rows


def _allocate(shares: dict[str, float], n_samples: int) -> dict[str, int]:
    """Rows per corpus by largest remainder; ties go to the corpus listed first."""
    total = sum(shares.values())
    exact = {name: n_samples * share / total for name, share in shares.items()}
    counts = {name: int(value) for name, value in exact.items()}
    # Rounded so that float noise in the shares cannot break a tie (sorted() is stable).
    by_remainder = sorted(shares, key=lambda name: -round(exact[name] - counts[name], 9))
    for name in by_remainder[: n_samples - sum(counts.values())]:
        counts[name] += 1
    return {name: count for name, count in counts.items() if count}


@dataclass(frozen=True)
class CalibrationSet:
    input_ids: torch.Tensor  # int64 [n_samples, seq_len]; rows are separate sequences
    row_sources: tuple[str, ...]  # which corpus (or the source itself) each row came from
    source: str
    seed: int
    chat: bool
    fingerprint: str

    @property
    def n_samples(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def rows_per_source(self) -> dict[str, int]:
        return {name: self.row_sources.count(name) for name in dict.fromkeys(self.row_sources)}

    def describe(self) -> dict:
        return {"source": self.source, "n_samples": self.n_samples, "seq_len": self.seq_len,
                "seed": self.seed, "chat": self.chat, "rows_per_source": self.rows_per_source(),
                "tokens": self.input_ids.numel(), "fingerprint": self.fingerprint}


def _fingerprint(settings: dict, input_ids: torch.Tensor) -> str:
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode("utf-8"))
    digest.update(b"\0")
    digest.update(input_ids.numpy().astype("<i8").tobytes())
    return digest.hexdigest()


def calibration_set(tokenizer, source: str = "default", n_samples: int | None = 128, seq_len: int = 512,
                    seed: int = 0, chat: bool = False) -> CalibrationSet:
    """``n_samples`` rows of ``seq_len`` token ids from ``source`` (a mix, corpus, file or hf: spec);
    ``None``: as many as the source holds while keeping its mix's shares (the corpus with the least
    text for its share sets the size), which is what QAT trains on.

    Each row starts at a paragraph of its corpus, behind whatever the tokenizer puts first (its
    BOS, if it adds one, or the chat template's opening when ``chat``). Rows come from disjoint
    stretches of text, drawn with ``random.Random`` seeded by a string, so the set depends only on
    the seed and the data, not on Python's hash salt. Mix shares are met by largest remainder.
    """
    if source in HELDOUT:
        raise ValueError(f"{source!r} is a held-out evaluation set ({HELDOUT[source].role} text); "
                         "calibrating on it would contaminate the evaluation")
    if (n_samples is not None and n_samples < 1) or seq_len < 2:
        raise ValueError(f"need n_samples >= 1 and seq_len >= 2, got {n_samples} and {seq_len}")
    encoder = _Encoder(tokenizer, chat)
    shares = MIXES.get(source, {source: 1.0})
    draws: dict[str, tuple[random.Random, list[list[int]]]] = {}

    def draw(name: str, wanted: int | None) -> tuple[random.Random, list[list[int]]]:
        if name not in draws:
            documents = load_documents(name)
            rng = random.Random(f"quantkit-calibration:{seed}:{_source_identity(name)}")
            rng.shuffle(documents)
            draws[name] = rng, _runs(documents, encoder, seq_len, wanted=wanted)
        return draws[name]

    if n_samples is None:
        n_samples = _most_rows(shares, {name: len(draw(name, None)[1]) for name in shares})
        if n_samples == 0:
            raise ValueError(f"calibration source {source!r} holds no sequence of {seq_len} tokens")
    rows: list[list[int]] = []
    row_sources: list[str] = []
    for name, count in _allocate(shares, n_samples).items():
        rng, pool = draw(name, POOL_FACTOR * count)
        if len(pool) < count:
            raise ValueError(f"calibration source {name!r} yields only {len(pool)} disjoint "
                             f"sequences of {seq_len} tokens, but {count} were requested; lower "
                             "n_samples or seq_len, or use a larger source")
        rows += rng.sample(pool, count)
        row_sources += [name] * count
    order = list(range(n_samples))
    random.Random(f"quantkit-calibration:{seed}:order").shuffle(order)
    input_ids = torch.tensor([rows[i] for i in order], dtype=torch.long)
    settings = {"format": FINGERPRINT_FORMAT, "source": _source_identity(source),
                "n_samples": n_samples, "seq_len": seq_len, "seed": seed, "chat": chat}
    return CalibrationSet(input_ids=input_ids, row_sources=tuple(row_sources[i] for i in order),
                          source=source, seed=seed, chat=chat,
                          fingerprint=_fingerprint(settings, input_ids))


def _most_rows(shares: dict[str, float], available: dict[str, int]) -> int:
    """The largest row count whose allocation by ``shares`` no corpus's ``available`` rows fall short of."""
    total = sum(shares.values())
    rows = min(int(available[name] * total / share) for name, share in shares.items())
    while rows and any(count > available[name] for name, count in _allocate(shares, rows).items()):
        rows -= 1
    return rows


def heldout_tokens(tokenizer, name: str = "austen", max_tokens: int | None = None) -> torch.Tensor:
    """One LongTensor [T] of the held-out text (documents joined by a blank line), tokenized with
    the tokenizer's default special tokens. ``name`` is a held-out set (a validation text, on which
    defaults may be chosen, or a test text, for reported figures only), a local file or hf: spec;
    calibration corpora are refused. Only as much text as ``max_tokens`` needs is tokenized."""
    if name in MIXES:
        raise ValueError(f"{name!r} is calibration text; evaluating on it would be contaminated. "
                         f"Held-out sets: {sorted(HELDOUT)}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    text = "\n\n".join(load_documents(name))
    if max_tokens is None:
        return torch.tensor(tokenizer(text, verbose=False)["input_ids"], dtype=torch.long)
    length = (max_tokens + CUT_MARGIN_TOKENS) * CHARS_PER_TOKEN_GUESS
    while True:
        ids = tokenizer(text[:length], verbose=False)["input_ids"]
        # Tokens next to the cut can differ from the full text's: keep a margin beyond them.
        if len(ids) >= max_tokens + CUT_MARGIN_TOKENS or length >= len(text):
            return torch.tensor(ids[:max_tokens], dtype=torch.long)
        length *= 2
