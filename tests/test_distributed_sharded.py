"""Fully sharded QAT under torchrun (FSDP2, quantkit.training.sharding) and the sharded checkpoints of
quantkit.training.state, proven with real 2-rank gloo jobs on the CPU, one thread per rank, on
tests/test_distributed.py's tiny model and settings: a sharded run trains as the unsharded one does, each
rank writes half of every tensor, a checkpoint resumes sharded or not at any world size, a rank killed mid-run
leaves no artifact and torchrun's restart finishes the run as if uninterrupted, and refusals only rank 0 can
make stop every rank in one line."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from safetensors import safe_open
from test_distributed import (
    STEP_TOKENS,
    STEPS,
    STOP,
    assert_trains_alike,
    cli_qat,
    logged,
    model,  # noqa: F401 (a fixture)
    one_rank,
    settings,
    stopped_job,
)

from helpers import JOB_ENV, TIMEOUT, torchrun

pytestmark = pytest.mark.usefixtures("private_cache")


def weights(out: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def unsharded(model, training_text, tmp_path_factory):  # noqa: F811
    """A 2-rank data-parallel run left to choose (--shard auto, the default: the tiny model fits, so it does not
    shard), its --json report."""
    out = tmp_path_factory.mktemp("unsharded") / "out"
    return out, json.loads(cli_qat(2, model, out, settings(training_text)).stdout)


@pytest.fixture(scope="module")
def sharded(model, training_text, unsharded, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("sharded") / "out"
    return out, json.loads(cli_qat(2, model, out, settings(training_text), "--shard", "on").stdout)


def test_a_sharded_run_trains_as_the_unsharded_one(sharded, unsharded):
    out, report = sharded
    assert report["sharded"] is True and unsharded[1]["sharded"] is False
    assert (report["world_size"], report["backend"]) == (2, "gloo")
    assert_trains_alike(out, unsharded[0])
    # bit for bit: both sum a step's gradients once, in the same order, and the gradient's norm (summed shard by
    # shard when sharded) stays under qat.grad_clip here (about 0.2 of 1.0), so it clips nothing
    assert logged(out, "loss") == logged(unsharded[0], "loss") and weights(out) == weights(unsharded[0])
    assert json.loads((out / "quantkit.json").read_text())["qat"]["sharded"] is True


def test_dwq_trains_sharded_as_unsharded(model, training_text, tmp_path):  # noqa: F811
    """DWQ's scales and biases shard as QAT's latent weights do; the codes, a buffer, stay whole on every rank.
    Not bit for bit: the gradient's norm, which DWQ's steps are clipped by, is summed shard by shard."""
    overrides = settings(training_text, **{"qat.learning_rate": 1e-4})
    for shard in ("off", "on"):
        cli_qat(2, model, tmp_path / shard, overrides, "--shard", shard, command="dwq")
    assert_trains_alike(tmp_path / "on", tmp_path / "off")


def test_auto_does_not_shard_what_fits(unsharded):
    assert unsharded[1]["sharded"] is False and unsharded[1]["world_size"] == 2


class Stopped(NamedTuple):
    out: Path  # the interrupted run's files beside it
    threads: list[list[str]]  # each rank's threads still running once the run was over


@pytest.fixture(scope="module")
def stopped_sharded(model, training_text, tmp_path_factory) -> Stopped:  # noqa: F811
    """A sharded 2-rank run stopped after STOP steps."""
    out = tmp_path_factory.mktemp("stopped-sharded") / "out"
    return Stopped(out, stopped_job(2, model=model, overrides=settings(training_text), out=out, stop_after_steps=STOP,
                                    shard_state="on"))


def test_a_sharded_run_leaves_no_thread_of_its_process_group(stopped_sharded):
    """FSDP's modules and DTensor's caches hold the group; had its gloo threads (gloo_tcp_loop, pt_gloo_runloop)
    lived on, the interpreter would destroy them at its exit, where a rank can abort after its work is done."""
    assert len(stopped_sharded.threads) == 2
    assert not [name for threads in stopped_sharded.threads for name in threads if "gloo" in name], \
        stopped_sharded.threads


def resumable_copy(stopped: Path, out: Path) -> Path:
    """``out`` with a copy of the interrupted run at ``stopped``, for a test that resumes (and so consumes) it."""
    shutil.copytree(f"{stopped}.partial", f"{out}.partial")
    return out


def test_each_rank_writes_half_of_every_tensor(stopped_sharded):
    checkpoint = Path(f"{stopped_sharded.out}.partial") / "qat_checkpoint"
    record = json.loads((checkpoint / "checkpoint.json").read_text())
    assert record["step"] == STOP
    files = sorted((checkpoint / record["folder"]).glob("*.safetensors"))
    assert [path.name for path in files] == ["shard-00001-model-00001-of-00001.safetensors",
                                             "shard-00002-model-00001-of-00001.safetensors"]
    rows = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if name.startswith(("param/", "exp_avg/")):
                    rows.setdefault(name, []).append(f.get_slice(name).get_shape()[0])
    assert rows and all(len(parts) == 2 and parts[0] == parts[1] for parts in rows.values()), rows


def test_a_sharded_checkpoint_resumes_in_one_process(model, training_text, stopped_sharded, unsharded,  # noqa: F811
                                                     tmp_path):
    out = resumable_copy(stopped_sharded.out, tmp_path / "out")
    report = one_rank(model, out, settings(training_text), resume=True)
    assert report.resumed_from_step == STOP and (report.world_size, report.sharded) == (1, False)
    assert_trains_alike(out, unsharded[0])


def test_a_one_process_checkpoint_resumes_sharded(model, training_text, sharded, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    stopped_job(1, model=model, overrides=settings(training_text), out=out, stop_after_steps=STOP)
    report = json.loads(cli_qat(2, model, out, settings(training_text), "--shard", "on", "--resume").stdout)
    assert report["resumed_from_step"] == STOP and report["sharded"] is True
    assert_trains_alike(out, sharded[0])


def test_shard_on_needs_ranks(model, training_text, tmp_path):  # noqa: F811
    from quantkit.run import RunError

    with pytest.raises(RunError, match="--shard on: sharding splits the training state over the ranks"):
        one_rank(model, tmp_path / "out", settings(training_text), shard_state="on")


def rank_pid(job: subprocess.Popen, rank: int) -> int | None:
    """The pid of ``job``'s worker of ``rank``: torchrun's child whose environment says RANK=rank."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == job.pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def killed_after_a_checkpoint(model, training_text, out: Path, restarts: int) -> subprocess.CompletedProcess:  # noqa: F811
    """A sharded 2-rank run with --resume under torchrun --max-restarts ``restarts``, rank 1 killed (SIGKILL) as
    soon as the run's first checkpoint is committed. Its steps: 4 times tests/test_distributed.py's."""
    overrides = settings(training_text, **{"qat.checkpoint_interval": 1})
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    record = Path(f"{out}.partial") / "qat_checkpoint" / "checkpoint.json"
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         f"--max-restarts={restarts}", "--log-dir", str(out.parent / "logs"), "--redirects", "2",
         "-m", "quantkit.cli", "qat", "ternary", "--model", str(model), "--out",
         str(out), "--tokens", str(4 * STEPS * STEP_TOKENS), "--no-progress", "--json", "--shard", "on", "--resume",
         *sets], env={**os.environ, **JOB_ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + TIMEOUT
    while not record.is_file() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    victim = rank_pid(job, 1)
    assert victim is not None and job.poll() is None, "the run ended before its first checkpoint"
    os.kill(victim, signal.SIGKILL)
    stdout, stderr = job.communicate(timeout=TIMEOUT)
    ranks = "".join(f"\n--- {log.relative_to(out.parent)}:\n{log.read_text()[-2000:]}"
                    for log in sorted((out.parent / "logs").glob("*/attempt_*/*/stderr.log")))
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr[-2000:] + ranks)


@pytest.fixture(scope="module")
def uninterrupted_long(model, training_text, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("long") / "out"
    cli_qat(2, model, out, settings(training_text, **{"qat.checkpoint_interval": 1}), "--shard", "on",
            "--tokens", str(4 * STEPS * STEP_TOKENS))
    return out


def test_a_killed_rank_leaves_no_artifact_and_resume_finishes_the_run(model, training_text, uninterrupted_long,  # noqa: F811
                                                                      tmp_path):
    out = tmp_path / "out"
    done = killed_after_a_checkpoint(model, training_text, out, restarts=0)
    assert done.returncode != 0 and not out.exists()
    assert json.loads((Path(f"{out}.partial") / "qat_checkpoint" / "checkpoint.json").read_text())["step"] >= 1
    cli_qat(2, model, out, settings(training_text, **{"qat.checkpoint_interval": 1}), "--shard", "on",
            "--tokens", str(4 * STEPS * STEP_TOKENS), "--resume")
    assert weights(out) == weights(uninterrupted_long)
    assert logged(out, "loss") == logged(uninterrupted_long, "loss")


def test_torchrun_restarts_a_killed_run_from_its_checkpoint(model, training_text, uninterrupted_long, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    done = killed_after_a_checkpoint(model, training_text, out, restarts=1)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["resumed_from_step"] >= 1 and report["steps"] == 4 * STEPS
    assert weights(out) == weights(uninterrupted_long)
    assert logged(out, "loss") == logged(uninterrupted_long, "loss")


def test_an_existing_output_is_refused_on_every_rank(model, training_text, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    out.mkdir()
    done = cli_qat(2, model, out, settings(training_text), check=False, logs=tmp_path / "logs")
    assert done.returncode != 0
    ranks = sorted((tmp_path / "logs").glob("*/attempt_0/*/stderr.log"))
    assert [path.parent.name for path in ranks] == ["0", "1"]
    lines = [log.read_text().strip().splitlines() for log in ranks]
    assert lines[0] == lines[1] and len(lines[0]) == 1 and lines[0][0].startswith("Error: ")
    assert "already exists" in lines[0][0]


def test_a_checkpoint_of_other_inputs_is_refused_on_every_rank(model, training_text, stopped_sharded,  # noqa: F811
                                                               tmp_path):
    out = resumable_copy(stopped_sharded.out, tmp_path / "out")
    other = settings(training_text, **{"qat.learning_rate": 2e-3})
    done = cli_qat(2, model, out, other, "--resume", check=False, logs=tmp_path / "logs")
    assert done.returncode != 0
    ranks = sorted((tmp_path / "logs").glob("*/attempt_0/*/stderr.log"))
    lines = [log.read_text().strip().splitlines() for log in ranks]
    assert len(lines) == 2 and lines[0] == lines[1] and len(lines[0]) == 1
    assert lines[0][0].startswith("Error: ") and "was started with a different" in lines[0][0]


def test_ranks_on_mixed_devices_are_refused_on_every_rank(tmp_path):
    """Rank 1 says it runs on a GPU, rank 0 on the CPU: each stops with the same line, naming both."""
    done = torchrun(2, __file__, check=False, logs=tmp_path / "logs")
    assert done.returncode != 0
    for log in sorted((tmp_path / "logs").glob("*/attempt_0/*/stderr.log")):
        rank = log.parent.name
        assert log.read_text().strip().splitlines()[-1] == (
            f"rank {rank} of 2: the ranks run on different devices (rank 0 cpu, rank 1 cuda), whose collectives "
            "need different backends (gloo on CPUs, NCCL on GPUs): give every rank the same --device")


if __name__ == "__main__":  # a rank of test_ranks_on_mixed_devices_are_refused_on_every_rank's job
    from quantkit.distributed import DistributedError, joined

    with joined("cpu") as world:  # the group every rank makes (gloo); then each compares the device it names
        try:
            world.refuse_mixed_devices("cuda" if world.rank == 1 else "cpu")
        except DistributedError as e:
            print(e, file=sys.stderr)
            sys.exit(1)
