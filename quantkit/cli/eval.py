"""`quantkit eval ...`: accuracy of a model or artifact. Here the group, what its commands share, and the
commands that score held-out text (perplexity, KL divergence, reports over many variants) or the stored codes
(conformance); those that let the model generate are in ``quantkit.cli.eval_generation``."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import click

from quantkit.cli import (
    LazyGroup,
    device_option,
    emit,
    friendly_errors,
    json_option,
    revision_option,
    sparse_config_option,
    sparse_option,
    stack,
)
from quantkit.cli.runtime import runtime_from_options
from quantkit.table import format_table

# command name -> "module:attribute", as the `quantkit` group's table
EVAL_COMMANDS = {
    "ppl": "quantkit.cli.eval:eval_ppl",
    "kld": "quantkit.cli.eval:eval_kld",
    "report": "quantkit.cli.eval:eval_report",
    "conformance": "quantkit.cli.eval:eval_conformance",
    "niah": "quantkit.cli.eval_generation:eval_niah",
    "tasks": "quantkit.cli.eval_generation:eval_tasks",
    "accept": "quantkit.cli.eval_generation:eval_accept",
}


@click.group("eval", cls=LazyGroup, lazy_commands=EVAL_COMMANDS)
def eval_group():
    """Measure accuracy: perplexity, KL divergence against a reference model, reports over many variants,
    task scores, needle-in-a-haystack retrieval, speculative acceptance length."""


data_option = click.option("--data", default="austen", show_default=True,
                           help="Held-out text by name: austen, zh-heldout (validation: the defaults were "
                                "chosen on them); test-fiction, test-manual, test-code, test-zh (test: "
                                "never used to choose anything); or a local text file.")
tokens_option = click.option("--max-tokens", default=16384, show_default=True, type=int,
                             help="Evaluate on at most this many tokens.")
window_option = click.option("--window", default=2048, show_default=True, type=int, help="Context window.")
stride_option = click.option("--stride", default=None, type=int, help="Window stride (default: the window).")


# `--runtime` evaluates quantkit's runtime (kernels/: quantized linears, InfLLM v2) instead of the
# reference model that dequantizes every weight.
eval_runtime_options = stack(
    click.option("--runtime", is_flag=True, help="Run through quantkit's runtime instead of the reference model."),
    sparse_option,
    sparse_config_option,
)
# The options every `quantkit eval` command over held-out text shares.
eval_options = stack(data_option, tokens_option, window_option, stride_option, device_option, json_option,
                     friendly_errors)


def evaluated_model(model_dir: Path, runtime: bool, sparse: str, sparse_config: str | None, device: str):
    """The model an eval command scores, on ``device`` (already resolved)."""
    from quantkit.kernels.generate import DEFAULT_PREFILL_CHUNK, TextGeneratorLM
    from quantkit.loading import load_model

    if not runtime:
        if sparse != "auto" or sparse_config:
            raise click.ClickException("--sparse and --sparse-config need --runtime")
        return load_model(model_dir).to(device)
    return TextGeneratorLM(runtime_from_options(str(model_dir), None, sparse, sparse_config, device,
                                                DEFAULT_PREFILL_CHUNK))


def heldout_tokens(model_dir: Path, data: str, max_tokens: int):
    """At most ``max_tokens`` of the held-out text ``data``, in the tokens of the model at ``model_dir``."""
    from quantkit import calib
    from quantkit.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return calib.heldout_tokens(tokenizer, name=data, max_tokens=max_tokens)


@click.command("ppl")
@click.option("--model", default="default", show_default=True, help="Checkpoint or quantized artifact.")
@revision_option("--model")
@eval_runtime_options
@eval_options
def eval_ppl(model, revision, data, max_tokens, window, stride, device, as_json, runtime, sparse, sparse_config):
    """Perplexity on held-out text."""
    from quantkit.device import resolve_device
    from quantkit.eval.ppl import perplexity
    from quantkit.zoo import resolve_model

    device = resolve_device(device)
    model_dir = resolve_model(model, revision=revision)
    evaluated = evaluated_model(model_dir, runtime, sparse, sparse_config, device)
    tokens = heldout_tokens(model_dir, data, max_tokens).to(device)
    result = perplexity(evaluated, tokens, window, stride, progress=not as_json)
    payload = {"model": str(model_dir), "data": data, "runtime": runtime, "sparse": sparse,
               "sparse_config": sparse_config, "device": device, **asdict(result)}
    emit(as_json, payload, format_table(["model", "data", "tokens", "perplexity"],
                                         [[model_dir.name, data, result.tokens, result.perplexity]]))


@click.command("kld")
@click.option("--model", required=True, help="The model under test (e.g. a quantized artifact).")
@revision_option("--model")
@click.option("--ref", default="default", show_default=True, help="The reference (unquantized) model.")
@click.option("--reference-prefix", type=click.IntRange(min=0), default=0, show_default=True,
              help="Each window's first N positions run through the reference, and the model continues "
                   "from their K/V (a full-precision stored prefix); only later positions are scored.")
@eval_options
def eval_kld(model, revision, ref, data, max_tokens, window, stride, device, as_json, reference_prefix):
    """KL divergence and top-1 agreement against a reference model."""
    from quantkit.device import resolve_device
    from quantkit.eval.kld import kl_divergence
    from quantkit.loading import load_model
    from quantkit.zoo import resolve_model

    device = resolve_device(device)
    model_dir, ref_dir = resolve_model(model, revision=revision), resolve_model(ref)
    result = kl_divergence(load_model(model_dir).to(device), load_model(ref_dir).to(device),
                           heldout_tokens(ref_dir, data, max_tokens).to(device), window, stride, progress=not as_json,
                           reference_prefix=reference_prefix)
    payload = {"model": str(model_dir), "reference": str(ref_dir), "data": data, "device": device, **asdict(result)}
    rows = [[model_dir.name, result.tokens, result.perplexity, result.reference_perplexity, result.mean_kl,
             result.top1_agreement]]
    emit(as_json, payload, format_table(["model", "tokens", "ppl", "ref ppl", "mean KL", "top-1 agree"], rows))


@click.command("report")
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
@eval_options
def eval_report(ref, variants, out, top_k, cache_dir, task_names, task_limit, draft, accept_k, data, max_tokens,
                window, stride, device, as_json):
    """Score every variant against the reference in one run: report.json, report.md and PNG plots.
    --device places the reference, perplexity, KL, tau and task (--tasks) runs. Under torchrun the variants
    are spread over the ranks, rank 0 writing the report (docs/distributed.md)."""
    from quantkit.atomic import refuse_existing
    from quantkit.device import resolve_device
    from quantkit.distributed import joined
    from quantkit.eval import report
    from quantkit.eval.refcache import DEFAULT_DIR
    from quantkit.eval.tasks.registry import parse_task_names
    from quantkit.zoo import resolve_model

    device = resolve_device(device)
    with joined(device) as world:  # under torchrun, the variants are spread over the ranks; rank 0 writes
        world.made_on_main(lambda: refuse_existing(out))
        ref_dir = resolve_model(ref)
        variant_dirs = [resolve_model(v.strip()) for v in variants.split(",") if v.strip()]
        extras = report.Extras(tuple(parse_task_names(task_names)) if task_names else (), task_limit,
                               resolve_model(draft) if draft else None, accept_k)
        tokens = heldout_tokens(ref_dir, data, max_tokens)
        results, cache = report.evaluate(ref_dir, variant_dirs, tokens, window, stride, top_k,
                                         cache_dir or DEFAULT_DIR, progress=not as_json and world.is_main,
                                         extras=extras, device=device, world=world)
        if not world.is_main:
            return
    setup = {**report.setup_record(ref_dir, data, tokens, window, stride, top_k, extras),
             "device": device, "reference_cache": str(cache), **world.described}
    report.write(out, results, setup)
    emit(as_json, {"setup": setup, "variants": [asdict(r) for r in results], "out": str(out)},
          report.markdown(results, setup))


@click.command("conformance")
@click.option("--model", required=True, help="A quantized artifact (quantkit's, or a GPTQ/AWQ checkpoint).")
@revision_option("--model")
@json_option
@friendly_errors
def eval_conformance(model, revision, as_json):
    """Decode every quantized linear the way each consumer does (AutoGPTQ, vLLM, GPTQModel, AutoAWQ,
    Marlin, CPM.cu) and compare with quantkit's reading, bit for bit. Exits 1 on any difference."""
    from quantkit.eval.conformance import check_conformance
    from quantkit.zoo import resolve_model

    report = check_conformance(resolve_model(model, revision=revision))
    rows = [[c.consumer, c.linears, "yes" if c.identical else f"no ({len(c.mismatched)} differ)", c.max_abs_diff]
            for c in report.checks]
    text = format_table(["consumer", "linears", "identical", "max |diff|"], rows)
    if report.quantkit_error:
        text += f"\nquantkit refuses this artifact: {report.quantkit_error}"
    emit(as_json, report.as_dict(), f"{report.artifact} ({report.format})\n{text}")
    if not report.passed:
        raise SystemExit(1)
