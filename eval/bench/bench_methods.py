"""`make bench-gptq`, `make bench-awq`, `make bench-ct`: quantization methods side by side, in one run, on the same
calibration tokens, over calibration seeds, compute paths and test texts.

Each variant (method, bits, calibration seed, compute path) is quantized in its own process under
`/usr/bin/time -v` (wall time and peak RSS of that process alone), then scored against the
unquantized model on every test text: perplexity, KL divergence and top-1 agreement. Peers that run
in their own environment (GPTQModel, llm-compressor) join through `--peer NAME=COMMAND` lines that
write a checkpoint quantkit loads into the directory given as `{out}`, on the same seed's rows; a
peer has one compute path, given as `{dtype}`: what quantkit's `compute_dtype: auto` picks on this CPU.

The tables: each method's KL as the mean over texts and seeds with its range, then per text, then
the verdicts (a method beats another only where its whole range is below the other's on every
text), and each method's float32 path against its bf16 path.

    python -m quantkit.eval.bench.bench_methods --out out/bench-gptq [--reuse]
"""
from __future__ import annotations

import json
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path

import click

from quantkit.eval.bench.across_texts import Spread, beats, names, remembered_scores, text_tokens, texts_option
from quantkit.eval.bench.common import Variant, machine, make_variant, quantize_command, report
from quantkit.table import format_table

# method -> (recipe, overrides). Every variant but the compressed-tensors one is written as a GPTQ
# checkpoint: those weights do not depend on the format (tests read AWQ/Marlin artifacts back equal to
# the GPTQ ones), and the GPTQ format also holds W3 and the default model's ragged g128 groups, which
# AWQ's GEMM layout cannot.
METHODS = {
    "RTN": ("rtn-w4g128", ()),
    "AWQ": ("awq-w4g128", ("format=gptq",)),
    "GPTQ": ("gptq-w4g128", ()),
    "P-GPTQ": ("p-gptq-w4g128", ()),
    "S-GPTQ": ("s-gptq-w4g128", ()),
    "S-P-GPTQ": ("s-p-gptq-w4g128", ()),
    # below 4 bits: the asymmetric grid, GPTQ alone and followed by block reconstruction
    "GPTQ-ASYM": ("gptq-w4g128", ("quant.sym=false",)),
    "BLOCK-RECON": ("block-recon-w2g64", ()),
    # compressed-tensors keeps scales in the model's dtype, so its weights differ from the GPTQ format's
    "S-GPTQ-CT": ("s-gptq-w4a16-ct", ()),
    "INT8-W8A8": ("int8-w8a8", ()),  # scored with its activations quantized per token (quantkit.loading)
    "FP8-W8A8": ("fp8-w8a8", ()),  # likewise, cast to E4M3 per token
}
PATH_NAMES = {"bfloat16": "bf16", "float32": "fp32"}
TARGET_RATIO = 0.8  # issue 70: S-P-GPTQ's mean KL at most this times the peer's
PATH_TOLERANCE = 0.05  # the same recipe's KL on the two compute paths


@dataclass
class Scored:
    method: str
    bits: int
    seed: int
    path: str  # bf16 / fp32, or the peer's own
    seconds: float
    peak_rss_mb: float
    scores: dict  # text -> KLResult fields
    bits_per_weight: float  # the decoder linears' stored bytes, x 8 / their weights


def linear_bits_per_weight(artifact: Path) -> float:
    """Bits per weight of the decoder's linears as an artifact stores them (codes, scales, zero points,
    g_idx, activation scales: every tensor of a linear), from the safetensors headers; the embedding and
    LM head, which every tool here keeps in 16 or 32 bits, are not counted."""
    from quantkit.checkpoint import read_header
    from quantkit.models import MiniCPMConfig
    from quantkit.models.layers import layer_prefix
    from quantkit.reader import linear_shapes

    config = MiniCPMConfig.from_pretrained(artifact)
    layers = config.num_hidden_layers
    prefixes = tuple(f"{layer_prefix(index)}{linear}." for index in range(layers) for linear in linear_shapes(config))
    stored = 0
    for shard in sorted(artifact.glob("*.safetensors")):
        header, _ = read_header(shard)
        stored += sum(info["data_offsets"][1] - info["data_offsets"][0] for name, info in header.items()
                      if name != "__metadata__" and name.startswith(prefixes))
    return 8 * stored / (layers * sum(n * k for n, k in linear_shapes(config).values()))


def default_paths() -> str:
    from quantkit.stats import BF16_IN_HARDWARE

    return "bfloat16,float32" if BF16_IN_HARDWARE else "float32"


def auto_path() -> str:
    from quantkit.stats import BF16_IN_HARDWARE

    return "bfloat16" if BF16_IN_HARDWARE else "float32"


def peer_path(artifact: Path) -> str:
    """The dtype a peer says it computed in (GPTQModel's run file), or "own"."""
    run = artifact / "gptqmodel_run.json"
    dtype = json.loads(run.read_text())["settings"].get("dtype", "") if run.is_file() else ""
    return PATH_NAMES.get(dtype, dtype or "own")


@click.command()
@click.option("--model", default="default", show_default=True)
@click.option("--bits", "bit_widths", default="4", show_default=True, help="Comma-separated bit widths.")
@click.option("--group-size", default=128, show_default=True)
@click.option("--n-samples", default=128, show_default=True)
@click.option("--seq-len", default=512, show_default=True)
@click.option("--seeds", default="0,1,2", show_default=True, help="Comma-separated calibration seeds.")
@click.option("--compute-dtypes", default=None,
              help="Comma-separated calibration compute paths (bfloat16, float32) for quantkit's methods; "
                   "default: both where the CPU multiplies bf16 in hardware, float32 elsewhere.")
@texts_option("test-fiction,test-manual,test-code,test-zh")
@click.option("--max-tokens", default=16384, show_default=True, help="Tokens scored per text.")
@click.option("--window", default=2048, show_default=True)
@click.option("--methods", default="GPTQ,S-GPTQ,S-P-GPTQ", show_default=True,
              help=f"Comma-separated, from {', '.join(METHODS)}.")
@click.option("--baseline", default="GPTQ", show_default=True, help="The method KL ratios are taken against.")
@click.option("--out", default="out/bench-gptq", show_default=True, type=click.Path(path_type=Path))
@click.option("--peer", "peers", multiple=True, help="NAME=COMMAND producing a checkpoint quantkit loads in {out} "
              "(run with {model}, {bits}, {group_size}, {n_samples}, {seq_len}, {seed}, {dtype} substituted).")
@click.option("--reuse", is_flag=True, help="Keep artifacts and scores an earlier run made with the same commands "
              "and tokens (and continue interrupted quantizations).")
def main(model, bit_widths, group_size, n_samples, seq_len, seeds, compute_dtypes, texts, max_tokens, window,
         methods, baseline, out, peers, reuse):
    """Quantize the model with every method, seed and compute path, score each on every text, and compare."""
    from transformers import AutoTokenizer

    from quantkit.eval.kld import kl_divergence
    from quantkit.loading import load_model
    from quantkit.zoo import resolve_model

    chosen = names(methods)
    unknown = sorted(set(chosen) - set(METHODS))
    if unknown:
        raise click.BadParameter(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}",
                                 param_hint="--methods")
    paths = names(compute_dtypes or default_paths())
    if set(paths) - set(PATH_NAMES):
        raise click.BadParameter(f"choose from {', '.join(PATH_NAMES)}", param_hint="--compute-dtypes")
    model_dir = resolve_model(model)
    out.mkdir(parents=True, exist_ok=True)
    tokens = text_tokens(AutoTokenizer.from_pretrained(model_dir), names(texts), max_tokens)
    reference = load_model(model_dir)
    fp = remembered_scores(out / "fp.scores.json", lambda t: kl_divergence(reference, reference, t, window=window),
                           tokens, window, reuse)
    peer_commands = dict(peer.split("=", 1) for peer in peers)
    variants: list[Scored] = []
    for bits in (int(b) for b in names(bit_widths)):
        for seed in (int(s) for s in names(seeds)):
            jobs = [(method, path) for method in chosen for path in paths] + [(peer, None) for peer in peer_commands]
            for method, path in jobs:
                settings = {"bits": bits, "group_size": group_size, "n_samples": n_samples, "seq_len": seq_len,
                            "seed": seed, "dtype": auto_path()}
                if method in METHODS:
                    recipe, overrides = METHODS[method]
                    key = f"{method.lower()}-w{bits}-seed{seed}-{PATH_NAMES[path]}"
                    command = quantize_command(recipe, model_dir, out / key, (
                        f"quant.bits={bits}", f"quant.group_size={group_size}",
                        f"calibration.n_samples={n_samples}", f"calibration.seq_len={seq_len}",
                        f"calibration.seed={seed}", f"compute_dtype={path}", *overrides))
                else:
                    key = f"{method.lower()}-w{bits}-seed{seed}"
                    command = shlex.split(peer_commands[method].format(model=model_dir, out=out / key, **settings))
                record = make_variant(Variant(key, f"{method} W{bits} seed {seed}", command), out, reuse)
                scores = remembered_scores(out / f"{key}.scores.json",
                                           lambda t: kl_divergence(load_model(out / key), reference, t,
                                                                   window=window),
                                           tokens, window, reuse and record["reused"])
                variants.append(Scored(method, bits, seed, PATH_NAMES[path] if path else peer_path(out / key),
                                         record["seconds"], record["peak_rss_mb"], scores,
                                         linear_bits_per_weight(out / key)))
    summary, per_text, verdicts = tables(variants, list(tokens), baseline, peer_commands)
    reference_ppl = ", ".join(f"{name} {score['perplexity']:.2f}" for name, score in fp.items())
    header = (f"model {model_dir.name}; group size {group_size}; calibration {n_samples} x {seq_len} tokens "
              f"(default mix), seeds {seeds}; scored on {', '.join(tokens)} ({max_tokens} tokens each, window "
              f"{window}; reference perplexity {reference_ppl}); machine: {machine()}")
    report(header, f"{summary}\n\nKL per text (mean over seeds, range):\n{per_text}", variants,
           json_path=out / "bench.json", markdown_path=out / "bench.md", notes="\n".join(verdicts),
           extra={"verdicts": verdicts})


def tables(variants: list[Scored], texts: list[str], baseline: str, peers: dict) -> tuple[str, str, list[str]]:
    groups: dict[tuple, list[Scored]] = {}
    for v in variants:
        groups.setdefault((v.method, v.bits, v.path), []).append(v)

    def kls(group, text=None) -> list[float]:
        return [v.scores[t]["mean_kl"] for v in group for t in ([text] if text else texts)]

    def by_text(group) -> dict[str, list[float]]:
        return {text: kls(group, text) for text in texts}

    baseline_kl = {(bits, path): statistics.fmean(kls(g)) for (m, bits, path), g in groups.items() if m == baseline}
    summary = format_table(
        ["method", "bits", "bits/weight", "path", "mean KL (range)", f"KL / {baseline}", "ppl", "top-1", "quantize s",
         "peak RSS MB"],
        [[method, bits, statistics.fmean(v.bits_per_weight for v in g), path, str(Spread.of(kls(g))),
          statistics.fmean(kls(g)) / baseline_kl[(bits, path)] if (bits, path) in baseline_kl else "",
          statistics.fmean(v.scores[t]["perplexity"] for v in g for t in texts),
          statistics.fmean(v.scores[t]["top1_agreement"] for v in g for t in texts),
          statistics.median(v.seconds for v in g), max(v.peak_rss_mb for v in g)]
         for (method, bits, path), g in groups.items()])
    per_text = format_table(["method", "bits", "path", *texts],
                            [[method, bits, path, *(str(Spread.of(kls(g, t))) for t in texts)]
                             for (method, bits, path), g in groups.items()])
    verdicts = []
    ours = [(key, g) for key, g in groups.items() if key[0] not in peers]
    for (method, bits, path), group in ours:
        for (other, other_bits, other_path), theirs in groups.items():
            if other in peers and other_bits == bits:
                ratio = statistics.fmean(kls(group)) / statistics.fmean(kls(theirs))
                verdicts.append(
                    f"{method} W{bits} {path} vs {other} ({other_path}): mean KL {ratio:.2f}x (target <= "
                    f"{TARGET_RATIO}: {'PASS' if ratio <= TARGET_RATIO else 'FAIL'}); every seed and text below: "
                    f"{'yes' if beats(by_text(group), by_text(theirs)) else 'no'}")
    for (method, bits, path), group in ours:
        other = groups.get((method, bits, "bf16")) if path == "fp32" else None
        if other:
            ratio = statistics.fmean(kls(group)) / statistics.fmean(kls(other))
            verdicts.append(f"{method} W{bits}: fp32 path / bf16 path mean KL {ratio:.3f} (target within "
                            f"{PATH_TOLERANCE:.0%}: {'PASS' if abs(ratio - 1) <= PATH_TOLERANCE else 'FAIL'})")
    return summary, per_text, verdicts


if __name__ == "__main__":
    main()
