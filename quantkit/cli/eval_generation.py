"""`quantkit eval niah|tasks|accept`: the evaluations that let the model generate: needle-in-a-haystack
retrieval, task scores, speculative acceptance length."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import click

from quantkit.cli import (
    device_option,
    emit,
    friendly_errors,
    json_option,
    progress_option,
    revision_option,
    seed_option,
)
from quantkit.cli.eval import eval_runtime_options, evaluated_model, heldout_tokens
from quantkit.table import format_table


@click.command("niah")
@click.option("--model", default="default", show_default=True, help="Checkpoint or quantized artifact.")
@revision_option("--model")
@click.option("--data", default="austen", show_default=True, help="Held-out text the haystack is cut from.")
@click.option("--lengths", default="1024,2048,4096,8192", show_default=True, help="Comma-separated context lengths.")
@click.option("--depths", default="0,0.25,0.5,0.75,1", show_default=True,
              help="Comma-separated needle depths (0 = start of the context, 1 = just before the question).")
@click.option("--trials", default=1, show_default=True, type=click.IntRange(min=1), help="Needles per cell.")
@seed_option("the needles' numbers")
@click.option("--plot", "plot_path", default=None, type=click.Path(path_type=Path), help="Write a heatmap PNG here.")
@device_option
@eval_runtime_options
@friendly_errors
@json_option
def eval_niah(model, revision, data, lengths, depths, trials, seed, plot_path, device, as_json, runtime, sparse,
              sparse_config):
    """Needle in a haystack: retrieval accuracy over context length x needle depth."""
    from quantkit import calib
    from quantkit.device import resolve_device
    from quantkit.eval import niah
    from quantkit.tokenizer import load_tokenizer
    from quantkit.zoo import resolve_model

    device = resolve_device(device)
    model_dir = resolve_model(model, revision=revision)
    text = "\n\n".join(calib.load_documents(data))
    evaluated = evaluated_model(model_dir, runtime, sparse, sparse_config, device)
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
    emit(as_json, payload, table)
@click.command("tasks")
@click.option("--model", default="default", show_default=True, help="Checkpoint or quantized artifact.")
@revision_option("--model")
@click.option("--tasks", "task_names", default="humaneval,gsm,family", show_default=True,
              help="Comma-separated task names: humaneval, gsm, family.")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Samples per task (default: each task's own subset; the summary shows how many).")
@click.option("--record", type=click.Path(path_type=Path), default=None,
              help="Also write every sample (id, model output, outcome) to this JSON file.")
@device_option
@progress_option
@json_option
@friendly_errors
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
    emit(as_json, {"model": str(model_dir), "device": device, "tasks": summaries},
          format_table(["task", "metric", "score", "samples", "seconds", "notes"], rows))


@click.command("accept")
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
@seed_option("the sampler (temperature > 0)")
@device_option
@friendly_errors
@json_option
def eval_accept(targets, drafts, k, tree, temperature, data, prompts, prompt_tokens, max_new_tokens, seed, device,
                as_json):
    """Speculative decoding acceptance length tau for every target x draft pair, on the same prompts."""
    import torch

    from quantkit.device import resolve_device
    from quantkit.eval.accept import acceptance, prompt_rows
    from quantkit.kernels.generate import load_text_generator
    from quantkit.kernels.speculative import TreeShape
    from quantkit.zoo import resolve_model

    device = resolve_device(device)

    shapes = [(f"chain of {k}", None)] + ([(f"tree {tree}", TreeShape.parse(tree))] if tree else [])
    target_dirs, draft_dirs = [resolve_model(t) for t in targets], [resolve_model(d) for d in drafts]
    batch = prompt_rows(heldout_tokens(target_dirs[0], data, prompts * prompt_tokens), prompts, prompt_tokens)
    pairs, rows = [], []
    for target_dir in target_dirs:
        generator = load_text_generator(target_dir, dtype=torch.float32, device=device)
        for draft_dir in draft_dirs:
            for shape, tree_shape in shapes:
                total = acceptance(generator, draft_dir, batch, k, max_new_tokens, temperature, seed,
                                   progress=not as_json, description=f"{target_dir.name} <- {draft_dir.name}",
                                   tree=tree_shape)
                pairs.append({"target": str(target_dir), "draft": str(draft_dir), "k": k, "shape": shape,
                              "temperature": temperature, "tau": total.tau, "position_rates": total.position_rates,
                              "rounds": total.rounds, "committed": total.committed})
                rows.append([target_dir.name, draft_dir.name, shape, total.tau, *total.position_rates])
    depth = max(len(pair["position_rates"]) for pair in pairs)
    rows = [row + [""] * (4 + depth - len(row)) for row in rows]
    table = format_table(["target", "draft", "shape", "tau", *[f"accept@{i + 1}" for i in range(depth)]], rows)
    emit(as_json, {"data": data, "prompts": prompts, "prompt_tokens": prompt_tokens,
                    "max_new_tokens": max_new_tokens, "seed": seed, "device": device, "pairs": pairs}, table)
