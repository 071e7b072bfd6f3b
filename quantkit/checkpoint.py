"""Read a Hugging Face checkpoint directory tensor by tensor, without loading or mapping it whole.

Only safetensors are read (never pickle). Tensors are read with plain positioned reads rather than
a memory map: the pages of a map that has been touched count as this process's resident memory,
so validating a 16 GB checkpoint through mmap would look like (and be reported as) 16 GB of RSS.
Single-file and sharded (`model.safetensors.index.json`) checkpoints are both supported; every
failure names the file or tensor at fault.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from quantkit.errors import CheckpointError
from quantkit.json_files import loads_json, read_config_json, read_json_object

INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "quantkit.json"  # an artifact's manifest (quantkit.artifact writes it)
FILES_KEY = "files"  # its key: each file's size and SHA-256, so that a changed or truncated file is found
SINGLE_FILE = "model.safetensors"
SINGLE_FILES = (SINGLE_FILE, "model_gptq.safetensors")  # the second is CPM.cu's Marlin checkpoint

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "U32": torch.uint32,  # MLX's packed weights
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def manifest_records(directory: str | Path) -> dict[str, dict]:
    """The files an artifact's manifest records ({name: {"size", "sha256"}}); {} without a manifest, or with
    one older than file records."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        return {}
    records = read_json_object(path).get(FILES_KEY, {})
    if not isinstance(records, dict) or not all(
            isinstance(r, dict) and type(r.get("size")) is int and isinstance(r.get("sha256"), str)
            for r in records.values()):
        raise CheckpointError(f"{path}: '{FILES_KEY}' is not an object of {{size, sha256}} records")
    return records


def check_files(directory: str | Path, records: dict[str, dict], *,
                digests: Callable[[list[Path]], list[str]] | None = None) -> None:
    """Each file of ``records`` (``manifest_records``) against the one in ``directory``: there, of that size
    (a stat a file), and with ``digests`` of that SHA-256: ``quantkit.file_hashes.sha256_files`` reads every
    byte (1.4 s a GiB here), ``remembered_sha256s`` only those of a file not hashed in this version."""
    directory = Path(directory)
    names = sorted(records)
    for name in names:
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"incomplete artifact {directory}: {name} is missing ({MANIFEST_FILE} records it)")
        size = path.stat().st_size
        if size != records[name]["size"]:
            raise CheckpointError(f"{directory}: {name} has {size} bytes, {MANIFEST_FILE} records "
                                  f"{records[name]['size']}: the file was changed or truncated")
    if digests is None:
        return
    for name, actual in zip(names, digests([directory / name for name in names])):
        if actual != records[name]["sha256"]:
            raise CheckpointError(f"{directory}: {name}'s SHA-256 differs from the one {MANIFEST_FILE} records: the "
                                  "file was changed after quantkit wrote it")


@dataclass(frozen=True)
class TensorEntry:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    size: int


MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit on the JSON header


def _check_entries(header, data_start: int, file_size: int) -> str | None:
    """What is wrong with a parsed header's tensor entries, or None. Checked before any tensor is read, so
    no byte count the file does not hold is ever allocated."""
    if not isinstance(header, dict):
        return f"the header is a JSON {type(header).__name__}, not an object"
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict):
                return "'__metadata__' is not an object"
            continue
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            return f"tensor '{name}' lacks dtype, shape or data_offsets"
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            return f"tensor '{name}' has an unknown dtype {dtype!r}"
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            return f"tensor '{name}' has a bad shape {shape!r}"
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] or data_start + offsets[1] > file_size):
            return f"tensor '{name}' lies outside the file (data_offsets {offsets!r})"
        count = 1
        for d in shape:
            count *= d
        if count * DTYPES[dtype].itemsize != offsets[1] - offsets[0]:
            return (f"tensor '{name}': shape {shape} of {dtype} needs {count * DTYPES[dtype].itemsize} bytes, "
                    f"data_offsets hold {offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            return f"tensors '{first}' and '{second}' overlap"
    return None


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's JSON header and the offset where its data starts (validated: every tensor's
    dtype, shape and byte span agree and lie inside the file, no two overlap, no name repeats)."""
    try:
        if path.exists() and not path.is_file():
            raise ValueError("not a regular file")
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > file_size - 8 or length > MAX_HEADER_BYTES:
                raise ValueError(f"header length {length} exceeds the file or the format's limit")
            header = loads_json(f.read(length))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint shard missing: {path}") from None
    except (OSError, ValueError, struct.error, RecursionError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors file ({e})") from e
    data_start = 8 + length
    problem = _check_entries(header, data_start, file_size)
    if problem is not None:
        raise CheckpointError(f"{path}: corrupt safetensors file ({problem})")
    return header, data_start


# A decoder layer's tensor names; at most 9 digits, so that int() of a hostile name's digits stays cheap
# (a longer number is no layer, and the run's checks refuse the name).
_LAYER_KEY = re.compile(r"model\.layers\.(\d{1,9})\.")

# config.json sizes that a stored tensor's first dimension shows in every format quantkit reads: norms
# are never quantized, and a quantized embedding (MLX's) still stores one row per token.
SIZE_TENSORS = {"hidden_size": "model.norm.weight", "vocab_size": "model.embed_tokens.weight"}


class CheckpointReader:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"model directory not found: {self.directory}")
        if not (self.directory / "config.json").is_file():
            raise CheckpointError(f"{self.directory} has no config.json: not a Hugging Face checkpoint")
        config = read_config_json(self.directory)
        self._entries = self._read_entries()
        self._check_sizes(config)
        # An artifact's weight files are held to the sizes its manifest records (a stat each), so that a
        # truncated or grown one never gets as far as a model; `quantkit.reader` holds them to the hashes.
        check_files(self.directory, self.weight_records())

    def weight_records(self) -> dict[str, dict]:
        """What the manifest (if any) records of the weight files."""
        weights = {path.name for path in self.files()}
        return {name: r for name, r in manifest_records(self.directory).items() if name in weights}

    def _check_sizes(self, config: dict) -> None:
        """The config's layer count and sizes against the tensors present, before anything is built from
        the config (a shape table of a billion layers alone fills the memory): both ways for the layers
        (no tensor beyond the count, and some tensor of every layer), and ``SIZE_TENSORS``. Values of the
        wrong type are left to the config's own checks."""
        layers = config.get("num_hidden_layers")
        stored = {int(m[1]) for m in map(_LAYER_KEY.match, self._entries) if m}
        if stored and type(layers) is int:
            if max(stored) >= layers:
                beyond = min(index for index in stored if index >= layers)
                raise CheckpointError(f"{self.directory} holds tensors of layer {beyond}, but its config.json "
                                      f"has num_hidden_layers = {layers}: config and weights disagree")
            if len(stored) < layers:
                first = next(index for index in range(layers) if index not in stored)
                raise CheckpointError(f"{self.directory}: its config.json has num_hidden_layers = {layers}, but the "
                                      f"weights hold no tensor of layer {first} ({len(stored)} layers in all): "
                                      "config and weights disagree")
        for key, name in SIZE_TENSORS.items():
            size = config.get(key)
            if type(size) is int and name in self._entries and self._entries[name].shape[:1] != (size,):
                raise CheckpointError(f"{self.directory}: its config.json has {key} = {size}, but {name} has shape "
                                      f"{list(self._entries[name].shape)}: config and weights disagree")

    def _weight_files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: corrupt index ({e!r})") from e
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: corrupt index ('weight_map' is not a non-empty object)")
            for file in set(weight_map.values()):
                # Shards are files of this directory, by plain name: never a path that leaves it. (A shard
                # may be a symlink, as in the Hugging Face cache; what it points to is validated like any shard.)
                if (not isinstance(file, str) or not file or file != Path(file).name or file in (".", "..")
                        or "\\" in file):
                    raise CheckpointError(f"{index}: shard name {file!r} is not a file name in {self.directory}")
            return sorted({self.directory / file for file in weight_map.values()})
        single = next((self.directory / f for f in SINGLE_FILES if (self.directory / f).is_file()), None)
        if single is None:
            if any(self.directory.glob("*.bin")) or any(self.directory.glob("*.pt")):
                raise CheckpointError(f"{self.directory} holds only pickle weights (.bin/.pt); quantkit reads "
                                      "safetensors only. Convert them first with a trusted tool.")
            raise CheckpointError(f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        return [single]

    def _read_entries(self) -> dict[str, TensorEntry]:
        entries = {}
        for path in self._weight_files():
            header, data_start = read_header(path)
            for name, info in header.items():
                if name != "__metadata__":
                    if name in entries:
                        raise CheckpointError(f"{self.directory}: tensor '{name}' is stored twice, in "
                                              f"{entries[name].path.name} and {path.name}")
                    begin, end = info["data_offsets"]
                    entries[name] = TensorEntry(path, info["dtype"], tuple(info["shape"]), data_start + begin,
                                                end - begin)
        return entries

    @property
    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, name: str) -> TensorEntry:
        if name not in self._entries:
            raise CheckpointError(f"{self.directory}: tensor '{name}' is missing")
        return self._entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self._entry(name).dtype]

    def get(self, name: str) -> torch.Tensor:
        """The tensor on a private (copy-on-write) map of its bytes in the file: reading into a fresh buffer
        instead zero-filled and copied every page (1.3 s for the default model's 650 MB, against 0.2 s
        mapped). The map is the tensor's alone, so it goes with the tensor; writes to it stay private."""
        entry = self._entry(name)
        if entry.size == 0:
            return torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
        start = entry.start - entry.start % mmap.ALLOCATIONGRANULARITY  # a map starts on a page
        with open(entry.path, "rb") as f:
            if os.fstat(f.fileno()).st_size < entry.start + entry.size:  # a map past the end faults (SIGBUS)
                raise CheckpointError(f"{entry.path}: corrupt safetensors file (tensor '{name}' is truncated)")
            mapped = mmap.mmap(f.fileno(), entry.start + entry.size - start, access=mmap.ACCESS_COPY, offset=start)
        return torch.frombuffer(mapped, dtype=DTYPES[entry.dtype], count=entry.size // DTYPES[entry.dtype].itemsize,
                                offset=entry.start - start).reshape(entry.shape)

    def files(self) -> list[Path]:
        return sorted({entry.path for entry in self._entries.values()})

    def fingerprint(self) -> str:
        """SHA-256 over config.json and every weight file's bytes (what a run's results depend on)."""
        digest = hashlib.sha256((self.directory / "config.json").read_bytes())
        for path in self.files():
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
        return digest.hexdigest()
