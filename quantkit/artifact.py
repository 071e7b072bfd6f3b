"""Writing a quantized artifact directory: shards, index, configs, copied tokenizer files, manifest.

The writer fills a staging directory (``<out>.partial``, which the run renames onto ``<out>`` only
when complete: ``quantkit.run``), so a reader never sees half of an artifact. Each shard is itself
written atomically, which is what lets an interrupted run resume from its last finished layer.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

from quantkit import atomic
from quantkit.checkpoint import DTYPES, FILES_KEY, INDEX_FILE, MANIFEST_FILE, SINGLE_FILES, read_header
from quantkit.file_hashes import remembered_sha256s

PROGRESS_FILE = "progress.json"
REPORT_FILE = "quantize_report.json"  # timings and memory: the only file that differs between runs

# Files of the source checkpoint that the artifact replaces rather than copies.
_NOT_COPIED = {"config.json", INDEX_FILE, *SINGLE_FILES, "quantize_config.json", MANIFEST_FILE, REPORT_FILE}


def file_records(directory: Path, skipped: set[str]) -> dict[str, dict]:
    """``{name: {"size", "sha256"}}`` of every file in ``directory`` whose name is not in ``skipped``."""
    paths = [path for path in sorted(directory.iterdir()) if path.is_file() and path.name not in skipped]
    return {path.name: {"size": path.stat().st_size, "sha256": digest}
            for path, digest in zip(paths, remembered_sha256s(paths))}


def shard_name(index: int, total: int) -> str:
    return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


class ArtifactWriter:
    """Shard ``i`` holds decoder layer ``i``; the last shard holds everything outside the layers."""

    def __init__(self, staging: Path, num_layers: int):
        self.staging = staging
        self.total = num_layers + 1
        staging.mkdir(parents=True, exist_ok=True)
        for stale in staging.glob(".*.tmp"):  # a killed run's half-written shard, never to be published
            atomic.remove_temporary(stale)

    def shard_path(self, index: int) -> Path:
        return self.staging / shard_name(index, self.total)

    def write_shard(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        atomic.save_safetensors(self.shard_path(index), tensors, metadata={"format": "pt"})

    def write_progress(self, layer_errors: list[dict]) -> None:
        """Record the finished layers (one entry each, in order) so that a resumed run can go on."""
        atomic.write_json(self.staging / PROGRESS_FILE, {"layer_errors": layer_errors})

    def read_progress(self) -> list[dict]:
        """The finished layers an interrupted run recorded (``write_progress``)."""
        return json.loads((self.staging / PROGRESS_FILE).read_text())["layer_errors"]

    def finish(self, source_dir: Path, config: dict, quantize_config: dict | None, report: dict,
               weights_file: str | None = None, extra_configs: dict[str, dict] | None = None,
               code_files: dict[str, str] | None = None) -> None:
        """Write the index (or merge the shards into ``weights_file``), configs, the report and copies:
        every file but the manifest (``write_manifest``). A plain (fake-quantized) checkpoint has no
        ``quantize_config``. ``extra_configs`` are further JSON files some consumer reads (file name ->
        content); ``code_files`` the model code config.json's auto_map names (file name -> text:
        ``quantkit.models.remote_code``), written in place of the source's files of those names."""
        shards = [self.shard_path(index) for index in range(self.total)]
        if weights_file is None:
            weight_map, total_size = {}, 0
            for path in shards:
                for name, (dtype, shape) in _header(path).items():
                    weight_map[name] = path.name
                    total_size += _nbytes(dtype, shape)
            atomic.write_json(self.staging / INDEX_FILE, {"metadata": {"total_size": total_size},
                                                          "weight_map": dict(sorted(weight_map.items()))})
        else:
            merge_safetensors(shards, self.staging / weights_file)
            for path in shards:
                path.unlink()
        atomic.write_json(self.staging / "config.json", config)
        for name, content in (extra_configs or {}).items():
            atomic.write_json(self.staging / name, content)
        if quantize_config is not None:
            atomic.write_json(self.staging / "quantize_config.json", quantize_config)
        atomic.write_json(self.staging / REPORT_FILE, report)
        for name, text in (code_files or {}).items():
            atomic.write_text(self.staging / name, text)
        # Tokenizer, chat template, generation config and anything else travel verbatim.
        for path in sorted(source_dir.iterdir()):
            if (path.is_file() and path.name not in _NOT_COPIED and path.suffix != ".safetensors"
                    and path.name not in (code_files or {})):
                with atomic.atomic_path(self.staging / path.name) as tmp:  # a failed copy names its file
                    shutil.copyfile(path, tmp)

    def write_manifest(self, manifest: dict, manifest_file: str = MANIFEST_FILE) -> None:
        """The manifest, with the size and SHA-256 of every other file the staging holds: the last file,
        written once the run's own files have left (``Run.publishing``). A plain (fake-quantized)
        checkpoint keeps it under another ``manifest_file``: quantkit.json marks a quantized artifact."""
        # The manifest cannot record itself, and the report differs between runs of the same artifact.
        records = file_records(self.staging, {manifest_file, REPORT_FILE})
        atomic.write_json(self.staging / manifest_file, {**manifest, FILES_KEY: records})


def _header(path: Path) -> dict[str, tuple[str, list[int]]]:
    header, _ = read_header(path)
    return {name: (h["dtype"], h["shape"]) for name, h in header.items() if name != "__metadata__"}


def merge_safetensors(paths: list[Path], out: Path) -> None:
    """Concatenate safetensors files into one, streaming the tensor bytes (never all in memory)."""
    entries, offset = {}, 0
    for path in paths:
        header, _ = read_header(path)
        for name, info in sorted(header.items()):
            if name == "__metadata__":
                continue
            size = info["data_offsets"][1] - info["data_offsets"][0]
            entries[name] = (path, info, offset, size)
            offset += size
    header = {"__metadata__": {"format": "pt"}}
    header.update({name: {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [start, start + size]}
                   for name, (_, info, start, size) in sorted(entries.items())})
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8-byte alignment
    with atomic.atomic_path(out) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, (path, info, _, size) in sorted(entries.items(), key=lambda e: e[1][2]):
            _, data_start = read_header(path)
            with open(path, "rb") as src:
                src.seek(data_start + info["data_offsets"][0])
                f.write(src.read(size))


def _nbytes(dtype: str, shape: list[int]) -> int:
    n = DTYPES[dtype].itemsize
    for d in shape:
        n *= d
    return n
