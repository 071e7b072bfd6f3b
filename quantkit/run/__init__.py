"""One run's lifecycle, the same for every pipeline that writes an output directory (`quantize`, `qat`,
`draft train`, `draft quantize`)::

    run = Run(out, resume=resume)                 # refusals before any work; the output's lock held
    ...check the inputs...
    continuing = run.begin(inputs, CHECKPOINT)    # the staging tied to the inputs' fingerprint
    ...work in run.staging, checkpointing to run.staging / CHECKPOINT...
    with run.publishing():                        # the run's own files leave the staging first
        ...the output's last files (a manifest lists what the staging holds)...
    report.seconds, report.peak_rss_mb = round(run.elapsed(), 3), peak_rss_mb()

The output is built in ``<out>.partial`` and renamed onto ``<out>`` whole (``quantkit.atomic``); one
writer per output (``quantkit.lock``: a killed run's lock is stale and taken over). An interrupted run's
staging is continued only with ``resume``, and only by a run with the same inputs: ``begin`` records
their fingerprint there and compares it with the recorded one. A ``resume`` that finds no checkpoint (a
run killed before its first) starts over, in an emptied staging, rather than refusing what a user
cannot fix.

Nothing is written outside the output the user named: a symbolic link under the output's name, its
staging's or its lock's is refused, never followed, and so is a staging that holds files but no run
record (a directory quantkit did not make: a resume would publish its files as the output's). All of
this is judged when the ``Run`` is made, before any work. This module imports no torch: the command
line reads it at startup.
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from quantkit import atomic
from quantkit.errors import QuantkitError
from quantkit.lock import OutputLock

if TYPE_CHECKING:
    from quantkit.distributed import World

# In the staging, the run's own folder: the record of the inputs it started with (their fingerprint). A
# folder, so that a manifest, which lists the staging's files, leaves it out. Just before the rename it
# moves beside the staging (``parked_record``), so that the output never holds it and a staging killed
# between that move and the rename is still known as quantkit's own; it is removed after the rename.
RUN_DIR = ".run"
RECORD_FILE = "run.json"


class RunError(QuantkitError, RuntimeError):
    """A run that cannot start or continue as asked."""


def fingerprint(inputs: dict) -> str:
    """SHA-256 of ``inputs`` as sorted-key JSON: the same inputs, the same fingerprint, on any machine."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB to one decimal, as the run reports give it."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)  # Linux reports KiB


class Run:
    """A run that writes the directory ``out``.

    Made before any work: refuses an existing ``out`` or a link under its name (``atomic.refuse_existing``),
    takes the output's lock (a live run writing it is named before its staging is judged; a lock that
    cannot be made is refused), refuses a staging that is a link, a file or a directory no run made,
    and an interrupted run's staging without ``resume``. A run that cannot be resumed
    (``resumable=False``: nothing it leaves could be continued) removes such a staging instead. The lock
    is released when the output is published, or when the process exits."""

    def __init__(self, out: str | os.PathLike, *, resume: bool = False, resumable: bool = True):
        self.out = Path(out)
        self.staging = atomic.staging_dir(self.out)
        self.resume = resume
        self.fingerprint: str | None = None
        self._started = time.perf_counter()
        self._progress_file: str | None = None
        atomic.refuse_existing(self.out)
        self._lock = OutputLock(self.out).acquire()
        try:
            self._judge_staging(resumable)
        except Exception:  # a run refused here leaves no lock file behind, even where no exit hook runs
            self._lock.release()
            raise

    def _judge_staging(self, resumable: bool) -> None:
        if os.path.islink(parked_record(self.staging)):
            raise RunError(f"{parked_record(self.staging)} is a symbolic link, not a record a quantkit run made; "
                           "remove it")
        if atomic.existing_staging(self.staging):
            _record(self.staging)  # refuses a staging no quantkit run made, with or without resume
            if not resumable:
                atomic.remove_tree(self.staging)
            elif not self.resume:
                raise RunError(f"{self.staging} holds an interrupted run: pass --resume to continue it, or remove it")

    def begin(self, inputs: dict, progress_file: str) -> bool:
        """Tie the staging to the run's ``inputs`` (their ``fingerprint``) and make it; return whether the
        run continues an interrupted one, which left ``progress_file`` (its checkpoint, or the record of its
        checkpoint folder: ``folder/record``, the folder leaving with it when the run publishes) in the staging.
        A continued run must have the inputs it started with: ``RunError`` names those that count."""
        self.fingerprint = fingerprint(inputs)
        self._progress_file = progress_file
        recorded = _record(self.staging).get("fingerprint") if atomic.existing_staging(self.staging) else None
        checkpointed = (self.staging / progress_file).is_file()
        if self.resume and checkpointed and recorded != self.fingerprint:
            *most, last = inputs
            named = f"{', '.join(most)} or {last}" if most else last
            raise RunError(f"{self.staging} was started with a different {named}; remove it to start over")
        continuing = self.resume and checkpointed
        if not continuing:  # what an earlier start left (its own files, judged above) is not this run's
            atomic.remove_tree(self.staging)
        atomic.remove_tree(parked_record(self.staging))  # left by a kill while publishing; superseded
        self._make_staging()
        return continuing

    def _make_staging(self) -> None:
        atomic.make_staging(self.staging)
        atomic.make_staging(self.staging / RUN_DIR)
        atomic.write_json(self.staging / RUN_DIR / RECORD_FILE, {"fingerprint": self.fingerprint})

    @contextmanager
    def publishing(self) -> Iterator[Path]:
        """Around the output's last files: the run's checkpoint leaves the staging first, so that what a
        manifest lists is the output; when the block ends, the run's record goes, the staging is renamed
        onto the output and the lock released. An error in the block publishes nothing."""
        if self._progress_file is None:
            self._make_staging()  # a run without checkpoints (never resumed) makes its staging here
        else:  # so that a kill after this leaves a run that starts over
            (self.staging / self._progress_file).unlink(missing_ok=True)
            folder = Path(self._progress_file).parent
            if folder != Path("."):  # the record of a checkpoint folder: the folder's files go with it
                atomic.remove_tree(self.staging / folder.parts[0])
        yield self.staging
        parked = parked_record(self.staging)
        atomic.remove_tree(parked)
        os.replace(self.staging / RUN_DIR, parked)
        atomic.publish_dir(self.staging, self.out)
        atomic.remove_tree(parked)
        self._lock.release()

    @property
    def private(self) -> Path:
        """The run's own folder in the staging, for files it needs until the end that the output must not
        hold (it goes before the output is published)."""
        return self.staging / RUN_DIR

    def elapsed(self) -> float:
        """Seconds since the run was made."""
        return time.perf_counter() - self._started


def begin_on_main(world: World, run: Run | None, inputs: dict, progress_file: str) -> bool:
    """``run.begin`` for a torchrun job, whose rank 0 alone owns the run (``run`` is None on the other ranks):
    whether it continues an interrupted one, on every rank, and its refusal raised on every rank."""
    continuing = world.made_on_main(lambda: run.begin(inputs, progress_file))
    return bool(world.from_main(lambda: {"continuing": float(continuing)}, ("continuing",))["continuing"])


def parked_record(staging: Path) -> Path:
    """Where the run's folder waits while its staging is renamed onto the output: ``<out>.partial.run``."""
    return staging.with_name(staging.name + RUN_DIR)


def _read_record(folder: Path) -> dict | None:
    if os.path.islink(folder):  # never read through a link to somewhere else
        return None
    try:
        record = json.loads((folder / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _record(staging: Path) -> dict:
    """The record a run left in its ``staging``, or beside it if killed while publishing ({} when there
    is none yet: a run killed as it made the staging, which then holds nothing else). A staging holding
    files but no record was not made by a run (or by a quantkit older than this record's place): it is
    refused, never continued, emptied or published."""
    for folder in (staging / RUN_DIR, parked_record(staging)):
        record = _read_record(folder)
        if record is not None:
            return record
    if any(entry.name != RUN_DIR for entry in os.scandir(staging)):
        raise RunError(f"{staging} holds files but no record of the quantkit run that made it ({RUN_DIR}/"
                       f"{RECORD_FILE}): remove it, or choose another --out")
    return {}
