"""`quantkit quantize`: post-training quantization, layer by layer, into a recipe's format."""
from __future__ import annotations

import click

from quantkit.cli import (
    device_option,
    emit,
    friendly_errors,
    json_option,
    out_dir_option,
    progress_option,
    revision_option,
)
from quantkit.cli.plan import make_plan, plan_text, target_bpw_option, target_size_option
from quantkit.table import format_table


@click.command()
@click.option("--recipe", required=True, help="Built-in recipe name (see `quantkit recipes`) or a YAML file.")
@click.option("--model", default="default", show_default=True,
              help="Checkpoint directory, 'default', or a Hub repo id owner/name[@revision] (every --model, --ref, "
                   "--target and --draft takes one; docs/hub.md).")
@revision_option("--model")
@out_dir_option
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a recipe setting, e.g. --set quant.bits=3 --set calibration.n_samples=32.")
@target_size_option
@target_bpw_option
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its last finished layer.")
@device_option
@click.option("--activations", type=click.Choice(["auto", "memory", "disk"]), default="auto", show_default=True,
              help="Where the calibration activations live: auto keeps them in memory when the run fits and "
                   "otherwise spills them to files beside --out (same bytes out, slower).")
@progress_option
@json_option
@friendly_errors
def quantize(recipe, model, revision, out, overrides, target_size, target_bpw, resume, device, activations, progress,
             as_json):
    """Quantize a model layer by layer and write the recipe's checkpoint format."""
    from quantkit.budget.target import budget_from_options
    from quantkit.engine import quantize as run
    from quantkit.recipe import load_recipe, parse_override
    from quantkit.zoo import resolve_model

    settings = dict(parse_override(text) for text in overrides)
    model_dir, loaded, planned = resolve_model(model, revision=revision), load_recipe(recipe, settings), None
    budget = budget_from_options(target_size, target_bpw)
    if budget is not None:  # the plan's grids become the recipe's per-tensor overrides, which the solver rounds to
        planned, chosen = make_plan(model_dir, loaded, budget, progress=progress)
        loaded = load_recipe(recipe, settings | chosen)
    report = run(model_dir, loaded, out, resume=resume, device=device, activations=activations, progress=progress,
                 notes={"budget": planned.to_dict()} if planned else None)
    rows = []
    for layer in report.layers:
        worst = max(layer.errors, key=layer.errors.get)
        rows.append([layer.index, layer.seconds, layer.errors[worst], worst])
    text = format_table(["layer", "seconds", "max rel. error", "worst linear"], rows)
    text += (f"\n\nwrote {out} in {report.seconds:.1f} s on {report.device}, peak RSS {report.peak_rss_mb:.0f} MB"
             + (", activations spilled to disk" if report.activations == "disk" else "")
             + (f" (resumed at layer {report.resumed_from_layer})" if report.resumed_from_layer else ""))
    if planned is not None:
        text = plan_text(planned) + "\n\n" + text
    emit(as_json, report.to_dict() | ({"budget": planned.to_dict()} if planned else {}), text)
