"""Data-parallel QAT under torchrun (quantkit.distributed), proven with real 2-rank gloo jobs on the
CPU, one thread per rank, on a tiny random MiniCPM: a 2-rank run trains as one rank does, gives the same
bytes twice, resumes at another world size, and refuses a world size that does not divide a step.

Run as a script under torchrun (``worker_job``), this file is the worker of the one run the command line
cannot express: a run stopped after a number of steps (``train``'s ``stop_after_steps``, as
tests/test_qat.py uses it)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TIMEOUT, torchrun

# Float reduction tolerance. A step's gradient is the sum of its 4 micro-batches' gradients: one rank adds
# them in order, ((g0 + g1) + g2) + g3, two ranks as (g0 + g2) + (g1 + g3). float32 addition is not
# associative, so the sums may differ in their last bits (6e-8 relative per addition), and AdamW carries
# that into the latent weights; where it moves one across a rounding boundary of the ternary grid, a code
# flips, a step of the grid. The first step's loss is always bit-identical (same weights, same rows, the
# micro-batch losses averaged in the same order); over these 5 steps the losses differ by at most 2.9e-6
# nats of 4.6 (6e-7 relative) and the held-out KL by at most 1.4e-7 nats of 0.016.
# The KL, a small difference of two cross-entropies of ~4.6 nats, is held to an absolute bound in nats,
# the loss to a relative one; both leave a margin of 7x or more, and both are far below what a real fault
# does: a micro-batch lost, counted twice or weighted wrongly moves a step's loss by ~1e-2 relative.
LOSS_TOLERANCE = 1e-5  # relative
KL_TOLERANCE = 1e-6  # nats
SEQ_LEN = 64
STEP_TOKENS = 4 * SEQ_LEN  # 4 micro-batches of one row a step: 2 for each of 2 ranks
STEPS = 5  # 20 rows: the teacher's cache is 2 chunks of 16 rows, one computed by each rank
STOP = 2

pytestmark = pytest.mark.usefixtures("private_cache")


def settings(training_text, **more) -> dict:
    """tests/test_qat.py's small QAT settings, with 4 micro-batches a step, measured and checkpointed every 2,
    the last step's weights written (on the tiny model the held-out KL rises from the start: qat.keep best
    would write the start and compare nothing trained)."""
    return {"qat.seq_len": SEQ_LEN, "qat.batch_tokens": STEP_TOKENS, "qat.eval_interval": 2, "qat.eval_tokens": 128,
            "qat.checkpoint_interval": 2, "qat.data": str(training_text), "qat.learning_rate": 1e-3,
            "qat.top_k": 8, "qat.full_rate_excess": 0.0, "qat.keep": "last", **more}


def cli_qat(ranks: int, model, out, overrides: dict, *more: str, command: str = "ternary",
            **job) -> subprocess.CompletedProcess:
    """`quantkit qat ternary` (or another ``command``) as a user starts it under torchrun, with the tests' settings."""
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    return torchrun(ranks, "-m", "quantkit.cli", "qat", command, "--model", str(model), "--out", str(out),
                    "--tokens", str(STEPS * STEP_TOKENS), "--no-progress", "--json", *sets, *more, **job)


def stopped_job(ranks: int, **spec) -> list[list[str]]:
    """A run of ``ranks`` processes stopped after ``spec["stop_after_steps"]``, its checkpoint left as an
    interruption leaves it: ``train(**spec)`` on every rank, by this file's ``__main__``. Returns each rank's
    threads still running once ``train`` has returned (their names, in any order of ranks)."""
    done = torchrun(ranks, __file__, json.dumps(spec, default=str))
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]


def one_rank(model, out, overrides: dict, **kwargs):
    """The run in this process, on one thread as each rank runs."""
    from quantkit.device import torch_threads
    from quantkit.eval.ppl import perplexity
    from quantkit.qat import run_qat
    from quantkit.recipe import load_recipe

    with torch_threads(1):
        return run_qat(model, load_recipe("qat-ternary-g32", overrides), out, tokens=STEPS * STEP_TOKENS,
                       perplexity=perplexity, progress=False, **kwargs)


def logged(out: Path, key: str) -> list[float]:
    return [entry[key] for entry in json.loads((out / "qat_log.json").read_text()) if key in entry]


def assert_trains_alike(out: Path, reference: Path) -> None:
    """Every step's loss and every held-out KL measured (the last: the artifact's, qat.keep last) agree
    within the tolerance; the first step's loss exactly."""
    ours, theirs = logged(out, "loss"), logged(reference, "loss")
    assert len(ours) == len(theirs) == STEPS and ours[0] == theirs[0]
    assert ours == pytest.approx(theirs, rel=LOSS_TOLERANCE, abs=0)
    assert len(logged(out, "heldout_kl")) == 4  # steps 0, 2, 4 and the last
    assert logged(out, "heldout_kl") == pytest.approx(logged(reference, "heldout_kl"), rel=0, abs=KL_TOLERANCE)


def teacher_chunks() -> dict[str, int]:
    """The teacher cache's chunk files, with the time each was written."""
    return {path.name: path.stat().st_mtime_ns
            for path in Path(os.environ["QUANTKIT_CACHE"]).glob("qat-teacher/*/rows-*.safetensors")}


@pytest.fixture(scope="module")
def model(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(hidden_size=256, intermediate_size=512)


@pytest.fixture(scope="module")
def two_ranks(model, training_text, tmp_path_factory):
    """A 2-rank run through the command line, the first run of the module, so its ranks build the teacher's
    cache: its output, --json report, and the cache's chunks as it left them."""
    out = tmp_path_factory.mktemp("two-ranks") / "out"
    done = cli_qat(2, model, out, settings(training_text))
    return out, json.loads(done.stdout), teacher_chunks()


@pytest.fixture(scope="module")
def one_rank_reference(model, training_text, two_ranks, tmp_path_factory):
    out = tmp_path_factory.mktemp("one-rank") / "out"
    one_rank(model, out, settings(training_text))
    return out


def test_each_step_deals_every_row_once_over_the_ranks():
    """Rank r takes micro-batches r, r + W, ... of each step: a step's rows over the ranks are the rows one
    process takes in that step, each once, as many on each rank; over an epoch, the data, each row once."""
    import torch

    from quantkit.distributed import World
    from quantkit.training.data import TrainingData

    data = TrainingData(torch.zeros(24, 8, dtype=torch.long), seed=3, fingerprint="", described={})
    rows_per_step, size, micro_batches = 8, 2, 4  # 3 steps an epoch
    for world_size in (1, 2, 4):
        epoch = []
        for step in range(3):
            per_rank = [[row for micro in World(rank, world_size).share(micro_batches)
                         for row in data.micro_batch(step, micro, rows_per_step, size)] for rank in range(world_size)]
            dealt = [row for rows in per_rank for row in rows]
            assert sorted(dealt) == sorted(data.row_ids(step * rows_per_step, rows_per_step))
            assert len(set(dealt)) == rows_per_step
            assert {len(rows) for rows in per_rank} == {rows_per_step // world_size}
            epoch += dealt
        assert sorted(epoch) == list(range(24))


def artifact_kl(model_dir: Path, artifact: Path) -> float:
    """The artifact's held-out KL to ``model_dir``, measured from its files as the trainer measures it."""
    import torch

    from quantkit import calib
    from quantkit.loading import load_model
    from quantkit.qat.teacher import heldout_kl, heldout_targets
    from quantkit.tokenizer import load_tokenizer

    tokens = calib.heldout_tokens(load_tokenizer(model_dir), "austen", max_tokens=128)
    targets = heldout_targets(load_model(model_dir, torch.float32), tokens, SEQ_LEN)
    return heldout_kl(load_model(artifact), targets)


def test_two_ranks_train_as_one_rank_does(model, two_ranks, one_rank_reference):
    out, report, _ = two_ranks
    assert_trains_alike(out, one_rank_reference)
    trained = artifact_kl(model, out)
    assert trained != logged(out, "heldout_kl")[0]  # not the start's weights
    assert trained == pytest.approx(artifact_kl(model, one_rank_reference), rel=0, abs=KL_TOLERANCE)
    assert (report["world_size"], report["backend"], report["threads"]) == (2, "gloo", 1)
    assert len(report["rank_tokens_per_second"]) == 2 and min(report["rank_tokens_per_second"]) > 0
    assert len(report["rank_collective_share"]) == 2 and all(0 < share < 1 for share in report["rank_collective_share"])
    assert (report["steps"], report["tokens"]) == (STEPS, STEPS * STEP_TOKENS)
    assert not (out / "qat_checkpoint").exists()
    recorded = json.loads((out / "quantkit.json").read_text())["qat"]
    assert (recorded["world_size"], recorded["backend"]) == (2, "gloo")
    recorded = json.loads((one_rank_reference / "quantkit.json").read_text())["qat"]
    assert (recorded["world_size"], recorded["backend"]) == (1, None)


def test_a_cache_two_ranks_built_is_read_by_one(two_ranks, one_rank_reference):
    """The 2-rank run's ranks computed the teacher cache's 2 chunks; the 1-rank run read them, writing none."""
    built = two_ranks[2]
    assert sorted(built) == ["rows-000000.safetensors", "rows-000016.safetensors"]
    assert teacher_chunks() == built


def test_the_same_two_rank_run_gives_the_same_bytes(model, training_text, two_ranks, tmp_path):
    out = tmp_path / "again"
    cli_qat(2, model, out, settings(training_text))
    reference = two_ranks[0]
    files = sorted(path.name for path in reference.glob("*.safetensors")) + ["qat_log.json", "config.json"]
    assert len(files) > 2
    for name in files:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


def test_two_ranks_stopped_resume_on_one(model, training_text, one_rank_reference, tmp_path):
    out = tmp_path / "out"
    stopped_job(2, model=model, overrides=settings(training_text), out=out, stop_after_steps=STOP)
    assert not out.exists()
    report = one_rank(model, out, settings(training_text), resume=True)
    assert report.resumed_from_step == STOP and report.world_size == 1
    assert_trains_alike(out, one_rank_reference)


def test_one_rank_stopped_resumes_on_two(model, training_text, two_ranks, tmp_path):
    out = tmp_path / "out"
    stopped_job(1, model=model, overrides=settings(training_text), out=out, stop_after_steps=STOP)
    report = json.loads(cli_qat(2, model, out, settings(training_text), "--resume").stdout)
    assert report["resumed_from_step"] == STOP and report["world_size"] == 2
    assert_trains_alike(out, two_ranks[0])


def test_a_world_size_that_does_not_divide_a_step_is_refused_on_every_rank(model, training_text, tmp_path):
    out = tmp_path / "out"
    done = cli_qat(2, model, out, settings(training_text, **{"qat.batch_tokens": 3 * SEQ_LEN}), check=False,
                   logs=tmp_path / "logs")  # a hang would raise subprocess.TimeoutExpired
    assert done.returncode != 0
    ranks = sorted((tmp_path / "logs").glob("*/attempt_0/*/stderr.log"))
    assert [path.parent.name for path in ranks] == ["0", "1"]
    for log in ranks:  # each rank's whole message: one line, no traceback
        assert log.read_text().strip().splitlines() == [
            "Error: qat: a step's 3 micro-batches (qat.batch_tokens / (qat.seq_len x qat.micro_batch)) cannot be "
            "dealt evenly to 2 ranks: run a number of ranks that divides 3, or change qat.batch_tokens or "
            "qat.micro_batch"]
    assert not out.exists() and not Path(f"{out}.partial").exists()


def test_a_missing_rendezvous_fails_in_one_line_within_the_timeout(model, training_text, tmp_path):
    """Rank 0 of 2 started alone waits for its peer no longer than QUANTKIT_DISTRIBUTED_TIMEOUT."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "QUANTKIT_DISTRIBUTED_TIMEOUT": "3"}
    sets = [arg for key, value in settings(training_text).items() for arg in ("--set", f"{key}={value}")]
    done = subprocess.run([sys.executable, "-m", "quantkit.cli", "qat", "ternary", "--model", str(model), "--out",
                           str(tmp_path / "out"), "--no-progress", *sets], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: rank 0 of 2: no rendezvous with the other ranks at 127.0.0.1:") and "3 s" in last
    assert not (tmp_path / "out").exists()


if __name__ == "__main__":  # a rank of worker_job's job
    import torch

    from quantkit.eval.ppl import perplexity
    from quantkit.qat.trainer import train
    from quantkit.recipe import load_recipe

    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    train(spec["model"], load_recipe("qat-ternary-g32", spec["overrides"]), spec["out"], tokens=STEPS * STEP_TOKENS,
          perplexity=perplexity, progress=False, stop_after_steps=spec["stop_after_steps"],
          shard_state=spec.get("shard_state", "auto"))
    tasks = Path("/proc/self/task")
    print(json.dumps([(tasks / task / "comm").read_text().strip() for task in os.listdir(tasks)]), flush=True)
