"""What a checkpoint or artifact is, read only from its self-describing files, once they are known to be
whole: every safetensors header within its file, the config's layer count and sizes held to the tensors
present, and each file an artifact's manifest records of that size and SHA-256 (a shard changed after
quantkit wrote it is an error, never described as if it were the artifact)."""
from __future__ import annotations

from pathlib import Path

from quantkit.artifact import MANIFEST_FILE, REPORT_FILE
from quantkit.checkpoint import (
    CheckpointReader,
    check_files,
    manifest_records,
    read_config_json,
    read_json_object,
)
from quantkit.file_hashes import sha256_files


def _quantization(quant: dict) -> str:
    if not quant:
        return "none"
    if "file_type" in quant:  # GGUF blocks (format gguf-*): the file type names every tensor's type
        return f"{quant['quant_method']} {quant['file_type']}"
    if quant.get("config_groups"):  # compressed-tensors: each config group's weights and input activations
        def args(a: dict) -> str:
            return (f"{a.get('num_bits')}-bit {a.get('type')} {a.get('strategy')}"
                    f"{'' if a.get('group_size') is None else ' g' + str(a['group_size'])} "
                    f"{'sym' if a.get('symmetric') else 'asym'}")

        def activations(a: dict) -> str:  # a scale per token at run time, or the stored one
            return f", activations {args(a)} {'dynamic' if a.get('dynamic') is True else 'static'}"

        kv_cache = quant.get("kv_cache_scheme")
        return f"{quant['quant_method']} {quant.get('format')} " + "; ".join(
            args(group.get("weights") or {})
            + ("" if not group.get("input_activations") else activations(group["input_activations"]))
            for group in quant["config_groups"].values()) + (f", KV cache {args(kv_cache)}" if kv_cache else "")
    symmetric = quant.get("sym", not quant.get("zero_point", True))
    method = quant.get("quant_method") or f"mlx {quant.get('mode', 'affine')}"  # mlx-lm writes no quant_method
    return (f"{method} {quant.get('bits')}-bit g{quant.get('group_size')} "
            f"{'sym' if symmetric else 'asym'}")


def describe(model_dir: str | Path) -> dict:
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    config = read_config_json(model_dir)
    CheckpointReader(model_dir)
    check_files(model_dir, manifest_records(model_dir), digests=sha256_files)  # inspect reads every byte
    quant = config.get("quantization_config") or {}
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    info = {
        "path": str(model_dir),
        "model_type": config.get("model_type"),
        "layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "heads (q/kv)": f"{config.get('num_attention_heads')}/{config.get('num_key_value_heads')}",
        "vocab_size": config.get("vocab_size"),
        "sparse_config": bool(config.get("sparse_config")),
        "quantization": _quantization(quant),
        "weights_mb": round(weights / 2**20, 1),
    }
    manifest_path = model_dir / MANIFEST_FILE
    if manifest_path.is_file():
        manifest = read_json_object(manifest_path)
        errors = [max(e["errors"].values()) for e in manifest["layer_errors"]]
        info.update({"recipe": manifest["recipe"]["name"], "quantkit_version": manifest["quantkit_version"],
                     "run_fingerprint": manifest["fingerprints"]["run"][:16],
                     "max_layer_rel_error": max(errors) if errors else None})
    if manifest_path.is_file() and "budget" in manifest:
        budget = manifest["budget"]
        info.update({"budget": budget["budget"], "budget_file_bytes": budget["file_bytes"],
                     "budget_matrix_bpw": budget["matrix_bpw"], "budget_predicted_kl": budget["predicted_kl"]})
    report_path = model_dir / REPORT_FILE
    if report_path.is_file():
        report = read_json_object(report_path)
        info.update({"quantize_seconds": report["seconds"], "peak_rss_mb": report["peak_rss_mb"]})
    return info


def budget_types(model_dir: str | Path) -> tuple[str, dict[str, str]]:
    """The budget family of a size budget's plan and the grid it gave each matrix (tensor -> grid), from the
    artifact's manifest; no grids for an artifact made without a budget."""
    manifest_path = Path(model_dir) / MANIFEST_FILE
    budget = (read_json_object(manifest_path).get("budget") or {}) if manifest_path.is_file() else {}
    # plans were GGUF's alone before they recorded their family
    return budget.get("family", "gguf"), {name: entry["type"] for name, entry in budget.get("tensors", {}).items()}
