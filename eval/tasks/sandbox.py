"""Run untrusted Python (model-written code) in a child process with hard limits.

What a run guarantees, on a Linux that allows unprivileged user namespaces (``isolation="namespaces"``,
checked once per process by :func:`namespaces_available`):
- **no writes outside the scratch directory**: every mount is read-only and locked, /dev is an empty
  read-only tmpfs, and the scratch directory (cwd and HOME) is a fresh tmpfs of ``scratch_mb``
  that disappears with the run; enforced by the kernel, whatever the program does;
- **no network**: a new network namespace (loopback down) and a seccomp filter that fails every
  socket() call, AF_UNIX included;
- **no other programs, processes or threads**: seccomp fails execve and every fork/clone;
- **limits**: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS: allocations beyond it raise
  MemoryError, reported as ``memory``), file size (RLIMIT_FSIZE, which also caps captured output),
  and a wall-clock timeout that SIGKILLs the process group; the PID namespace dies with it.
Without user namespaces (``isolation="audit-hook"``) the seccomp filter and limits still apply, but
writes outside the scratch directory are refused only by a Python audit hook (PEP 578), which
catches what Python's own file APIs do but is no security boundary: C code could bypass it (ctypes
is refused by the same hook; compiled extension modules already installed are not).
The child's own code is ``sandbox_child.py``; the environment is minimal and ``python -I -S`` ignores
PYTHON* variables and site-packages.
"""
from __future__ import annotations

import functools
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NAMESPACES, AUDIT_HOOK = "namespaces", "audit-hook"
_CHILD_SOURCE = (Path(__file__).parent / "sandbox_child.py").read_text()
# The child's reserved exit codes (sandbox_child.py).
EXIT_MEMORY, EXIT_SETUP_FAILED = 124, 125


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not a failure of the program inside it)."""


@dataclass(frozen=True)
class Limits:
    seconds: float = 10.0  # wall clock; the CPU limit is the same, rounded up
    memory_mb: int = 1024  # address space
    file_mb: int = 16  # largest file the program may write, and the most output kept
    scratch_mb: int = 64  # size of the scratch tmpfs (namespace isolation)

    def __post_init__(self):
        if self.seconds <= 0 or min(self.memory_mb, self.file_mb, self.scratch_mb) <= 0:
            raise ValueError(f"sandbox limits must be positive: {self}")


@dataclass(frozen=True)
class RunResult:
    outcome: str  # "ok", "error" (non-zero exit), "timeout" or "memory"
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    isolation: str

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def _apply_limits(limits: Limits) -> None:
    """preexec_fn: runs in the child between fork and exec; the limits hold for everything after."""
    cpu = math.ceil(limits.seconds)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL one second on
    memory = limits.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    file_size = limits.file_mb << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _command(scratch: Path, limits: Limits, isolation: str, audit_hook: bool) -> list[str]:
    child = [sys.executable, "-I", "-S", "-c", _CHILD_SOURCE, f"--{isolation}", str(scratch), str(limits.scratch_mb)]
    if not audit_hook:
        child.append("--no-audit-hook")
    if isolation == AUDIT_HOOK:
        return child
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SandboxError("namespace isolation needs util-linux's unshare, which is not on PATH")
    return [unshare, "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child",
            "--mount-proc", *child]


def _outcome(returncode: int, timed_out: bool) -> str:
    if timed_out or returncode in (-signal.SIGKILL, -signal.SIGXCPU):
        return "timeout"
    if returncode == EXIT_MEMORY:
        return "memory"
    return "ok" if returncode == 0 else "error"


def run_python(source: str, limits: Limits = Limits(), isolation: str | None = None,
               audit_hook: bool = True) -> RunResult:
    """Run ``source`` as a Python program in a fresh sandbox and report how it ended.

    ``isolation`` defaults to the best available; ``audit_hook=False`` leaves out the Python-level
    guard so that tests can show what the kernel enforces on its own."""
    isolation = isolation or best_isolation()
    if isolation not in (NAMESPACES, AUDIT_HOOK):
        raise ValueError(f"isolation must be '{NAMESPACES}' or '{AUDIT_HOOK}', got {isolation!r}")
    scratch = Path(tempfile.mkdtemp(prefix="quantkit-sandbox-")).resolve()
    try:
        (scratch / "program.py").write_text(source)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch), "LANG": "C.UTF-8"}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            start = time.monotonic()
            process = subprocess.Popen(_command(scratch, limits, isolation, audit_hook), stdin=subprocess.DEVNULL,
                                       stdout=out, stderr=err, cwd=scratch, env=env, start_new_session=True,
                                       preexec_fn=functools.partial(_apply_limits, limits))
            try:
                process.wait(timeout=limits.seconds)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # unshare --kill-child takes the PID namespace along
                process.wait()
                timed_out = True
            seconds = time.monotonic() - start
            stdout, stderr = (_read(f, limits.file_mb << 20) for f in (out, err))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if process.returncode == EXIT_SETUP_FAILED:
        raise SandboxError(f"{isolation} sandbox could not be set up: {stderr.strip()}")
    return RunResult(_outcome(process.returncode, timed_out), process.returncode, stdout, stderr, seconds, isolation)


def _read(file, limit: int) -> str:
    file.seek(0)
    return file.read(limit).decode(errors="replace")


@functools.lru_cache(maxsize=1)
def namespaces_available() -> tuple[bool, str]:
    """(whether namespace isolation works here, why not): a trivial program is run once to find out."""
    try:
        result = run_python("print('ok')", Limits(seconds=30), NAMESPACES)
    except (SandboxError, OSError) as e:
        return False, str(e)
    if result.outcome != "ok" or result.stdout != "ok\n":
        return False, f"probe ended with {result.outcome}: {result.stderr.strip()[-300:]}"
    return True, ""


def best_isolation() -> str:
    available, reason = namespaces_available()
    if not available:
        import warnings

        warnings.warn(f"sandbox: user namespaces unavailable ({reason}); falling back to the audit hook, "
                      "which is not a security boundary", RuntimeWarning, stacklevel=3)
    return NAMESPACES if available else AUDIT_HOOK
