"""Hostile input that asked for memory or time without bound, or ended in a traceback (issue 62).

Each case is a `quantkit` run (from tests/reliability.py's fork server) that must end in one clear line
(exit code 1; click's own option errors exit 2), without a traceback, within SECONDS and PEAK_KB of
resident memory (the unbounded cases took 5-7 GB and minutes); every run has an address-space limit, so
that a regression fails here instead of taking the machine. The cases are rows of
`make test-reliability`'s table (docs/reliability.md).
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.reliability

SECONDS = 120  # a run of the tiny model takes seconds, or two minutes when it compiles quantkit.cpu_ops
MEMORY = 2 << 30  # the address space a run may add to the fork server's
IMPORTER_MEMORY = 3 << 30  # the address space of a process that imports torch (1.1 GB) and converts
PEAK_KB = 3 << 20  # the fork server (~0.5 GB), the run, and the compiler when it builds quantkit.cpu_ops
GENERATE = ["--prompt", "Hi", "--max-new-tokens", "2"]


def _copy(model: Path, where: Path) -> Path:
    return Path(shutil.copytree(model, where))


def _bounded_run(launcher, argv, row, code: int = 1) -> tuple[list[str], str]:
    """One case: a clear error (exit ``code``, one `Error:` line, no traceback) within the time and memory
    bounds. Returns the problems and the error line."""
    started = time.monotonic()
    proc = launcher.start(argv, memory=MEMORY)
    while proc.poll() is None and time.monotonic() - started < SECONDS:
        time.sleep(0.05)
    seconds = time.monotonic() - started
    proc.kill()
    outcome = proc.wait()
    errors = [line for line in outcome.stderr.splitlines() if line.startswith("Error: ")]
    clear = outcome.code == code and len(errors) == 1 and not outcome.traceback
    row.cases += 1
    row.ran(outcome)
    row.tracebacks += outcome.traceback
    row.clear_errors += clear
    problems = []
    if not clear:
        problems.append(f"exit {outcome.code}, stderr: {outcome.stderr[-1500:]}")
    if seconds >= SECONDS:
        problems.append(f"still running after {SECONDS} s")
    if outcome.peak_kb > PEAK_KB:
        problems.append(f"peak memory {outcome.peak_kb >> 10} MB")
    return problems, errors[0] if errors else ""


# ---------------------------------------------------------------------------------------------------
# Recipes

def _laughs(levels: int = 9) -> str:
    """A YAML flow list whose aliases expand to 9^levels strings (the "billion laughs")."""
    lists = ["&l0 [" + ", ".join(["lol"] * 9) + "]"]
    lists += [f"&l{level} [" + ", ".join([f"*l{level - 1}"] * 9) + "]" for level in range(1, levels)]
    return "[" + ", ".join(lists) + "]"


RECIPES = {
    "billion laughs in description": f"name: x\ndescription: {_laughs()}\nalgorithm: rtn\nquant:\n  bits: 4\n",
    "billion laughs in quant.bits": f"name: x\ndescription: y\nalgorithm: rtn\nquant:\n  bits: {_laughs()}\n",
    "duplicate key": "name: x\ndescription: y\nalgorithm: rtn\nalgorithm: gptq\nquant:\n  bits: 4\n",
}


@pytest.mark.parametrize("case", list(RECIPES))
def test_hostile_recipes_are_one_clear_line_in_bounded_memory(case, launcher, model, tmp_path, tally):
    recipe = tmp_path / "hostile.yaml"
    recipe.write_text(RECIPES[case])
    argv = ["quantize", "--recipe", recipe, "--model", model, "--out", tmp_path / "out", "--no-progress"]
    problems, error = _bounded_run(launcher, argv, tally.row("quantize --recipe", case))
    assert not problems, "\n".join(problems)
    assert str(recipe) in error and len(error) < 400, error
    assert ("stated twice" if case == "duplicate key" else "aliases") in error, error
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------
# Chat templates

TEMPLATES = {
    "three nested range(100000) loops": "{% for i in range(100000) %}{% for j in range(100000) %}"
                                         "{% for k in range(100000) %}{{ k }}{% endfor %}{% endfor %}{% endfor %}",
    "a 100 MB string multiplied by 50": "{% set s = 'x' * 100000000 %}{% set t = s * 50 %}{{ t | length }}",
    "padding to a width of 10^9": "{{ 'x' | center(1000000000) }}",
    "a string concatenated in a loop": "{% set ns = namespace(s='') %}{% for i in range(100000) %}"
                                       "{% set ns.s = ns.s ~ ('y' * 1000) %}{% endfor %}{{ ns.s }}",
    "''.__class__.__mro__": "{{ ''.__class__.__mro__ }}",
    "cycler's __globals__": "{{ cycler.__init__.__globals__.os }}",
    "a syntax error": "{% for message in messages %}{{ message.content }",
    "raise_exception": "{{ raise_exception('Conversation roles must alternate user/assistant') }}",
    "macro recursion": "{% macro deeper(n) %}{{ deeper(n + 1) }}{% endmacro %}{{ deeper(0) }}",
}
# every case as chat_template.jinja; three in tokenizer_config.json, whose template is rendered the same way
TEMPLATE_CASES = [(case, "chat_template.jinja") for case in TEMPLATES] + [
    (case, "tokenizer_config.json") for case in ("''.__class__.__mro__", "cycler's __globals__",
                                                 "three nested range(100000) loops")]


@pytest.mark.parametrize(("case", "source"), TEMPLATE_CASES)
def test_hostile_chat_templates_are_one_line_naming_the_template(case, source, launcher, model, tmp_path, tally):
    folder = _copy(model, tmp_path / "model")
    if source == "chat_template.jinja":
        (folder / source).write_text(TEMPLATES[case])
    else:
        settings = json.loads((folder / source).read_text())
        settings["chat_template"] = TEMPLATES[case]
        (folder / source).write_text(json.dumps(settings))
    row = tally.row("generate", f"chat template: {case}")
    problems, error = _bounded_run(launcher, ["generate", "--model", folder, *GENERATE], row)
    assert not problems, "\n".join(problems)
    assert f"chat template {folder / source}:" in error and len(error) < 500, error


def test_legitimate_templates_render_as_transformers_renders_them(model):
    """MiniCPM4.1's template (the default model's too) and the tiny model's: the same ids, thinking on and
    off, over conversations up to a megabyte of text."""
    from quantkit.chat_template import render_chat
    from quantkit.models import CHAT_TEMPLATE
    from quantkit.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    conversations = []
    for turns, words in [(0, 3), (3, 20), (60, 2000)]:
        messages = [{"role": "system", "content": "You are helpful."}]
        for turn in range(turns):
            messages += [{"role": "user", "content": f"question {turn} " + "lorem ipsum " * words},
                         {"role": "assistant", "content": f"<think>\nhm\n</think>\n\nanswer {turn} " + "do " * words}]
        conversations.append([*messages, {"role": "user", "content": "last"}])
    for template in (tokenizer.chat_template, CHAT_TEMPLATE):
        tokenizer.chat_template = template
        for messages in conversations:
            for thinking in (False, True):
                ours = render_chat(tokenizer, messages, add_generation_prompt=True, enable_thinking=thinking)
                theirs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False, enable_thinking=thinking)
                assert ours == theirs


# ---------------------------------------------------------------------------------------------------
# GGUF files

def _gguf_with_array(length: int) -> bytes:
    """A GGUF v3 header with one metadata key holding a uint8 array that claims ``length`` items."""
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 0, length)
    return header + bytes(165 - len(header))


def test_a_gguf_array_longer_than_the_file_is_one_clear_line(launcher, tmp_path, tally):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(_gguf_with_array(1 << 62))
    row = tally.row("publish --dry-run (GGUF check)", "GGUF array of 2^62 items in 165 bytes")
    problems, error = _bounded_run(launcher, ["publish", path, "--repo-id", "someone/model", "--dry-run"], row)
    assert not problems, "\n".join(problems)
    assert str(path) in error and "past the end of the file" in error, error


def test_the_importer_refuses_a_gguf_array_longer_than_the_file(tmp_path, tally):
    """The converter every GGUF model goes through (a Hub repo's owner/name:QUANT), called as resolve_model
    calls it, in a process of its own under an address-space limit."""
    path = tmp_path / "hostile.gguf"
    path.write_bytes(_gguf_with_array(1 << 62))
    out = tmp_path / "converted"
    code = ("import sys\nfrom quantkit.gguf.importer import convert_gguf\ntry:\n"
            f"    convert_gguf({str(path)!r}, {str(out)!r}, progress=False)\nexcept ValueError as e:\n"
            "    sys.exit(f'Error: {e}')\n")
    row = tally.row("GGUF conversion (default model, Hub GGUF files)", "GGUF array of 2^62 items in 165 bytes")
    row.cases += 1
    started = time.monotonic()
    limit = (IMPORTER_MEMORY, IMPORTER_MEMORY)
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, limit))
    try:
        stderr = proc.communicate(timeout=SECONDS)[1].decode(errors="replace")
    finally:
        proc.kill()
    row.tracebacks += "Traceback" in stderr
    assert proc.returncode == 1 and stderr.count("Error: ") == 1 and "Traceback" not in stderr, stderr[-1500:]
    assert str(path) in stderr and "past the end of the file" in stderr, stderr
    assert time.monotonic() - started < SECONDS and not out.exists()
    row.clear_errors += 1


# ---------------------------------------------------------------------------------------------------
# The runtime's input

def test_a_token_id_beyond_the_vocabulary_is_refused_at_load(launcher, model, tmp_path, tally):
    folder = _copy(model, tmp_path / "model")
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    tokenizer["added_tokens"].append({"id": vocab_size, "content": "<beyond>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": False})
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    row = tally.row("generate", "added token id >= vocab_size")
    argv = ["generate", "--model", folder, "--prompt", "a <beyond> b", "--max-new-tokens", "2"]
    problems, error = _bounded_run(launcher, argv, row)
    assert not problems, "\n".join(problems)
    assert "<beyond>" in error and f"vocab_size of {vocab_size}" in error, error


ARGUMENTS = {  # case -> (arguments, exit code, what the line says)
    "invalid UTF-8 prompt": (["--prompt", "ab\udcff", "--max-new-tokens", "2"], 1, "not valid UTF-8"),
    "invalid UTF-8 prompt (raw)": (["--prompt", "ab\udcff", "--raw", "--max-new-tokens", "2"], 1, "not valid UTF-8"),
    "sparse config not an object": ([*GENERATE, "--sparse-config", "[1]"], 1, "must be an object"),
    "sparse config with an unknown key": ([*GENERATE, "--sparse-config", '{"topk_": 2}'], 1, "unknown keys"),
    "sparse config for dense attention": ([*GENERATE, "--sparse-config", '{"topk": 2}'], 1, "attention is dense"),
}


@pytest.mark.parametrize("case", list(ARGUMENTS))
def test_bad_runtime_arguments_are_one_clear_line(case, launcher, model, tally):
    arguments, code, says = ARGUMENTS[case]
    row = tally.row("generate", case)
    problems, error = _bounded_run(launcher, ["generate", "--model", model, *arguments], row, code)
    assert not problems, "\n".join(problems)
    assert says in error, error


# Every seed a user gives, on the command line or in a recipe, is 32-bit (recipes/fields.py's MAX_SEED): the
# data order's seeds are derived from it and torch's generators overflow past 64 bits.
HUGE_SEED = str(2**70)
SEED_CASES = {  # command -> (argv, with {model} and {out}; exit code: click's 2 for options, 1 for recipes)
    "generate --seed": (["generate", "--model", "{model}", *GENERATE, "--seed", HUGE_SEED], 2),
    "imatrix --seed": (["imatrix", "--model", "{model}", "--out", "{out}", "--seed", HUGE_SEED], 2),
    "draft train --seed": (["draft", "train", "--target", "{model}", "--out", "{out}", "--seed", HUGE_SEED], 2),
    "eval niah --seed": (["eval", "niah", "--model", "{model}", "--seed", HUGE_SEED], 2),
    "quantize calibration.seed": (["quantize", "--recipe", "rtn-w4g128", "--model", "{model}", "--out", "{out}",
                                   "--set", f"calibration.seed={HUGE_SEED}"], 1),
    "qat qat.seed": (["qat", "ternary", "--model", "{model}", "--out", "{out}", "--set", f"qat.seed={HUGE_SEED}"], 1),
}


@pytest.mark.parametrize("case", list(SEED_CASES))
def test_a_seed_beyond_32_bits_is_one_clear_line(case, launcher, model, tmp_path, tally):
    template, code = SEED_CASES[case]
    argv = [str(a).format(model=model, out=tmp_path / "out") for a in template]
    command, _, option = case.rpartition(" ")
    problems, error = _bounded_run(launcher, argv, tally.row(command, f"{option} of 2^70"), code)
    assert not problems, "\n".join(problems)
    assert "seed" in error and "4294967295" in error, error
    assert not (tmp_path / "out").exists()


def test_calibration_renders_chat_templates_within_the_budget(model, tmp_path):
    """Calibration's chat rows (`calibration.chat`) go through the same bounded rendering as the runtime."""
    from quantkit.calib import calibration_set
    from quantkit.chat_template import ChatTemplateError
    from quantkit.tokenizer import load_tokenizer

    folder = _copy(model, tmp_path / "model")
    (folder / "chat_template.jinja").write_text(TEMPLATES["three nested range(100000) loops"])
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match="exceeds its budget"):
        calibration_set(load_tokenizer(folder), n_samples=2, seq_len=32, seed=0, chat=True)
    assert time.monotonic() - started < SECONDS


def test_an_imatrix_file_longer_than_it_is_is_one_clear_error(tmp_path):
    from quantkit.gguf.imatrix_file import read_imatrix

    path = tmp_path / "hostile.imatrix.gguf"
    path.write_bytes(_gguf_with_array(1 << 62))
    with pytest.raises(ValueError, match="past the end of the file"):
        read_imatrix(path)


def test_chat_reports_invalid_utf8_and_goes_on(model, tally):
    """A real process (click's test runner echoes input through a strict UTF-8 stream, as no terminal does)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "quantkit.cli", "chat", "--model", str(model), "--max-new-tokens",
                           "2"], input=b"ab\xff\nhello\n/exit\n", capture_output=True, env=env, timeout=SECONDS)
    stdout, stderr = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    row = tally.row("chat", "invalid UTF-8 on stdin")
    row.cases += 1
    row.tracebacks += "Traceback" in stderr
    assert done.returncode == 0, stderr[-1500:]
    assert stderr.count("Error: the message is not valid UTF-8") == 1, stderr[-1500:]
    assert stdout.count("model> ") == 1, stdout  # the next message is answered
    row.clear_errors += 1


def test_generation_stops_at_the_context(model, tally):
    """As llama.cpp stops at n_ctx: a prompt 5 tokens short of max_position_embeddings gets 5 new tokens of
    the 100 asked for, and says why."""
    import torch

    from quantkit.kernels.generate import CONTEXT_LIMIT, PromptError, load_text_generator

    generator = load_text_generator(model, dtype=torch.float32)
    generator.stop_tokens = set()  # only the context may end it
    context = generator.context
    row = tally.row("generate", "prompt + max_new_tokens past the context")
    row.cases += 2
    result = generator.generate([5] * (context - 5), max_new_tokens=100)
    assert (len(result.tokens), result.stop_reason) == (5, CONTEXT_LIMIT)
    assert generator.generate([5] * (context - 5), max_new_tokens=5).stop_reason == "length"
    with pytest.raises(PromptError, match="leaves no room"):
        generator.generate([5] * context, max_new_tokens=1)
    row.clear_errors += 2
