"""Data-parallel draft-head training under torchrun (quantkit.distributed), proven with real 2-rank
gloo jobs on the CPU, one thread per rank, on tests/test_draft.py's tiny random target: a 2-rank run trains
as one rank does, gives the same bytes twice, resumes on one rank, and refuses a world size that does not
divide a step.

Run as a script under torchrun, this file is the worker of the one run the command line cannot express: a
run stopped after a number of steps (``train_head``'s ``stop_after_steps``, as tests/test_draft.py uses it)."""
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import torchrun

# Float reduction tolerance. Each draft step's loss is a mean over the positions of the step's 4 rows; two
# ranks each sum the positions of their 2 rows and the two sums are added, where one process sums all 4 at
# once, and each gradient is likewise two rows' matmul per rank plus an all_reduce instead of one matmul
# over 4 rows. float32 addition is not associative: the results differ in their last bits (6e-8 relative
# per addition), from the first step's loss on, and AdamW carries the difference into the weights. Over
# these 8 steps the losses differ by at most 1.6e-7 relative (the held-out losses, measured at the start
# and the end, came out equal); the bound leaves a margin of 60x, and a real fault is far outside it:
# gradients not summed over the ranks (each rank stepping on its half) move the second step's loss by
# 1.7e-2 relative.
LOSS_TOLERANCE = 1e-5  # relative
# A W4 head's linears are fake-quantized: a weight whose latent value differs in its last bits can round to the
# next code, a whole grid step. Over 8 steps the losses of a sharded-then-resumed W4 run differ from one process's
# by up to 1.1e-5 relative (step 7, on an AVX-512 EPYC; below 1e-5 on AVX2 ones): the bound leaves 9x, and a
# real fault (1.7e-2) stays 170x outside it.
W4_LOSS_TOLERANCE = 1e-4  # relative
SEQ_LEN, BATCH_ROWS = 64, 4  # 2 rows a step for each of 2 ranks
STEPS = 8  # 32 rows: the target features' cache is 2 chunks of 16 rows, one computed by each rank
STOP = 3
TINY_RUN = {"tokens": STEPS * BATCH_ROWS * SEQ_LEN, "seq_len": SEQ_LEN, "batch_rows": BATCH_ROWS, "ttt_steps": 2,
            "draft_vocab": 64}

pytestmark = pytest.mark.usefixtures("private_cache")


def cli_options(run: dict) -> list[str]:
    return [arg for key, value in run.items() for arg in (f"--{key.replace('_', '-')}", str(value))]


def settings(run: dict):
    """The settings `quantkit draft train` makes of the options ``run``."""
    from quantkit.cli.draft import DRAFT_DEFAULTS

    return replace(DRAFT_DEFAULTS, **run)


def cli_train(ranks: int, target, out, run: dict, *more: str, **job):
    """`quantkit draft train` as a user starts it under torchrun."""
    return torchrun(ranks, "-m", "quantkit.cli", "draft", "train", "--target", str(target), "--out", str(out),
                    *cli_options(run), "--no-progress", "--json", *more, **job)


def one_rank(target, out, run: dict, **kwargs):
    """The run in this process, on one thread as each rank runs."""
    from quantkit.device import torch_threads
    from quantkit.draft.trainer import train_head

    with torch_threads(1):
        return train_head(target, out, settings(run), progress=False, **kwargs)


def logged(out: Path, key: str) -> list[float]:
    return [entry[key] for entry in json.loads((out / "draft_train.json").read_text())["log"] if key in entry]


def assert_trains_alike(out: Path, reference: Path, tolerance: float = LOSS_TOLERANCE) -> None:
    """Every step's loss and every held-out loss measured (the start's and the last step's) agree within
    ``tolerance`` (relative)."""
    ours, theirs = logged(out, "loss"), logged(reference, "loss")
    assert len(ours) == len(theirs) == STEPS
    assert ours == pytest.approx(theirs, rel=tolerance, abs=0)
    assert len(logged(out, "heldout_loss")) == 2
    assert logged(out, "heldout_loss") == pytest.approx(logged(reference, "heldout_loss"), rel=tolerance, abs=0)


def feature_chunks() -> dict[str, int]:
    """The target features' chunk files, with the time each was written."""
    return {path.name: path.stat().st_mtime_ns
            for path in Path(os.environ["QUANTKIT_CACHE"]).glob("draft-features/*/rows-*.safetensors")}


@pytest.fixture(scope="module")
def target(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(num_hidden_layers=8)


@pytest.fixture(scope="module")
def run(training_text) -> dict:
    return {**TINY_RUN, "data": str(training_text)}


@pytest.fixture(scope="module")
def two_ranks(target, run, tmp_path_factory):
    """A 2-rank run through the command line, the first run of the module, so its ranks build the target
    features' cache: its output, --json report, and the cache's chunks as it left them."""
    out = tmp_path_factory.mktemp("two-ranks") / "head"
    done = cli_train(2, target, out, run)
    return out, json.loads(done.stdout), feature_chunks()


@pytest.fixture(scope="module")
def one_rank_reference(target, run, two_ranks, tmp_path_factory):
    out = tmp_path_factory.mktemp("one-rank") / "head"
    one_rank(target, out, run)
    return out


def test_two_ranks_train_as_one_rank_does(two_ranks, one_rank_reference):
    out, report, _ = two_ranks
    assert_trains_alike(out, one_rank_reference)
    assert logged(out, "heldout_loss")[-1] < logged(out, "heldout_loss")[0]  # trained, not the start
    assert (report["world_size"], report["backend"], report["threads"]) == (2, "gloo", 1)
    assert len(report["rank_tokens_per_second"]) == 2 and min(report["rank_tokens_per_second"]) > 0
    assert len(report["rank_collective_share"]) == 2 and all(0 < share < 1 for share in report["rank_collective_share"])
    assert (report["steps"], report["tokens"]) == (STEPS, TINY_RUN["tokens"])
    assert {path.name for path in out.iterdir()} == {"config.json", "model.safetensors", "draft_train.json",
                                                     "draft_report.json"}
    recorded = json.loads((out / "draft_report.json").read_text())
    assert (recorded["world_size"], recorded["backend"], recorded["sharded"]) == (2, "gloo", False)
    recorded = json.loads((one_rank_reference / "draft_report.json").read_text())
    assert (recorded["world_size"], recorded["backend"], recorded["rank_tokens_per_second"],
            recorded["rank_collective_share"]) == (1, None, [recorded["tokens_per_second"]], [0.0])


def test_features_two_ranks_cached_are_read_by_one(two_ranks, one_rank_reference):
    """The 2-rank run's ranks computed the features' 2 chunks; the 1-rank run read them, writing none."""
    built = two_ranks[2]
    assert sorted(built) == ["rows-000000.safetensors", "rows-000016.safetensors"]
    assert feature_chunks() == built


def test_the_same_two_rank_run_gives_the_same_bytes(target, run, two_ranks, tmp_path):
    out = tmp_path / "again"
    cli_train(2, target, out, run)
    for name in ("model.safetensors", "config.json", "draft_train.json"):  # the report holds timings
        assert (out / name).read_bytes() == (two_ranks[0] / name).read_bytes(), name


def test_two_ranks_stopped_resume_on_one(target, run, one_rank_reference, tmp_path):
    out = tmp_path / "head"
    torchrun(2, __file__, json.dumps({"target": str(target), "out": str(out), "run": run}))
    assert not out.exists() and (tmp_path / "head.partial" / "draft_checkpoint" / "checkpoint.json").is_file()
    report = one_rank(target, out, run, resume=True)
    assert report.resumed_from_step == STOP and report.world_size == 1
    assert_trains_alike(out, one_rank_reference)


def test_a_sharded_head_trains_as_the_unsharded_one(target, run, two_ranks, tmp_path):
    """--shard on: each module of the head a unit of its own, its parameters, gradients and moments split over
    the ranks; the same steps as the 2-rank data-parallel run, within the tolerance."""
    out = tmp_path / "head"
    report = json.loads(cli_train(2, target, out, run, "--shard", "on").stdout)
    assert report["sharded"] is True and two_ranks[1]["sharded"] is False
    assert_trains_alike(out, two_ranks[0])
    assert {path.name for path in out.iterdir()} == {"config.json", "model.safetensors", "draft_train.json",
                                                     "draft_report.json"}


def test_a_sharded_checkpoint_of_a_w4_head_resumes_in_one_process(target, run, tmp_path):
    """The W4 head (fake-quantized linears, whose grid weight a sharded forward rounds anew each time): stopped
    sharded on 2 ranks, finished by one process, as one process trains it uninterrupted."""
    out, reference = tmp_path / "head", tmp_path / "reference"
    w4 = {**run, "w4": "gptq"}
    torchrun(2, __file__, json.dumps({"target": str(target), "out": str(out), "run": w4, "shard_state": "on"}))
    report = one_rank(target, out, w4, resume=True)
    assert report.resumed_from_step == STOP and (report.world_size, report.sharded) == (1, False)
    one_rank(target, reference, w4)
    assert_trains_alike(out, reference, W4_LOSS_TOLERANCE)


def test_a_world_size_that_does_not_divide_a_step_is_refused_on_every_rank(target, run, tmp_path):
    out = tmp_path / "head"
    done = cli_train(2, target, out, {**run, "batch_rows": 3}, check=False, logs=tmp_path / "logs")
    assert done.returncode != 0
    ranks = sorted((tmp_path / "logs").glob("*/attempt_0/*/stderr.log"))
    assert [path.parent.name for path in ranks] == ["0", "1"]
    for log in ranks:  # each rank's whole message: one line, no traceback
        assert log.read_text().strip().splitlines() == [
            "Error: draft train: a step's 3 rows (--batch-rows) cannot be dealt evenly to 2 ranks: run a number "
            "of ranks that divides 3, or change --batch-rows"]
    assert not out.exists() and not (tmp_path / "head.partial").exists()


if __name__ == "__main__":  # a rank of test_two_ranks_stopped_resume_on_one's job
    import torch

    from quantkit.draft.trainer import train_head

    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    train_head(spec["target"], spec["out"], settings(spec["run"]), progress=False, stop_after_steps=STOP,
               shard_state=spec.get("shard_state", "auto"))
