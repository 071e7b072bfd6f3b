"""`make bench-8b`: quantkit's runtime at MiniCPM4.1-8B's scale against llama.cpp, on this CPU.

The model is MiniCPM4.1-8B's shape with ``--layers`` decoder layers (32: the whole model) of random
weights, written once as ``make bench-scale`` writes it: no speed here depends on the values. From
it, once each (an earlier run's are reused; ``--no-reuse`` remakes them): quantkit's W4 artifact in
the GPTQ layout by the cheapest recipe that writes it (``rtn-w4g128`` on one calibration row: RTN's
weights do not depend on calibration), its ternary artifact likewise (``rtn-ternary-g32``), and
llama.cpp's Q4_0 and Q4_K_M files of the same weights by
``quantkit export gguf``. Prompts are random token ids. Every contender runs with ``--threads``
threads; llama.cpp through llama-cpp-python, without its CPU weight repacking (as ``make
bench-runtime`` runs it).

The first table has a row per measure, a column per contender, then quantkit's ratio to each
llama.cpp file (``x Q4_0``, ``x Q4_K_M``):

- ``file GB``: the W4 artifact's directory, the GGUF file.
- ``prefill tok/s, P-token prompt`` (P: the first of ``--contexts``): the prompt from an empty cache,
  median of ``--repeats`` runs; quantkit in the generator's 512-token chunks, as generation runs it.
- ``decode tok/s at C``: ``--new-tokens`` greedy steps C positions in, median of ``--repeats``. After
  the first context's prompt, prefilled once (each run drops the previous run's tokens). At later
  contexts llama.cpp prefills the C-token prompt once (half an hour at 8K) and saves its cache in its
  own session file under ``--out``, which the other GGUF and later runs load instead of prefilling
  (a decode step reads every cached key and value whatever they hold); quantkit's cache is filled directly
  with C positions of random keys and values (as in the second table), since the runtime's 8B
  prefill would take an hour at 8K: runs continue the sequence, after a warm-up.
- ``MB read per token at C``: what one decode step reads, C + new-tokens/2 positions in: quantkit's
  quantized weights as stored, its other parameters but the embedding table (one row of it is read)
  and its bf16 KV cache (``bench_runtime.decode_bytes``); llama.cpp's GGUF tensors but
  ``token_embd``, and its F16 KV cache.
- ``read GB/s around decode at C``: the memory bandwidth of that decode's own minute: the mean of a read
  probe (``memory_bandwidth_gb_s``) just before the measurement and one just after, or what the decode
  itself read (tok/s x bytes per token) if that is more. On a shared VM whose memory speed moves by 40 %
  within minutes, one probe at the start of the run met later decodes in other phases (a share of 77 % in
  one run and 59 % in the same command's run twenty minutes later).
- ``ceiling tok/s at C``: that bandwidth / the bytes per token: no decode can go faster.
- ``share of ceiling at C``: decode tok/s / that ceiling.

The second table is InfLLM v2 end to end at each of ``--long-contexts``: the runtime's whole decode
step (every layer and the LM head) with dense attention (``load_text_generator(..., sparse="off")``) and with
InfLLM v2 (``sparse="on"``, MiniCPM4.1's sparse_config): tok/s of each, their ratio, and the MB a step
reads (dense: every key and value; InfLLM v2: its selected blocks and the compressed keys, counted as
``kernels/roofline`` counts them). The KV cache is not prefilled but filled directly with random bf16
keys and values (``common.random_keys_values``, as bench_sparse fills its caches), with InfLLM v2's
compressed keys pooled from them as decode finds them: a decode step's speed does not depend on the
values, and prefilling 64K positions of an 8B model takes hours on 2 cores. The cache holds
C - (repeats + 1) x new-tokens positions, so that the last timed step attends C keys; a warm-up and
``--repeats`` runs, each continuing the sequence, median. Below ``dense_len`` (8,192) keys InfLLM v2
is dense attention anyway (the last column says which ran).

A table of the CPU classes this one is above (``bench_8b_emulated``: without AMX, and an AVX2
desktop): quantkit's prefill and decode at the first context in a process held to the class's
instruction sets, where prefill multiplies int8 activations by the int4 codes instead of bf16 weights on
AMX, beside llama.cpp Q4_0 compiled for the class (llama-bench, built once, with llama.cpp's defaults)
or, for a class without such a build, llama.cpp on this CPU.

First, before the files are made, one decoder layer is quantized with the full calibration set
(``--layer-calibration``, 128 x 2048 tokens) and printed against its floor (``bench_8b_layer``).

The third table puts ternary weights (``rtn-ternary-g32``: BitCPM4's grid by rounding, since a step's
speed does not depend on training) beside W4 in quantkit's runtime: decode tok/s at the first context
on a random-filled cache (both rows measured that way), MB read per token and the share of the
bandwidth ceiling (each row between its own probes, as above).

GGUF export speed (``--export-speed``, ``bench_gguf_speed``): ``quantkit export gguf`` against
llama.cpp's own quantizer of its F32 export, per type, on the default model and the 8B-shaped
one-layer slice, with the slice's Q4_K_M export's wall time and peak memory as a command; the whole
8B's Q4_K_M export is in the files table.

Then the targets, printed and not asserted: quantkit's decode >= 1.0x llama.cpp Q4_0 and >= 60 % of
its bandwidth ceiling at every context, its prefill >= 2x llama.cpp Q4_0, each GGUF export
at most 1.5x llama.cpp's quantizer's time with identical tensors; the CPU flags and whether
AMX is there (the targets must hold without it); the files made; a profile of quantkit's decode step
(``bench_runtime.profile_decode``, after a 16-token prompt).

A slice of fewer than 32 layers runs the W4 linears as the full model does: they keep no bf16
dequantized copy for prefill (the whole model's weights exceed ``KEEP_DEQUANTIZED_BYTES``), so each
prefill chunk rebuilds it. Disk at 32 layers: about 31 GB in ``--out`` (checkpoint 16.4, W4 artifact
5.2, ternary about 3.5, Q4_0 4.7, Q4_K_M 4.9).

    python -m quantkit.eval.bench.bench_8b --out out/bench-8b
    python -m quantkit.eval.bench.bench_8b --layers 2 --long-contexts 16384 --repeats 1 --new-tokens 8
"""
from __future__ import annotations

import gc
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

import click
import torch

from quantkit.eval.bench import bench_8b_layer, bench_gguf_speed
from quantkit.eval.bench.bench_8b_emulated import emulated_classes
from quantkit.eval.bench.bench_8b_emulated import measure as measure_emulated
from quantkit.eval.bench.bench_gguf_speed import eight_b_slice
from quantkit.eval.bench.bench_runtime import (
    bench_llamacpp,
    bench_quantkit,
    decode_bytes,
    greedy_steps,
    memory_bandwidth_gb_s,
    profile_decode,
)
from quantkit.eval.bench.common import (
    Variant,
    cpu_flags,
    export_command,
    machine,
    make_variant,
    median_seconds,
    quantize_command,
    random_keys_values,
    report,
    timing_options,
)
from quantkit.table import format_table

FULL_LAYERS = 32
RECIPE = "rtn-w4g128"
# BitCPM4's ternary grid by rounding alone: a ternary step's speed and bytes do not depend on training
TERNARY_RECIPE = "rtn-ternary-g32"
# RTN's weights do not depend on calibration (it only scores each layer's error): the smallest set
CALIBRATION = ("calibration.n_samples=1", "calibration.seq_len=16", "calibration.batch_size=1")
GGUF_TYPES = ("q4_0", "q4_k_m")  # llama.cpp's files; Q4_0 is the targets' reference
GGUF_KV_BYTES = 2  # llama.cpp's default F16 KV cache
# quantkit's decode profile runs after this many prompt tokens: a decode step is weight-bound (the KV
# cache at 512 is 0.4 % of the bytes), and a prompt this short stays on the packed kernel (FEW_ROWS)
# rather than rebuild every dequantized weight, minutes at 8B
PROFILE_PROMPT = 16
# the targets, printed against the measurements (not asserted)
DECODE_VS_Q4_0 = 1.0
CEILING_SHARE = 0.60
PREFILL_VS_Q4_0 = 2.0


@dataclass
class Measured:
    """One contender's numbers; contexts are the prompt lengths of ``--contexts``."""

    name: str
    file_bytes: int
    prefill: dict[int, float] = field(default_factory=dict)  # prompt tokens -> tok/s
    decode: dict[int, float] = field(default_factory=dict)  # context -> tok/s
    bytes_per_token: dict[int, int] = field(default_factory=dict)  # context -> bytes a decode step reads
    probed: dict[int, float] = field(default_factory=dict)  # context -> GB/s of the probes around its decode

    def bandwidth(self, context: int) -> float:
        return decode_bandwidth(self.probed[context], self.decode[context], self.bytes_per_token[context])

    def ceiling(self, context: int) -> float:
        """Decode tok/s no run can exceed: bandwidth / bytes read per token."""
        return self.bandwidth(context) * 1e9 / self.bytes_per_token[context]

    def share(self, context: int) -> float:
        return self.decode[context] / self.ceiling(context)


def decode_bandwidth(probed_gb_s: float, tok_s: float, bytes_per_token: float) -> float:
    """GB/s a decode had: the mean of its probes, or its own read if that was more."""
    return max(probed_gb_s, tok_s * bytes_per_token / 1e9)


Result = TypeVar("Result")


def between_probes(measure: Callable[[], Result]) -> tuple[Result, float]:
    """``measure()`` and the read bandwidth of its minute, GB/s: the mean of a probe just before and one
    just after (this VM's memory speed moves by up to 40 % within minutes)."""
    before = memory_bandwidth_gb_s()
    result = measure()
    return result, (before + memory_bandwidth_gb_s()) / 2


def emulated_llama_cpp(run: dict, q4_0: Measured, prompt: int) -> dict:
    """What an emulated class's figures are held against: llama.cpp Q4_0 built for the class where the
    emulating process ran one, else llama.cpp Q4_0 on this CPU."""
    return run.get("llama_cpp") or {"build": "on this CPU", "prefill_tok_s": q4_0.prefill[prompt],
                                    "decode_tok_s": q4_0.decode[prompt]}


def emulated_ratio(run: dict, llama: dict, step: str) -> float:
    """quantkit / llama.cpp for ``step`` (prefill or decode) of an emulated class: the median of the paired
    rounds' ratios where llama.cpp ran in them, else the ratio of the medians."""
    paired = run.get("paired_ratios")
    return paired[step] if paired else run[f"{step}_tok_s"] / llama[f"{step}_tok_s"]


def targets(ours: Measured, q4_0: Measured, emulated: list[dict]) -> list[dict]:
    """The printed targets, one per context and measure (and per emulated CPU class for prefill): what,
    the measured value, the target, met."""
    rows = []
    for context in ours.decode:
        rows.append({"target": f"decode at {context}: quantkit / llama.cpp Q4_0",
                     "measured": ours.decode[context] / q4_0.decode[context], "goal": DECODE_VS_Q4_0})
        rows.append({"target": f"decode at {context}: share of the bandwidth ceiling",
                     "measured": ours.share(context), "goal": CEILING_SHARE})
    for prompt in ours.prefill:
        rows.append({"target": f"prefill of {prompt}: quantkit / llama.cpp Q4_0",
                     "measured": ours.prefill[prompt] / q4_0.prefill[prompt], "goal": PREFILL_VS_Q4_0})
        for run in emulated:
            llama = emulated_llama_cpp(run, q4_0, prompt)
            against = f"llama.cpp Q4_0 ({llama['build']})"
            rows.append({"target": f"prefill of {prompt} as {run['cpu_class']} (emulated): quantkit / {against}",
                         "measured": emulated_ratio(run, llama, "prefill"), "goal": PREFILL_VS_Q4_0})
            rows.append({"target": f"decode at {prompt} as {run['cpu_class']} (emulated): quantkit / {against}",
                         "measured": emulated_ratio(run, llama, "decode"), "goal": DECODE_VS_Q4_0})
    for row in rows:
        row["met"], row["at_most"] = row["measured"] >= row["goal"], False
    return rows


def export_targets(rows: list[dict]) -> list[dict]:
    """GGUF export, per model and type (``bench_gguf_speed.compare``'s rows): quantkit's time over llama.cpp's
    quantizer's at most its target ratio, with tensors identical to llama.cpp's."""
    return [{"target": f"GGUF {r['type']} export of {r['model']}: quantkit / llama.cpp's quantizer, tensors "
                       f"{'identical' if r['identical'] else 'DIFFERENT'}",
             "measured": r["ratio"], "goal": bench_gguf_speed.TARGET_RATIO, "at_most": True,
             "met": r["target_met"] and r["identical"]} for r in rows]


def gguf_decode_bytes(gguf: Path, config, context: int) -> int:
    """Bytes a llama.cpp decode step reads, counted as ``decode_bytes`` counts quantkit's: every tensor of
    the file but the token embedding (one row is read), and the F16 KV cache at ``context``."""
    from quantkit.gguf.reader import open_gguf

    weights = sum(int(t.n_bytes) for t in open_gguf(gguf).tensors if t.name != "token_embd.weight")
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * GGUF_KV_BYTES
    return weights + per_position * context


def size_of(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@contextmanager
def as_full_model(layers: int):
    """Whether W4 linears keep a dequantized bf16 copy for prefill depends on the model's total weights
    (``KEEP_DEQUANTIZED_BYTES``): a slice of ``layers`` decides as the full 32-layer model does."""
    from quantkit.kernels import linear

    kept = linear.KEEP_DEQUANTIZED_BYTES
    linear.KEEP_DEQUANTIZED_BYTES = kept * min(layers, FULL_LAYERS) // FULL_LAYERS
    try:
        yield
    finally:
        linear.KEEP_DEQUANTIZED_BYTES = kept


@torch.inference_mode()  # the runtime's own buffers are inference tensors
def fill_cache(generator, length: int, capacity: int, seed: int):
    """``length`` positions of random keys and values in every layer of a new cache of ``generator`` (room for
    ``capacity``), with InfLLM v2's compressed keys pooled from them (and the pre-RoPE keys it scores with
    under use_nope), as a decode step finds them after a prefill."""
    runtime, cache = generator.runtime, generator.new_cache()
    config = runtime.config
    generator = torch.Generator().manual_seed(seed)
    for layer in range(config.num_hidden_layers):
        keys, values = cache.buffers(layer, capacity)
        k, v = random_keys_values(config.num_key_value_heads, length, config.head_dim, generator)
        keys[:, :length], values[:, :length] = k, v
        scoring = keys[:, :length]
        if runtime.scores_pre_rope:
            scoring = cache.pre_rope_keys(layer, length)
            scoring.copy_(k)
        if cache.compressed[layer] is not None:
            cache.compressed[layer].update(scoring)
    cache.advance(length)
    return cache


def random_cache_decode(generator, filled: int, new_tokens: int, repeats: int) -> float:
    """Decode tok/s of ``generator`` after ``filled`` positions of ``fill_cache``: a warm-up and ``repeats``
    runs of ``new_tokens`` steps, each continuing the sequence, median."""
    steps = (repeats + 1) * new_tokens
    cache = fill_cache(generator, filled, filled + steps + 1, seed=filled)
    return new_tokens / median_seconds(lambda: greedy_steps(generator.runtime, cache, 0, new_tokens), repeats)


def sparse_step_bytes(generator, context: int) -> int:
    """Bytes an InfLLM v2 decode step reads at ``context``: ``decode_bytes`` with the keys and values
    of the selected blocks and the compressed keys in place of the whole cache."""
    from quantkit.kernels.roofline import attended_keys

    config, sparse = generator.runtime.config, generator.runtime.attention.config
    full, compressed = attended_keys(context, sparse)
    per_key = (config.num_hidden_layers * config.num_key_value_heads * config.head_dim
               * generator.runtime.kv_dtype.itemsize)
    return decode_bytes(generator, 0) + (2 * full + compressed) * per_key


def bit_width_row(weights: str, recipe: str, artifact: Path, generator, context: int, new_tokens: int,
                  repeats: int) -> dict:
    """One row of the ternary-beside-W4 table: ``generator``'s decode at ``context`` on a random cache, and the
    bandwidth ceiling of its own minute (as ``Measured.bandwidth``)."""
    read = decode_bytes(generator, context + new_tokens // 2)
    tok_s, probed = between_probes(lambda: random_cache_decode(generator, context, new_tokens, repeats))
    bandwidth = decode_bandwidth(probed, tok_s, read)
    return {"weights": weights, "recipe": recipe, "file_gb": size_of(artifact) / 1e9, "tok_s": tok_s,
            "mb_per_token": read / 1e6, "bandwidth_gb_s": bandwidth, "ceiling_tok_s": bandwidth * 1e9 / read}


def random_prompt(tokens: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def progress(message: str) -> None:
    click.echo(f"[{time.strftime('%H:%M:%S')}] {message}", err=True)


def prepare(out: Path, layers: int, reuse: bool,
            gguf_types: list[str]) -> tuple[Path, dict[str, Path], dict[str, Path], list[list]]:
    """The checkpoint (written once), the W4 and ternary artifacts and the GGUF files -> (checkpoint,
    {"w4"|"ternary": artifact}, {type: gguf}, a table row per file: what, seconds, peak RSS MB, GB, made or
    reused)."""
    checkpoint = out / f"minicpm41-8b-{layers}-layer"
    reused = (checkpoint / "config.json").is_file()
    if not reuse and reused:
        shutil.rmtree(checkpoint)
        reused = False
    progress(f"checkpoint {checkpoint}" + (" (reused)" if reused else ": writing"))
    started = time.perf_counter()
    eight_b_slice(checkpoint, layers)
    rows = [["random checkpoint (bf16)", "" if reused else time.perf_counter() - started, "", size_of(checkpoint) / 1e9,
             "reused" if reused else "made"]]
    variants = [Variant(f"{name}-{recipe}-{layers}-layer", f"quantkit {recipe}",
                        quantize_command(recipe, checkpoint, out / f"{name}-{recipe}-{layers}-layer", CALIBRATION))
                for name, recipe in (("w4", RECIPE), ("ternary", TERNARY_RECIPE))]
    for file_type in gguf_types:
        key = f"{file_type}-{layers}-layer.gguf"
        variants.append(Variant(key, f"export gguf {file_type}", export_command(checkpoint, file_type, out / key)))
    for variant in variants:
        record = make_variant(variant, out, reuse)
        rows.append([variant.label, record["seconds"], record["peak_rss_mb"], size_of(out / variant.key) / 1e9,
                     "reused" if record["reused"] else "made"])
    ggufs = {file_type: out / variant.key for file_type, variant in zip(gguf_types, variants[2:])}
    return checkpoint, {"w4": out / variants[0].key, "ternary": out / variants[1].key}, ggufs, rows


def amx_note(flags: list[str]) -> str:
    amx = [flag for flag in flags if flag.startswith("amx")]
    if not amx:
        return "AMX: absent on this CPU, so these numbers are the ones the targets are judged on."
    held = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return (f"AMX: present ({' '.join(amx)}). quantkit's prefill matmuls (oneDNN bf16) and its fused InfLLM v2 "
            "kernels use it on this CPU; llama.cpp here does not (its AMX path is weight repacking, off). The "
            "targets must hold without AMX: the emulated classes' table is quantkit without it; read "
            "InfLLM v2 here as an upper bound for a CPU without it"
            + (f" (oneDNN held to ONEDNN_MAX_CPU_ISA={held} in this run)." if held else "."))


@click.command()
@click.option("--layers", default=FULL_LAYERS, show_default=True,
              help="Decoder layers of the 8B-shaped checkpoint (32: the whole model).")
@click.option("--contexts", default="512,8192", show_default=True,
              help="Prompt lengths before the decode rows; the first is also the prefill row's (median of repeats).")
@click.option("--long-contexts", default="32768,65536", show_default=True,
              help="Contexts of the InfLLM v2 vs dense decode rows (cache filled with random keys and values).")
@click.option("--new-tokens", default=32, show_default=True, help="Decode steps per timed run.")
@click.option("--gguf-types", default=",".join(GGUF_TYPES), show_default=True,
              help="llama.cpp's files to compare with, from q4_0 (the targets' reference, always run) and q4_k_m.")
@click.option("--layer-calibration", default="128x2048", show_default=True,
              help="ROWSxTOKENS of the one-layer quantization row (bench_8b_layer); empty: skip it.")
@click.option("--export-speed/--no-export-speed", default=True, show_default=True,
              help="Time `quantkit export gguf` against llama.cpp's quantizer on the default model and the 8B-shaped "
                   "one-layer slice (bench_gguf_speed).")
@click.option("--reuse/--no-reuse", default=True, show_default=True,
              help="Keep the checkpoint, W4 artifact and GGUF files an earlier run made with the same commands.")
@click.option("--out", default="out/bench-8b", show_default=True, type=click.Path(path_type=Path))
@timing_options(repeats=3)
def main(layers, contexts, long_contexts, new_tokens, gguf_types, layer_calibration, export_speed, reuse, out, repeats,
         threads, json_path):
    """Prepare the files, time every contender, print the two tables and the targets."""
    from quantkit.kernels.generate import load_text_generator
    from quantkit.models import MiniCPMConfig

    started = time.perf_counter()
    torch.set_num_threads(threads)
    contexts = [int(c) for c in contexts.split(",") if c.strip()]
    long_contexts = [int(c) for c in long_contexts.split(",") if c.strip()]
    if repeats < 1 or new_tokens < 1 or not contexts:
        raise click.UsageError("--repeats and --new-tokens must be >= 1 and --contexts not empty")
    too_short = [c for c in long_contexts if c <= (repeats + 1) * new_tokens]
    if too_short:
        raise click.UsageError(f"--long-contexts {too_short} must exceed (repeats + 1) x new-tokens")
    out.mkdir(parents=True, exist_ok=True)
    layer_text, layer_results = "", None
    if layer_calibration:
        calib_rows, calib_tokens = (int(n) for n in layer_calibration.lower().split("x"))
        progress(f"one 8B layer quantized with {calib_rows} x {calib_tokens} calibration tokens "
                 f"({bench_8b_layer.RECIPE})")
        layer_setup, layer_body, layer_results = bench_8b_layer.run(
            out, bench_8b_layer.RECIPE, calib_rows, calib_tokens, batch_size=8, threads=threads, activations="auto")
        layer_text = f"Quantization: {layer_setup}\n{layer_body}"
    named = bench_gguf_speed.split_types(gguf_types)
    gguf_types = [GGUF_TYPES[0], *(t for t in named if t != GGUF_TYPES[0])]
    unknown = set(gguf_types) - set(GGUF_TYPES)
    if unknown:
        raise click.UsageError(f"--gguf-types: {sorted(unknown)} not among {list(GGUF_TYPES)}")
    checkpoint, artifacts, ggufs, files = prepare(out, layers, reuse, gguf_types)
    artifact = artifacts["w4"]
    config = MiniCPMConfig.from_pretrained(checkpoint)
    prompts = {c: random_prompt(c, config.vocab_size, seed=c) for c in contexts}

    contenders = []
    for file_type, gguf in ggufs.items():
        measured = Measured(f"llama.cpp {file_type.upper()}", size_of(gguf))
        for i, context in enumerate(contexts):
            progress(f"{measured.name}: prefill and decode at {context}")
            (measured.prefill[context], measured.decode[context]), measured.probed[context] = between_probes(
                lambda: bench_llamacpp(
                    gguf, prompts[context], new_tokens, repeats, threads, prefill_repeats=None if i == 0 else 0,
                    cache_file=None if i == 0 else out / f"llamacpp-cache-{layers}-layer-{context}.session"))
            measured.bytes_per_token[context] = gguf_decode_bytes(gguf, config, context + new_tokens // 2)
        contenders.append(measured)

    progress(f"quantkit: loading {artifact} (dense attention)")
    with as_full_model(layers):
        generator = load_text_generator(artifact, sparse="off")
    ours = Measured(f"quantkit W4 ({RECIPE})", size_of(artifact))
    for i, context in enumerate(contexts):
        if i == 0:
            progress(f"{ours.name}: prefill and decode at {context}")
            (_, ours.prefill[context], ours.decode[context]), ours.probed[context] = between_probes(
                lambda: bench_quantkit(artifact, prompts[context], new_tokens, repeats, generator=generator))
        else:
            progress(f"{ours.name}: decode at {context} (random cache)")
            ours.decode[context], ours.probed[context] = between_probes(
                lambda: random_cache_decode(generator, context, new_tokens, repeats))
        ours.bytes_per_token[context] = decode_bytes(generator, context + new_tokens // 2)
    contenders.insert(0, ours)
    progress("quantkit: decode profile")
    profile = profile_decode(generator, prompts[contexts[0]][:PROFILE_PROMPT], steps=min(new_tokens, 16), rows=8)

    long_rows = {}
    for context in long_contexts:
        progress(f"quantkit dense attention: decode at {context} (random cache)")
        dense = random_cache_decode(generator, context - (repeats + 1) * new_tokens, new_tokens, repeats)
        long_rows[context] = {"context": context, "dense_tok_s": dense, "dense_bytes": decode_bytes(generator, context)}
    first = contexts[0]
    progress(f"{ours.name}: decode at {first} (random cache, as the ternary row)")
    widths = [bit_width_row("W4 g128", RECIPE, artifact, generator, first, new_tokens, repeats)]
    del generator
    gc.collect()
    progress(f"quantkit: loading {artifacts['ternary']} (ternary)")
    with as_full_model(layers):
        generator = load_text_generator(artifacts["ternary"], sparse="off")
    progress(f"quantkit ternary: decode at {first} (random cache)")
    widths.append(bit_width_row("ternary g32", TERNARY_RECIPE, artifacts["ternary"], generator, first, new_tokens,
                                repeats))
    del generator
    gc.collect()
    if long_contexts:
        progress(f"quantkit: loading {artifact} (InfLLM v2)")
        with as_full_model(layers):
            generator = load_text_generator(artifact, sparse="on")
        sparse = generator.runtime.attention.config
        for context in long_contexts:
            progress(f"quantkit InfLLM v2: decode at {context} (random cache)")
            row = long_rows[context]
            row["sparse_tok_s"] = random_cache_decode(generator, context - (repeats + 1) * new_tokens, new_tokens,
                                                      repeats)
            row["sparse_bytes"] = sparse_step_bytes(generator, context)
            row["attention"] = "dense (below dense_len)" if sparse.is_dense(context) else "InfLLM v2"
        del generator
        gc.collect()
    emulated = []
    for cpu_class in emulated_classes(cpu_flags()):
        progress(f"{ours.name}: prefill and decode at {first} as {cpu_class} (emulated, a process of its own, in "
                 "rounds with llama.cpp Q4_0 built for the class if it has a build: llama-bench, built on first use)")
        emulated.append(measure_emulated(cpu_class, artifact, layers, first, new_tokens, repeats, threads,
                                         ggufs["q4_0"]))

    export_rows, export_memory, export_text = [], None, ""
    if export_speed:
        progress("GGUF export: quantkit against llama.cpp's quantizer, the default model and the 8B-shaped slice")
        from quantkit.zoo import resolve_model

        split = bench_gguf_speed.split_types
        export_rows, export_memory = bench_gguf_speed.side_by_side(
            resolve_model("default"), split(bench_gguf_speed.DEFAULT_TYPES), split(bench_gguf_speed.SLICE_TYPES), 1,
            out, repeats, 0, threads)
        export_text = (f"GGUF export (bench_gguf_speed): quantkit export (quantizer: {bench_gguf_speed.quantizer()}) "
                       f"against llama_model_quantize of its F32 export, {threads} threads each, in-process; default "
                       f"model median of {repeats} after a warm-up, the 8B-shaped one-layer slice one call each; "
                       f"{bench_gguf_speed.memory_note(export_memory, 1)}\n{bench_gguf_speed.speed_table(export_rows)}")

    names = [c.name for c in contenders]
    others = contenders[1:]
    ratio_headers = [f"x {c.name.removeprefix('llama.cpp ')}" for c in others]

    def line(label: str, values: list[float], ratios: bool = True, fmt=None) -> list:
        shown = [fmt(v) for v in values] if fmt else values
        return [label, *shown, *((values[0] / v if v else "") if ratios else "" for v in values[1:])]

    percent = "{:.0%}".format
    rows = [line("file GB", [c.file_bytes / 1e9 for c in contenders])]
    rows.append(line(f"prefill tok/s, {first}-token prompt", [c.prefill[first] for c in contenders]))
    for context in contexts:
        rows.append(line(f"decode tok/s at {context}", [c.decode[context] for c in contenders]))
        rows.append(line(f"MB read per token at {context}", [c.bytes_per_token[context] / 1e6 for c in contenders]))
        rows.append(line(f"read GB/s around decode at {context}", [c.bandwidth(context) for c in contenders], False))
        rows.append(line(f"ceiling tok/s at {context}", [c.ceiling(context) for c in contenders], False))
        rows.append(line(f"share of ceiling at {context}", [c.share(context) for c in contenders], False, percent))
    table = format_table(["measure", *names, *ratio_headers], rows)
    emulated_table = ""
    if emulated:
        compared = [(run, emulated_llama_cpp(run, contenders[1], first)) for run in emulated]
        emulated_table = (
            f"CPU classes below this one, emulated (bench_8b_emulated: quantkit held to the class's instruction "
            f"sets; llama.cpp built for the class where it has a build, llama-bench with its defaults, timed in "
            f"alternation with quantkit, x the median of the {repeats} rounds' ratios): prefill of the {first}-token "
            f"prompt, decode {first} positions in\n" + format_table(
                ["CPU class", "quantkit prefill", "llama.cpp Q4_0 prefill", "x", "quantkit decode",
                 "llama.cpp Q4_0 decode", "x", "llama.cpp"],
                [[run["cpu_class"], run["prefill_tok_s"], llama["prefill_tok_s"], emulated_ratio(run, llama, "prefill"),
                  run["decode_tok_s"], llama["decode_tok_s"], emulated_ratio(run, llama, "decode"), llama["build"]]
                 for run, llama in compared]))
    long_table = ""
    if long_rows:
        long_table = format_table(
            ["context", "dense tok/s", "InfLLM v2 tok/s", "InfLLM v2 / dense", "dense MB/token", "InfLLM v2 MB/token",
             "InfLLM v2 runs"],
            [[r["context"], r["dense_tok_s"], r["sparse_tok_s"], r["sparse_tok_s"] / r["dense_tok_s"],
              r["dense_bytes"] / 1e6, r["sparse_bytes"] / 1e6, r["attention"]] for r in long_rows.values()])
        long_table = ("InfLLM v2 end to end: the runtime's whole decode step, sparse=\"off\" vs \"on\"; KV cache "
                      "filled directly with random bf16 keys and values (no prefill; compressed keys pooled from "
                      f"them), the last timed step attending <context> keys; {new_tokens} steps, median of {repeats} "
                      f"after a warm-up\n{long_table}")
    widths_table = (f"Ternary beside W4 in quantkit's runtime: decode at {first} on a cache filled with random keys "
                    f"and values, {new_tokens} steps, median of {repeats} after a warm-up; bytes and ceiling as above\n"
                    + format_table(["weights", "recipe", "file GB", "decode tok/s", "MB read per token",
                                    "read GB/s around", "ceiling tok/s", "share of ceiling", "x W4 tok/s"],
                                   [[w["weights"], w["recipe"], w["file_gb"], w["tok_s"], w["mb_per_token"],
                                     w["bandwidth_gb_s"], w["ceiling_tok_s"], f"{w['tok_s'] / w['ceiling_tok_s']:.0%}",
                                     w["tok_s"] / widths[0]["tok_s"]] for w in widths]))
    fills = "; ".join(f"{c.name} " + (f"{c.prefill[context]:.4g} tok/s" if c.prefill[context] else "loaded")
                      for c in others for context in contexts[1:])
    if fills:
        fills = (f"decode at {', '.join(map(str, contexts[1:]))}: quantkit's cache filled with random keys and values "
                 f"(no prefill); llama.cpp's prefill of that prompt, one run, or its cache loaded from the session "
                 f"file an earlier prefill of the same prompt saved under {out} (by any of the GGUFs: a decode step "
                 f"reads the cached keys and values whatever they hold): {fills}")
    checked = targets(ours, contenders[1], emulated) + export_targets(export_rows)
    target_lines = "\n".join(f"  {t['target']}: {t['measured']:.2f} (target {'<=' if t['at_most'] else '>='} "
                             f"{t['goal']:g}) "
                             f"{'met' if t['met'] else 'NOT met'}" for t in checked)
    files_table = format_table(["file", "seconds", "peak RSS MB", "GB", ""], files)
    profile_table = format_table(["op", "share", "calls/token", "us/token"],
                                 [[p["op"], f"{100 * p['share']:.1f}%", p["calls_per_token"], p["us_per_token"]]
                                  for p in profile])
    flags = cpu_flags()
    elapsed = time.perf_counter() - started
    scope = ("the whole model" if layers >= FULL_LAYERS else
             f"a slice: {layers} of its {FULL_LAYERS} layers, so the LM head weighs more than in the full model")
    setup = (f"MiniCPM4.1-8B's shape, random weights, {layers} decoder layers ({scope}); random prompts; "
             f"{new_tokens} greedy decode steps per run, median of {repeats}; {threads} threads each; "
             f"each decode's bandwidth ceiling from read probes just before and after it (or its own read if "
             f"more); quantkit's W4 prefill "
             f"rebuilds each bf16 dequantized weight per chunk, as the full model does (KEEP_DEQUANTIZED_BYTES); "
             f"machine: {machine()}")
    notes = "\n\n".join(part for part in (
        layer_text,
        emulated_table,
        long_table,
        widths_table,
        export_text,
        fills,
        f"targets (printed, not asserted), quantkit against llama.cpp Q4_0:\n{target_lines}",
        f"CPU flags: {' '.join(flags) or 'none listed'}\n{amx_note(flags)}",
        f"files (made once under {out}; --no-reuse remakes them):\n{files_table}",
        f"quantkit decode profile after a {PROFILE_PROMPT}-token prompt (top ops by self CPU time):\n{profile_table}",
        f"wall time of this run: {elapsed:.0f} s",
    ) if part)
    report(setup, table, contenders, json_path=json_path or out / "bench.json", markdown_path=out / "bench.md",
           notes=notes, extra={"read_gb_s_around_decode": {
                                   c.name: {context: c.bandwidth(context) for context in c.decode} for c in contenders},
                               "long_contexts": list(long_rows.values()),
                               "targets": checked, "ternary_vs_w4": widths, "layer_quantization": layer_results,
                               "cpu_flags": flags, "files": files, "decode_profile": profile,
                               "emulated": emulated, "gguf_export": export_rows,
                               "gguf_export_memory": export_memory,
                               "layers": layers, "wall_seconds": elapsed})


if __name__ == "__main__":
    main()
