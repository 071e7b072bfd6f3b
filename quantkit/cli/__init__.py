"""The `quantkit` command line: a thin layer over library functions that the tests call too.

This module is the ``quantkit`` group and what every command shares (its common options, the JSON or
table output, the one-line report of quantkit's errors). Each command group lives in a module of its
own, imported only when one of its commands runs or the group's help lists them (``COMMANDS``), so a
command imports only what it runs: ``quantkit generate`` loads the runtime, never the quantizer or the
trainers (tests/test_cli.py)."""
from __future__ import annotations

import functools
import importlib
import json
import os
from pathlib import Path

import click

from quantkit.errors import QuantkitError

DEBUG_ENV = "QUANTKIT_DEBUG"  # set to 1: every error shows its traceback

# PyTorch's CPU allocator backs tensors of 2 MB and more with transparent huge pages when this is set. A
# layer's calibration batches allocate temporaries of hundreds of MB that glibc maps afresh each time; in 4
# KB pages their first touch costs one page fault per 4 KB (docs/results/quantize-8b.md, "One layer with the
# full calibration set"). Read once, at the allocator's first use: set before a command imports torch
# (``main``). Not for the runtime's commands, which allocate their weights once: there the kernel's
# compaction on first touch of huge pages cost the first answer 0.6 s (docs/results/runtime.md).
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
WITHOUT_HUGE_PAGES = frozenset({"generate", "chat"})

# command name -> "module:attribute" of the command (or group) it runs
COMMANDS = {
    "quantize": "quantkit.cli.quantize:quantize",
    "plan": "quantkit.cli.plan:plan_command",
    "qat": "quantkit.cli.qat:qat_group",
    "draft": "quantkit.cli.draft:draft_group",
    "eval": "quantkit.cli.eval:eval_group",
    "generate": "quantkit.cli.runtime:generate",
    "chat": "quantkit.cli.runtime:chat",
    "roofline": "quantkit.cli.runtime:roofline",
    "export": "quantkit.cli.export:export_group",
    "imatrix": "quantkit.cli.export:imatrix",
    "publish": "quantkit.cli.hub:publish",
    "inspect": "quantkit.cli.info:inspect",
    "recipes": "quantkit.cli.info:recipes",
    "default-model": "quantkit.cli.info:default_model",
}


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


def friendly_errors(fn):
    """quantkit's own errors become one clear line and exit code 1: every ``QuantkitError``, and a
    ValueError, RuntimeError or missing / existing file that quantkit's code raised. Any other error
    (torch's included) keeps its traceback, and with QUANTKIT_DEBUG=1 every error does."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (QuantkitError, FileExistsError, FileNotFoundError, ValueError, RuntimeError) as e:
            debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
            if debug or not (isinstance(e, QuantkitError) or _raised_by_quantkit(e)):
                raise
            raise click.ClickException(str(e)) from e
    return wrapper


def emit(as_json: bool, payload: dict, text: str) -> None:
    click.echo(json.dumps(payload, indent=2, sort_keys=True) if as_json else text)


def ranks_text(report, sharded: bool = False) -> str:
    """What a training report adds when a torchrun job of several ranks made it: their number, backend (and
    whether the training state was ``sharded``), each rank's tokens/s and share of its loop in collectives
    (nothing for one process)."""
    if report.world_size == 1:
        return ""
    return (f"\n{report.world_size} ranks ({report.backend}{', sharded' if sharded else ''}), tok/s per rank: "
            + ", ".join(f"{rate:.0f}" for rate in report.rank_tokens_per_second)
            + "; in collectives: " + ", ".join(f"{share:.0%}" for share in report.rank_collective_share))


def stack(*options):
    """One decorator applying ``options`` (click options or other decorators) in the order listed, the
    first outermost, as the same decorators written one per line above a function would."""
    def decorate(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn
    return decorate


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
shard_option = click.option(
    "--shard", "shard_state", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
    help="Under torchrun: split the weights, gradients and optimizer state over the ranks (FSDP2) instead of "
         "a whole copy on each; auto does when the unsharded state would take over half a device's free memory.")
progress_option = click.option("--progress/--no-progress", default=True, show_default=True)
out_dir_option = click.option("--out", required=True, type=click.Path(path_type=Path),
                              help="Output directory (must not exist).")


def seed_option(what: str, default: int = 0):
    """``--seed``, as wide as any seed quantkit takes (recipes' too)."""
    from quantkit.recipes.fields import MAX_SEED

    return click.option("--seed", default=default, show_default=True, type=click.IntRange(0, MAX_SEED),
                        help=f"Seed of {what}.")


def revision_option(of: str):
    """``--revision`` for a command's main model option (other model options take owner/name@revision)."""
    return click.option("--revision", default=None, metavar="REV",
                        help=f"Branch, tag or commit of {of} when it is a Hub repo id (other model options take "
                             "owner/name@revision).")


class LazyGroup(click.Group):
    """A group whose commands are named in a table of ``"module:attribute"`` and imported when one runs or
    the group's help lists them (click's documented pattern for lazily loaded subcommands)."""

    def __init__(self, *args, lazy_commands: dict[str, str], **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self.lazy_commands)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.lazy_commands:
            return None  # click reports "No such command"
        module, _, attribute = self.lazy_commands[name].partition(":")
        return getattr(importlib.import_module(module), attribute)


@click.group(cls=LazyGroup, lazy_commands=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=f"Errors quantkit itself detects print as one line; an error raised inside a library it calls "
                    f"(torch, transformers, ...) keeps its traceback. Set {DEBUG_ENV}=1 to see the traceback of "
                    "every error.")
@click.version_option(package_name="quantkit")
@click.pass_context
def main(ctx: click.Context):
    """quantkit: quantize MiniCPM4.1 (and its EAGLE3 head) and measure what it cost."""
    if ctx.invoked_subcommand not in WITHOUT_HUGE_PAGES:
        os.environ.setdefault(HUGE_PAGES_ENV, "1")
