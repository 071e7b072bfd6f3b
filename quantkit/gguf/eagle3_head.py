"""An EAGLE-3 draft head (``quantkit.models.eagle3``'s layout) as the GGUF file llama.cpp's own converter
writes for it: ``convert_hf_to_gguf.py HEAD --target-model-dir TARGET --outtype T`` of the llama.cpp that
the installed llama-cpp-python vendors (class ``LlamaModel`` in ``conversion/llama.py``, which detects a
head by ``draft_vocab_size`` and one layer and switches to the ``eagle3`` architecture; generic parts in
``conversion/base.py``). The layout, taken from there (docs/speculative.md, "Heads for llama.cpp"):

- metadata: ``general.architecture = eagle3``; the EAGLE-3 keys (``EAGLE3_KEYS``); ``general.type``,
  name and size label as gguf-py's ``Metadata`` derives them from the head's folder; the head's shape
  under ``eagle3.*`` from its config.json; then the tokenizer of the *target* (tokens, scores and types
  from ``quantkit.gguf.vocab``, the special tokens and chat template from gguf-py's ``SpecialVocab``,
  the reader the converter uses);
- tensors in the order of their Hugging Face names, renamed by ``TENSOR_NAMES``; vectors (the norms) F32,
  matrices in the requested type (F16 where a Q8_0 row is not whole blocks), q/k rows permuted for
  GGML's rope; ``t2d`` dropped; ``d2t`` last, as absolute target ids in I64.

A quantized head (`quantkit draft quantize`: GPTQ, Marlin or CPM.cu layout) has no converter to compare
with: its quantized linears are written as the block type that holds their grid exactly
(``quantkit.gguf.exact``: symmetric 4-bit groups of a multiple of 32 are Q4_0 blocks, 8-bit ones Q8_0), the
solver's codes copied, the rest as for an FP head.

llama.cpp's ``eagle3`` graph (``src/models/eagle3.cpp``) is the plain EAGLE-3 layer. quantkit's MiniCPM
head scales what that graph does not: both residual branches by ``scale_depth/sqrt(L+1)``, and, for
``aux_states = cpmcu``, fc's input by ``scale_depth/sqrt(L)``. Those factors are folded into the weights
they multiply (``MINICPM_FOLDS``), which is exact in real arithmetic. For any other target the head is
written as it is, which is what the converter writes.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch

from quantkit.atomic import atomic_path, refuse_existing
from quantkit.checkpoint import CheckpointReader
from quantkit.gguf.exact import EXACT, exact_blocks, holds_exactly
from quantkit.gguf.export import PackedWriter
from quantkit.gguf.mixes import FILE_TYPES, Model, choose_type
from quantkit.gguf.names import permute_rows
from quantkit.gguf.types import TYPES, TensorType
from quantkit.gguf.vocab import read_vocab
from quantkit.json_files import read_config_json
from quantkit.lock import OutputLock
from quantkit.models.eagle3 import DraftHeadError, Eagle3Config, check_pairing
from quantkit.quant import QuantizedTensor
from quantkit.reader import read_head_records

ARCH = "eagle3"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # the converter's --outtype choices for a dense head
D2T = "d2t"
DROPPED = frozenset({"t2d"})  # the converter leaves it out: llama.cpp does not use it

# The head's tensors -> their GGUF names (LlamaModel.index_tensors renames midlayer.* to model.layers.0.*,
# modify_tensors passes fc through and maps hidden_norm to attn_norm_2, gguf-py's tensor map the rest).
TENSOR_NAMES: dict[str, str] = {
    "fc.weight": "fc.weight",
    "embed_tokens.weight": "token_embd.weight",  # optional; llama.cpp then embeds with it, not the target's
    "lm_head.weight": "output.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "norm.weight": "output_norm.weight",
}
# GGML's "normal" rope rotates adjacent pairs, the head's rotate_half rope the two halves of each head:
# these rows are permuted per head (LlamaModel.permute), over this many heads
ROPE_PERMUTED: dict[str, Callable[[Eagle3Config], int]] = {
    "blk.0.attn_q.weight": lambda config: config.num_attention_heads,
    "blk.0.attn_k.weight": lambda config: config.num_key_value_heads,
}
# What quantkit's head multiplies by that llama.cpp's eagle3 graph has no place for, folded into the
# weight that follows it: HF tensor -> the factor, read off the head as quantkit builds it for a MiniCPM
# target (residual scale of both branches; fc's input scale for aux_states = cpmcu, 1 otherwise).
MINICPM_FOLDS: dict[str, Callable] = {
    "midlayer.self_attn.o_proj.weight": lambda head: head.midlayer.residual_scale,
    "midlayer.mlp.down_proj.weight": lambda head: head.midlayer.residual_scale,
    "fc.weight": lambda head: head.aux_scale,
}


@dataclass(frozen=True)
class TargetShape:
    """What ``check_pairing`` and the EAGLE-3 keys read of a target of any architecture."""
    model_type: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int

    @classmethod
    def of(cls, values: dict) -> TargetShape:
        return cls(values.get("model_type", ""), values["hidden_size"], values["vocab_size"],
                   values["num_hidden_layers"])


@dataclass(frozen=True)
class _Planned:
    source: str  # the head's tensor name
    name: str  # GGUF name
    shape: tuple[int, ...]  # numpy order
    tensor_type: TensorType
    permute_heads: int | None  # q/k: rows permuted for GGML's rope over this many heads
    factor: float = 1.0  # folded into the weight (MINICPM_FOLDS)
    record: QuantizedTensor | None = None  # a quantized linear's, written as its exact blocks

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape[:-1]) * self.tensor_type.row_bytes(self.shape[-1])


@dataclass
class HeadExportReport:
    path: str
    outtype: str
    target_model_type: str
    folded: dict[str, float] = field(default_factory=dict)  # HF tensor -> factor folded into it
    tensors_by_type: dict[str, int] = field(default_factory=dict)
    file_bytes: int = 0
    seconds: float = 0.0
    note: str = ""


# llama.cpp's MiniCPM graph (src/models/granite.cpp, which src/models/models.h has MiniCPM use) never records
# the layer inputs an EAGLE-3 draft reads, so a run aborts at src/llama-graph.cpp:1384
MINICPM_NOTE = ("llama.cpp (as llama-cpp-python 0.3.36 vendors it) cannot run this head yet: its MiniCPM graph "
                "does not record the layer inputs the draft reads (docs/speculative.md, \"Heads for llama.cpp\")")


def _target_values(target_dir: Path) -> dict:
    """The target's config.json as the converter reads it: a multimodal config's text_config on top."""
    values = read_config_json(target_dir)
    missing = [key for key in ("hidden_size", "vocab_size", "num_hidden_layers") if key not in values
               and key not in values.get("text_config", {})]
    if missing:
        raise DraftHeadError(f"{target_dir}/config.json lacks {', '.join(missing)}: not a target model")
    return {**values, **values.get("text_config", {})}


def _target_layers(raw_head: dict, target: TargetShape) -> list[int]:
    """eagle3.target_layers: the head's eagle_aux_hidden_state_layer_ids, else the converter's default."""
    layers = raw_head.get("eagle_aux_hidden_state_layer_ids") or [2, target.num_hidden_layers // 2,
                                                                    target.num_hidden_layers - 3]
    return [int(layer) for layer in layers]


def _folds(config: Eagle3Config, target_values: dict) -> dict[str, float]:
    """The factors to fold for this target: MiniCPM's, read off a weightless head, or none."""
    if target_values.get("model_type") != "minicpm":
        return {}
    from quantkit.models.eagle3 import Eagle3Head
    from quantkit.models.settings import MiniCPMSettings

    with torch.device("meta"):
        head = Eagle3Head(config, MiniCPMSettings.from_values(target_values))
    return {name: float(factor(head)) for name, factor in MINICPM_FOLDS.items()}


def _check_head(raw_head: dict, names: list[str]) -> None:
    flags = [key for key in ("norm_before_fc", "norm_before_residual") if raw_head.get(key)]
    if flags or raw_head.get("rope_scaling"):
        raise DraftHeadError(f"{', '.join(flags) or 'rope_scaling'} is set in the head's config.json: quantkit's "
                             "EAGLE-3 head has no such part")
    unknown = sorted(set(names) - set(TENSOR_NAMES) - DROPPED - {D2T})
    if unknown:
        raise DraftHeadError(f"the head holds {unknown[0]}, which an EAGLE-3 head has no place for")
    if D2T not in names:
        raise DraftHeadError(f"the head lacks {D2T}: llama.cpp maps draft ids to target ids with it")


def _exact_type(name: str, record: QuantizedTensor) -> TensorType:
    """The GGUF type whose blocks hold a quantized linear's grid exactly; refused if none does."""
    for type_name in EXACT:
        if holds_exactly(record, type_name):
            return TYPES[type_name]
    config = record.config
    raise DraftHeadError(f"the head's {name} is {config.bits}-bit {'sym' if config.sym else 'asym'} in groups of "
                         f"{config.group_size}: no llama.cpp block type holds that grid exactly (Q4_0 and Q8_0 "
                         "take symmetric 4- and 8-bit groups of a multiple of 32 in natural order); export the FP "
                         "head it was made from")


def _target_ids(d2t, target: TargetShape) -> np.ndarray:
    """d2t as llama.cpp reads it: each draft id's absolute target id, all distinct and inside the vocabulary."""
    ids = d2t.long().numpy().reshape(-1) + np.arange(d2t.numel(), dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= target.vocab_size):
        raise DraftHeadError(f"the head's d2t maps to target ids outside 0..{target.vocab_size - 1}")
    if np.unique(ids).size != ids.size:
        raise DraftHeadError("the head's d2t maps two draft ids to the same target id")
    return ids


@dataclass(frozen=True)
class _Export:
    """Everything checked and decided before a byte is written."""
    head_dir: Path
    target_dir: Path
    config: Eagle3Config
    target: TargetShape
    target_layers: list[int]
    outtype: str
    reader: CheckpointReader  # the head's tensors
    planned: list[_Planned]
    target_ids: np.ndarray
    file_type: str  # general.file_type: outtype, or a quantized head's block type


def check_outtype(outtype: str) -> None:
    if outtype not in OUTTYPES:
        raise ValueError(f"unknown --outtype {outtype!r}; choose from {', '.join(OUTTYPES)}")


def plan_head_export(head_dir: str | Path, target_dir: str | Path, outtype: str) -> _Export:
    """Every refusal, in one line, before any tensor is converted: an unknown type, a head that does not
    fit the target (hidden size, vocabulary, layers), one llama.cpp cannot hold."""
    check_outtype(outtype)
    head_dir, target_dir = Path(head_dir), Path(target_dir)
    config = Eagle3Config.from_pretrained(head_dir)
    raw_head = read_config_json(head_dir)
    target_values = _target_values(target_dir)
    target = TargetShape.of(target_values)
    check_pairing(config, target)
    layers = _target_layers(raw_head, target)
    if tuple(layers) != config.aux_layers(target):  # llama.cpp reads the first, the head was trained on the second
        raise DraftHeadError(f"the head's eagle_aux_hidden_state_layer_ids {layers} are not the layers its aux_states "
                             f"{config.aux_states!r} reads ({list(config.aux_layers(target))})")
    reader = CheckpointReader(head_dir)
    linears = read_head_records(head_dir, config)
    records = {f"{linear}.weight": record for linear, record in linears.items()}
    # a quantized linear's stored tensors (qweight, scales, ...; CPM.cu fuses q/k/v) sit under its parent module
    parts = tuple(sorted({linear.rpartition(".")[0] + "." if "." in linear else linear + "." for linear in linears}))
    stored = {name for name in reader.names if name in TENSOR_NAMES or not (parts and name.startswith(parts))}
    _check_head(raw_head, sorted(stored | set(records)))
    folds = _folds(config, target_values)
    model = Model(1, config.num_attention_heads // config.num_key_value_heads, tied_embeddings=False)
    planned = []
    # the converter's order: by name (gguf-py's SafetensorsLocal sorts them)
    for source in sorted(stored | set(records)):
        if source in DROPPED or source == D2T:
            continue
        name, record = TENSOR_NAMES[source], records.get(source)
        shape = record.shape if record is not None else reader.shape(source)
        # norms are vectors, F32 either way; every matrix takes the type, F16 where its rows are not whole blocks
        tensor_type = _exact_type(source, record) if record is not None else choose_type(outtype, name, shape, model)
        heads = ROPE_PERMUTED[name](config) if name in ROPE_PERMUTED else None
        planned.append(_Planned(source, name, shape, tensor_type, heads, folds.get(source, 1.0), record))
    quantized_types = [item.tensor_type.name for item in planned if item.record is not None]
    return _Export(head_dir, target_dir, config, target, layers, outtype, reader, planned,
                   _target_ids(reader.get(D2T), target), quantized_types[0] if quantized_types else outtype)


def _add_eagle3_keys(writer: gguf.GGUFWriter, plan: _Export) -> None:
    """The EAGLE-3 keys, right after the architecture (LlamaModel.__init__ adds them there)."""
    writer.add_array(f"{ARCH}.target_layers", plan.target_layers)
    writer.add_uint32(f"{ARCH}.target_hidden_size", plan.config.target_hidden_size)
    writer.add_bool(f"{ARCH}.norm_before_residual", False)  # _check_head refuses either flag set
    writer.add_bool(f"{ARCH}.norm_before_fc", False)


def _add_general(writer: gguf.GGUFWriter, plan: _Export) -> None:
    """general.type, name, size label..., as gguf-py's Metadata derives them from the head's folder."""
    counts = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, plan.head_dir, None, counts[0])
    if metadata.name is None:
        metadata.name = plan.head_dir.name
    if metadata.size_label is None and counts[0] > 0:
        metadata.size_label = gguf.size_label(*counts)
    writer.add_type(gguf.GGUFType.MODEL)
    metadata.set_gguf_meta_model(writer)


def _add_shape(writer: gguf.GGUFWriter, plan: _Export) -> None:
    """The head's shape as TextModel.set_gguf_parameters and LlamaModel.set_gguf_parameters write it."""
    config = plan.config
    writer.add_block_count(1)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_file_type(FILE_TYPES[plan.file_type])
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


@dataclass(frozen=True)
class _TokenizerLayout:
    """How the converter writes one tokenizer model's keys (its _set_vocab_sentencepiece / _set_vocab_gpt2)."""
    scores: bool  # token scores, between the tokens and their types
    special_vocab: Callable[[Path, int], gguf.SpecialVocab]  # the merges come through it for BPE


TOKENIZER_LAYOUTS: dict[str, _TokenizerLayout] = {
    "llama": _TokenizerLayout(True, lambda folder, n_vocab: gguf.SpecialVocab(folder, n_vocab=n_vocab)),
    "gpt2": _TokenizerLayout(False, lambda folder, n_vocab: gguf.SpecialVocab(folder, load_merges=True)),
}

# The converter's tokenizer settings by the head's vocabulary size (LlamaModel.set_vocab): 49152 is taken
# for a small Granite model, whose tokenizer adds no BOS (quantkit's default model, SmolLM2, has it too).
ADD_BOS_BY_VOCAB_SIZE: dict[int, bool] = {49152: False}


def _add_tokenizer(writer: gguf.GGUFWriter, plan: _Export, tokenizer_pre: str | None) -> None:
    """The target's tokenizer (LlamaModel.set_vocab reads it from --target-model-dir)."""
    from quantkit.json_files import read_json_object

    tokenizer_config = plan.target_dir / "tokenizer_config.json"
    prefix_space = read_json_object(tokenizer_config).get("add_prefix_space") if tokenizer_config.is_file() else None
    if prefix_space is not None:
        writer.add_add_space_prefix(prefix_space)
    vocab = read_vocab(plan.target_dir, plan.config.vocab_size, {}, tokenizer_pre)
    layout = TOKENIZER_LAYOUTS[vocab.model]
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    if layout.scores:
        writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.token_types)
    layout.special_vocab(plan.target_dir, len(vocab.tokens)).add_to_gguf(writer, quiet=True)
    if plan.config.vocab_size in ADD_BOS_BY_VOCAB_SIZE:
        writer.add_add_bos_token(ADD_BOS_BY_VOCAB_SIZE[plan.config.vocab_size])


def _tensor_bytes(item: _Planned, reader: CheckpointReader) -> np.ndarray:
    """The tensor's GGUF bytes: widened to float32 (as the converter widens all but F16/F32), the folded
    factor applied, q/k rows permuted, then converted to its type. A quantized linear's own codes become its
    blocks, the factor multiplied into each group's fp16 scale (one rounding to fp16: ≤ 2⁻¹¹ relative)."""
    if item.record is not None:
        record = item.record if item.factor == 1.0 else replace(
            item.record, scales=(item.record.scales.float() * item.factor).to(item.record.scales.dtype))
        rows = torch.from_numpy(exact_blocks(record, item.tensor_type.name))
        return (permute_rows(rows, item.permute_heads) if item.permute_heads else rows).numpy()
    value = reader.get(item.source).to(torch.float32)
    if item.factor != 1.0:
        value = value * item.factor
    if item.permute_heads:
        value = permute_rows(value, item.permute_heads)
    rows = np.ascontiguousarray(value.numpy()).reshape(-1, item.shape[-1])
    return item.tensor_type.quantize_fast(rows)


def export_head_gguf(head_dir: str | Path, target_dir: str | Path, out: str | Path, outtype: str = "f16",
                     tokenizer_pre: str | None = None) -> HeadExportReport:
    """Write ``head_dir``'s EAGLE-3 head for the target at ``target_dir`` as the GGUF file ``out`` (which
    must not exist), matrices in ``outtype``."""
    started = time.perf_counter()
    out = Path(out)
    refuse_existing(out)
    plan = plan_head_export(head_dir, target_dir, outtype)
    report = HeadExportReport(str(out), outtype, plan.target.model_type,
                              {item.source: item.factor for item in plan.planned if item.factor != 1.0},
                              note=MINICPM_NOTE if plan.target.model_type == "minicpm" else "")
    with OutputLock(out), atomic_path(out) as tmp:
        refuse_existing(out)
        writer = PackedWriter(tmp, ARCH)
        for item in plan.planned:
            byte_shape = (*item.shape[:-1], item.tensor_type.row_bytes(item.shape[-1]))
            writer.add_tensor_info(item.name, byte_shape, np.dtype(np.uint8), item.nbytes,
                                   raw_dtype=item.tensor_type.ggml)
        writer.add_tensor_info(D2T, plan.target_ids.shape, plan.target_ids.dtype, plan.target_ids.nbytes,
                               raw_dtype=gguf.GGMLQuantizationType.I64)
        _add_eagle3_keys(writer, plan)
        _add_general(writer, plan)  # after the tensors: the size label counts them
        _add_shape(writer, plan)
        _add_tokenizer(writer, plan, tokenizer_pre)
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for item in plan.planned:
            writer.write_tensor_data(_tensor_bytes(item, plan.reader))
            report.tensors_by_type[item.tensor_type.name] = report.tensors_by_type.get(item.tensor_type.name, 0) + 1
        writer.write_tensor_data(plan.target_ids)
        report.tensors_by_type["i64"] = 1
        writer.close()
    report.file_bytes = out.stat().st_size
    report.seconds = round(time.perf_counter() - started, 3)
    return report
