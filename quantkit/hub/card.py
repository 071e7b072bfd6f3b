"""The model card (the repository's README.md), built from the artifact's own files.

Front matter in the Hub's conventions (https://huggingface.co/docs/hub/model-cards#model-card-metadata):
``base_model`` with ``base_model_relation: quantized``, ``library_name``, ``pipeline_tag``, the base
model's ``license`` and ``language``, and tags naming the method and the format. The body says what
the artifact is, its size and bits per weight, the evaluation table of a ``quantkit eval report``
when one is given, how to run it (only with the consumers that read its format: ``Format.consumers``), the
recipe and the calibration data with their hashes, and every file with its SHA-256.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from quantkit.hub.check import CARD_FILE, CheckedArtifact, CheckedGGUF
from quantkit.hub.repo import RepoRef
from quantkit.table import format_table

if TYPE_CHECKING:  # quantkit.formats imports every format (and transformers): only where a card is built
    from quantkit.formats.consumers import Consumer

REPORT_FILE = "report.json"  # what `quantkit eval report` writes; looked for in the artifact too
# Words CPM.cu looks for in a model's folder name to treat it as quantized (cpmcu/common/utils.py).
CPMCU_QUANTIZED_WORDS = ("marlin", "gptq", "quant", "awq", "int4", "int8", "w4a16", "qat")

PIPELINE_TAG = "text-generation"


@dataclass(frozen=True)
class BaseModel:
    repo_id: str
    license: str
    languages: tuple[str, ...]


def _front_matter(base: BaseModel, library: str, tags: list[str]) -> str:
    from huggingface_hub import ModelCardData

    data = ModelCardData(base_model=base.repo_id, base_model_relation="quantized", library_name=library,
                         pipeline_tag=PIPELINE_TAG, license=base.license, language=list(base.languages) or None,
                         tags=list(dict.fromkeys(tags)))
    return f"---\n{data.to_yaml()}\n---\n"


def _usage(consumers: list[Consumer] | tuple[Consumer, ...], fields: dict) -> str:
    blocks = []
    for consumer in consumers:
        note = f"\n{consumer.note}\n" if consumer.note else ""
        blocks.append(f"### {consumer.title}\n\n```{consumer.language}\n{consumer.command.format(**fields)}\n```\n"
                      + note)
    return "## Use it\n\n" + "\n".join(blocks)


def _cpmcu_folder(name: str) -> str:
    quantized = any(word in name.lower() for word in CPMCU_QUANTIZED_WORDS)
    return f"models/{name}" if quantized else f"models/{name}-marlin"


def _files_table(files) -> str:
    return format_table(["file", "bytes", "sha256"], [[f.path_in_repo, f.size, f.sha256] for f in files])


def _calibration(calibration: dict) -> str:
    from quantkit.calib import CORPORA, DATA_PACKAGE
    from quantkit.corpora import DOWNLOADED

    shipped = json.loads(resources.files(DATA_PACKAGE).joinpath("manifest.json").read_text())["files"]
    rows = []
    for source, count in sorted(calibration.get("rows_per_source", {}).items()):
        if source in CORPORA:
            corpus = CORPORA[source]
            sha256 = shipped.get(corpus.file, {}).get("sha256", "-")
            rows.append([source, count, corpus.description, corpus.file, sha256])
        elif source in DOWNLOADED:
            corpus = DOWNLOADED[source]
            rows.append([source, count, corpus.description, corpus.source.origin, corpus.sha256])
        else:
            rows.append([source, count, source, "-", "-"])
    table = format_table(["source", "rows", "text", "file", "sha256"], rows)
    return (f"## Calibration data\n\n{calibration['n_samples']} rows of {calibration['seq_len']} tokens "
            f"(mix `{calibration['source']}`, seed {calibration['seed']}, chat template "
            f"{'on' if calibration.get('chat') else 'off'}):\n\n```\n{table}\n```\n\n"
            f"SHA-256 of the token rows: `{calibration['fingerprint']}`.\n")


def _evaluation(report: dict | None, artifact: Path) -> str:
    if report is None:
        return ("## Evaluation\n\nNo evaluation report was published with this artifact "
                "(`quantkit eval report` writes one; `quantkit publish --report` adds it here).\n")
    variants = report["variants"]
    mine = [v for v in variants[1:] if Path(v["path"]).name == artifact.name]
    if not mine:
        raise ValueError(f"the report has no variant named {artifact.name} "
                         f"(it has {', '.join(Path(v['path']).name for v in variants[1:])})")
    shown = [variants[0], mine[0]]
    tasks = list(variants[0].get("tasks", {}))
    tau = variants[0].get("tau") is not None
    headers = ["model", "bits/param", "perplexity", "Δppl %", "mean KL", "top-1", *tasks, *(["τ"] if tau else [])]
    rows = [[v["name"], v["bits_per_parameter"], v["perplexity"], v["delta_ppl_pct"], v["mean_kl"], v["top1"],
             *[v["tasks"][t] for t in tasks], *([v["tau"]] if tau else [])] for v in shown]
    setup = report["setup"]
    return (f"## Evaluation\n\nMeasured by `quantkit eval report` against the unquantized model on {setup['tokens']} "
            f"held-out tokens (`{setup['data']}`, window {setup['window']}, token SHA-256 "
            f"`{setup['tokens_sha256'][:16]}`); KL over the reference's top {setup['kl_top_k']} tokens:\n\n"
            f"```\n{format_table(headers, rows)}\n```\n")


def base_model_of(checked: CheckedArtifact, repo_id: str | None) -> BaseModel:
    """The base model: ``repo_id`` (``--base-model``) or the upstream of a quantkit-converted model; its
    licence and languages from the base model's card the artifact carries, else from quantkit's registry."""
    from quantkit.zoo import MODELS, SOURCE_FILE

    source_path = checked.directory / SOURCE_FILE
    source = json.loads(source_path.read_text()).get("source", {}) if source_path.is_file() else {}
    upstream = MODELS.get(source.get("model", ""))
    repo_id = repo_id or (upstream.hub_repo if upstream else None)
    if repo_id is None:
        raise ValueError(f"cannot tell which model {checked.directory} was quantized from: pass --base-model "
                         "owner/name")
    card = _base_card(checked.directory / CARD_FILE)
    license_ = card.get("license") or (upstream.hub_license if upstream else "unknown")
    languages = card.get("language") or (upstream.languages if upstream else ())
    return BaseModel(repo_id, license_, tuple([languages] if isinstance(languages, str) else languages))


def gguf_base_model(checked: CheckedGGUF, repo_id: str | None) -> BaseModel:
    if repo_id is None:
        raise ValueError(f"a GGUF file does not say which Hub model it came from: pass --base-model owner/name "
                         f"for {checked.file.path}")
    return BaseModel(repo_id, checked.license or "unknown", checked.languages)


def _base_card(path: Path) -> dict:
    if not path.is_file():
        return {}
    from huggingface_hub import ModelCard

    return ModelCard(path.read_text(encoding="utf-8")).data.to_dict()


def load_report(path: Path | None, directory: Path) -> dict | None:
    """``path``, else the artifact's own report.json, else nothing."""
    found = path or (directory / REPORT_FILE if (directory / REPORT_FILE).is_file() else None)
    return json.loads(Path(found).read_text()) if found else None


def artifact_card(checked: CheckedArtifact, ref: RepoRef, base: BaseModel, report: dict | None) -> str:
    from quantkit.formats import FORMATS
    from quantkit.formats.consumers import UNQUANTIZED
    from quantkit.inspect import describe
    from quantkit.models import MiniCPMConfig
    from quantkit.models.decoder import weight_shapes

    manifest = checked.manifest or {}
    fmt = checked.format or "unquantized"
    recipe = manifest.get("recipe", {})
    info = describe(checked.directory)
    shapes = weight_shapes(MiniCPMConfig.from_pretrained(checked.directory))
    # MiniCPM's code: what config.json's auto_map names (quantkit's own, generated into every artifact it
    # writes, or the base model's), else quantkit's classes, registered with transformers on import
    remote = "auto_map" in checked.config
    consumers = [consumer for consumer in (FORMATS[fmt].consumers if fmt in FORMATS else UNQUANTIZED)
                 if remote or not consumer.needs_auto_map]
    library = next((consumer.library for consumer in consumers if consumer.library), "quantkit")
    fields = {"repo": ref.repo_id, "ref": str(ref), "remote": ", trust_remote_code=True" if remote else "",
              "remote_flag": " --trust-remote-code" if remote else "", "local": _cpmcu_folder(ref.name),
              # both servers use the stated scales only when asked for an FP8 cache (E4M3, as calibrated)
              "kv_cache_flag": " --kv-cache-dtype fp8_e4m3"
              if (checked.config.get("quantization_config") or {}).get("kv_cache_scheme") else "",
              "register": "" if remote else "import quantkit  # registers MiniCPM's model code with transformers\n"}
    summary = FORMATS[fmt].summary if fmt in FORMATS else fmt
    facts = [["format", f"`{fmt}`: {summary}"], ["quantization", info["quantization"]],
             ["weights", f"{checked.weight_bytes / 2**20:.1f} MB"],
             ["bits per weight", _bits_per_weight(checked, shapes)]]
    if info.get("max_layer_rel_error") is not None:
        facts.append(["largest layer error", f"{info['max_layer_rel_error']:.4g} (relative output error of one "
                                             "linear on calibration data)"])
    body = [f"# {ref.name}\n",
            f"A quantization of [{base.repo_id}](https://huggingface.co/{base.repo_id}) made with "
            f"quantkit {manifest.get('quantkit_version', '')}"
            + (f", recipe `{recipe['name']}`: {recipe.get('description', '')}." if recipe else "."),
            _facts(facts),
            _evaluation(report, checked.directory), _usage(consumers, fields)]
    if recipe:
        body.append(f"## Recipe\n\n```yaml\n{yaml.safe_dump(recipe, sort_keys=False, allow_unicode=True)}```\n")
    if "calibration" in manifest:
        body.append(_calibration(manifest["calibration"]))
    body.append(f"## Files\n\n```\n{_files_table(checked.files)}\n```\n")
    tags = ["quantkit", "quantized", recipe.get("algorithm", ""), fmt,
            *([f"{recipe['quant']['bits']}-bit"] if recipe.get("quant", {}).get("bits") else [])]
    return _front_matter(base, library, [t for t in tags if t]) + "\n" + "\n".join(body)


FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})  # safetensors dtypes a tensor stored as it is has


@dataclass(frozen=True)
class Stored:
    """One part of the artifact's weights: parameters of the unquantized model, the bytes that store them,
    what they are, and their dtypes as stored."""

    parameters: int
    bytes: int
    parts: tuple[str, ...]
    dtypes: tuple[str, ...]

    @property
    def bits(self) -> float:
        return 8 * self.bytes / self.parameters

    def says(self) -> str:
        return _listed(self.parts)


PARTS = ("the embedding", "the decoder layers' linears", "the norms", "the LM head", "other tensors")  # model order


def _part(module: str) -> str:
    """What a module of the model is, as the card names it."""
    from quantkit.models.layers import EMBEDDING, FINAL_NORM, LAYER_NORMS, LM_HEAD

    names = {EMBEDDING.rpartition(".")[0]: "the embedding", LM_HEAD.rpartition(".")[0]: "the LM head",
             FINAL_NORM.rpartition(".")[0]: "the norms"}
    if module in names:
        return names[module]
    if module.endswith(LAYER_NORMS):
        return "the norms"
    return "the decoder layers' linears" if module.startswith("model.layers.") else "other tensors"


def _listed(parts: tuple[str, ...]) -> str:
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _module_parameters(module: str, shapes: dict[str, tuple[int, ...]]) -> int:
    """The unquantized model's parameters a stored module holds; a fused module (CPM.cu's qkv_proj) holds
    those of its parts."""
    from quantkit.models.layers import FUSIONS

    members = {module}
    for fused, parts in FUSIONS.items():
        if module.endswith("." + fused):
            members = {module.removesuffix(fused) + part for part in parts}
    return sum(math.prod(shape) for name, shape in shapes.items() if name.rpartition(".")[0] in members)


def stored_weights(checked: CheckedArtifact, shapes: dict[str, tuple[int, ...]]) -> tuple[Stored, Stored]:
    """(quantized, kept): the artifact's modules whose stored tensors are codes (any tensor not a float
    ``weight``/``bias``), and those stored as they are, from the safetensors headers."""
    from quantkit.checkpoint import read_header

    modules: dict[str, list[tuple[str, str, int]]] = {}  # module -> (suffix, dtype, bytes) of its tensors
    for file in checked.files:
        if file.path_in_repo.endswith(".safetensors"):
            header, _ = read_header(file.path)
            for name, info in header.items():
                if name != "__metadata__":
                    module, _, suffix = name.rpartition(".")
                    start, end = info["data_offsets"]
                    modules.setdefault(module, []).append((suffix, info["dtype"], end - start))
    groups: dict[bool, list[str]] = {True: [], False: []}
    for module, tensors in modules.items():
        groups[any(dtype not in FLOAT_DTYPES or suffix not in ("weight", "bias") for suffix, dtype, _ in tensors)
               ].append(module)

    def part(members: list[str]) -> Stored:
        return Stored(sum(_module_parameters(m, shapes) for m in members),
                      sum(size for m in members for _, _, size in modules[m]),
                      tuple(sorted({_part(m) for m in members}, key=PARTS.index)),
                      tuple(sorted({dtype for m in members for _, dtype, _ in modules[m]})))

    return part(groups[True]), part(groups[False])


def _bits_per_weight(checked: CheckedArtifact, shapes: dict[str, tuple[int, ...]]) -> str:
    """The "bits per weight" fact: of the quantized tensors, and of the whole weight files, saying in the
    same line what is quantized and what is kept (a W4 artifact of the default model is 4.2 bits in its
    linears and 13.9 over its files: its embedding and LM head, 35 % of the parameters, stay float32)."""
    parameters = sum(math.prod(shape) for shape in shapes.values())
    whole = 8 * checked.weight_bytes / parameters
    quantized, kept = stored_weights(checked, shapes)
    if not quantized.parameters:
        return (f"{whole:.3f} over the weight files ({parameters:,} parameters); nothing is quantized: every "
                f"tensor is stored as {'/'.join(kept.dtypes)}")
    rest = (f", which keep {kept.says()} ({kept.parameters:,} parameters) in {'/'.join(kept.dtypes)}"
            if kept.parameters else "")
    return (f"{quantized.bits:.3f} in the quantized tensors ({quantized.says()}: {quantized.parameters:,} of "
            f"{parameters:,} parameters); {whole:.3f} over the whole weight files{rest}")


def _facts(rows: list[list[str]]) -> str:
    return "\n| | |\n|---|---|\n" + "".join(f"| {key} | {value} |\n" for key, value in rows)


def gguf_card(checked: CheckedGGUF, ref: RepoRef, base: BaseModel, siblings: list[tuple[str, int]]) -> str:
    """The card of a GGUF repository: llama.cpp's usage, and every GGUF file the repository holds
    (``siblings``: the other files already there, as (name, bytes))."""
    from quantkit.formats.consumers import LLAMA_CPP

    files = sorted({*siblings, (checked.file.path_in_repo, checked.file.size)})
    facts = [["this file", f"`{checked.file.path_in_repo}` ({checked.file.size / 2**20:.1f} MB, "
                           f"{checked.bits_per_weight:.3f} bits per weight, {checked.parameters:,} parameters)"],
             ["file type", checked.file_type], ["architecture", checked.architecture],
             ["sha256", f"`{checked.file.sha256}`"]]
    fields = {"repo": ref.repo_id, "file_type": checked.file_type}
    table = format_table(["file", "MB"], [[name, size / 2**20] for name, size in files])
    body = [f"# {ref.name}\n",
            f"GGUF files of [{base.repo_id}](https://huggingface.co/{base.repo_id}) for llama.cpp, made with "
            f"quantkit; one file per type, named `<model>-<TYPE>.gguf`.\n", _facts(facts),
            f"## Files\n\n```\n{table}\n```\n", _usage((LLAMA_CPP,), fields)]
    tags = ["quantkit", "quantized", "gguf", "llama.cpp", checked.file_type]
    return _front_matter(base, "gguf", tags) + "\n" + "\n".join(body)
