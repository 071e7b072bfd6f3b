"""EAGLE-3 heads as GGUF for llama.cpp (``quantkit.gguf.eagle3_head``).

- Byte for byte against llama.cpp's own converter (``convert_hf_to_gguf.py HEAD --target-model-dir T``
  from the source the installed llama-cpp-python vendors, run with this Python): on a llama target, the
  architecture llama.cpp runs EAGLE-3 drafts for, in every --outtype; on MiniCPM targets (SentencePiece
  like MiniCPM4.1, and the default model's byte-level BPE) against the converter given the head with the
  scales folded in, the one thing quantkit adds there.
- The folded MiniCPM file computes quantkit's head: one draft pass of llama.cpp's eagle3 graph written out
  from the file's tensors equals ``Eagle3Head``'s.
- Bad input is refused in one line before any work.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from quantkit.cli import main
from quantkit.gguf.eagle3_head import OUTTYPES, TENSOR_NAMES, export_head_gguf
from quantkit.gguf.reader import open_gguf
from quantkit.models import MiniCPMForCausalLM
from quantkit.models.eagle3 import AUX_STATES, entering_states
from quantkit.reader import load_head
from quantkit.synthetic import write_tiny_eagle3_head

from helpers import write_sentencepiece_tokenizer

pytestmark = pytest.mark.llamacpp
DRAFT_VOCAB = 100

# Runs the converter's main() once per job in one process (its imports cost ~5 s a run)
CONVERTER_JOBS = """
import json, sys
source = sys.argv[1]
sys.path[:0] = [source, source + "/gguf-py"]
import convert_hf_to_gguf
for head, target, outtype, out in json.loads(sys.argv[2]):
    sys.argv = ["convert_hf_to_gguf.py", head, "--target-model-dir", target, "--outtype", outtype, "--outfile", out]
    convert_hf_to_gguf.main()
"""


@pytest.fixture(scope="module")
def minicpm_target(tiny_checkpoint_factory, tmp_path_factory) -> Path:
    """A tiny MiniCPM of 8 layers (distinct aux layers) with MiniCPM4.1's kind of tokenizer."""
    folder = tmp_path_factory.mktemp("targets") / "minicpm"
    shutil.copytree(tiny_checkpoint_factory(num_hidden_layers=8, vocab_size=1216, longrope=False), folder)
    write_sentencepiece_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def llama_target(minicpm_target, tmp_path_factory) -> Path:
    """A random Hugging Face llama of the MiniCPM target's shape and tokenizer: the same head fits both."""
    values = json.loads((minicpm_target / "config.json").read_text())
    config = LlamaConfig(**{key: values[key] for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "bos_token_id",
        "eos_token_id")})
    folder = tmp_path_factory.mktemp("targets") / "llama"
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(minicpm_target / name, folder / name)
    return folder


def _head(target: Path, folder: Path, aux_states: str = "cpmcu") -> Path:
    return write_tiny_eagle3_head(folder / "head", target, draft_vocab_size=DRAFT_VOCAB, aux_states=aux_states)


@pytest.fixture(scope="module")
def head(minicpm_target, tmp_path_factory) -> Path:
    return _head(minicpm_target, tmp_path_factory.mktemp("heads"))


def _folded_for_converter(head_dir: Path, target: Path, folder: Path) -> Path:
    """The head with MiniCPM's scales multiplied into the weights by hand, for the converter: the branches'
    scale_depth/sqrt(L+1) into o_proj and down_proj, the cpmcu states' scale_depth/sqrt(L) into fc. Same
    folder name as the head (the file's general.name comes from it)."""
    values = json.loads((target / "config.json").read_text())
    layers, depth = values["num_hidden_layers"], values["scale_depth"]
    aux_states = json.loads((head_dir / "config.json").read_text())["aux_states"]
    factors = {"midlayer.self_attn.o_proj.weight": depth / math.sqrt(layers + 1),
               "midlayer.mlp.down_proj.weight": depth / math.sqrt(layers + 1),
               "fc.weight": depth / math.sqrt(layers) if AUX_STATES[aux_states].scaled else 1.0}
    tensors = load_file(head_dir / "model.safetensors")
    tensors.update({name: tensors[name] * factor for name, factor in factors.items()})
    out = folder / head_dir.name
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(head_dir / "config.json", out / "config.json")
    return out


@pytest.fixture(scope="module")
def cases(head, llama_target, minicpm_target, default_model, tmp_path_factory):
    """case id -> (head, target, outtype, what the converter wrote), every conversion in one run."""
    from quantkit.eval.bench.llama_build import llama_cpp_source

    source = llama_cpp_source()  # from the package registry, as the GGUF tests' llama tools are
    work = tmp_path_factory.mktemp("converter")
    default_head = _head(default_model, work / "default")
    jobs = {**{f"llama-{outtype}": (head, head, llama_target, outtype) for outtype in OUTTYPES},
            "minicpm-q8_0": (head, _folded_for_converter(head, minicpm_target, work / "folded"), minicpm_target,
                             "q8_0"),
            "default-bf16": (default_head, _folded_for_converter(default_head, default_model, work / "folded-default"),
                             default_model, "bf16")}
    outputs = {case: work / f"{case}.gguf" for case in jobs}
    argv = [[str(given), str(target), outtype, str(outputs[case])]
            for case, (_, given, target, outtype) in jobs.items()]
    # in a scratch folder: `python -c` puts it on sys.path, where the checkout's kernels/ would hide transformers'
    run = subprocess.run([sys.executable, "-c", CONVERTER_JOBS, str(source), json.dumps(argv)], capture_output=True,
                         text=True, cwd=tempfile.gettempdir(), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return {case: (ours, target, outtype, outputs[case]) for case, (ours, _, target, outtype) in jobs.items()}


def _first_difference(ours: Path, theirs: Path) -> str:
    a, b = open_gguf(ours), open_gguf(theirs)
    for key in dict.fromkeys([*a.fields, *b.fields]):
        if key not in a.fields or key not in b.fields or a.fields[key].contents() != b.fields[key].contents():
            return f"metadata {key}"
    if list(a.fields) != list(b.fields):
        return "metadata order"
    for x, y in zip(a.tensors, b.tensors):
        if (x.name, x.tensor_type, list(x.shape)) != (y.name, y.tensor_type, list(y.shape)):
            return f"tensor {x.name} {x.tensor_type.name} vs {y.name} {y.tensor_type.name}"
        if not np.array_equal(x.data, y.data):
            return f"tensor {x.name}'s data"
    return "padding or layout"


@pytest.mark.parametrize("case", [*(f"llama-{outtype}" for outtype in OUTTYPES), "minicpm-q8_0", "default-bf16"])
def test_file_is_the_converters_byte_for_byte(cases, case, tmp_path):
    head_dir, target, outtype, theirs = cases[case]
    ours = tmp_path / "head.gguf"
    export_head_gguf(head_dir, target, ours, outtype)
    assert ours.read_bytes() == theirs.read_bytes(), _first_difference(ours, theirs)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _normal_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """GGML's normal rope on [T, heads, d]: each adjacent pair (2i, 2i+1) turned by position · base^(-2i/d)."""
    d = x.shape[-1]
    angle = positions[:, None, None].double() * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angle.cos().float(), angle.sin().float()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def llama_cpp_draft_logits(path: Path, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """One pass of llama.cpp's eagle3 graph (src/models/eagle3.cpp) over T positions, from the GGUF file's
    tensors: g = fc(features); x = [attn_norm(embedding) ‖ attn_norm_2(g)]; causal attention with normal
    rope on the (permuted) q/k rows; h = g + attn_output(...); h += ffn_down(silu(ffn_gate) · ffn_up) of
    ffn_norm(h); logits = output(output_norm(h)), scattered to target ids by d2t. No scale anywhere."""
    reader = open_gguf(path)
    w = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    meta = {key: reader.fields[f"eagle3.{key}"].contents() for key in (
        "attention.head_count", "attention.head_count_kv", "attention.key_length", "rope.freq_base",
        "attention.layer_norm_rms_epsilon", "vocab_size")}
    heads, kv_heads, d = meta["attention.head_count"], meta["attention.head_count_kv"], meta["attention.key_length"]
    eps, positions = meta["attention.layer_norm_rms_epsilon"], torch.arange(len(features))
    g = features @ w["fc.weight"].T
    x = torch.cat([_rms(embeddings, w["blk.0.attn_norm.weight"], eps), _rms(g, w["blk.0.attn_norm_2.weight"], eps)], -1)
    q = _normal_rope((x @ w["blk.0.attn_q.weight"].T).view(-1, heads, d), positions, meta["rope.freq_base"])
    k = _normal_rope((x @ w["blk.0.attn_k.weight"].T).view(-1, kv_heads, d), positions, meta["rope.freq_base"])
    v = (x @ w["blk.0.attn_v.weight"].T).view(-1, kv_heads, d)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(len(x), len(x), dtype=torch.bool).tril(), float("-inf"))
    mixed = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(len(x), -1)
    h = g + mixed @ w["blk.0.attn_output.weight"].T
    normed = _rms(h, w["blk.0.ffn_norm.weight"], eps)
    h = h + (torch.nn.functional.silu(normed @ w["blk.0.ffn_gate.weight"].T) * (normed @ w["blk.0.ffn_up.weight"].T)
             ) @ w["blk.0.ffn_down.weight"].T
    draft = _rms(h, w["output_norm.weight"], eps) @ w["output.weight"].T
    logits = torch.full((len(x), meta["vocab_size"]), float("-inf"))
    logits[:, w["d2t"]] = draft
    return logits


@pytest.mark.parametrize("aux_states", sorted(AUX_STATES))
def test_folded_minicpm_file_computes_quantkits_head(minicpm_target, aux_states, tmp_path):
    """llama.cpp feeds the draft the target's states entering each layer as they are (HF-equal; granite.cpp
    scales inside the branches) and embeds with the target's raw embedding. Given scale_emb × that
    embedding, the file's pass is quantkit's head's to float32 rounding; with the raw one (what llama.cpp
    computes) only RMSNorm's epsilon, seen against a scale_emb² larger mean square, moves the embedding's
    norm, by a relative ~ eps / (2 · mean x²)."""
    head_dir = _head(minicpm_target, tmp_path, aux_states)
    path = tmp_path / "head.gguf"
    report = export_head_gguf(head_dir, minicpm_target, path, "f32")
    assert set(report.folded) == ({"midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"}
                                  | ({"fc.weight"} if AUX_STATES[aux_states].scaled else set()))
    target = MiniCPMForCausalLM.from_pretrained(minicpm_target, dtype=torch.float32).eval()
    head = load_head(head_dir, target.config)
    ids = torch.randint(0, target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, states = entering_states(target, ids, head.aux_layers)
        tokens, raw = ids[0, 1:], target.model.embed_tokens(ids[0, 1:])
        positions = torch.arange(tokens.numel())[None]
        hidden = head.draft(head.project(head.aux_from_states(states))[:, :-1], head.embed(target.model.embed_tokens,
                                                                                              tokens[None]), positions)
        expected = torch.full((tokens.numel(), target.config.vocab_size), float("-inf"))
        expected[:, head.target_ids(torch.arange(DRAFT_VOCAB))] = head.logits(hidden)[0]
        features = torch.cat([states[layer][0, :-1] for layer in head.aux_layers], dim=-1)
        scaled = llama_cpp_draft_logits(path, features, raw * target.config.scale_emb)
        as_llama_cpp = llama_cpp_draft_logits(path, features, raw)
    kept = expected.isfinite()
    assert torch.equal(scaled.isfinite(), kept) and torch.equal(as_llama_cpp.isfinite(), kept)
    # measured: 3e-7 and 3e-5 of the largest logit (cpmcu and hf-hidden-states alike); left unfolded 2e-2 and
    # 0.28, with q/k unpermuted 0.1 to 0.2. The tiny embedding's mean square is 1/144: eps/(2 · mean x²) = 7e-5
    spread = expected[kept].abs().max()
    assert (scaled[kept] - expected[kept]).abs().max() <= 2e-6 * spread
    assert (as_llama_cpp[kept] - expected[kept]).abs().max() <= 2e-4 * spread
    assert torch.equal(as_llama_cpp.argmax(-1), expected.argmax(-1))


def _copy_with_config(folder: Path, where: Path, **changes) -> Path:
    shutil.copytree(folder, where)
    config = json.loads((where / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**config, **changes}))
    return where


@pytest.mark.parametrize("bad, message", [
    ("target-hidden", "the head reads target states of width 256, the target's hidden size is 128"),
    ("target-vocab", "the head's vocabulary has 1216 tokens, the target's 2000"),
    ("outtype", "unknown --outtype 'q4_k'; choose from f32, f16, bf16, q8_0"),
    ("exists", "already exists; choose another --out or remove it"),
    ("aux-layers", "eagle_aux_hidden_state_layer_ids [1, 2, 3] are not the layers its aux_states 'cpmcu' reads"),
])
def test_bad_input_is_refused_in_one_line_before_any_work(head, llama_target, tmp_path, bad, message, monkeypatch):
    import quantkit.gguf.eagle3_head as module

    monkeypatch.setattr(module, "_tensor_bytes", lambda *_: pytest.fail("a tensor was converted"))
    target, head_dir, out, outtype = llama_target, head, tmp_path / "head.gguf", "f16"
    if bad == "target-hidden":
        target = _copy_with_config(llama_target, tmp_path / "t", hidden_size=128, head_dim=8)
    elif bad == "target-vocab":
        target = _copy_with_config(llama_target, tmp_path / "t", vocab_size=2000)
    elif bad == "outtype":
        outtype = "q4_k"
    elif bad == "exists":
        out.write_bytes(b"mine")
    else:
        head_dir = _copy_with_config(head, tmp_path / "h", eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    result = CliRunner().invoke(main, ["export", "gguf-head", "--head", str(head_dir), "--target", str(target),
                                       "--out", str(out), "--outtype", outtype])
    assert result.exit_code == 1, result.output
    assert result.output.count("\n") == 1 and message in result.output, result.output
    assert out.read_bytes() == b"mine" if bad == "exists" else not out.exists()


def _quantized_head(head: Path, target: Path, tmp_path: Path, recipe: str, **changes) -> Path:
    from quantkit.draft.quantize import quantize_head

    from helpers import small_recipe

    out = tmp_path / recipe
    quantize_head(head, target, small_recipe(recipe, tmp_path, **changes), out, progress=False)
    return out


@pytest.mark.parametrize("bits, block_type", [(4, "q4_0"), (8, "q8_0")])
def test_a_quantized_head_is_written_as_its_solvers_own_blocks(head, minicpm_target, tmp_path, bits, block_type):
    """A GPTQ-solved head (symmetric, groups of 32 here) keeps its codes: each quantized matrix is Q4_0 (Q8_0)
    blocks that ggml decodes to the head's dequantized weight, q/k rows permuted; exactly where nothing is
    folded, and within one fp16 rounding of each scaled group scale (2^-11 relative) where a MiniCPM scale is;
    the other matrices are in --outtype, the file type is the blocks'."""
    from quantkit.gguf.mixes import FILE_TYPES
    from quantkit.gguf.names import permute_rows
    from quantkit.gguf.types import TYPES

    quantized = _quantized_head(head, minicpm_target, tmp_path, "gptq-w4g128", quant={"bits": bits, "group_size": 32})
    path = tmp_path / "head.gguf"
    report = export_head_gguf(quantized, minicpm_target, path, "f16")
    target = MiniCPMForCausalLM.from_pretrained(minicpm_target).config
    expected = load_head(quantized, target).state_dict()
    linears = 1 + 7  # fc, q/k/v/o, gate/up/down
    assert report.tensors_by_type[block_type] == linears and report.tensors_by_type["f16"] == 1  # lm_head
    reader = open_gguf(path)
    assert reader.fields["general.file_type"].contents() == FILE_TYPES[block_type]
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = json.loads((quantized / "config.json").read_text())
    heads = {"blk.0.attn_q.weight": config["num_attention_heads"], "blk.0.attn_k.weight": config["num_key_value_heads"]}
    compared = 0
    for source, name in TENSOR_NAMES.items():
        if name not in tensors or tensors[name].tensor_type.name.lower() != block_type:
            continue
        compared += 1
        weight = expected[source] * report.folded.get(source, 1.0)
        if name in heads:
            weight = permute_rows(weight, heads[name])
        decoded = torch.from_numpy(TYPES[block_type].dequantize(np.array(tensors[name].data), weight.shape[1]))
        if source in report.folded:
            torch.testing.assert_close(decoded, weight, rtol=2 ** -11, atol=0)
        else:
            assert torch.equal(decoded, weight), name
    assert compared == linears


def test_a_quantized_head_off_the_block_grids_is_refused(head, minicpm_target, tmp_path):
    quantized = _quantized_head(head, minicpm_target, tmp_path, "rtn-w4g128", quant={"sym": False, "group_size": 32})
    out = tmp_path / "head.gguf"
    result = CliRunner().invoke(main, ["export", "gguf-head", "--head", str(quantized), "--target", str(minicpm_target),
                                       "--out", str(out)])
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert ("the head's fc.weight is 4-bit asym in groups of 32: no llama.cpp block type holds that grid"
            in result.output)
    assert not out.exists()


def test_cli_writes_the_file_and_notes_what_llama_cpp_lacks_for_minicpm(head, minicpm_target, tmp_path):
    out = tmp_path / "head.gguf"
    result = CliRunner().invoke(main, ["export", "gguf-head", "--head", str(head), "--target", str(minicpm_target),
                                       "--out", str(out), "--outtype", "q8_0", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["tensors_by_type"] == {"q8_0": 9, "f32": 4, "i64": 1} and out.stat().st_size == report["file_bytes"]
    assert "does not record the layer inputs" in report["note"]
    fields = open_gguf(out).fields
    assert fields["general.architecture"].contents() == "eagle3"
    assert fields["eagle3.target_layers"].contents() == [2, 4, 5]
