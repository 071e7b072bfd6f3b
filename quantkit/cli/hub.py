"""`quantkit publish`: an artifact or GGUF file to the Hugging Face Hub, checked, with its model card."""
from __future__ import annotations

from pathlib import Path

import click

from quantkit.cli import emit, friendly_errors, json_option
from quantkit.table import format_table


@click.command()
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
@friendly_errors
def publish(target, repo_id, revision, private, base_model, report, dry_run, card_only, as_json):
    """Publish an artifact directory or a GGUF file to the Hugging Face Hub: check it, write its model card,
    send what the repository lacks in one commit. The token comes from HF_TOKEN or `hf auth login`."""
    from quantkit.hub.publish import check, render_card
    from quantkit.hub.publish import publish as run
    from quantkit.hub.repo import parse_repo_ref

    ref = parse_repo_ref(repo_id, revision)
    if card_only:
        card = render_card(check(target, ref), ref, base_model, report)
        emit(as_json, {"repo_id": ref.repo_id, "card": card}, card)
        return
    result = run(target, ref, base_model=base_model, report=report, private=private, dry_run=dry_run)
    rows = [[f.path_in_repo, f.size, f.sha256[:16], f.action] for f in result.files]
    head = (f"{'plan for' if dry_run else 'published to'} {result.repo_id} (revision {result.revision}"
            f"{', private' if private else ''})")
    tail = (f"\ncommit {result.commit}: {result.commit_url}" if result.commit
            else "" if dry_run else "\nnothing to send: the repository already holds every file")
    notes = "".join(f"\nnote: {note}" for note in result.notes)
    table = format_table(["file", "bytes", "sha256", "action"], rows)
    emit(as_json, result.to_dict(), f"{head}\n{table}{tail}{notes}")
