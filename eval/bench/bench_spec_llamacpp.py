"""`make bench-spec-llamacpp`: a quantkit EAGLE-3 head drafting in llama.cpp's own speculative decoding.

The FP head (``--head``, or one this bench trains: `quantkit draft train --target default` over
``--train-tokens`` of ``--train-data``, one 512-token row and 4 unrolled draft steps a step) is written by
`quantkit export gguf-head` in each ``--outtypes``, its GPTQ W4 g128 copy (`quantkit draft quantize`) as
Q4_0 blocks of its own codes (lm_head f16), and `llama-speculative-simple` (built from the llama.cpp that
llama-cpp-python vendors) decodes with it, ``--spec-type draft-eagle3``, greedy, chains of ``--k``. The
targets are llama GGUFs of the default model: the file it was converted from (SmolLM2-135M-Instruct
Q4_1, architecture ``llama``: the default model is that file's weights, dequantized, with MiniCPM4.1's μP
multipliers divided out) and the same weights in F32. llama.cpp runs EAGLE-3 drafts on llama targets
but not yet on its MiniCPM graph (docs/speculative.md, "Heads for llama.cpp"); the llama file computes
the same function, so a head trained on the default model fits it unchanged.

Per prompt (held-out text, tokenized by llama.cpp as `llama-speculative-simple` tokenizes it):
- **greedy equality**: the text llama.cpp decodes with the draft equals its plain greedy text (llama.cpp
  through llama-cpp-python, one token a forward), token for token; beside it, how llama.cpp's own logits
  at those positions change when it computes them k + 1 tokens a forward, as a verification does (argmax
  flips, largest difference): a target whose batches compute other logits cannot be held to its plain text;
- **acceptance**: llama.cpp's own statistics (n_predict, n_drafted, n_accept: τ = committed tokens per
  target forward) against `quantkit eval accept` (``quantkit.eval.accept``) on the same token ids, with
  the FP head in quantkit's float32 runtime on the default model;
- llama.cpp's decode speed with the draft, beside its plain greedy decode through llama-cpp-python.

    python -m quantkit.eval.bench.bench_spec_llamacpp --out out/bench-spec-llamacpp [--head H] [--reuse]
"""
from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from quantkit.eval.bench.common import Variant, machine, make_variant, report
from quantkit.table import format_table

SPECULATIVE_PROGRAM = "llama-speculative-simple"
# llama.cpp's file types (llama.h, enum llama_ftype) for the targets made from the default model's GGUF
TARGETS = {"Q4_1": None, "F32": 0}  # None: the original file as it is
# The statistics `llama-speculative-simple` prints at the end of a run
STATISTICS = re.compile(r"\b(n_predict|n_drafted|n_accept)\s*=\s*(\d+)")
DECODE_SPEED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")


def speculative_program(jobs: int = 2) -> Path:
    """llama.cpp's speculative example, built once (about 10 minutes on 2 cores) beside the other tools."""
    from quantkit.eval.bench.llama_build import NATIVE, llama_cpp_programs

    return llama_cpp_programs("speculative", (SPECULATIVE_PROGRAM,), NATIVE, jobs=jobs, examples=True) \
        / SPECULATIVE_PROGRAM


@dataclass
class LlamaSpeculation:
    """What one `llama-speculative-simple` run printed."""

    text: str  # the generated text, as the token pieces it printed
    n_predict: int  # tokens committed
    n_drafted: int
    n_accept: int
    decode_seconds: float

    @property
    def rounds(self) -> int:
        """Target forwards after the prompt: each commits its accepted drafts and one token of its own."""
        return self.n_predict - self.n_accept

    @property
    def tau(self) -> float:
        return self.n_predict / self.rounds


def run_speculative(program: Path, target: Path, head: Path, prompt: str, prompt_pieces: str, new_tokens: int,
                    k: int, threads: int) -> LlamaSpeculation:
    """Greedy speculative decoding of ``new_tokens`` after ``prompt`` (whose token pieces, as llama.cpp prints
    them back, are ``prompt_pieces``) with ``head`` drafting chains of ``k`` for ``target``."""
    command = [str(program), "-m", str(target), "-md", str(head), "--spec-type", "draft-eagle3",
               "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0",
               "--temp", "0", "--ignore-eos", "-n", str(new_tokens), "-c", "1024", "-t", str(threads), "-s", "0",
               "--no-repack", "--log-colors", "off", "-p", prompt]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise click.ClickException(f"{program.name} failed ({done.returncode}): {done.stderr[-2000:]}")
    counts = {name: int(value) for name, value in STATISTICS.findall(done.stderr)}
    decoded = DECODE_SPEED.search(done.stderr)
    if len(counts) != 3 or decoded is None:
        raise click.ClickException(f"{program.name} printed no statistics: {done.stderr[-2000:]}")
    # it prints two newlines before the prompt's pieces, and two after the generated ones, then two more at the end
    printed = done.stdout.removeprefix("\n\n").removesuffix("\n\n\n\n")
    if not printed.startswith(prompt_pieces):
        raise click.ClickException(f"{program.name} did not echo the prompt first: {printed[:200]!r}")
    return LlamaSpeculation(printed[len(prompt_pieces):], counts["n_predict"], counts["n_drafted"],
                            counts["n_accept"], float(decoded.group(2)))


def plain_greedy(llm, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    """llama.cpp's greedy tokens after ``prompt``, one target forward a token, and the decode seconds."""
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    tokens, started = [], time.perf_counter()
    for _ in range(new_tokens):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(tokens[-1:])
    return tokens, time.perf_counter() - started


def batch_differences(llm, prompt: list[int], generated: list[int], batch: int) -> tuple[int, float]:
    """How llama.cpp's logits at the generated positions differ between one token a forward (``generated``'s
    greedy run, still in ``llm.scores``) and ``batch`` tokens a forward, as a verification runs them: positions
    whose argmax differs, and the largest |difference|. Where this is not zero, a verified draft can make
    llama.cpp's speculative text leave its plain greedy text at a near-tie, whatever the draft."""
    import numpy as np

    positions = slice(len(prompt) - 1, len(prompt) + len(generated) - 1)
    single = np.array(llm.scores[positions])
    sequence = prompt + generated
    llm.reset()
    for start in range(0, len(sequence), batch):
        llm.eval(sequence[start:start + batch])
    batched = np.array(llm.scores[positions])
    return int((single.argmax(-1) != batched.argmax(-1)).sum()), float(np.abs(single - batched).max())


def llama_targets(out: Path) -> dict[str, Path]:
    """The default model's llama GGUFs: the original file, and its weights in each other type of TARGETS."""
    from quantkit.eval.llamacpp import llama_quantize
    from quantkit.zoo import fetch_gguf

    original = fetch_gguf()
    files = {}
    for name, file_type in TARGETS.items():
        files[name] = original if file_type is None else out / f"target-{name.lower()}.gguf"
        if not files[name].exists():
            llama_quantize(original, files[name], file_type, requantize=True)
    return files


def head_files(fp_head: Path, w4_head: Path, outtypes: tuple[str, ...], out: Path) -> list[tuple[str, Path, Path]]:
    """(label, head folder, GGUF file) of every head llama.cpp runs: the FP head as llama.cpp's converter would
    write it for the default model in each of ``outtypes``, and the GPTQ W4 head as its own Q4_0 blocks."""
    from quantkit.gguf.eagle3_head import export_head_gguf
    from quantkit.zoo import resolve_model

    files = [*((f"FP, {outtype}", fp_head, out / f"head-{outtype}.gguf", outtype) for outtype in outtypes),
             ("GPTQ W4 g128, Q4_0 + f16", w4_head, out / "head-w4.gguf", "f16")]  # lm_head is not quantized
    for _, folder, file, outtype in files:
        if not file.exists():
            export_head_gguf(folder, resolve_model("default"), file, outtype)
    return [(label, folder, file) for label, folder, file, _ in files]


def prompts(count: int, length: int, data: str) -> list[str]:
    """``count`` held-out texts of ``length`` of the default model's tokens each, decoded back to text."""
    from quantkit.calib import heldout_tokens
    from quantkit.tokenizer import load_tokenizer
    from quantkit.zoo import resolve_model

    tokenizer = load_tokenizer(resolve_model("default"))
    tokens = heldout_tokens(tokenizer, name=data, max_tokens=count * length).view(count, length)
    return [tokenizer.decode(row.tolist()) for row in tokens]


def made_heads(out: Path, tokens: int, data: str, reuse: bool, fp_head: Path | None) -> tuple[Path, Path]:
    """The FP head (``fp_head``, or one trained for the default model) and its GPTQ W4 g128 copy, each made in a
    child process (``--reuse``: what an earlier run left, or its interrupted training continued)."""
    from quantkit.draft.trainer import CHECKPOINT_DIR
    from quantkit.training.state import progress_file

    quantkit = [sys.executable, "-m", "quantkit.cli"]
    if fp_head is None:
        fp_head = out / "head"
        make_variant(Variant("head", "FP head", [*quantkit, "draft", "train", "--target", "default", "--data", data,
                                                  "--tokens", str(tokens), "--batch-rows", "1", "--ttt-steps", "4",
                                                  "--no-progress", "--out", str(fp_head)],
                             progress_file(CHECKPOINT_DIR)), out, reuse)
    make_variant(Variant("head-w4", "GPTQ W4 head", [*quantkit, "draft", "quantize", "--head", str(fp_head),
                                                      "--target", "default", "--no-progress", "--out",
                                                      str(out / "head-w4")]), out, reuse)
    return fp_head, out / "head-w4"


@click.command()
@click.option("--head", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="An EAGLE-3 head of the default model [default: train one].")
@click.option("--train-tokens", default=65536, show_default=True, type=click.IntRange(min=1),
              help="The trained head's tokens (without --head).")
@click.option("--train-data", default="novels", show_default=True, help="The trained head's text (without --head).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Where the GGUF files and results go.")
@click.option("--reuse", is_flag=True, help="Take the head an earlier run trained, or continue its training.")
@click.option("--outtypes", default="f32,f16,q8_0", show_default=True, help="The head's GGUF matrix types.")
@click.option("--k", default=3, show_default=True, type=click.IntRange(min=1), help="Draft tokens per round.")
@click.option("--data", default="austen", show_default=True, help="Held-out text the prompts are cut from.")
@click.option("--prompts", "count", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-tokens", default=64, show_default=True, type=click.IntRange(min=2))
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(min=2))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
def main(head, train_tokens, train_data, out, reuse, outtypes, k, data, count, prompt_tokens, new_tokens, threads):
    import llama_cpp
    import torch

    from quantkit.eval.accept import acceptance
    from quantkit.eval.llamacpp import disable_weight_repacking
    from quantkit.kernels.generate import load_text_generator
    from quantkit.kernels.speculative import Acceptance
    from quantkit.zoo import resolve_model

    out.mkdir(parents=True, exist_ok=True)
    program = speculative_program(threads)
    heads = head_files(*made_heads(out, train_tokens, train_data, reuse, head), tuple(outtypes.split(",")), out)
    texts = prompts(count, prompt_tokens, data)
    generator = load_text_generator(resolve_model("default"), dtype=torch.float32)
    disable_weight_repacking()
    ours: dict[Path, Acceptance] = {}  # by head folder: quantkit's target is the default model for every GGUF
    rows, table = [], []
    for target_name, target in llama_targets(out).items():
        llm = llama_cpp.Llama(str(target), n_ctx=1024, n_threads=threads, logits_all=True, verbose=False)
        ids = [llm.tokenize(text.encode(), add_bos=True, special=True) for text in texts]
        plain, differences = [], []
        for prompt in ids:
            plain.append(plain_greedy(llm, prompt, new_tokens + 1))
            differences.append(batch_differences(llm, prompt, plain[-1][0], k + 1))
        plain_speed = statistics.median(len(tokens) / seconds for tokens, seconds in plain)
        flips, largest = sum(flip for flip, _ in differences), max(delta for _, delta in differences)
        for label, folder, head_file in heads:
            if folder not in ours:  # the same token ids in quantkit's runtime, float32, on the default model
                ours[folder] = Acceptance(k)
                for prompt in ids:
                    ours[folder].merge(acceptance(generator, folder, torch.tensor([prompt]), k, new_tokens))
            runs = [run_speculative(program, target, head_file, text, llm.detokenize(prompt, special=True).decode(
                errors="replace"), new_tokens, k, threads) for text, prompt in zip(texts, ids)]
            equal = sum(run.text == llm.detokenize(tokens[:run.n_predict]).decode(errors="replace")
                        for run, (tokens, _) in zip(runs, plain))
            committed, rounds = sum(run.n_predict for run in runs), sum(run.rounds for run in runs)
            spec_speed = committed / sum(run.decode_seconds for run in runs)
            row = {"target": target_name, "head": label, "prompts": len(runs), "greedy_equal": equal,
                   "batch_argmax_flips": flips, "batch_max_logit_difference": largest,
                   "llamacpp_tau": committed / rounds,
                   "llamacpp_accept_rate": sum(run.n_accept for run in runs) / sum(run.n_drafted for run in runs),
                   "quantkit_tau": ours[folder].tau, "quantkit_rates": ours[folder].position_rates,
                   "llamacpp_tok_s": spec_speed, "plain_tok_s": plain_speed}
            rows.append(row)
            table.append([target_name, label, f"{equal}/{len(runs)}", f"{flips}/{len(runs) * (new_tokens + 1)}",
                          largest, row["llamacpp_tau"], ours[folder].tau,
                          row["llamacpp_tau"] / ours[folder].tau, row["llamacpp_accept_rate"], spec_speed,
                          plain_speed, spec_speed / plain_speed])
        llm.close()
    header = ["target", "head", "greedy =", f"flips {k + 1} vs 1", "max dlogit", "tau llama.cpp", "tau quantkit",
              "ratio", "accept rate", "tok/s spec", "tok/s plain", "speed-up"]
    setup = (f"{machine()}; FP head {heads[0][1]}; chains of {k}, greedy; {count} prompts x {prompt_tokens} "
             f"tokens of {data}, {new_tokens} new tokens; llama.cpp {llama_cpp.__version__} ({program.name}); "
             "plain decode: the same llama.cpp through llama-cpp-python, one token a forward")
    report(setup, format_table(header, table), rows, json_path=out / "results.json",
           markdown_path=out / "results.md")


if __name__ == "__main__":
    main()
