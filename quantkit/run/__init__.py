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
run killed before its first) starts over rather than refusing what a user cannot fix. This module
imports no torch: the command line reads it at startup.
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from quantkit import atomic
from quantkit.errors import QuantkitError
from quantkit.lock import OutputLock

RECORD_FILE = "run.json"  # in the staging: the fingerprint of the inputs the run started with


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

    Made before any work: refuses an existing ``out`` (``atomic.refuse_existing``), takes the output's
    lock (a live run writing it is named before its staging is judged), and refuses an interrupted run's
    staging without ``resume``. A run that cannot be resumed (``resumable=False``: nothing it leaves
    could be continued) removes such a staging instead. The lock is released when the output is
    published, or when the process exits."""

    def __init__(self, out: str | os.PathLike, *, resume: bool = False, resumable: bool = True):
        self.out = Path(out)
        self.staging = atomic.staging_dir(self.out)
        self.resume = resume
        self.fingerprint: str | None = None
        self._started = time.perf_counter()
        self._progress_file: str | None = None
        atomic.refuse_existing(self.out)
        self._lock = OutputLock(self.out).acquire()
        if self.staging.exists():
            if not resumable:
                atomic.remove_tree(self.staging)
            elif not resume:
                raise RunError(f"{self.staging} holds an interrupted run: pass --resume to continue it, or remove it")

    def begin(self, inputs: dict, progress_file: str) -> bool:
        """Tie the staging to the run's ``inputs`` (their ``fingerprint``) and make it; return whether the
        run continues an interrupted one, which left ``progress_file`` (its checkpoint) in the staging.
        A continued run must have the inputs it started with: ``RunError`` names those that count."""
        self.fingerprint = fingerprint(inputs)
        self._progress_file = progress_file
        record = self.staging / RECORD_FILE
        continuing = self.resume and (self.staging / progress_file).is_file()
        if continuing and _recorded(record) != self.fingerprint:
            *most, last = inputs
            named = f"{', '.join(most)} or {last}" if most else last
            raise RunError(f"{self.staging} was started with a different {named}; remove it to start over")
        self.staging.mkdir(parents=True, exist_ok=True)
        atomic.write_json(record, {"fingerprint": self.fingerprint})
        return continuing

    @contextmanager
    def publishing(self) -> Iterator[Path]:
        """Around the output's last files: the run's own files (its record and checkpoint) leave the
        staging first, so that what a manifest lists is the output; when the block ends, the staging
        is renamed onto the output and the lock released. An error in the block publishes nothing."""
        for name in (self._progress_file, RECORD_FILE):  # so that a kill between leaves a run that starts over
            if name is not None:
                (self.staging / name).unlink(missing_ok=True)
        yield self.staging
        atomic.publish_dir(self.staging, self.out)
        self._lock.release()

    def elapsed(self) -> float:
        """Seconds since the run was made."""
        return time.perf_counter() - self._started


def _recorded(record: Path) -> str | None:
    return json.loads(record.read_text())["fingerprint"] if record.is_file() else None
