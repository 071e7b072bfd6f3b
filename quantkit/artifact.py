"""Writing a quantized artifact directory: shards, index, configs, copied tokenizer files, manifest.

An artifact is built in ``<out>.partial`` and renamed onto ``<out>`` only when complete, so a
reader never sees half of one. Each shard is itself written atomically, which is what lets an
interrupted run resume from its last finished layer.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from quantkit import atomic
from quantkit.checkpoint import INDEX_FILE, SINGLE_FILE

PROGRESS_FILE = "progress.json"
MANIFEST_FILE = "quantkit.json"
REPORT_FILE = "quantize_report.json"  # timings and memory: the only file that differs between runs

# Files of the source checkpoint that the artifact replaces rather than copies.
_NOT_COPIED = {"config.json", INDEX_FILE, SINGLE_FILE, "quantize_config.json", MANIFEST_FILE, REPORT_FILE}


def staging_dir(out_dir: Path) -> Path:
    return out_dir.with_name(out_dir.name + ".partial")


def shard_name(index: int, total: int) -> str:
    return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


class ArtifactWriter:
    """Shard ``i`` holds decoder layer ``i``; the last shard holds everything outside the layers."""

    def __init__(self, staging: Path, num_layers: int):
        self.staging = staging
        self.total = num_layers + 1
        staging.mkdir(parents=True, exist_ok=True)

    def shard_path(self, index: int) -> Path:
        return self.staging / shard_name(index, self.total)

    def write_shard(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        atomic.save_safetensors(self.shard_path(index), tensors, metadata={"format": "pt"})

    def read_progress(self) -> dict | None:
        path = self.staging / PROGRESS_FILE
        return json.loads(path.read_text()) if path.is_file() else None

    def write_progress(self, fingerprint: str, layer_errors: list[dict]) -> None:
        """Record the finished layers (one entry each, in order) so that a resumed run can go on."""
        atomic.write_json(self.staging / PROGRESS_FILE, {"fingerprint": fingerprint, "layer_errors": layer_errors})

    def finish(self, source_dir: Path, out_dir: Path, config: dict, quantize_config: dict,
               manifest: dict, report: dict) -> None:
        from safetensors import safe_open

        weight_map, total_size = {}, 0
        for index in range(self.total):
            path = self.shard_path(index)
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    weight_map[name] = path.name
                    t = f.get_slice(name)
                    total_size += _nbytes(t.get_dtype(), t.get_shape())
        atomic.write_json(self.staging / INDEX_FILE, {"metadata": {"total_size": total_size},
                                                      "weight_map": dict(sorted(weight_map.items()))})
        atomic.write_json(self.staging / "config.json", config)
        atomic.write_json(self.staging / "quantize_config.json", quantize_config)
        atomic.write_json(self.staging / MANIFEST_FILE, manifest)
        atomic.write_json(self.staging / REPORT_FILE, report)
        # Tokenizer, chat template, generation config and anything else travel verbatim.
        for path in sorted(source_dir.iterdir()):
            if path.is_file() and path.name not in _NOT_COPIED and path.suffix != ".safetensors":
                shutil.copyfile(path, self.staging / path.name)
        (self.staging / PROGRESS_FILE).unlink()
        atomic.publish_dir(self.staging, out_dir)


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _nbytes(dtype: str, shape: list[int]) -> int:
    n = _DTYPE_BYTES[dtype]
    for d in shape:
        n *= d
    return n
