"""`quantkit plan` and the size budget of `quantkit quantize`: bits per tensor chosen for a size."""
from __future__ import annotations

from pathlib import Path

import click

from quantkit.cli import emit, friendly_errors, json_option, progress_option, revision_option
from quantkit.table import format_table

target_size_option = click.option(
    "--target-size", metavar="SIZE", help="Largest file to write, e.g. 4.5GB or 800MiB: the grid of every weight "
                                           "matrix is chosen to minimise the estimated loss within it (gguf-* and "
                                           "mlx-* recipes).")
target_bpw_option = click.option(
    "--target-bpw", type=float, metavar="BITS",
    help="Instead of --target-size: bits per weight over the weight matrices (decoder linears, embedding, "
         "output: the tensors a plan allocates).")


def make_plan(model_dir, recipe, budget, *, progress: bool):
    """The plan of ``recipe`` on ``model_dir`` under ``budget`` (quantkit.budget), with the recipe settings that
    hand it to the solver."""
    from quantkit.budget.formats import budget_format
    from quantkit.budget.plan import measure_options, plan
    from quantkit.gguf.export import file_bytes

    fmt = budget_format(recipe, file_bytes)
    options = measure_options(model_dir, recipe, fmt, progress=progress)
    planned = plan(options, fmt.layout(model_dir, fmt.tensors(_config(model_dir))), budget, recipe=recipe.name,
                   fmt=fmt)
    return planned, fmt.settings(planned.tensor_types)


def _config(model_dir):
    from quantkit.models import MiniCPMConfig

    return MiniCPMConfig.from_pretrained(model_dir)


plot_option = click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), metavar="PNG",
                           help="Also draw the bits per weight each layer's linears get into this PNG file.")


def plan_text(planned) -> str:
    headers, rows = planned.layer_rows()
    return (format_table(headers, rows) + "\n\n" + format_table(["tensor", "type", "mix"], planned.other_rows())
            + "\n\n" + format_table(["", "file MB", "matrices' bits/weight", "predicted KL"], planned.summary()))


def plot_allocation(family: str, tensor_types: dict[str, str], path: Path, title: str) -> None:
    """Bits per weight of every decoder linear's grid, one line per linear across the layers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from quantkit.budget.formats import FAMILIES

    budget_family = FAMILIES[family]
    headers, rows = budget_family.layer_table({name: budget_family.bits(t) for name, t in tensor_types.items()})
    figure, axes = plt.subplots(figsize=(8, 4))
    for column, stem in enumerate(headers[1:], start=1):
        axes.plot([row[0] for row in rows], [row[column] for row in rows], marker="o", markersize=3, linewidth=1,
                  label=stem)
    axes.set(xlabel="layer", ylabel="bits per weight", title=title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, ncol=4)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


@click.command("plan")
@click.option("--recipe", required=True, help="A gguf-* or mlx-* recipe (see `quantkit recipes`) or a YAML file.")
@click.option("--model", default="default", show_default=True,
              help="Checkpoint directory, 'default', or a Hub repo id.")
@revision_option("--model")
@target_size_option
@target_bpw_option
@plot_option
@progress_option
@json_option
@friendly_errors
def plan_command(recipe, model, revision, target_size, target_bpw, plot, progress, as_json):
    """Print the grid a size budget gives each weight matrix, the predicted size and loss, without quantizing."""
    from quantkit.budget.target import BudgetError, budget_from_options
    from quantkit.recipe import load_recipe
    from quantkit.zoo import resolve_model

    budget = budget_from_options(target_size, target_bpw)
    if budget is None:
        raise BudgetError("give --target-size or --target-bpw")
    planned, _ = make_plan(resolve_model(model, revision=revision), load_recipe(recipe), budget, progress=progress)
    if plot is not None:
        plot_allocation(planned.family, planned.tensor_types, plot,
                        f"{planned.recipe} plan: {planned.budget.describe()}")
    emit(as_json, planned.to_dict(), plan_text(planned))
