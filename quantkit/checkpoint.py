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
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SINGLE_FILES = (SINGLE_FILE, "model_gptq.safetensors")  # the second is CPM.cu's Marlin checkpoint

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "U32": torch.uint32,  # MLX's packed weights
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def sha256_file(path: str | os.PathLike) -> str:
    """The SHA-256 of one file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or does not match what it should contain."""


@dataclass(frozen=True)
class TensorEntry:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    size: int


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's JSON header and the offset where its data starts (validated)."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > file_size - 8:
                raise ValueError(f"header length {length} exceeds the file")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint shard missing: {path}") from None
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"{path}: corrupt safetensors file ({e})") from e
    data_start = 8 + length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info.get("data_offsets", (0, -1))
        if info.get("dtype") not in DTYPES or not 0 <= begin <= end or data_start + end > file_size:
            raise CheckpointError(f"{path}: corrupt safetensors file (tensor '{name}' lies outside the file "
                                  "or has an unknown dtype)")
    return header, data_start


class CheckpointReader:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"model directory not found: {self.directory}")
        if not (self.directory / "config.json").is_file():
            raise CheckpointError(f"{self.directory} has no config.json: not a Hugging Face checkpoint")
        self._entries = self._read_entries()

    def _weight_files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: corrupt index ({e})") from e
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
        entry = self._entry(name)
        buffer = bytearray(entry.size)
        view, done = memoryview(buffer), 0
        with open(entry.path, "rb") as f:
            while done < entry.size:  # one read returns at most ~2 GiB on Linux
                count = os.preadv(f.fileno(), [view[done:]], entry.start + done)
                if count == 0:
                    raise CheckpointError(f"{entry.path}: corrupt safetensors file (tensor '{name}' is truncated)")
                done += count
        if entry.size == 0:
            return torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
        return torch.frombuffer(buffer, dtype=DTYPES[entry.dtype]).reshape(entry.shape)

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
