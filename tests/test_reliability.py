"""Reliability under faults and hostile input, measured (issue 26; docs/reliability.md).

* kills: `quantkit quantize` (RTN and GPTQ), `quantkit export gguf`, `quantkit qat ternary` and
  `quantkit draft train` are SIGKILLed at seeded random times and at chosen moments (a shard or the file
  being written, just before and just after the final rename); the output name is polled all the while.
  The rerun (`--resume` where there is one) must give the uninterrupted run's bytes, and nothing
  incomplete may ever stand under the final name.
* write errors: RLIMIT_FSIZE at several sizes: one clear error naming the file, nothing under the final
  name, the same bytes on a rerun without the limit.
* two runs, one output: the second is refused while the first writes; a killed run's lock is taken over.
* memory: a calibration that cannot fit is refused before any work, with the estimate and the limit.
* hostile input: safetensors headers, checkpoint directories, recipes and `--set` (hypothesis), GGUF and
  tokenizer files, runtime arguments: every case is one clear error, never a traceback.

`make test` runs a reduced set of cases; `make test-reliability` (QUANTKIT_RELIABILITY_CASES=full) runs
them all and prints the table (tests/reliability_table.py).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantkit.atomic import staging_dir
from quantkit.checkpoint import CheckpointError, CheckpointReader, read_header

from reliability import (
    KillCase,
    cases,
    full_run,
    kill_cases,
    listing,
    run_kill_case,
    snapshot,
    watch,
)

pytestmark = pytest.mark.reliability

QUANTIZE_SETTINGS = ["--set", "calibration.n_samples=8", "--set", "calibration.seq_len=64", "--no-progress"]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return tmp_path_factory.mktemp("reliability-out")


def _quantize(recipe):
    return lambda model, out, extra=(): ["quantize", "--recipe", recipe, "--model", model, "--out", out,
                                         *QUANTIZE_SETTINGS]


def _gguf(model, out, extra=()):
    return ["export", "gguf", "--model", model, "--type", "q4_k_m", "--out", out, "--no-progress"]


def _qat(model, out, extra=()):
    text, cache, _ = extra
    sets = {"qat.seq_len": 64, "qat.batch_tokens": 128, "qat.eval_interval": 4, "qat.eval_tokens": 128,
            "qat.checkpoint_interval": 2, "qat.data": text, "qat.top_k": 8, "qat.learning_rate": 1e-3}
    return ["qat", "ternary", "--model", model, "--out", out, "--tokens", "1024", "--no-progress",
            *[arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]]


def _draft(model, out, extra=()):
    text, cache, target = extra  # a head reads the states entering layers 2, L/2 and L-3: L = 4, not 2
    return ["draft", "train", "--target", target, "--out", out, "--tokens", "1280", "--seq-len", "64",
            "--batch-rows", "2", "--ttt-steps", "2", "--draft-vocab", "128", "--data", text, "--no-progress"]


# command -> (argv builder, output is a file, resume flag, quick random kills, full random kills)
COMMANDS = {
    "quantize rtn-w4g128": (_quantize("rtn-w4g128"), False, "--resume", 2, 16),
    "quantize gptq-w4g128": (_quantize("gptq-w4g128"), False, "--resume", 2, 16),
    "export gguf q4_k_m": (_gguf, True, None, 2, 17),
    "qat ternary": (_qat, False, "--resume", 0, 19),
    "draft train": (_draft, False, "--resume", 0, 19),
}  # with the chosen moments, at least 20 kills per command in the full run


def _triggers(is_file: bool, reference_size: int) -> dict:
    """Moments worth a kill, as conditions on (final, staging, temp files beside the final) listings."""
    if is_file:
        return {
            "while the file is written": lambda final, staging, temps: any(temps.values()),
            "at half the file": lambda final, staging, temps: any(s >= reference_size // 2 for s in temps.values()),
            "right after the rename": lambda final, staging, temps: final is not None,
        }
    return {
        "during a shard write": lambda final, staging, temps: bool(staging) and any(
            n.endswith(".tmp") and "safetensors" in n for n in staging),
        "after the first shard": lambda final, staging, temps: bool(staging) and any(
            n.startswith("model-00001-") and not n.endswith(".tmp") for n in staging),
        "just before the rename": lambda final, staging, temps: bool(staging) and "quantkit.json" in staging,
        "right after the rename": lambda final, staging, temps: final is not None,
    }


_REFERENCES: dict[str, tuple[dict, float]] = {}


def _output(outputs: Path, command: str, tag) -> Path:
    """Where one case of ``command`` writes: a .gguf file or an artifact directory."""
    return outputs / f"{command.replace(' ', '-')}-{tag}{'.gguf' if COMMANDS[command][1] else ''}"


def _reference(command, launcher, model, outputs, extra) -> tuple[dict, float]:
    """The uninterrupted run's bytes and how long it took."""
    if command not in _REFERENCES:
        build = COMMANDS[command][0]
        final = _output(outputs, command, "reference")
        outcome = launcher.run(build(model, final, extra))
        assert outcome.code == 0, outcome.stderr[-3000:]
        # a second run times the work alone (a first run also pays for lazy imports): the random kills' range
        started = time.monotonic()
        again = launcher.run(build(model, final.with_name(final.name + "-timing"), extra))
        assert again.code == 0, again.stderr[-3000:]
        _REFERENCES[command] = snapshot(final), time.monotonic() - started
    return _REFERENCES[command]


@pytest.fixture(scope="module")
def training_extra(training_text, tmp_path_factory, tiny_checkpoint_factory):
    return str(training_text), str(tmp_path_factory.mktemp("cache")), str(tiny_checkpoint_factory(num_hidden_layers=4))


def _killed_commands() -> list[str]:
    """Every command in the full run; the reduced one (make test) leaves out the training commands,
    whose reference runs alone take minutes."""
    return [c for c in COMMANDS if full_run() or COMMANDS[c][3] > 0]


@pytest.mark.parametrize("command", _killed_commands())
def test_killed_runs_resume_to_the_same_bytes(command, launcher, model, outputs, tally, training_extra):
    build, is_file, resume_flag, quick, full = COMMANDS[command]
    training = command.startswith(("qat", "draft"))
    launcher.env = {"QUANTKIT_CACHE": training_extra[1]} if training else {}
    reference, seconds = _reference(command, launcher, model, outputs, training_extra)
    size = len(reference[""]) if is_file else 0
    kills = kill_cases(cases(quick, full), seconds, seed=hash(command) % 1000,
                       triggers=_triggers(is_file, size) if not training else {})
    if training:  # their checkpoints are the only resumable state: kill after one was written
        kills.append(KillCase("kill after a checkpoint", trigger=lambda final, staging, temps: bool(staging) and any(
            n.endswith((".pt", ".safetensors")) and not n.startswith(".") for n in staging)))
    problems = []
    for number, case in enumerate(kills):
        final = _output(outputs, command, number)
        problems += run_kill_case(launcher, tally, command, build(model, final, training_extra), final, reference,
                                  case, resume_flag)
    assert not problems, "\n".join(problems)


FSIZE_LIMITS = {False: (4096, 100_000, 300_000, 700_000), True: (4096, 100_000, 400_000, 700_000)}


@pytest.mark.parametrize("command", ["quantize rtn-w4g128", "export gguf q4_k_m"])
def test_write_errors_are_one_clear_line_and_leave_nothing_under_the_final_name(command, launcher, model, outputs,
                                                                                 tally, training_extra):
    build, is_file, resume_flag, *_ = COMMANDS[command]
    launcher.env = {}
    reference, _ = _reference(command, launcher, model, outputs, training_extra)
    limits = FSIZE_LIMITS[is_file] if full_run() else FSIZE_LIMITS[is_file][::2]
    row = tally.row(command, "file size limit (RLIMIT_FSIZE)")
    problems = []
    for limit in limits:
        final = _output(outputs, command, f"fsize{limit}")
        row.cases += 1
        outcome = launcher.run(build(model, final), fsize=limit)
        row.tracebacks += outcome.traceback
        if outcome.clear_error and "cannot write" in outcome.stderr and final.name in outcome.stderr:
            row.clear_errors += 1
        else:
            problems.append(f"limit {limit}: not one clear error naming the file: {outcome.stderr[-2000:]}")
        if final.exists():
            row.partial_outputs += 1
            problems.append(f"limit {limit}: {final} exists after a failed write")
        resume = [resume_flag] if resume_flag and staging_dir(final).exists() else []
        rerun = launcher.run(build(model, final) + resume)
        row.resumes += 1
        row.identical += rerun.code == 0 and snapshot(final) == reference
        if rerun.code != 0 or snapshot(final) != reference:
            problems.append(f"limit {limit}: rerun gave other bytes ({rerun.stderr[-500:]})")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------------
# Two runs, one output

def _wait_for(condition, proc, timeout=300.0) -> bool:
    started = time.monotonic()
    while not condition():
        if proc.poll() is not None or time.monotonic() - started > timeout:
            return False
        time.sleep(0.002)
    return True


@pytest.mark.parametrize("command", ["quantize gptq-w4g128", "export gguf q4_k_m"])
def test_a_second_run_into_the_same_output_is_refused(command, launcher, model, outputs, tally, training_extra):
    build, _, resume_flag, *_ = COMMANDS[command]
    launcher.env = {}
    reference, _ = _reference(command, launcher, model, outputs, training_extra)
    row = tally.row(command, "second run into a busy output")
    problems = []
    for attempt in range(cases(1, 3)):
        final = _output(outputs, command, f"busy{attempt}")
        lock = final.with_name(final.name + ".lock")
        first = launcher.start(build(model, final))
        if not _wait_for(lock.exists, first):
            problems.append(f"attempt {attempt}: the first run never took its lock")
            first.wait()
            continue
        # the plain second run, and (for quantize) the --resume one, which passes the staging check
        for extra in ([], [resume_flag]) if resume_flag else ([],):
            row.cases += 1
            second = launcher.run(build(model, final) + extra)
            row.tracebacks += second.traceback
            refused = second.clear_error and "being written by another" in second.stderr
            row.clear_errors += refused
            if not refused and not (first.poll() is not None and "already exists" in second.stderr):
                problems.append(f"attempt {attempt} {extra}: second run not refused: {second.code} "
                                f"{second.stderr[-1000:]}")
        done = first.wait()
        row.resumes += 1
        row.identical += done.code == 0 and snapshot(final) == reference
        if done.code != 0 or snapshot(final) != reference:
            problems.append(f"attempt {attempt}: the first run failed or changed: {done.stderr[-1000:]}")
        if lock.exists():
            problems.append(f"attempt {attempt}: {lock} left behind by a finished run")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("command", ["quantize rtn-w4g128", "export gguf q4_k_m"])
def test_a_killed_runs_lock_is_stale_and_taken_over(command, launcher, model, outputs, tally, training_extra):
    build, _, resume_flag, *_ = COMMANDS[command]
    launcher.env = {}
    reference, _ = _reference(command, launcher, model, outputs, training_extra)
    row = tally.row(command, "stale lock of a killed run")
    problems = []
    for attempt in range(cases(1, 3)):
        final = _output(outputs, command, f"stale{attempt}")
        lock = final.with_name(final.name + ".lock")
        row.cases += 1
        if attempt == 0:  # killed as soon as it holds the lock
            first = launcher.start(build(model, final))
            _wait_for(lock.exists, first)
            partial, _ = watch(first, final, {}, KillCase("now", delay=0.0), staging_dir(final))
            row.partial_outputs += partial
        else:  # a lock file naming a process that no longer exists, on another host
            lock.write_text("pid 999999999 on some-other-host\n")
        if not lock.exists():
            problems.append(f"attempt {attempt}: no lock file to recover from")
        resume = [resume_flag] if resume_flag and staging_dir(final).exists() else []
        rerun = launcher.run(build(model, final) + resume)
        row.tracebacks += rerun.traceback
        row.resumes += 1
        row.identical += rerun.code == 0 and snapshot(final) == reference
        if rerun.code != 0 or snapshot(final) != reference:
            problems.append(f"attempt {attempt}: rerun over a stale lock failed: {rerun.stderr[-1000:]}")
    assert not problems, "\n".join(problems)


# calibration rows x tokens far beyond any machine's memory (a tiny model's activations alone: ~1 TB)
OVERSIZED_CALIBRATION = [("calibration.n_samples", 100_000), ("calibration.seq_len", 4096)]


def test_a_calibration_that_cannot_fit_is_refused_before_any_work(launcher, model, outputs, tally, training_extra):
    """Refused up front with the estimate and the binding limit, in far less time than tokenizing it would
    take, nothing under the final name; the same run with a calibration that fits then completes."""
    launcher.env = {}
    reference, _ = _reference("quantize gptq-w4g128", launcher, model, outputs, training_extra)
    row = tally.row("quantize", "calibration beyond memory")
    final = _output(outputs, "quantize gptq-w4g128", "oversized")
    sets = [arg for key, value in OVERSIZED_CALIBRATION for arg in ("--set", f"{key}={value}")]
    row.cases += 1
    started = time.monotonic()
    outcome = launcher.run(["quantize", "--recipe", "gptq-w4g128", "--model", model, "--out", final, "--no-progress",
                            *sets])
    seconds = time.monotonic() - started
    row.tracebacks += outcome.traceback
    refused = outcome.clear_error and "does not fit" in outcome.stderr and "GiB" in outcome.stderr
    row.clear_errors += refused
    row.partial_outputs += final.exists() or staging_dir(final).exists()
    assert refused, outcome.stderr[-2000:]
    assert seconds < 30 and not final.exists() and not staging_dir(final).exists()
    rerun = launcher.run(_quantize("gptq-w4g128")(model, final))
    row.resumes += 1
    row.identical += rerun.code == 0 and snapshot(final) == reference
    assert rerun.code == 0 and snapshot(final) == reference, rerun.stderr[-1000:]


def test_the_lock_excludes_another_process_and_not_its_own(tmp_path):
    """In-process: the same process takes its own lock over (a resumed run in a test); another is refused."""
    import subprocess
    import sys

    from quantkit.errors import QuantkitError
    from quantkit.lock import OutputLock, OutputLockedError, lock_path

    out = tmp_path / "artifact"
    first = OutputLock(out).acquire()
    again = OutputLock(out).acquire()  # same process: taken over, no error
    code = ("import sys; from quantkit.lock import OutputLock, OutputLockedError\n"
            "try:\n    OutputLock(sys.argv[1]).acquire()\nexcept OutputLockedError as e:\n"
            "    print(e); sys.exit(3)\n")
    other = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True)
    assert other.returncode == 3 and f"pid {os.getpid()}" in other.stdout, other.stdout + other.stderr
    first.release()  # no longer the holder: a no-op
    assert lock_path(out).exists()
    again.release()
    assert not lock_path(out).exists()
    assert subprocess.run([sys.executable, "-c", code, str(out)]).returncode == 0
    assert OutputLockedError.__mro__[1:3] == (QuantkitError, RuntimeError)  # the command line prints it as one line


def test_a_killed_writers_temporary_is_removed_by_the_next_write_and_a_live_ones_kept(tmp_path):
    import subprocess
    import sys

    from quantkit.atomic import save_safetensors, write_bytes

    final = tmp_path / "model-Q4_0.gguf"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f".{final.name}.{int(dead.stdout)}-abc123.tmp"
    live = tmp_path / f".{final.name}.{os.getppid()}-def456.tmp"  # the test runner's parent: alive
    other = tmp_path / f".other.gguf.{int(dead.stdout)}-ghi789.tmp"  # another output's: not ours to judge
    for path in (orphan, live, other):
        path.write_bytes(b"partial")
    # save_safetensors writes in a private directory: safetensors strands its own .tmpXXXXXX in it
    orphan_dir = tmp_path / f".{final.name}.{int(dead.stdout)}-jkl012.tmp"
    orphan_dir.mkdir()
    (orphan_dir / ".tmpAbC123").write_bytes(b"partial")
    write_bytes(final, b"whole")
    assert final.read_bytes() == b"whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([final.name, live.name, other.name])
    save_safetensors(tmp_path / "shard.safetensors", {"x": torch.arange(4)})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([final.name, live.name, other.name,
                                                                 "shard.safetensors"])


# ---------------------------------------------------------------------------------------------------
# Hostile input: safetensors headers

def _safetensors(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(blob) if length is None else length) + blob + data


def _good(n=4):
    return {"a": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}


HEADER_CASES = {
    "empty file": b"",
    "truncated length": b"\x10\x00\x00",
    "header length beyond the file": _safetensors(_good(), bytes(16), length=1 << 40),
    "header length 2^64-1": _safetensors(_good(), bytes(16), length=(1 << 64) - 1),
    "non-JSON header": _safetensors(b"\x00\xffnot json at all", bytes(16)),
    "JSON list header": _safetensors(b"[1, 2, 3]"),
    "JSON string header": _safetensors(b'"a"'),
    "deeply nested header": _safetensors(b"[" * 100_000 + b"]" * 100_000),
    "entry not an object": _safetensors({"a": 5}),
    "entry without shape": _safetensors({"a": {"dtype": "F32", "data_offsets": [0, 4]}}, bytes(4)),
    "unknown dtype": _safetensors({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, bytes(16)),
    "offsets out of range": _safetensors({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 50]}},
                                         bytes(16)),
    "offsets reversed": _safetensors({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}}, bytes(16)),
    "negative offset": _safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, bytes(16)),
    "offsets not integers": _safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]}},
                                         bytes(4)),
    "offsets of three": _safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, bytes(8)),
    "overlapping tensors": _safetensors({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                         "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, bytes(24)),
    "dtype inconsistent with bytes": _safetensors({"a": {"dtype": "F64", "shape": [4], "data_offsets": [0, 16]}},
                                                  bytes(16)),
    "absurd shape": _safetensors({"a": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 16]}},
                                 bytes(16)),
    "negative dimension": _safetensors({"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, bytes(16)),
    "shape not a list": _safetensors({"a": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}}, bytes(16)),
    "duplicate names": _safetensors(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                                    b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', bytes(8)),
    "metadata not an object": _safetensors({"__metadata__": [1], **_good()}, bytes(16)),
    "invalid UTF-8 in names": _safetensors(b'{"\xff\xfe": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
                                           bytes(4)),
    "data truncated": _safetensors(_good(1024), bytes(100)),
}


def _checkpoint_dir(root: Path, model: Path, name: str) -> Path:
    """A copy of ``model`` without its weights (config, tokenizer)."""
    folder = root / name
    folder.mkdir(parents=True)
    for path in model.iterdir():
        if path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            shutil.copy(path, folder / path.name)
    return folder


def _clear_checkpoint_error(action, tally_row) -> str | None:
    """Run ``action``; a CheckpointError is a clear error, anything else a problem. Records in the row."""
    tally_row.cases += 1
    tracemalloc.start()
    try:
        action()
    except CheckpointError as e:
        tally_row.clear_errors += 1
        _, peak = tracemalloc.get_traced_memory()
        return None if peak < 64 << 20 else f"allocated {peak} bytes before refusing: {e}"
    except Exception as e:  # noqa: BLE001  (what the test counts)
        tally_row.tracebacks += 1
        return f"{type(e).__name__}: {e}"
    finally:
        tracemalloc.stop()
    return "accepted"


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_corrupt_safetensors_headers_are_refused_before_any_large_allocation(case, tmp_path, model, tally):
    folder = _checkpoint_dir(tmp_path, model, "bad")
    (folder / "model.safetensors").write_bytes(HEADER_CASES[case])
    problem = _clear_checkpoint_error(lambda: CheckpointReader(folder).get("a"), tally.row("checkpoint reader",
                                                                                          "safetensors header"))
    assert problem is None, f"{case}: {problem}"


@settings(max_examples=cases(60, 400), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_safetensors_headers_are_read_or_refused_cleanly(data, tmp_path_factory, tally):
    """Random mutations of a valid file: each is read whole, or refused with a CheckpointError."""
    tensors = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3), "y": torch.ones(4, dtype=torch.int8)}
    from safetensors.torch import save

    raw = bytearray(save(tensors))
    kind = data.draw(st.sampled_from(["flip", "truncate", "splice-json"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            at = data.draw(st.integers(0, len(raw) - 1))
            raw[at] = data.draw(st.integers(0, 255))
    elif kind == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    else:
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + length])
        name = data.draw(st.sampled_from(["x", "y"]))
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        header[name][field] = data.draw(st.one_of(
            st.integers(-2**70, 2**70), st.text(max_size=5), st.none(), st.floats(),
            st.lists(st.integers(-2**70, 2**70), max_size=4), st.sampled_from(["F16", "BF16", "I64", "BOOL"])))
        blob = json.dumps(header).encode()
        raw = bytearray(struct.pack("<Q", len(blob)) + blob + raw[8 + length:])
    path = tmp_path_factory.mktemp("fuzz") / "model.safetensors"
    path.write_bytes(bytes(raw))
    row = tally.row("checkpoint reader", "safetensors fuzz (hypothesis)")
    row.cases += 1
    try:
        header, start = read_header(path)
    except CheckpointError:
        row.clear_errors += 1
        return
    except Exception:
        row.tracebacks += 1
        raise
    for name, info in header.items():  # accepted: every tensor must then read without surprise
        if name != "__metadata__":
            count = 1
            for d in info["shape"]:
                count *= d
            assert info["data_offsets"][1] - info["data_offsets"][0] == count * torch.empty(
                0, dtype=__import__("quantkit.checkpoint").checkpoint.DTYPES[info["dtype"]]).element_size()


# ---------------------------------------------------------------------------------------------------
# Hostile input: checkpoint directories, through the command line

def _index(folder: Path, weight_map: dict) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _dir_cases(root: Path, model: Path) -> dict[str, Path]:
    """Checkpoint folders that must each be refused with one clear error."""
    made = {}

    def make(name):
        made[name] = _checkpoint_dir(root, model, name.replace(" ", "-"))
        return made[name]

    weights = model / "model.safetensors"
    root.mkdir(parents=True, exist_ok=True)
    outside = root / "outside.safetensors"
    shutil.copy(weights, outside)
    _index(make("index names ../"), {"model.embed_tokens.weight": "../outside.safetensors"})
    _index(make("index names an absolute path"), {"model.embed_tokens.weight": str(outside)})
    _index(make("index names a subfolder"), {"model.embed_tokens.weight": "sub/model.safetensors"})
    _index(make("index names a missing shard"), {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"})
    _index(make("index weight_map is a list"), ["model.safetensors"])  # type: ignore[arg-type]
    (make("index is not JSON") / "model.safetensors.index.json").write_text("{ nope")
    (make("index is a JSON list") / "model.safetensors.index.json").write_text("[]")
    _index(make("index names a number"), {"model.embed_tokens.weight": 7})
    folder = make("shard is a symlink to a non-safetensors file")
    (folder / "model.safetensors").symlink_to(model / "config.json")
    folder = make("shard is a directory")
    (folder / "model.safetensors").mkdir()
    folder = make("shard is a named pipe")
    os.mkfifo(folder / "model.safetensors")
    folder = make("pickle weights only (.bin)")
    torch.save({"x": torch.ones(1)}, folder / "pytorch_model.bin")
    folder = make("pickle weights only (.pt)")
    torch.save({"x": torch.ones(1)}, folder / "model.pt")
    folder = make("no config.json")
    shutil.copy(weights, folder / "model.safetensors")
    (folder / "config.json").unlink()
    folder = make("config.json not JSON")
    shutil.copy(weights, folder / "model.safetensors")
    (folder / "config.json").write_text("{ broken")
    folder = make("config disagrees with the tensors")
    shutil.copy(weights, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = config["hidden_size"] * 2
    (folder / "config.json").write_text(json.dumps(config))
    folder = make("config has fewer layers than the tensors")
    shutil.copy(weights, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    folder = make("tensor missing")
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    tensors.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(tensors, folder / "model.safetensors")
    folder = make("tensor stored twice across shards")
    shutil.copy(weights, folder / "a.safetensors")
    shutil.copy(weights, folder / "b.safetensors")
    _index(folder, {"x": "a.safetensors", "y": "b.safetensors"})
    folder = make("tokenizer.json garbage")
    shutil.copy(weights, folder / "model.safetensors")
    (folder / "tokenizer.json").write_text("{ not a tokenizer")
    folder = make("tokenizer files missing")
    shutil.copy(weights, folder / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    return made


DIR_COMMANDS = {
    "quantize": lambda folder, out: ["quantize", "--recipe", "rtn-w4g128", "--model", folder, "--out", out,
                                     *QUANTIZE_SETTINGS],
    "export gguf": lambda folder, out: ["export", "gguf", "--model", folder, "--type", "q8_0", "--out",
                                        f"{out}.gguf", "--no-progress"],
    "inspect": lambda folder, out: ["inspect", folder],
}


@pytest.mark.parametrize("command", list(DIR_COMMANDS))
def test_hostile_checkpoint_directories_are_one_clear_error(command, launcher, model, tmp_path, tally):
    launcher.env = {}
    made = _dir_cases(tmp_path / "dirs", model)
    names = list(made) if full_run() or command != "inspect" else list(made)[::3]
    row = tally.row(command, "hostile checkpoint dir")
    problems = []
    for number, name in enumerate(names):
        row.cases += 1
        outcome = launcher.run(DIR_COMMANDS[command](made[name], tmp_path / f"out{number}"))
        row.tracebacks += outcome.traceback
        if command == "inspect" and outcome.code == 0:
            continue  # inspect describes what it finds; it must only not crash
        row.clear_errors += outcome.clear_error
        if not outcome.clear_error:
            problems.append(f"{name}: exit {outcome.code}, stderr: {outcome.stderr[-1500:]}")
        if list(tmp_path.glob(f"out{number}*")) and not all(
                p.name.endswith((".partial", ".lock")) for p in tmp_path.glob(f"out{number}*")):
            row.partial_outputs += 1
            problems.append(f"{name}: an output was written")
    assert not problems, "\n\n".join(problems)


def test_auto_map_code_is_never_executed(launcher, model, tmp_path, tally):
    """A config and tokenizer config that name remote code: the code is never imported."""
    launcher.env = {}
    folder = _checkpoint_dir(tmp_path, model, "auto-map")
    shutil.copy(model / "model.safetensors", folder / "model.safetensors")
    marker = tmp_path / "EXECUTED"
    code = f"open({str(marker)!r}, 'w').write('x')\n"
    for module in ("configuration_evil", "modeling_evil", "tokenization_evil"):
        (folder / f"{module}.py").write_text(code)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    row = tally.row("quantize / export / generate / eval", "auto_map remote code")
    problems = []
    for number, argv in enumerate([
            ["quantize", "--recipe", "rtn-w4g128", "--model", folder, "--out", tmp_path / "q", *QUANTIZE_SETTINGS],
            ["export", "gguf", "--model", folder, "--type", "q8_0", "--out", tmp_path / "q.gguf", "--no-progress"],
            ["generate", "--model", folder, "--prompt", "Hi", "--max-new-tokens", "2"],
            ["eval", "ppl", "--model", folder, "--max-tokens", "128", "--window", "64"],
            ["inspect", folder]]):
        row.cases += 1
        outcome = launcher.run(argv)
        row.tracebacks += outcome.traceback
        row.clear_errors += outcome.code == 0 or outcome.clear_error
        if marker.exists():
            problems.append(f"{argv[0]}: remote code was executed")
            marker.unlink()
        if outcome.traceback or outcome.code not in (0, 1):
            problems.append(f"{argv[:2]}: exit {outcome.code}: {outcome.stderr[-1500:]}")
    assert not problems, "\n\n".join(problems)


# ---------------------------------------------------------------------------------------------------
# Hostile input: GGUF files and the runtime's arguments

def test_corrupt_gguf_files_are_one_clear_error(launcher, model, outputs, tmp_path, tally, training_extra):
    launcher.env = {}
    reference, _ = _reference("export gguf q4_k_m", launcher, model, outputs, training_extra)
    good = reference[""]
    files = {"empty": b"", "bad magic": b"XXXX" + good[4:], "truncated header": good[:40],
             "truncated data": good[:len(good) // 2], "random bytes": os.urandom(4096),
             "version 99": good[:4] + struct.pack("<I", 99) + good[8:],
             "tensor count huge": good[:8] + struct.pack("<Q", 1 << 60) + good[16:]}
    from quantkit.gguf.importer import convert_gguf

    row = tally.row("publish --dry-run (GGUF check)", "corrupt GGUF")
    conversion = tally.row("GGUF conversion (default model, Hub GGUF files)", "corrupt GGUF")
    problems = []
    for name, data in files.items():
        path = tmp_path / f"{name.replace(' ', '-')}.gguf"
        path.write_bytes(data)
        row.cases += 1
        outcome = launcher.run(["publish", path, "--repo-id", "someone/model", "--dry-run"])
        row.tracebacks += outcome.traceback
        row.clear_errors += outcome.clear_error
        if not outcome.clear_error:
            problems.append(f"{name}: exit {outcome.code}: {outcome.stderr[-1500:]}")
        conversion.cases += 1  # the converter every GGUF model goes through, called as `resolve_model` calls it
        out = tmp_path / f"converted-{path.stem}"
        try:
            convert_gguf(path, out, progress=False)
            problems.append(f"{name}: converted without an error")
        except ValueError as error:
            conversion.clear_errors += str(path) in str(error) and "\n" not in str(error)
        except Exception as error:  # what reaches the user as a traceback
            conversion.tracebacks += 1
            problems.append(f"{name}: conversion raised {type(error).__name__}: {error}")
        conversion.partial_outputs += out.exists()
    assert not problems, "\n\n".join(problems)
    assert conversion.clear_errors == conversion.cases and not conversion.partial_outputs


RUNTIME_CASES = {
    "empty prompt (raw)": ["--prompt", "", "--raw"],  # the tokenizer's BOS alone: a run, or a clear error
    "prompt longer than the context": ["--prompt", "word " * 400, "--raw"],
    "negative temperature": ["--prompt", "Hi", "--temperature", "-1"],
    "NaN temperature": ["--prompt", "Hi", "--temperature", "nan"],
    "infinite temperature": ["--prompt", "Hi", "--temperature", "inf"],
    "top_p 0": ["--prompt", "Hi", "--top-p", "0", "--temperature", "1"],
    "top_p above 1": ["--prompt", "Hi", "--top-p", "1.5", "--temperature", "1"],
    "NaN top_p": ["--prompt", "Hi", "--top-p", "nan", "--temperature", "1"],
    "max_new_tokens 0": ["--prompt", "Hi", "--max-new-tokens", "0"],
    "prefill_chunk 0": ["--prompt", "Hi", "--prefill-chunk", "0"],
    "bad sparse config": ["--prompt", "Hi", "--sparse-config", "{not json"],
    "draft of another vocabulary": ["--prompt", "Hi", "--draft", "<other-vocabulary>"],
    "draft tokens 0": ["--prompt", "Hi", "--draft-tokens", "0"],
    "draft tokens neither a count nor auto": ["--prompt", "Hi", "--draft-tokens", "many"],
}


@pytest.mark.parametrize("case", list(RUNTIME_CASES))
def test_generate_refuses_bad_arguments_with_one_clear_error(case, launcher, model, tally, tiny_checkpoint_factory):
    launcher.env = {}
    row = tally.row("generate", "bad prompt / sampling argument")
    row.cases += 1
    other = str(tiny_checkpoint_factory(vocab_size=1024))  # a draft model of another vocabulary than the target
    arguments = [other if argument == "<other-vocabulary>" else argument for argument in RUNTIME_CASES[case]]
    outcome = launcher.run(["generate", "--model", model, "--max-new-tokens", "2", *arguments])
    row.tracebacks += outcome.traceback
    row.clear_errors += outcome.clear_error
    allowed_to_run = case.startswith("empty prompt") and outcome.code == 0
    assert outcome.clear_error or allowed_to_run, f"{case}: exit {outcome.code}: {outcome.stderr[-1500:]}"


# ---------------------------------------------------------------------------------------------------
# Hostile input: recipes and --set, property-based

KEYS = ["name", "description", "algorithm", "format", "prefix_tokens", "prefix_linears", "quant", "quant.bits",
        "quant.group_size", "quant.sym", "quant.ternary", "gptq", "gptq.damp_percent", "gptq.desc_act",
        "gptq.group_aware", "gptq.clip_search", "gptq.static_groups", "calibration", "calibration.n_samples",
        "calibration.seq_len", "calibration.seed", "calibration.source", "smooth.enabled", "qat.tokens",
        "qat.warmup", "qat.batch_tokens", "compute_dtype", "nonsense", "quant.nonsense", "quant.bits.deeper",
        "", ".", "quant.", ".bits", "a..b"]
TEXTS = st.one_of(st.sampled_from(["4", "3", "-1", "0", "1e-3", "true", "null", "~", "[1, 2]", "{a: 1}", "gptq",
                                   "gguf-q4_k_m", "'", "[", "{", ": :", "1e999", ".nan", "!!python/object:os.system",
                                   "0x10", "128", "2", "8", "float32", "'4'", "- a"]),
                  st.text(max_size=12))


def _settings(draw_pairs) -> list[str]:
    return [f"{key}={value}" if sep else key for key, sep, value in draw_pairs]


@settings(max_examples=cases(40, 300), deadline=None, suppress_health_check=list(HealthCheck))
@given(pairs=st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(["=", ""]), TEXTS), max_size=3),
       recipe=st.sampled_from(["rtn-w4g128", "gptq-w4g128", "awq-w4g128", "gguf-q4_k_m", "qat-ternary-g32"]))
def test_fuzzed_set_overrides_are_valid_or_one_clear_error(pairs, recipe, model, tmp_path_factory, tally):
    """Through the command line in-process; --out exists, so a valid recipe stops at that check."""
    from click.testing import CliRunner

    from quantkit.cli import main

    out = tmp_path_factory.mktemp("exists")
    args = [arg for text in _settings(pairs) for arg in ("--set", text)]
    result = CliRunner().invoke(main, ["quantize", "--recipe", recipe, "--model", str(model), "--out", str(out),
                                       *args, "--no-progress"])
    row = tally.row("quantize --set", "fuzzed overrides (hypothesis)")
    row.cases += 1
    clean = result.exception is None or isinstance(result.exception, SystemExit)
    row.tracebacks += not clean
    assert clean, f"{args}: {type(result.exception).__name__}: {result.exception}"
    assert result.exit_code == 1, result.output
    message = result.output.strip().splitlines()[-1]
    assert message.startswith("Error: "), result.output
    row.clear_errors += 1
    if "already exists" not in message and "trains (it has a 'qat' section)" not in message and pairs:
        # an error about the overrides names the key (or the whole override when it has no key)
        named = [key for key, _, _ in pairs if key and key.split(".")[-1] and key.split(".")[-1] in message]
        assert named or "override" in message or "recipe" in message, message


RECIPE_TEXT = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5000), st.floats(allow_nan=True), st.text(max_size=8),
              st.sampled_from(["rtn", "gptq", "awq", "gptq-v2", "ternary", "q_proj", "default"])),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.sampled_from([k.split(".")[-1] for k in KEYS if k] + ["qat"]),
                                               children, max_size=4)),
    max_leaves=12)


@settings(max_examples=cases(40, 300), deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(st.sampled_from([k for k in KEYS if k and "." not in k] + ["smooth", "qat"]),
                            RECIPE_TEXT, max_size=6),
       raw=st.one_of(st.none(), st.text(max_size=30)))
def test_fuzzed_recipe_files_are_valid_or_one_clear_error(body, raw, tmp_path_factory, tally):
    import yaml

    from quantkit.recipe import RecipeError, load_recipe

    path = tmp_path_factory.mktemp("recipe") / "r.yaml"
    path.write_text(raw if raw is not None else yaml.safe_dump(body))
    row = tally.row("recipe loader", "fuzzed recipe YAML (hypothesis)")
    row.cases += 1
    try:
        load_recipe(path)
    except RecipeError as e:
        row.clear_errors += 1
        assert str(path) in str(e)
    except Exception:
        row.tracebacks += 1
        raise


def test_listing_sees_a_directory_and_a_file(tmp_path):
    """The poller's own check: a listing is None until something stands under the name."""
    assert listing(tmp_path / "nothing") is None
    (tmp_path / "f").write_bytes(b"abc")
    assert listing(tmp_path / "f") == {"": 3}
