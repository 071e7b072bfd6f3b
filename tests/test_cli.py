"""The command line on a tiny checkpoint: help everywhere, tables and JSON, clear failures."""
import json

import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.synthetic import write_tiny_checkpoint

RECIPE = """\
name: tiny-rtn
description: RTN on a tiny checkpoint
algorithm: rtn
quant: {bits: 8, group_size: 64, sym: false}
calibration: {n_samples: 2, seq_len: 32}
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", num_hidden_layers=2)


@pytest.mark.parametrize("command", [[], ["quantize"], ["eval"], ["eval", "ppl"], ["eval", "kld"], ["eval", "tasks"],
                                     ["inspect"], ["recipes"], ["default-model"], ["export"], ["export", "gguf"],
                                     ["qat"], ["qat", "ternary"]])
def test_help_everywhere(command):
    result = CliRunner().invoke(main, command + ["--help"])
    assert result.exit_code == 0 and "Usage:" in result.output


@pytest.mark.parametrize("command", [["quantize"], ["qat", "ternary"], ["qat", "dwq"], ["generate"], ["chat"],
                                     ["draft", "train"], ["eval", "ppl"], ["eval", "kld"], ["eval", "niah"],
                                     ["eval", "accept"], ["eval", "tasks"], ["eval", "report"]])
def test_every_command_that_runs_a_model_takes_device(command):
    result = CliRunner().invoke(main, command + ["--help"])
    assert result.exit_code == 0 and "--device [auto|cpu|cuda]" in result.output


def test_recipes_lists_builtin_with_purpose():
    result = CliRunner().invoke(main, ["recipes", "--json"])
    listing = json.loads(result.output)
    assert "RTN" in listing["rtn-w4g128"]


def test_every_builtin_recipe_loads_says_what_it_is_for_and_matches_its_name():
    from quantkit.recipe import builtin_dir, builtin_names, load_recipe

    for name in builtin_names():
        text = (builtin_dir() / f"{name}.yaml").read_text()
        assert text.startswith("# "), f"{name}: no comment at the top saying what it is for"
        recipe = load_recipe(name)
        # rtn, awq, gptq, p-gptq, s-gptq, s-p-gptq (marlin, cpmcu: S-GPTQ; int8-w8a8: SmoothQuant + GPTQ);
        # mlx-<family>[-mixed-*] on MLX's grid
        family = name.split("-w")[0].split("-mixed")[0].removeprefix("mlx-")
        family = {"marlin": "s-gptq", "cpmcu": "s-gptq", "gguf-q4_0": "gptq",
                  "rtn-ternary-g32": "rtn", "qat-ternary-g32": "rtn", "qat-ternary-g256": "rtn",
                  "dwq": "rtn", "int8": "s-gptq", "fp8": "gptq"}.get(family, family)
        assert recipe["algorithm"] == (family if family in ("rtn", "awq") else "gptq"), name
        assert recipe["smooth"]["enabled"] == (family.startswith("s-") or family == "awq"), name
        assert (recipe["prefix_tokens"] == 4) == ("p-gptq" in family), name


def test_quantize_inspect_eval_round_trip(tiny, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    text = tmp_path / "heldout.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "q"
    runner = CliRunner()
    result = runner.invoke(main, ["quantize", "--recipe", str(recipe), "--model", str(tiny), "--out", str(out),
                                  "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "max rel. error" in result.output and f"wrote {out}" in result.output

    info = json.loads(runner.invoke(main, ["inspect", str(out), "--json"]).output)
    assert info["quantization"] == "gptq 8-bit g64 asym" and info["recipe"] == "tiny-rtn"

    result = runner.invoke(main, ["eval", "kld", "--model", str(out), "--ref", str(tiny), "--data", str(text),
                                  "--window", "64", "--json"])
    assert result.exit_code == 0, result.output
    kl = json.loads(result.output)
    assert 0 < kl["mean_kl"] < 1e-2 and kl["top1_agreement"] > 0.9  # 8-bit loses almost nothing

    again = runner.invoke(main, ["quantize", "--recipe", str(recipe), "--model", str(tiny), "--out", str(out)])
    assert again.exit_code == 1 and "already exists" in again.output


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another model of ``tiny``'s vocabulary (KL to it above 0), deep enough for an EAGLE-3 head."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "other", num_hidden_layers=4, seed=1)


def _eval_command(name: str, tiny, other, tmp_path) -> list[str]:
    """The arguments of a small run of each `quantkit eval` command that runs a model, printing JSON."""
    from quantkit.synthetic import write_tiny_eagle3_head

    held_out = ["--max-tokens", "300", "--window", "64"]
    if name == "accept":
        head = tmp_path / "head"
        if not head.exists():
            write_tiny_eagle3_head(head, other, draft_vocab_size=100)
        return ["eval", "accept", "--target", str(other), "--draft", str(head), "--k", "2", "--prompts", "2",
                "--prompt-tokens", "16", "--max-new-tokens", "8", "--json"]
    return {
        "ppl": ["eval", "ppl", "--model", str(other), *held_out, "--json"],
        "ppl --runtime": ["eval", "ppl", "--model", str(other), *held_out, "--runtime", "--json"],
        "kld": ["eval", "kld", "--model", str(other), "--ref", str(tiny), *held_out, "--json"],
        "niah": ["eval", "niah", "--model", str(tiny), "--lengths", "96", "--depths", "0,1", "--json"],
        "tasks": ["eval", "tasks", "--model", str(other), "--tasks", "family", "--limit", "1", "--no-progress",
                  "--json"],
        "report": ["eval", "report", "--ref", str(tiny), "--variants", str(other), *held_out, "--draft", str(tiny),
                   "--accept-k", "2", "--tasks", "family", "--task-limit", "1", "--json"],
    }[name]


EVAL_COMMANDS = ["ppl", "ppl --runtime", "kld", "niah", "accept", "tasks", "report"]


def _timeless(payload: dict) -> dict:
    """`eval tasks`' JSON without the seconds each task took: the numbers, not the clock."""
    return {**payload, "tasks": [{k: v for k, v in task.items() if k != "seconds"} for task in payload["tasks"]]}


@pytest.mark.parametrize("name", EVAL_COMMANDS)
def test_eval_device_cpu_gives_the_defaults_numbers_here(name, tiny, other, tmp_path):
    """Without a GPU, auto is the CPU: --device cpu scores exactly as the default (the report computing
    its reference afresh each time, in a cache of its own)."""
    outputs = []
    for run, device in (("default", []), ("cpu", ["--device", "cpu"])):
        args = _eval_command(name, tiny, other, tmp_path) + device
        if name == "report":
            args += ["--out", str(tmp_path / run), "--cache-dir", str(tmp_path / f"cache-{run}")]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        payload = json.loads(result.output)
        outputs.append(payload["variants"] if name == "report" else _timeless(payload) if name == "tasks" else payload)
        assert (payload["setup"] if name == "report" else payload)["device"] == "cpu"
    assert outputs[0] == outputs[1]
    if name == "report":  # the reference cache is keyed without the device, and holds the same draws
        cached = [sorted((tmp_path / f"cache-{run}").iterdir()) for run in ("default", "cpu")]
        assert [p.name for p in cached[0]] == [p.name for p in cached[1]]
        assert cached[0][0].read_bytes() == cached[1][0].read_bytes()


@pytest.mark.parametrize("name", EVAL_COMMANDS)
def test_eval_device_cuda_without_a_gpu_is_one_clear_line(name, tiny, other, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = _eval_command(name, tiny, other, tmp_path) + ["--device", "cuda"]
    if name == "report":
        args += ["--out", str(tmp_path / "r"), "--cache-dir", str(tmp_path / "cache")]
    if name == "tasks":
        args += ["--record", str(tmp_path / "r")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "--device cuda: no CUDA device" in result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, RuntimeError)
    assert not (tmp_path / "r").exists() and not (tmp_path / "cache").exists()  # refused before any work


def test_failures_are_one_clear_line(tiny, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["quantize", "--recipe", "no-such-recipe", "--model", str(tiny), "--out",
                                  str(tmp_path / "q")])
    assert result.exit_code == 1 and "unknown recipe 'no-such-recipe'" in result.output
    assert "Traceback" not in result.output
    result = runner.invoke(main, ["eval", "ppl", "--model", str(tmp_path / "missing")])
    assert result.exit_code == 1 and "not found" in result.output


def test_errors_quantkit_did_not_raise_keep_their_traceback(tiny, tmp_path, monkeypatch):
    import torch

    import quantkit.inspect

    def shapes_mismatch(model_dir):  # torch raises it, from C++, as in a model with a wrong shape
        return torch.zeros(2, 3) @ torch.zeros(2, 3)

    monkeypatch.setattr(quantkit.inspect, "describe", shapes_mismatch)
    result = CliRunner().invoke(main, ["inspect", str(tiny)])
    assert result.exit_code == 1 and isinstance(result.exception, RuntimeError)  # not a one-line ClickException

    monkeypatch.setenv("QUANTKIT_DEBUG", "1")  # and with it, quantkit's own errors keep theirs too
    result = CliRunner().invoke(main, ["eval", "ppl", "--model", str(tmp_path / "missing")])
    assert result.exit_code == 1 and isinstance(result.exception, FileNotFoundError)
    assert "QUANTKIT_DEBUG=1" in CliRunner().invoke(main, ["--help"]).output


def test_help_does_not_import_torch():
    """`quantkit --help` lists every command, so it imports every command's module: none imports torch or
    transformers before its command runs."""
    import subprocess
    import sys

    probe = ("import sys\nfrom quantkit.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert "generate" in run.stdout and run.stdout.splitlines()[-1] == "[]"


def test_generate_writes_each_piece_as_soon_as_it_is_decoded(monkeypatch):
    """`quantkit generate` streams: each piece of text is written (and flushed) before the next is decoded."""
    import click

    import quantkit.cli.runtime

    events = []

    class Runtime:  # what `generate` uses of the runtime, without a model
        def chat_prompt(self, messages, enable_thinking):
            return [1, 2, 3]

        def stream(self, ids, timings, **settings):
            for piece in ("Par", "is"):
                events.append(("decoded", piece))
                yield piece
            timings.update(prefill_seconds=0.1, decode_seconds=0.2, stop_reason="stop token")

    echo = click.echo
    monkeypatch.setattr(quantkit.cli.runtime, "runtime_from_options", lambda *options: Runtime())
    monkeypatch.setattr(click, "echo", lambda message=None, **kwargs: (events.append(("written", message)),
                                                                       echo(message, **kwargs)))
    result = CliRunner().invoke(main, ["generate", "--prompt", "What is the capital of France?"])
    assert result.exit_code == 0, result.output
    assert events[:4] == [("decoded", "Par"), ("written", "Par"), ("decoded", "is"), ("written", "is")]
    assert result.output.startswith("Paris\n")


# What `quantkit generate` must not import: the pipelines and the algorithms with their solvers, transformers'
# modeling code (the runtime builds the plain-PyTorch skeleton) and torch's compiler, seconds of imports that a
# first answer would wait for (the runtime reads artifacts; it never quantizes or trains).
# transformers: its tokenizer and chat templates run in the tokenizer's own process
NOT_IMPORTED_BY_GENERATE = ["quantkit.engine", "quantkit.imatrix", "quantkit.qat", "quantkit.draft",
                            "quantkit.algorithms", "quantkit.models.minicpm", "transformers", "torch._dynamo"]


@pytest.fixture(scope="module")
def imported_by_generate(tiny):
    """The modules loaded by a whole `quantkit generate` run, in a fresh process."""
    import subprocess
    import sys

    probe = ("import sys\nfrom quantkit.cli import main\n"
             "main(sys.argv[1:], standalone_mode=False)\nprint('MODULES', *sorted(sys.modules))")
    run = subprocess.run([sys.executable, "-c", probe, "generate", "--model", str(tiny), "--raw", "--prompt", "hello",
                          "--max-new-tokens", "2"], capture_output=True, text=True, check=True)
    return set(run.stdout.splitlines()[-1].split()[1:])


@pytest.mark.parametrize("package", NOT_IMPORTED_BY_GENERATE)
def test_generate_imports_no_pipeline_and_no_solver(imported_by_generate, package):
    assert "quantkit.kernels.generate" in imported_by_generate
    assert sorted(m for m in imported_by_generate if m == package or m.startswith(f"{package}.")) == []


def test_commands_back_large_tensors_with_huge_pages():
    """The CLI asks PyTorch's allocator for transparent huge pages before a command imports torch: first
    touching a fresh 256 MB tensor then takes far fewer page faults (where the kernel offers huge pages at
    all); a value the user set is kept; the runtime's commands, which allocate their weights once, keep
    4 KB pages (the kernel's compaction cost their first answer 0.6 s)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    probe = ("import resource, sys, click\n"
             "if sys.argv[1] != 'plain':\n"
             "    from quantkit.cli import main\n"
             "    with click.Context(main, info_name='quantkit') as context:\n"
             "        context.invoked_subcommand = sys.argv[1]\n"
             "        main.callback()\n"
             "import os, torch\n"
             "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
             "torch.empty(64 << 20).fill_(1.0)\n"
             "after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
             "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), after - before)")
    environment = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}

    def faults(how: str, **extra) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", probe, how], capture_output=True, text=True, check=True,
                             env={**environment, **extra}).stdout.split()
        return out[0], int(out[1])

    plain, cli, kept = faults("plain"), faults("quantize"), faults("quantize", THP_MEM_ALLOC_ENABLE="0")
    assert plain[0] == "None" and cli[0] == "1" and kept[0] == "0"
    assert faults("generate")[0] == faults("chat")[0] == "None"
    assert plain[1] > 60_000 and kept[1] > 60_000  # 256 MB in 4 KB pages: 65,536 faults
    offered = "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    assert (cli[1] < plain[1] / 8) == offered


def test_set_overrides_are_validated_like_the_file(tiny, tmp_path):
    from quantkit.recipe import RecipeError, load_recipe

    recipe = load_recipe("gptq-w4g128", {"quant.bits": 3, "calibration.n_samples": 16})
    assert recipe["quant"]["bits"] == 3 and recipe["calibration"]["n_samples"] == 16
    with pytest.raises(RecipeError, match="unknown key 'quant.bitz'"):
        load_recipe("gptq-w4g128", {"quant.bitz": 3})
    result = CliRunner().invoke(main, ["quantize", "--recipe", "rtn-w4g128", "--model", str(tiny), "--out",
                                       str(tmp_path / "q"), "--set", "quant.bits=five"])
    assert result.exit_code == 1 and "'quant.bits' must be int" in result.output


def test_export_gguf_prints_a_summary_and_json(tiny, tmp_path):
    out = tmp_path / "tiny.gguf"
    result = CliRunner().invoke(main, ["export", "gguf", "--model", str(tiny), "--type", "q8_0", "--out", str(out),
                                       "--no-progress", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["file_bytes"] == out.stat().st_size
    assert report["tensors_by_type"]["q8_0"] == 2 * 7 + 2  # linears, embedding, output
    again = CliRunner().invoke(main, ["export", "gguf", "--model", str(tiny), "--type", "q8_0", "--out", str(out)])
    assert again.exit_code == 1 and "already exists" in again.output


def test_qat_refuses_a_post_training_recipe_and_quantize_a_qat_one(tiny, tmp_path):
    result = CliRunner().invoke(main, ["qat", "ternary", "--model", str(tiny), "--out", str(tmp_path / "q"),
                                       "--recipe", "gptq-w4g128"])
    assert result.exit_code == 1 and "does not train a ternary grid" in result.output
    result = CliRunner().invoke(main, ["quantize", "--recipe", "qat-ternary-g32", "--model", str(tiny), "--out",
                                       str(tmp_path / "q")])
    assert result.exit_code == 1 and "quantkit qat ternary --recipe qat-ternary-g32" in result.output
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.partial").exists()
