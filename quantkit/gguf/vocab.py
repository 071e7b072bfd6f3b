"""A Hugging Face tokenizer as llama.cpp's ``tokenizer.ggml.*`` metadata.

- SentencePiece (``tokenizer.model``, MiniCPM's own): ``tokenizer.ggml.model = "llama"`` with each
  piece's score and type, as llama.cpp's converter writes for MiniCPM. Its tokenizer merges any
  adjacent pair whose concatenation is a piece, highest score first, which is SentencePiece's BPE
  rule; pieces are read with the ``sentencepiece`` library, and whether a space is prefixed is
  read off its behaviour. Added tokens (``<|im_start|>``...) come from tokenizer.json /
  tokenizer_config.json.
- Byte-level BPE (GPT-2 style, the default model's): ``tokenizer.ggml.model = "gpt2"`` with merges.
  llama.cpp picks its pre-tokenization by name (``tokenizer.ggml.pre``); the name comes from
  matching tokenizer.json's pre_tokenizer against the table below.

The tests check both against llama.cpp's own tokenization. Other tokenizer models are refused with
a clear error instead of being written wrongly.
"""
from __future__ import annotations

import gc
import json
from dataclasses import dataclass, field
from pathlib import Path

from gguf import TokenType

from quantkit.checkpoint import CheckpointError

# tokenizer.json "pre_tokenizer" -> llama.cpp pre-tokenizer name
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
PRE_TOKENIZERS: dict[str, str] = {
    json.dumps({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
               sort_keys=True): "smollm",
    json.dumps(_BYTE_LEVEL, sort_keys=True): "gpt-2",
}


@dataclass(frozen=True)
class Vocab:
    model: str  # tokenizer.ggml.model
    pre: str  # tokenizer.ggml.pre
    tokens: list[str]
    token_types: list[int]
    merges: list[str]  # BPE only
    special_ids: dict[str, int]  # bos / eos / unk / pad -> id
    add_bos: bool
    chat_template: str | None
    scores: list[float] = field(default_factory=list)  # SentencePiece only
    add_space_prefix: bool | None = None  # SentencePiece only

# llama.cpp's converter gives added tokens this score, and ids the tokenizer leaves empty ([PAD<i>]) the
# other (conversion/base.py, _create_vocab_sentencepiece: every id starts at PAD_SCORE)
ADDED_SCORE = -1000.0
PAD_SCORE = -10000.0


def _merge_strings(merges: list) -> list[str]:
    """tokenizer.json's merges as llama.cpp's "left right" strings (newer files hold [left, right] pairs)."""
    return [merge if type(merge) is str else " ".join(merge) for merge in merges]


def read_vocab(model_dir: Path, vocab_size: int, special_ids: dict[str, int], pre: str | None = None) -> Vocab:
    """``special_ids`` from the model config (bos/eos/pad); ``pre`` overrides the table lookup (BPE).
    The files are parsed once, here, not also by transformers: its load cost a third of the default
    model's export, and holds the GIL the tensor worker needs meanwhile."""
    if (model_dir / "tokenizer.model").is_file():
        return _sentencepiece_vocab(model_dir, vocab_size, special_ids)
    return _byte_level_vocab(model_dir, vocab_size, special_ids, pre)


def _json_object(path: Path) -> dict:
    """``path`` parsed, or one clear error naming it. The cyclic garbage collector is paused meanwhile: a
    tokenizer.json's ~100,000 new lists and dicts set off collections that traverse every object of a
    process holding torch and transformers, 0.29 of the 0.35 s its parse took in the exporter."""
    gc.disable()
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: its tokenizer cannot be read ({type(e).__name__}: {e})") from e
    finally:
        gc.enable()
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _tokenizer_config(model_dir: Path) -> dict:
    path = model_dir / "tokenizer_config.json"
    return _json_object(path) if path.is_file() else {}


def _chat_template(model_dir: Path, config: dict) -> str | None:
    template_file = model_dir / "chat_template.jinja"
    return template_file.read_text() if template_file.is_file() else config.get("chat_template")


def _added_tokens(model_dir: Path, config: dict) -> dict[int, tuple[str, bool]]:
    """id -> (content, special) of the tokens added on top of the tokenizer's model."""
    path = model_dir / "tokenizer.json"
    if path.is_file():
        return {t["id"]: (t["content"], t["special"]) for t in _json_object(path).get("added_tokens", [])}
    return {int(i): (t["content"], t.get("special", False)) for i, t in config.get("added_tokens_decoder", {}).items()}


def _padded(by_id: dict[int, str], types: dict[int, int], vocab_size: int, source: Path) -> tuple[list, list]:
    if max(by_id) >= vocab_size:
        raise ValueError(f"{source}: token id {max(by_id)} does not fit the model's vocab_size {vocab_size}")
    unused = int(TokenType.UNUSED)
    return ([by_id[i] if i in by_id else f"[PAD{i}]" for i in range(vocab_size)],
            [int(types[i]) if i in types else unused for i in range(vocab_size)])


def _sentencepiece_vocab(model_dir: Path, vocab_size: int, special_ids: dict[str, int]) -> Vocab:
    from sentencepiece import SentencePieceProcessor

    path = model_dir / "tokenizer.model"
    try:
        sp = SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{path}: not a readable SentencePiece model ({e})") from e
    by_id, types, scores = {}, {}, {}
    for i in range(sp.vocab_size()):
        by_id[i], scores[i] = sp.id_to_piece(i), sp.get_score(i)
        types[i] = (TokenType.UNKNOWN if sp.is_unknown(i) else TokenType.CONTROL if sp.is_control(i)
                    else TokenType.UNUSED if sp.is_unused(i) else TokenType.BYTE if sp.is_byte(i)
                    else TokenType.NORMAL)
    config = _tokenizer_config(model_dir)
    for i, (content, special) in _added_tokens(model_dir, config).items():
        if i < sp.vocab_size() and types[i] not in (TokenType.NORMAL, TokenType.UNUSED):
            continue  # <unk>, <s>, </s>: the model's own types stand
        by_id[i], scores[i] = content, ADDED_SCORE
        types[i] = TokenType.CONTROL if special else TokenType.USER_DEFINED
    tokens, token_types = _padded(by_id, types, vocab_size, path)
    if sp.unk_id() >= 0:
        special_ids = {**special_ids, "unk": sp.unk_id()}
    # SentencePiece's add_dummy_prefix, observed: a lone word's first piece carries the space mark
    add_space_prefix = sp.encode("a", out_type=str)[0].startswith("▁")
    return Vocab("llama", "default", tokens, token_types, [], special_ids,
                 bool(config.get("add_bos_token", True)), _chat_template(model_dir, config),
                 [float(scores.get(i, PAD_SCORE)) for i in range(vocab_size)], add_space_prefix)


def _byte_level_vocab(model_dir: Path, vocab_size: int, special_ids: dict[str, int], pre: str | None) -> Vocab:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has neither tokenizer.model nor tokenizer.json; GGUF export needs "
                              "the tokenizer")
    spec = _json_object(path)
    model = spec.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("vocab"), dict):
        raise CheckpointError(f"{path}: no tokenizer model with a vocabulary ('model.vocab')")
    byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
    if model.get("type") != "BPE" or not byte_level:
        raise ValueError(f"{path}: only byte-level BPE tokenizers (or SentencePiece ones, with tokenizer.model) "
                         f"can be exported (model {model.get('type')!r}, decoder "
                         f"{(spec.get('decoder') or {}).get('type')!r})")
    if pre is None:
        signature = json.dumps(spec.get("pre_tokenizer"), sort_keys=True)
        if signature not in PRE_TOKENIZERS:
            raise ValueError(f"{path}: unknown pre-tokenizer {signature}; name llama.cpp's equivalent "
                             f"with --tokenizer-pre (known: {sorted(set(PRE_TOKENIZERS.values()))})")
        pre = PRE_TOKENIZERS[signature]

    by_id = {index: token for token, index in model["vocab"].items()}
    types = {index: TokenType.NORMAL for index in by_id}
    for added in spec.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = TokenType.CONTROL if added["special"] else TokenType.USER_DEFINED
    tokens, token_types = _padded(by_id, types, vocab_size, path)
    config = _tokenizer_config(model_dir)
    unk = model.get("unk_token")
    if unk in model["vocab"]:
        special_ids = {**special_ids, "unk": model["vocab"][unk]}
    return Vocab("gpt2", pre, tokens, token_types, _merge_strings(model.get("merges", [])),
                 special_ids, _adds_bos(spec, config, special_ids.get("bos")), _chat_template(model_dir, config))


def _adds_bos(spec: dict, config: dict, bos: int | None) -> bool:
    """tokenizer_config's add_bos_token if set, else whether the post-processor puts BOS first."""
    if "add_bos_token" in config:
        return bool(config["add_bos_token"])
    processor = spec.get("post_processor") or {}
    single = processor.get("single") or []
    first = single[0] if single else {}
    return bos is not None and "SpecialToken" in first
