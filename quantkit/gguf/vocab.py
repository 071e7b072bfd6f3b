"""A Hugging Face tokenizer as llama.cpp's ``tokenizer.ggml.*`` metadata.

Byte-level BPE tokenizers (GPT-2 style, the default model's) become ``tokenizer.ggml.model = "gpt2"``
with merges. llama.cpp picks its pre-tokenization by name (``tokenizer.ggml.pre``); the name comes
from matching tokenizer.json's pre_tokenizer against the table below. The tests check every
entry against llama.cpp's own tokenization. Other tokenizer models are refused with a clear error
instead of being written wrongly.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gguf import TokenType

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
    merges: list[str]
    special_ids: dict[str, int]  # bos / eos / unk / pad -> id
    add_bos: bool
    chat_template: str | None


def _merge_string(merge) -> str:
    return merge if isinstance(merge, str) else " ".join(merge)


def read_vocab(model_dir: Path, vocab_size: int, special_ids: dict[str, int], pre: str | None = None) -> Vocab:
    """``special_ids`` from the model config (bos/eos/pad); ``pre`` overrides the table lookup."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json; GGUF export needs the tokenizer")
    spec = json.loads(path.read_text())
    model = spec["model"]
    byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
    if model.get("type") != "BPE" or not byte_level:
        raise ValueError(f"{path}: only byte-level BPE tokenizers can be exported so far "
                         f"(model {model.get('type')!r}, decoder {(spec.get('decoder') or {}).get('type')!r})")
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
    if max(by_id) >= vocab_size:
        raise ValueError(f"{path}: token id {max(by_id)} does not fit the model's vocab_size {vocab_size}")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    token_types = [int(types.get(i, TokenType.UNUSED)) for i in range(vocab_size)]
    config = json.loads((model_dir / "tokenizer_config.json").read_text()) \
        if (model_dir / "tokenizer_config.json").is_file() else {}
    unk = model.get("unk_token")
    if unk in model["vocab"]:
        special_ids = {**special_ids, "unk": model["vocab"][unk]}
    template_file = model_dir / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
    return Vocab("gpt2", pre, tokens, token_types, [_merge_string(m) for m in model.get("merges", [])],
                 special_ids, _adds_bos(spec, config, special_ids.get("bos")), template)


def _adds_bos(spec: dict, config: dict, bos: int | None) -> bool:
    """tokenizer_config's add_bos_token if set, else whether the post-processor puts BOS first."""
    if "add_bos_token" in config:
        return bool(config["add_bos_token"])
    processor = spec.get("post_processor") or {}
    single = processor.get("single") or []
    first = single[0] if single else {}
    return bos is not None and "SpecialToken" in first
