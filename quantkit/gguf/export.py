"""Write a MiniCPM checkpoint (unquantized, or any artifact quantkit reads) as a llama.cpp GGUF.

The file is what llama.cpp's MiniCPM architecture expects (docs/gguf.md, "What the file holds"): μP multipliers as
``minicpm.embedding_scale`` / ``residual_scale`` / ``logit_scale`` (weights unchanged), q/k rows
permuted for GGML's rope, LongRoPE factors as ``rope_factors_long/short``, the tokenizer and chat
template, and ``sparse_config`` (which llama.cpp has no key for) under ``quantkit.sparse_config``.
Tensors are produced one decoder layer at a time and streamed to disk, so exporting an 8B model
never holds it in memory. The file appears under its name only when complete.
"""
from __future__ import annotations

import json
import math
import struct
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

from quantkit.atomic import atomic_path, refuse_existing
from quantkit.checkpoint import CheckpointError
from quantkit.gguf.exact import exact_blocks
from quantkit.gguf.imatrix_file import read_imatrix
from quantkit.gguf.mixes import FILE_TYPES, Model, choose_type, needs_imatrix
from quantkit.gguf.names import gguf_name, permute_rows, permuted_view, unpermute_rows
from quantkit.gguf.types import TensorType
from quantkit.gguf.vocab import read_vocab
from quantkit.lock import OutputLock
from quantkit.models import MiniCPMConfig, MiniCPMRotaryEmbedding
from quantkit.models.decoder import weight_shapes
from quantkit.models.layers import K, Q
from quantkit.quant import QuantizedTensor
from quantkit.reader import ArtifactReader

ARCH = "minicpm"
QUANTIZE_CHUNK_ELEMENTS = 1 << 22  # weights per quantizer call: 16 MB of float32 (and the NumPy codecs' temporaries)
AHEAD_BYTES = 1 << 28  # finished tensors the export may hold before writing them (an 8B's largest is ~300 MB)
SPARSE_CONFIG_KEY = "quantkit.sparse_config"


@dataclass
class ExportReport:
    path: str
    file_type: str
    seconds: float = 0.0
    file_bytes: int = 0
    weights: int = 0  # parameters written
    tensors_by_type: dict[str, int] = field(default_factory=dict)
    exact_tensors: int = 0  # quantized records written as their own grid, not re-rounded

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.file_bytes / self.weights if self.weights else 0.0


@dataclass(frozen=True)
class _Planned:
    name: str  # GGUF tensor name
    source: str  # MiniCPM key, or a rope factor name
    shape: tuple[int, ...]  # numpy order: [rows, K] or [K]
    tensor_type: TensorType
    importance: np.ndarray | None = None  # the imatrix's mean x² per input channel, where it has the tensor


class _LayerTensors:
    """The checkpoint's tensors one layer at a time, as float32 blocks of rows, and the quantized linears'
    records. One thread reads it: ``row_blocks`` widens into one small buffer reused for every block of
    every tensor (``_RowBlocks``). A float32 copy of a whole tensor cost more than quantizing it: an 8B's
    1.2 GB embedding paid 1.7 s of first page faults for its buffer, against 5.3 s of Q4_0 quantization
    for the whole slice of the 8B, where a 16 MB block stays mapped and in cache for the quantizer."""

    def __init__(self, model_dir: Path):
        self.artifact = ArtifactReader(model_dir)
        self.reader = self.artifact.tensors
        self.config = self.artifact.config
        self.format = self.artifact.format
        self._index: int | None = None
        self._plain: dict[str, torch.Tensor] = {}
        self._records: dict[str, QuantizedTensor] = {}
        self._blocks = _RowBlocks()

    def _load(self, key: str) -> None:
        index = int(key.split(".")[2])
        if self._index == index:
            return
        self._plain, self._records = self.artifact.layer(index)
        self._index = index

    def record(self, key: str) -> QuantizedTensor | None:
        """The quantized record behind ``key``, if the checkpoint stores that tensor quantized."""
        if not key.startswith("model.layers."):
            return None
        self._load(key)
        return self._records.get(key)

    def _stored_value(self, key: str) -> torch.Tensor:
        """``key`` as stored (a quantized record dequantized)."""
        if not key.startswith("model.layers."):
            return self.reader.get(key)
        self._load(key)
        record = self._records.get(key)
        if record is not None:
            return record.dequantize(torch.float32)
        if key not in self._plain:
            raise CheckpointError(f"{self.artifact.dir} lacks tensor '{key}'")
        return self._plain[key]

    def row_blocks(self, key: str, heads: int | None, whole: bool) -> Iterator[np.ndarray]:
        """``key`` as ``_RowBlocks`` yields it."""
        return self._blocks(self._stored_value(key), heads, whole)


class _RowBlocks:
    """Tensors as float32 in consecutive blocks of whole rows ([rows, K]; a 1-D tensor is one row), rows
    permuted for GGML's rope over ``heads`` heads if given, in blocks of about ``block_elements`` weights.
    A tensor already float32 in row order is read in place (copying the default model's float32 weights
    was a quarter of its export), and is one block when ``whole`` (ggml's quantizer makes no temporaries,
    and splitting the default model's embedding into 4 M-weight calls cost 9 %); any other is widened
    into one buffer reused for every block, each valid until the next."""

    def __init__(self, block_elements: int = QUANTIZE_CHUNK_ELEMENTS):
        self.block_elements = block_elements
        self._buffer = np.empty(0, dtype=np.float32)

    def __call__(self, value: torch.Tensor, heads: int | None, whole: bool = False) -> Iterator[np.ndarray]:
        value = value.reshape(1, -1) if value.ndim == 1 else value
        k = value.shape[-1]
        if value.dtype == torch.float32 and not heads:
            array = value.numpy()
            step = len(array) if whole else max(1, self.block_elements // k)
            for start in range(0, len(array), step):
                yield array[start:start + step]
            return
        bfloat16 = value.dtype == torch.bfloat16
        source = value.view(torch.int16).numpy().view(np.uint16) if bfloat16 else value.numpy()
        if heads:  # axis 0 is then the heads, each a run of whole output rows
            source = permuted_view(source, heads)
        step = min(len(source), max(1, self.block_elements // source[0].size))
        if self._buffer.size < step * source[0].size:
            self._buffer = np.empty(step * source[0].size, dtype=np.float32)
        for start in range(0, len(source), step):
            part = source[start:start + step]
            out = self._buffer[:part.size]
            _widen(part, bfloat16, out.reshape(part.shape))
            yield out.reshape(-1, k)


def _widen(source: np.ndarray, bfloat16: bool, out: np.ndarray) -> None:
    """``source`` (float32, float16, or bfloat16 as its uint16 bits) into the float32 array ``out`` of its
    shape. NumPy on this thread, not torch: torch's OpenMP threads spin after each op, and on two cores
    that starved the ggml quantizer threads that run next (0.3 s of the default model's Q8_0 export)."""
    if bfloat16:  # a bfloat16 is the upper half of the float32 it stands for
        np.left_shift(source, 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(out, source)


class PackedWriter(gguf.GGUFWriter):
    """gguf-py's writer with uniform metadata arrays packed in one call: gguf-py packs them item by item,
    which for the tokenizer's ~150k tokens, token types and merges took 0.8 s of every export of the
    default model. Bytes unchanged (tests/test_gguf_export.py)."""

    def _pack_val(self, val, vtype, add_vtype, sub_type=None) -> bytes:
        kind = type(val[0]) if vtype == gguf.GGUFValueType.ARRAY and isinstance(val, list) and val else None
        if kind not in (str, int, float) or set(map(type, val)) != {kind}:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        item_type = sub_type or gguf.GGUFValueType.get_type(val[0])
        prefix = "<" if self.endianess == gguf.GGUFEndian.LITTLE else ">"
        head = struct.pack(f"{prefix}IQ", item_type, len(val))
        head = (struct.pack(f"{prefix}I", vtype) if add_vtype else b"") + head
        if item_type == gguf.GGUFValueType.STRING:
            return head + _length_prefixed([item.encode("utf-8") for item in val], prefix)
        return head + struct.pack(f"{prefix}{len(val)}{self._simple_value_packing[item_type]}", *val)


def _length_prefixed(strings: list[bytes], byte_order: str) -> bytes:
    """Each string after its length as a uint64, all in one buffer: scattered by NumPy instead of packed
    one by one (0.15 s of the default model's ~100k tokens and merges)."""
    lengths = np.fromiter(map(len, strings), dtype=np.uint64, count=len(strings))
    is_length = np.zeros(int(lengths.sum()) + 8 * len(strings), dtype=bool)
    starts = np.cumsum(lengths + 8) - (lengths + 8)
    is_length[(starts[:, None] + np.arange(8, dtype=np.uint64)).ravel()] = True
    packed = np.empty(is_length.size, dtype=np.uint8)
    packed[is_length] = lengths.astype(f"{byte_order}u8").view(np.uint8)
    packed[~is_length] = np.frombuffer(b"".join(strings), dtype=np.uint8)
    return packed.tobytes()


def _rope_factors(config: MiniCPMConfig) -> dict[str, list[float]]:
    scaling = config.rope_scaling or {}
    if (scaling.get("rope_type") or scaling.get("type")) != "longrope":
        return {}
    return {"rope_factors_long.weight": scaling["long_factor"], "rope_factors_short.weight": scaling["short_factor"]}


def _check_exportable(config: MiniCPMConfig) -> None:
    if config.attention_bias:
        raise ValueError("attention_bias: true has no place in llama.cpp's MiniCPM architecture; cannot export")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        raise ValueError(f"head_dim {head_dim} x {config.num_attention_heads} heads != hidden_size "
                         f"{config.hidden_size}: llama.cpp's MiniCPM derives head_dim from them")


def _plan(config: MiniCPMConfig, file_type: str, imatrix_path: str | Path | None = None,
          solved: Mapping[str, str] | None = None) -> list[_Planned]:
    """Each tensor's GGUF type (llama-quantize's choice, with or without an importance matrix) and importance
    vector from the imatrix file; a type llama-quantize writes only with importance statistics is refused
    without them. ``solved``: the checkpoint is a calibrated ``gguf-<file_type>`` artifact, whose linears
    already hold the types chosen with statistics (the solver's Hessian) and its per-tensor overrides (this
    mapping, GGUF name -> type), and are copied."""
    imatrix = None if imatrix_path is None else read_imatrix(imatrix_path)
    model = Model.of(config)
    shapes = weight_shapes(config)
    foreign = sorted(set(imatrix.sums) - {gguf_name(key) for key in shapes}) if imatrix is not None else []
    if foreign:  # another model's statistics, whose shapes may even fit
        raise ValueError(f"the imatrix has {foreign[0]}, which this model lacks ({len(foreign)} such tensors): "
                         "is it another model's?")
    planned = []
    for key, shape in shapes.items():
        name = gguf_name(key)
        tensor_type = choose_type(file_type, name, shape, model, imatrix=solved is not None or imatrix is not None,
                                  overrides=solved or {})
        importance = imatrix.importance(name) if imatrix is not None and name in imatrix.sums else None
        if importance is not None and importance.shape != shape[-1:]:
            raise ValueError(f"the imatrix's {name} has {importance.size} channels; the model's has {shape[-1]}")
        if importance is None and solved is None and needs_imatrix(file_type, name, tensor_type):
            raise ValueError(f"{file_type}: {name} is {tensor_type.name}, which llama.cpp writes only with an "
                             "importance matrix: make one with `quantkit imatrix` and pass --imatrix")
        planned.append(_Planned(name, key, shape, tensor_type, importance))
    for name, factors in _rope_factors(config).items():
        planned.append(_Planned(name, name, (len(factors),), choose_type(file_type, name, (len(factors),), model)))
    return planned


def _add_metadata(writer: gguf.GGUFWriter, config: MiniCPMConfig, model_dir: Path, file_type: str,
                  tokenizer_pre: str | None) -> None:
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_name(model_dir.name)
    writer.add_file_type(FILE_TYPES[file_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_embedding_scale(float(config.scale_emb))
    writer.add_residual_scale(float(config.scale_depth) / math.sqrt(config.num_hidden_layers))
    writer.add_logit_scale(config.hidden_size / config.dim_model_base)
    if _rope_factors(config):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        rotary = MiniCPMRotaryEmbedding(config)
        writer.add_rope_scaling_orig_ctx_len(int(rotary.original_max_position_embeddings))
        # LongRoPE's cos/sin magnitude sqrt(1 + ln(max/original)/ln(original)): without this key
        # llama.cpp leaves it out (measured on a tiny LongRoPE model: mean KL 4e-4 -> 1.5e-9).
        writer.add_rope_scaling_attn_factors(rotary.attention_factor)
    if getattr(config, "sparse_config", None):
        writer.add_string(SPARSE_CONFIG_KEY, json.dumps(config.sparse_config, sort_keys=True))

    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    ids = {"bos": config.bos_token_id, "eos": eos, "pad": config.pad_token_id}
    vocab = read_vocab(model_dir, config.vocab_size, {k: v for k, v in ids.items() if v is not None}, tokenizer_pre)
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.scores:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id, "unk": writer.add_unk_token_id,
              "pad": writer.add_pad_token_id}
    for kind, token_id in vocab.special_ids.items():
        adders[kind](int(token_id))
    writer.add_add_bos_token(vocab.add_bos)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)


def _heads_to_permute(key: str, config: MiniCPMConfig) -> int | None:
    """q/k rows are permuted for GGML's rope, per head: the head count, or None for other tensors."""
    part = key.split(".", 3)[-1].rsplit(".", 1)[0] if key.startswith("model.layers.") else None
    return {Q: config.num_attention_heads, K: config.num_key_value_heads}.get(part)


def _stored(item: _Planned, source: _LayerTensors, config: MiniCPMConfig) -> tuple[np.ndarray, bool]:
    """The tensor's GGUF bytes, and whether they are a quantized record's own grid (not re-rounded)."""
    heads = _heads_to_permute(item.source, config)
    record = source.record(item.source)
    blocks = exact_blocks(record, item.tensor_type.name) if record is not None else None
    if blocks is not None:
        rows = torch.from_numpy(blocks)
        return (permute_rows(rows, heads) if heads else rows).numpy(), True
    if item.name.startswith("rope_factors_"):
        float_blocks = iter([np.asarray(_rope_factors(config)[item.name], dtype=np.float32)])
    else:
        # the NumPy codecs' temporaries grow with their input: ggml's quantizer alone takes a tensor whole
        float_blocks = source.row_blocks(item.source, heads, whole=item.tensor_type.quantized_by_ggml)
    k = item.shape[-1]
    out = np.empty((*item.shape[:-1], item.tensor_type.row_bytes(k)), dtype=np.uint8)
    rows_out = out.reshape(-1, out.shape[-1])
    done = 0
    for block in float_blocks:
        if not _all_finite(block):
            raise ValueError(f"tensor '{item.source}' contains NaN or Inf values")
        block = block.reshape(-1, k)
        item.tensor_type.quantize_fast(block, item.importance, out=rows_out[done:done + len(block)])
        done += len(block)
    if done != len(rows_out):
        raise CheckpointError(f"tensor '{item.source}' has {done * k} values, the model's shape {item.shape} "
                              f"needs {math.prod(item.shape)}")
    return out, False


def _solved(source: _LayerTensors, file_type: str) -> dict[str, str] | None:
    """For a calibrated ``gguf-<file_type>`` artifact, its per-tensor overrides of the mix; else None."""
    if source.format is None or source.format.name != f"gguf-{file_type}":
        return None
    return dict(source.artifact.quantization_config.get("tensor_types", {}))


def _all_finite(array: np.ndarray) -> bool:
    """NaN propagates through min and max, and an infinity is one of them: two passes with no full-size
    boolean temporary, which np.isfinite(array).all() made (0.3 s of the default model's export). NumPy,
    not torch, for the reason ``_widen`` gives."""
    return array.size == 0 or bool(np.isfinite(array.min()) and np.isfinite(array.max()))


def _stored_ahead(planned: list[_Planned], source: _LayerTensors, config: MiniCPMConfig,
                  worker: ThreadPoolExecutor) -> Iterator[tuple[np.ndarray, bool]]:
    """``_stored`` of each planned tensor in order, made on ``worker`` ahead of the caller's writes, so that
    reading, quantizing and writing overlap (ggml and the file write release the GIL). Work starts at once,
    while the caller builds the metadata (the vocabulary: half a second of the default model's export), and
    runs up to AHEAD_BYTES of finished tensors ahead, always at least the next one. A single worker
    reads ``source`` in order."""
    sizes = [_tensor_bytes(item) for item in planned]
    pending: deque = deque()
    held, submitted = 0, 0

    def submit_while_room() -> None:
        nonlocal held, submitted
        while submitted < len(planned) and (not pending or held + sizes[submitted] <= AHEAD_BYTES):
            pending.append((sizes[submitted], worker.submit(_stored, planned[submitted], source, config)))
            held += sizes[submitted]
            submitted += 1

    def results() -> Iterator[tuple[np.ndarray, bool]]:
        nonlocal held
        try:
            while pending:
                size, future = pending.popleft()
                stored = future.result()
                held -= size
                submit_while_room()
                yield stored
        finally:  # a tensor failed (or the caller stopped): the work queued behind it is not wanted
            for _, future in pending:
                future.cancel()
    submit_while_room()
    return results()


def _tensor_bytes(item: _Planned) -> int:
    return math.prod(item.shape[:-1]) * item.tensor_type.row_bytes(item.shape[-1])


def _header(path: Path, planned: list[_Planned], config: MiniCPMConfig, model_dir: Path, file_type: str,
            tokenizer_pre: str | None) -> PackedWriter:
    """A writer that has written the file's header, metadata and tensor table to ``path``."""
    writer = PackedWriter(path, ARCH)
    _add_metadata(writer, config, model_dir, file_type, tokenizer_pre)
    for item in planned:
        byte_shape = (*item.shape[:-1], item.tensor_type.row_bytes(item.shape[-1]))
        writer.add_tensor_info(item.name, byte_shape, np.dtype(np.uint8), _tensor_bytes(item),
                               raw_dtype=item.tensor_type.ggml)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    return writer


def file_bytes(model_dir: str | Path, file_type: str, tensor_types: Mapping[str, str] = {}, *,
               tokenizer_pre: str | None = None) -> tuple[int, dict[str, tuple[str, int, int]]]:
    """What ``export_gguf`` writes for ``model_dir`` as a ``file_type`` file whose linears have the mix's
    types with ``tensor_types``'s overrides (GGUF name -> type), without quantizing anything: the file's
    exact size in bytes, and per GGUF name the tensor's type, its bytes with their alignment padding and
    its weight count. The header is written to a scratch file, the tensors are counted."""
    import tempfile

    model_dir = Path(model_dir)
    source = _LayerTensors(model_dir)
    _check_exportable(source.config)
    planned = _plan(source.config, file_type, solved=dict(tensor_types))
    with tempfile.TemporaryDirectory(prefix="quantkit-gguf-header-") as scratch:
        writer = _header(Path(scratch) / "header.gguf", planned, source.config, model_dir, file_type, tokenizer_pre)
        header = writer.fout[0].tell()
        writer.close()
    tensors = {item.name: (item.tensor_type.name, gguf.GGUFWriter.ggml_pad(_tensor_bytes(item), writer.data_alignment),
                           math.prod(item.shape)) for item in planned}
    return gguf.GGUFWriter.ggml_pad(header, writer.data_alignment) + sum(t[1] for t in tensors.values()), tensors


def export_gguf(model_dir: str | Path, out: str | Path, file_type: str, *, tokenizer_pre: str | None = None,
                imatrix: str | Path | None = None, progress: bool = True) -> ExportReport:
    """Export ``model_dir`` to the GGUF file ``out`` (which must not exist) with ``file_type``'s mix; with
    ``imatrix`` (llama.cpp's importance-matrix file, ``quantkit imatrix``'s or ``llama-imatrix``'s) each
    tensor's type and bytes are llama-quantize's with ``--imatrix``."""
    started = time.perf_counter()
    model_dir, out = Path(model_dir), Path(out)
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown GGUF type '{file_type}'; choose from {', '.join(FILE_TYPES)}")
    refuse_existing(out)
    source = _LayerTensors(model_dir)  # reads and checks the checkpoint's files first
    config = source.config
    _check_exportable(config)
    planned = _plan(config, file_type, imatrix, _solved(source, file_type))
    report = ExportReport(str(out), file_type)
    with OutputLock(out), atomic_path(out) as tmp, ThreadPoolExecutor(1, thread_name_prefix="gguf-export") as worker:
        refuse_existing(out)  # another run may have finished it while this one was checking
        prepared = _stored_ahead(planned, source, config, worker)
        writer = _header(tmp, planned, config, model_dir, file_type, tokenizer_pre)
        for item, (data, exact) in tqdm(zip(planned, prepared), desc=f"export {file_type}", unit="tensor",
                                        total=len(planned), disable=not progress):
            writer.write_tensor_data(data)
            report.exact_tensors += exact
            report.tensors_by_type[item.tensor_type.name] = report.tensors_by_type.get(item.tensor_type.name, 0) + 1
            report.weights += math.prod(item.shape)
        writer.close()
    report.file_bytes = out.stat().st_size
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def exported_weights(model_dir: str | Path, file_type: str, imatrix: str | Path | None = None
                     ) -> dict[str, torch.Tensor]:
    """The MiniCPM state dict a ``file_type`` export computes with, in MiniCPM's row order: each
    tensor's stored blocks (a record's own grid, or its type's quantizer) dequantized. quantkit's
    reference for what llama.cpp should compute from the file."""
    model_dir = Path(model_dir)
    source = _LayerTensors(model_dir)
    config = source.config
    state = {}
    for item in _plan(config, file_type, imatrix, _solved(source, file_type)):
        if item.name.startswith("rope_factors_"):
            continue
        stored, _ = _stored(item, source, config)
        value = torch.from_numpy(item.tensor_type.dequantize(stored, item.shape[-1]).reshape(item.shape))
        heads = _heads_to_permute(item.source, config)
        state[item.source] = unpermute_rows(value, heads) if heads else value
    return state
