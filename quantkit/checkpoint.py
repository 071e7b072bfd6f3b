"""Read a Hugging Face checkpoint directory tensor by tensor, memory-mapped, without loading it whole.

Only safetensors are read (never pickle). Single-file and sharded (`model.safetensors.index.json`)
checkpoints are both supported; every failure names the file or tensor at fault.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SINGLE_FILES = (SINGLE_FILE, "model_gptq.safetensors")  # the second is CPM.cu's Marlin checkpoint


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or does not match what it should contain."""


class CheckpointReader:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"model directory not found: {self.directory}")
        if not (self.directory / "config.json").is_file():
            raise CheckpointError(f"{self.directory} has no config.json: not a Hugging Face checkpoint")
        self._handles: dict[Path, object] = {}
        self._file_of = self._map_tensors()

    def _map_tensors(self) -> dict[str, Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: corrupt index ({e})") from e
            return {name: self.directory / file for name, file in weight_map.items()}
        single = next((self.directory / f for f in SINGLE_FILES if (self.directory / f).is_file()), None)
        if single is None:
            if any(self.directory.glob("*.bin")) or any(self.directory.glob("*.pt")):
                raise CheckpointError(f"{self.directory} holds only pickle weights (.bin/.pt); quantkit reads "
                                      "safetensors only. Convert them first with a trusted tool.")
            raise CheckpointError(f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        return {name: single for name in self._open(single).keys()}

    def _open(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            if not path.is_file():
                raise CheckpointError(f"checkpoint shard missing: {path}")
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{path}: corrupt safetensors file ({e})") from e
            self._handles[path] = handle
        return handle

    @property
    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise CheckpointError(f"{self.directory}: tensor '{name}' is missing")
        path = self._file_of[name]
        try:
            return self._open(path).get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read tensor '{name}' ({e})") from e

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._file_of:
            raise CheckpointError(f"{self.directory}: tensor '{name}' is missing")
        return tuple(self._open(self._file_of[name]).get_slice(name).get_shape())

    def files(self) -> list[Path]:
        return sorted(set(self._file_of.values()))

    def fingerprint(self) -> str:
        """SHA-256 over config.json and every weight file's bytes (what a run's results depend on)."""
        digest = hashlib.sha256((self.directory / "config.json").read_bytes())
        for path in self.files():
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
        return digest.hexdigest()
