"""Hostile inputs (issue 62): output paths and the lock, and checkpoints whose config.json or tensors lie.

* output paths: a symbolic link (or a hard link, a directory, a file) under the output's name, its
  staging's (``<out>.partial``) or its lock's (``<out>.lock``), and outputs whose lock cannot be made;
* checkpoints: config.json values of the wrong type, range or finiteness, a layer count of a billion
  (directly, or behind a duplicate key), an architecture quantkit does not run, tensors a MiniCPM
  model has no place for;
* artifacts: a shard changed, truncated or grown after quantkit wrote it.

Each case must be one clear error (exit 1, one line, no traceback) before any work, with nothing written
anywhere: the folder around the output holds exactly what it held before (no ``.partial``, no lock, no
file written through a link). The cases are rows of `make test-reliability`'s table (tests/reliability.py).
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from quantkit.atomic import staging_dir
from quantkit.run import Run, RunError, parked_record

from reliability import Outcome

pytestmark = pytest.mark.reliability

QUANTIZE = ["quantize", "--recipe", "rtn-w4g128", "--set", "calibration.n_samples=4", "--set",
            "calibration.seq_len=64", "--no-progress"]
ADDRESS_SPACE = 3 << 30  # a refused run's whole address space (torch's libraries included: 251 MB resident)


def tree(root: Path) -> dict[str, object]:
    """Every entry under ``root`` as it is: a link's target, a folder's mark, a file's bytes."""
    entries = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            entries[name] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            entries[name] = "/"
        else:
            entries[name] = path.read_bytes()
    return entries


def judge(outcome: Outcome, row, name: str, before: dict, after: dict, lock_left: bool = False) -> list[str]:
    """One refused case: its row counts, and what was wrong with it. ``lock_left``: a run refused after it
    took its lock, started by the fork server, whose children end with os._exit and so skip the exit hook
    that removes the lock file (a `quantkit` process removes it: the bounded runs below show it)."""
    if lock_left and before.get("out.lock") is None:
        after = {n: entry for n, entry in after.items() if n != "out.lock"}
    row.cases += 1
    row.ran(outcome)
    row.tracebacks += outcome.traceback
    row.clear_errors += outcome.clear_error
    problems = []
    if not outcome.clear_error:
        problems.append(f"{name}: exit {outcome.code}, stderr: {outcome.stderr[-1500:]}")
    if before != after:
        row.partial_outputs += any(n.endswith(".partial") or n == "out" for n in set(after) - set(before))
        changed = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
        problems.append(f"{name}: the folder around the output changed: {changed}")
    return problems


# ---------------------------------------------------------------------------------------------------
# Output paths and the lock

def _victim(case: Path) -> Path:
    victim = case / "victim.txt"
    victim.write_text("precious\n")
    return victim


def _foreign_dir(case: Path) -> Path:
    folder = case / "elsewhere" / "precious"
    folder.mkdir(parents=True)
    (folder / "foreign.txt").write_text("not quantkit's\n")
    return folder


def _put(path: Path, kind: str, target: Path | str = "") -> None:
    """Something under a name quantkit writes: a symbolic link, a hard link, a folder, a file, or a folder
    with a file in it."""
    {"symlink": lambda: path.symlink_to(target), "hardlink": lambda: os.link(target, path), "folder": path.mkdir,
     "file": lambda: path.write_text("x"),
     "filled folder": lambda: (path.mkdir(), (path / "foreign.txt").write_text("x"))}[kind]()


# case -> (what to put under which name, in the case's folder; the --out to pass there; extra arguments)
PATH_CASES = {
    "lock is a symlink to a file": (lambda c: _put(c / "out.lock", "symlink", _victim(c).name), "out", []),
    "lock is a hard link to a file": (lambda c: _put(c / "out.lock", "hardlink", _victim(c)), "out", []),
    "lock name is a directory": (lambda c: _put(c / "out.lock", "folder"), "out", []),
    "staging is a symlink to a folder": (
        lambda c: _put(c / "out.partial", "symlink", _foreign_dir(c).relative_to(c)), "out", []),
    "staging is a symlink to a folder (--resume)": (
        lambda c: _put(c / "out.partial", "symlink", _foreign_dir(c).relative_to(c)), "out", ["--resume"]),
    "staging is a dangling symlink (--resume)": (lambda c: _put(c / "out.partial", "symlink", "nowhere"), "out",
                                                 ["--resume"]),
    "staging is a folder no run made (--resume)": (lambda c: _put(c / "out.partial", "filled folder"), "out",
                                                   ["--resume"]),
    "staging is a file (--resume)": (lambda c: _put(c / "out.partial", "file"), "out", ["--resume"]),
    "--out is a dangling symlink": (lambda c: _put(c / "out", "symlink", "nowhere/dir"), "out", []),
    "--out is a symlink to a folder": (lambda c: _put(c / "out", "symlink", _foreign_dir(c).relative_to(c)), "out",
                                       []),
    "--out's folder is a file": (lambda c: _put(c / "file", "file"), "file/out", []),
    "--out where no lock can be made (/proc/self)": (lambda c: None, "/proc/self/quantkit-out", []),
}


def test_outputs_reached_through_links_or_without_a_lock_are_refused_and_nothing_is_written(
        launcher, model, tmp_path, tally):
    row = tally.row("quantize", "hostile output path or lock")
    problems = []
    for number, (name, (make, out, extra)) in enumerate(PATH_CASES.items()):
        case = tmp_path / f"case{number}"
        case.mkdir()
        make(case)
        before = tree(case)
        outcome = launcher.run([*QUANTIZE, "--model", model, "--out", case / out, *extra])
        problems += judge(outcome, row, name, before, tree(case))
    assert not problems, "\n\n".join(problems)


def test_a_staging_without_a_run_record_is_neither_removed_nor_resumed(tmp_path):
    """`draft quantize` (never resumed) used to empty whatever stood under <out>.partial."""
    staging = staging_dir(tmp_path / "out")
    staging.mkdir()
    (staging / "thesis.tex").write_text("years of work")
    for resume, resumable in ((True, True), (False, False)):
        with pytest.raises(RunError, match="no record of the quantkit run"):
            Run(tmp_path / "out", resume=resume, resumable=resumable)
    assert (staging / "thesis.tex").read_text() == "years of work"


def test_a_resume_without_a_checkpoint_starts_over_in_an_emptied_staging(tmp_path):
    """What an earlier start left (a shard of another model's layer count) would otherwise be published."""
    out, inputs = tmp_path / "out", {"model": "m"}
    Run(out).begin(inputs, "progress.json")
    stale = staging_dir(out) / "model-00009-of-00009.safetensors"
    stale.write_bytes(b"left by a start with other inputs")
    run = Run(out, resume=True)
    assert run.begin({"model": "other"}, "progress.json") is False
    assert not stale.exists() and run.staging.is_dir()


def test_a_run_killed_while_publishing_is_still_known_as_its_own(tmp_path):
    """The record stays in the staging until just before the rename (a manifest's hashing takes seconds at
    8B): a resume then starts over instead of refusing a staging that holds no record."""
    out, inputs = tmp_path / "out", {"model": "m"}
    run = Run(out)
    run.begin(inputs, "progress.json")
    (run.staging / "progress.json").write_text("{}")
    with pytest.raises(KeyboardInterrupt), run.publishing() as staging:
        (staging / "quantkit.json").write_text("{}")
        raise KeyboardInterrupt  # the kill, as the manifest is written
    assert Run(out, resume=True).begin(inputs, "progress.json") is False
    assert not (staging_dir(out) / "quantkit.json").exists()


def test_a_run_killed_between_parking_its_record_and_the_rename_starts_over(tmp_path, monkeypatch):
    """The record leaves the staging just before the rename, so that the output never holds it; a kill
    between the two (seen by `make test`'s kill cases) leaves it beside the staging, where it still counts."""
    out, inputs = tmp_path / "out", {"model": "m"}
    run = Run(out)
    run.begin(inputs, "progress.json")

    def killed(staging, final):
        raise KeyboardInterrupt

    monkeypatch.setattr("quantkit.atomic.publish_dir", killed)
    with pytest.raises(KeyboardInterrupt), run.publishing() as staging:
        (staging / "quantkit.json").write_text("{}")
    assert not (staging_dir(out) / ".run").exists() and parked_record(staging_dir(out)).is_dir()
    monkeypatch.undo()
    rerun = Run(out, resume=True)
    assert rerun.begin(inputs, "progress.json") is False
    assert not (staging_dir(out) / "quantkit.json").exists() and not parked_record(staging_dir(out)).exists()
    with rerun.publishing() as staging:
        (staging / "quantkit.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["quantkit.json"]


# ---------------------------------------------------------------------------------------------------
# Checkpoints whose config.json or tensors lie

def _with_config(edit):
    def make(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config, indent=1))
    return make


def _with_config_text(old: str, new: str):
    def make(folder: Path) -> None:
        text = (folder / "config.json").read_text()
        assert old in text
        (folder / "config.json").write_text(text.replace(old, new, 1))
    return make


def _with_tensor(name: str):
    def make(folder: Path) -> None:
        tensors = load_file(folder / "model.safetensors")
        tensors[name] = tensors["model.norm.weight"].clone()
        save_file(tensors, folder / "model.safetensors")
    return make


LAYERS = '"num_hidden_layers": 2'
# case -> (how the checkpoint is made hostile, whether `inspect` must refuse it too: it describes what a
# config says, and must refuse only what it cannot describe truthfully)
CHECKPOINT_CASES = {
    "num_hidden_layers 1e9": (_with_config(lambda c: c.update(num_hidden_layers=10**9)), True),
    "num_hidden_layers 1e9 behind a duplicate key": (
        _with_config_text(LAYERS, f'{LAYERS}, "num_hidden_layers": 1000000000'), True),
    "rms_norm_eps NaN": (_with_config_text('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN'), True),
    "rope_theta Infinity": (_with_config_text('"rope_theta": 10000.0', '"rope_theta": Infinity'), True),
    "rms_norm_eps NaN as transformers' tag": (_with_config(lambda c: c.update(rms_norm_eps={"__float__": "NaN"})),
                                              False),
    "hidden_size -1": (_with_config(lambda c: c.update(hidden_size=-1)), True),
    "vocab_size 0": (_with_config(lambda c: c.update(vocab_size=0)), True),
    "num_attention_heads 'four'": (_with_config(lambda c: c.update(num_attention_heads="four")), False),
    "num_hidden_layers 2.5": (_with_config(lambda c: c.update(num_hidden_layers=2.5)), False),
    "num_key_value_heads not dividing the heads": (_with_config(lambda c: c.update(num_key_value_heads=3)), False),
    "architectures LlamaForCausalLM": (_with_config(lambda c: c.update(architectures=["LlamaForCausalLM"])), False),
    "model_type llama": (_with_config(lambda c: c.update(model_type="llama")), False),
    "an extra tensor in a layer": (_with_tensor("model.layers.1.self_attn.q_proj.bias"), False),
    "a tensor named with ../": (_with_tensor("model.layers.0/../../evil.weight"), False),
}
MEMORY_CASES = {name for name in CHECKPOINT_CASES if "1e9" in name}


@pytest.fixture(scope="module")
def hostile_checkpoints(model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile-checkpoints")
    made = {}
    for number, (name, (make, _)) in enumerate(CHECKPOINT_CASES.items()):
        made[name] = root / f"checkpoint{number}"
        shutil.copytree(model, made[name])
        make(made[name])
    return made


def _run_bounded(argv: list, logs: Path) -> Outcome:
    """A fresh `quantkit` process in at most ``ADDRESS_SPACE`` (a case that would build a billion layers'
    table fails instead of filling the machine), and its outcome."""
    limit = (ADDRESS_SPACE, ADDRESS_SPACE)
    stdout, stderr = logs.with_suffix(".out"), logs.with_suffix(".err")
    with open(stdout, "w") as out, open(stderr, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "quantkit.cli", *map(str, argv)], stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, limit))
        proc.wait()
    return Outcome(proc.returncode, stdout.read_text(), stderr.read_text())


def test_hostile_checkpoints_are_refused_before_any_work(launcher, hostile_checkpoints, tmp_path, tally):
    row = tally.row("quantize", "hostile config.json or tensors")
    problems = []
    for number, (name, folder) in enumerate(hostile_checkpoints.items()):
        case = tmp_path / f"case{number}"
        case.mkdir()
        argv = [*QUANTIZE, "--model", folder, "--out", case / "out"]
        if name in MEMORY_CASES:  # bounded by the address-space cap: a billion layers' table would not fit in it
            outcome = _run_bounded(argv, tmp_path / f"run{number}")
        else:
            outcome = launcher.run(argv)
        problems += judge(outcome, row, name, {}, tree(case), lock_left=name not in MEMORY_CASES)
    assert not problems, "\n\n".join(problems)


def test_inspect_refuses_configs_it_cannot_describe_truthfully(launcher, hostile_checkpoints, tally):
    row = tally.row("inspect", "hostile config.json or tensors")
    problems = []
    for name, folder in hostile_checkpoints.items():
        must_refuse = CHECKPOINT_CASES[name][1]
        outcome = launcher.run(["inspect", folder])
        if must_refuse:
            problems += judge(outcome, row, name, {}, {})
        else:  # it may describe what it finds, but never crash
            row.cases += 1
            row.tracebacks += outcome.traceback
            row.clear_errors += outcome.code == 0 or outcome.clear_error
            if outcome.traceback or outcome.code not in (0, 1):
                problems.append(f"{name}: exit {outcome.code}: {outcome.stderr[-1500:]}")
    assert not problems, "\n\n".join(problems)


# ---------------------------------------------------------------------------------------------------
# Artifacts changed after quantkit wrote them

@pytest.fixture(scope="module")
def artifact(launcher, model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile-artifact") / "artifact"
    outcome = launcher.run([*QUANTIZE, "--model", model, "--out", out])
    assert outcome.code == 0, outcome.stderr[-3000:]
    return out


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


SHARD = "model-00002-of-00003.safetensors"
# case -> (change, the commands that must refuse the changed artifact)
ARTIFACT_CASES = {
    "a shard changed in place (same size)": (_flip_last_byte, ["inspect", "generate"]),
    "a shard truncated": (lambda p: os.truncate(p, p.stat().st_size - 4), ["inspect", "generate"]),
    "a shard grown": (lambda p: p.write_bytes(p.read_bytes() + b"\0" * 4), ["inspect", "generate"]),
}
COMMANDS = {"inspect": lambda folder: ["inspect", folder],
            "generate": lambda folder: ["generate", "--model", folder, "--prompt", "Hi", "--max-new-tokens", "2"]}


def test_an_artifact_changed_after_it_was_written_is_one_clear_error(launcher, artifact, tmp_path, tally):
    """Every reader holds the weight files to their recorded sizes and SHA-256 (hashed once per version of
    a file: `remembered_sha256s`); `inspect` hashes every file every time."""
    problems = []
    for number, (name, (change, commands)) in enumerate(ARTIFACT_CASES.items()):
        changed = tmp_path / f"artifact{number}"
        shutil.copytree(artifact, changed)
        change(changed / SHARD)
        for command in commands:
            outcome = launcher.run(COMMANDS[command](changed))
            problems += judge(outcome, tally.row(command, "artifact changed after writing"), name, {}, {})
            if outcome.clear_error and SHARD not in outcome.stderr:
                problems.append(f"{command}, {name}: the error does not name {SHARD}: {outcome.stderr}")
    assert not problems, "\n\n".join(problems)
    for command in COMMANDS:  # the unchanged artifact passes the same checks
        assert launcher.run(COMMANDS[command](artifact)).code == 0


def test_a_file_is_hashed_once_per_version(tmp_path, monkeypatch):
    """What lets the runtime check an 8B artifact's 5 GB at every start: a second read costs a stat, and a
    write in place (same size, even with the modification time set back) is hashed again."""
    from quantkit import file_hashes

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * 4096)
    hashed = []
    real = file_hashes.sha256_file
    monkeypatch.setattr(file_hashes, "sha256_file", lambda p: hashed.append(p) or real(p))
    first = file_hashes.remembered_sha256s([path])[0]
    assert file_hashes.remembered_sha256s([path])[0] == first and len(hashed) == 1
    status = path.stat()
    with open(path, "r+b") as f:
        f.write(b"b")
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert file_hashes.remembered_sha256s([path])[0] == real(path) != first and len(hashed) == 2
