"""Is this artifact (or GGUF file) whole and self-consistent? Checked before anything is sent.

An artifact passes when: it holds no pickle file; every weights file its index names is there, and
every safetensors header lies within its file; each file the manifest records has that size and
SHA-256; the ``quantization_config`` decodes every layer's stored tensors (and matches
``quantize_config.json``); a tokenizer and a chat template are present. A GGUF file passes when
llama.cpp's reader (the ``gguf`` package) parses it and it carries a tokenizer and a chat template.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.artifact import MANIFEST_FILE, PROGRESS_FILE
from quantkit.checkpoint import FILES_KEY, CheckpointError, CheckpointReader, check_files
from quantkit.errors import QuantkitError
from quantkit.file_hashes import sha256_file, sha256_files

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
CARD_FILE = "README.md"  # the artifact's copy is the base model's card; publishing writes its own
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class ArtifactCheckError(QuantkitError, ValueError):
    """An artifact or GGUF file that must not be published as it is."""


@dataclass(frozen=True)
class LocalFile:
    path_in_repo: str
    path: Path
    size: int
    sha256: str


@dataclass
class CheckedArtifact:
    """What passed: the files to publish and what the card is built from."""

    directory: Path
    files: list[LocalFile]
    config: dict
    manifest: dict | None
    format: str | None  # the quantkit format that reads it; None: not quantized
    notes: list[str] = field(default_factory=list)  # what the check could not verify, said in the plan

    @property
    def weight_bytes(self) -> int:
        return sum(f.size for f in self.files if f.path_in_repo.endswith(".safetensors"))


@dataclass
class CheckedGGUF:
    file: LocalFile
    file_type: str  # llama.cpp's name of the file type: Q4_K_M, Q8_0, F16, ...
    architecture: str
    parameters: int
    license: str | None  # general.license, when the file records one
    languages: tuple[str, ...]  # general.languages

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.file.size / self.parameters


def _local_file(path: Path, path_in_repo: str) -> LocalFile:
    return LocalFile(path_in_repo, path, path.stat().st_size, sha256_file(path))


def _check_weights(directory: Path) -> None:
    """Every shard the index names exists and parses; no stray safetensors file besides them."""
    try:
        reader = CheckpointReader(directory)
    except CheckpointError as error:
        raise ArtifactCheckError(f"incomplete artifact: {error}") from error
    stray = {p.name for p in directory.glob("*.safetensors")} - {p.name for p in reader.files()}
    if stray:
        raise ArtifactCheckError(f"{directory}: {sorted(stray)} are not named by the index")


def _check_manifest_files(directory: Path, manifest: dict, notes: list[str]) -> None:
    if manifest.get(FILES_KEY) is None:
        notes.append(f"{MANIFEST_FILE} predates file hashes: only the safetensors headers were checked")
        return
    try:
        check_files(directory, manifest[FILES_KEY], digests=sha256_files)  # what is published is read whole
    except CheckpointError as error:
        raise ArtifactCheckError(str(error)) from error


def _check_quantization(directory: Path, config: dict) -> str | None:
    """The quantization_config must decode every layer's stored tensors, and agree with quantize_config.json;
    the name of the format that does, if any."""
    from quantkit.reader import ArtifactReader

    quantization = config.get("quantization_config")
    separate = directory / "quantize_config.json"
    if quantization and separate.is_file() and json.loads(separate.read_text()) != quantization:
        raise ArtifactCheckError("config.json's quantization_config differs from quantize_config.json")
    reader = ArtifactReader(directory)
    if reader.format is None:
        return None
    for index in range(reader.num_layers):
        try:
            reader.layer(index)
        except (KeyError, ValueError, RuntimeError) as error:
            raise ArtifactCheckError(f"quantization_config {quantization} does not describe the tensors of layer "
                                     f"{index} ({error.__class__.__name__}: {error})") from error
    return reader.format.name


def _check_tokenizer(directory: Path) -> None:
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ArtifactCheckError(f"incomplete artifact: no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    tokenizer_config = directory / "tokenizer_config.json"
    in_config = tokenizer_config.is_file() and "chat_template" in json.loads(tokenizer_config.read_text())
    if not (in_config or (directory / CHAT_TEMPLATE_FILE).is_file()):
        raise ArtifactCheckError(f"incomplete artifact: no chat template ({CHAT_TEMPLATE_FILE}, or chat_template "
                                 "in tokenizer_config.json)")


def _remote_code_notes(directory: Path, config: dict) -> list[str]:
    # auto_map values: "module.Class", "repo--module.Class", or [slow, fast] lists (tokenizers; either may be null)
    references = [r for value in (config.get("auto_map") or {}).values()
                  for r in (value if isinstance(value, list) else [value]) if r]
    modules = {reference.split("--")[-1].split(".")[0] for reference in references}
    missing = sorted(f"{module}.py" for module in modules if not (directory / f"{module}.py").is_file())
    return [f"config.json's auto_map names {', '.join(missing)}, which the artifact lacks: transformers and vLLM "
            "users need them (copy them from the base model)"] if missing else []


def check_artifact(directory: str | Path) -> CheckedArtifact:
    """The files to publish (every regular file but the base model's card and leftovers of a run), after
    every check above; raises ArtifactCheckError on the first failure."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactCheckError(f"artifact directory not found: {directory}")
    if (directory / PROGRESS_FILE).exists():
        raise ArtifactCheckError(f"{directory} is an unfinished run: finish it with --resume first")
    if not (directory / "config.json").is_file():
        raise ArtifactCheckError(f"{directory} has no config.json: not a model directory")
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ArtifactCheckError(f"{directory} holds pickle files {pickles}: quantkit publishes safetensors only")
    config = json.loads((directory / "config.json").read_text())
    manifest_path = directory / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
    notes: list[str] = []
    _check_weights(directory)
    if manifest is not None:
        _check_manifest_files(directory, manifest, notes)
    fmt = _check_quantization(directory, config)
    _check_tokenizer(directory)
    notes += _remote_code_notes(directory, config)
    files = [_local_file(path, path.name) for path in sorted(directory.iterdir())
             if path.is_file() and not path.name.startswith(".") and path.name != CARD_FILE]
    return CheckedArtifact(directory, files, config, manifest, fmt, notes)


def gguf_type_name(file_type: int) -> str:
    """llama.cpp's name of a ``general.file_type`` value, as its file names use it (``Q4_K_M``)."""
    from gguf import LlamaFileType

    return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")


def gguf_file_name(repo_name: str, file_type: str) -> str:
    """llama.cpp's naming: ``<model>-<TYPE>.gguf``, the model named after its repository without ``-GGUF``."""
    model = repo_name[:-len("-gguf")] if repo_name.lower().endswith("-gguf") else repo_name
    return f"{model}-{file_type}.gguf"


def check_gguf(path: str | Path, repo_name: str) -> CheckedGGUF:
    """A GGUF file llama.cpp's reader parses, with a tokenizer and a chat template, named for ``repo_name``."""
    from quantkit.gguf.reader import open_gguf

    path = Path(path)
    if not path.is_file():
        raise ArtifactCheckError(f"GGUF file not found: {path}")
    reader = open_gguf(path, ArtifactCheckError)
    fields = reader.fields

    def value(key: str):
        found = fields.get(key)
        return None if found is None else found.contents()

    for key, what in (("tokenizer.ggml.model", "tokenizer"), ("tokenizer.chat_template", "chat template")):
        if value(key) is None:
            raise ArtifactCheckError(f"{path} has no {what} ({key})")
    if value("general.file_type") is None:
        raise ArtifactCheckError(f"{path} does not record its file type (general.file_type)")
    file_type = gguf_type_name(value("general.file_type"))
    parameters = sum(int(tensor.n_elements) for tensor in reader.tensors)
    return CheckedGGUF(_local_file(path, gguf_file_name(repo_name, file_type)), file_type,
                       value("general.architecture"), parameters, value("general.license"),
                       tuple(value("general.languages") or ()))
