"""Fault injection for tests/test_reliability.py and tests/reliability_table.py.

Runs of the `quantkit` command line are started from a fork server: a process that has imported
quantkit (and torch) once and forks one child per run, which calls `quantkit.cli.main` exactly as the
console script does. A run then costs its work, not the ~10 s of imports, so many runs can be killed
at random points. QUANTKIT_RELIABILITY_SUBPROCESS=1 starts every run as a fresh `python -m quantkit.cli`
process instead (slower, no shared state at all).

Every case is recorded as one row (command, fault kind, outcome) in ``Tally``; with
QUANTKIT_RELIABILITY_RECORD set to a file, rows are appended there as JSON lines, which
tests/reliability_table.py sums into the table.
"""
from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

CASES_ENV = "QUANTKIT_RELIABILITY_CASES"  # "full": every case; unset: the reduced set `make test` runs
RECORD_ENV = "QUANTKIT_RELIABILITY_RECORD"
SUBPROCESS_ENV = "QUANTKIT_RELIABILITY_SUBPROCESS"
TRACEBACK = "Traceback (most recent call last)"


def full_run() -> bool:
    return os.environ.get(CASES_ENV, "") == "full"


def cases(reduced: int, full: int) -> int:
    return full if full_run() else reduced


# ---------------------------------------------------------------------------------------------------
# Starting runs

def _text(path: Path) -> str:
    """A run's captured output; none when it was killed before the forked child opened the file."""
    return path.read_text(errors="replace") if path.exists() else ""


@dataclass
class Outcome:
    code: int  # exit code, or -signal
    stdout: str
    stderr: str
    peak_kb: int = 0  # the run's peak resident memory (ru_maxrss)

    @property
    def traceback(self) -> bool:
        return TRACEBACK in self.stderr or TRACEBACK in self.stdout

    @property
    def clear_error(self) -> bool:
        """Exit 1 with one `Error: ...` line (click's form of quantkit's errors) and no traceback."""
        lines = [line for line in self.stderr.splitlines() if line.startswith("Error: ")]
        return self.code == 1 and len(lines) == 1 and not self.traceback


def _serve() -> None:
    """The fork server's loop: JSON requests on stdin, one JSON answer line each on stdout."""
    import torch
    from transformers import AutoTokenizer  # noqa: F401

    import quantkit.cli  # noqa: F401  everything a run imports, imported once
    import quantkit.draft.trainer  # noqa: F401
    import quantkit.engine  # noqa: F401
    import quantkit.gguf.export  # noqa: F401
    import quantkit.kernels.generate  # noqa: F401
    import quantkit.qat  # noqa: F401

    torch.set_num_threads(1)
    out = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "run":
            pid = os.fork()
            if pid == 0:
                _child(request)
            answer = {"pid": pid}
        else:
            flags = os.WNOHANG if request["op"] == "poll" else 0
            try:
                done, status, usage = os.wait4(request["pid"], flags)
            except ChildProcessError:
                done, status, usage = request["pid"], 0, None
            answer = {"code": os.waitstatus_to_exitcode(status) if done else None,
                      "peak_kb": usage.ru_maxrss if done and usage else 0}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def _child(request: dict) -> None:
    code = 1
    try:
        os.chdir(request["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.stdin = open(0, closefd=False)
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
        os.environ.update(request["env"])
        _limit(request["fsize"], request.get("memory"))
        from quantkit.cli import main

        sys.argv = ["quantkit", *request["argv"]]
        try:
            main(args=request["argv"], prog_name="quantkit")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _limit(fsize: int | None, memory: int | None) -> None:
    """A run's limits: the largest file it may write, and the address space it may add to what it has."""
    if fsize is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    if memory is not None:
        with open("/proc/self/statm") as statm:
            mapped = int(statm.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (mapped + memory, mapped + memory))


def _child_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.pop("QUANTKIT_DEBUG", None)
    return env


class Proc:
    """A started run: poll(), wait(), kill(); its output once it has ended."""

    def __init__(self, launcher: "Launcher", pid: int, stdout: Path, stderr: Path, popen=None):
        self.launcher, self.pid, self._stdout, self._stderr, self._popen = launcher, pid, stdout, stderr, popen
        self.code: int | None = None
        self.peak_kb = 0

    def poll(self) -> int | None:
        if self.code is None:
            if self._popen:
                self._reap(os.WNOHANG)
            else:
                self._answer(self.launcher._ask({"op": "poll", "pid": self.pid}))
        return self.code

    def wait(self, timeout: float = 600) -> Outcome:
        if self.code is None:
            if self._popen:
                self._reap(0)
            else:
                self._answer(self.launcher._ask({"op": "wait", "pid": self.pid}))
        return Outcome(self.code, _text(self._stdout), _text(self._stderr), self.peak_kb)

    def _answer(self, answer: dict) -> None:
        self.code, self.peak_kb = answer["code"], answer.get("peak_kb", 0)

    def _reap(self, flags: int) -> None:
        """A subprocess's exit and peak memory (os.wait4, which Popen does not give)."""
        done, status, usage = os.wait4(self.pid, flags)
        if done:
            self.code, self.peak_kb = os.waitstatus_to_exitcode(status), usage.ru_maxrss
            self._popen.returncode = self.code

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Launcher:
    """Starts `quantkit ARGV` runs in ``workdir`` (from the fork server, or as subprocesses)."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.subprocess = os.environ.get(SUBPROCESS_ENV, "") not in ("", "0")
        self._server = None
        self._count = 0
        self.env: dict = {}  # added to every run's environment
        if not self.subprocess:
            self._server = subprocess.Popen([sys.executable, "-c", "import reliability; reliability._serve()"],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                            cwd=self.workdir, env={**_child_env(),
                                                                   "PYTHONPATH": str(Path(__file__).parent)})

    def _ask(self, request: dict) -> dict:
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        line = self._server.stdout.readline()
        if not line:
            raise RuntimeError("the fork server died")
        return json.loads(line)

    def start(self, argv: list[str], *, fsize: int | None = None, env: dict | None = None,
              memory: int | None = None) -> Proc:
        """``fsize``: RLIMIT_FSIZE; ``memory``: bytes of address space the run may add to the server's."""
        env = {**self.env, **(env or {})}
        self._count += 1
        stdout, stderr = (self.workdir / f"run{self._count}.{kind}" for kind in ("out", "err"))
        argv = [str(a) for a in argv]
        if self.subprocess:
            def limit():
                _limit(fsize, memory)
            popen = subprocess.Popen([sys.executable, "-m", "quantkit.cli", *argv], cwd=self.workdir,
                                     stdout=open(stdout, "w"), stderr=open(stderr, "w"), stdin=subprocess.DEVNULL,
                                     env={**_child_env(), **(env or {})}, preexec_fn=limit)
            return Proc(self, popen.pid, stdout, stderr, popen)
        pid = self._ask({"op": "run", "argv": argv, "cwd": str(self.workdir), "stdout": str(stdout),
                         "stderr": str(stderr), "fsize": fsize, "memory": memory, "env": env or {}})["pid"]
        return Proc(self, pid, stdout, stderr)

    def run(self, argv: list[str], **kwargs) -> Outcome:
        return self.start(argv, **kwargs).wait()

    def close(self) -> None:
        if self._server is not None:
            self._server.stdin.close()
            self._server.wait(30)
            self._server = None


# ---------------------------------------------------------------------------------------------------
# Outputs: what lies under a name, compared byte for byte

# a run's timings, memory and resume point: the files that differ between runs by design
IGNORED = {"quantize_report.json", "draft_report.json"}


def snapshot(path: Path) -> dict[str, bytes]:
    """An output's bytes: a file's, or each file's in a directory (by relative name)."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name not in IGNORED}


def listing(path: Path) -> dict[str, int] | None:
    """Names and sizes under ``path`` right now (None if nothing is there); tolerant of a concurrent rename."""
    try:
        if path.is_dir():
            return {e.name: e.stat().st_size for e in os.scandir(path) if e.name not in IGNORED}
        return {"": path.stat().st_size}
    except FileNotFoundError:
        return None


def differences(got: dict[str, bytes], want: dict[str, bytes]) -> list[str]:
    names = sorted(set(got) | set(want))
    return [name or "(file)" for name in names if got.get(name) != want.get(name)]


# ---------------------------------------------------------------------------------------------------
# The tally

@dataclass
class Row:
    command: str
    fault: str
    cases: int = 0
    clear_errors: int = 0
    tracebacks: int = 0
    partial_outputs: int = 0  # an incomplete output seen under its final name
    resumes: int = 0  # reruns after a kill (or a failed write)
    identical: int = 0  # of those, byte-identical to the uninterrupted run
    peak_mb: int = 0  # the largest peak resident memory of a case's runs (the fork server's pages included)

    def ran(self, outcome: "Outcome") -> None:
        self.peak_mb = max(self.peak_mb, outcome.peak_kb >> 10)


class Tally:
    def __init__(self):
        self.rows: dict[tuple[str, str], Row] = {}
        self.notes: list[str] = []

    def row(self, command: str, fault: str) -> Row:
        return self.rows.setdefault((command, fault), Row(command, fault))

    def note(self, text: str) -> None:
        self.notes.append(text)

    def flush(self) -> None:
        path = os.environ.get(RECORD_ENV)
        if path:
            with open(path, "a") as f:
                for row in self.rows.values():
                    f.write(json.dumps(asdict(row)) + "\n")
        self.rows.clear()


def format_rows(rows: list[dict]) -> str:
    merged: dict[tuple[str, str], dict] = {}
    for row in rows:
        key = (row["command"], row["fault"])
        if key in merged:
            for field, value in row.items():
                if field == "peak_mb":
                    merged[key][field] = max(merged[key][field], value)
                elif isinstance(value, int):
                    merged[key][field] += value
        else:
            merged[key] = dict(row)
    head = ["command", "fault", "cases", "clear errors", "tracebacks", "partial under final name",
            "resumed/rerun", "identical bytes", "peak MB"]
    body = [[r["command"], r["fault"], r["cases"], r["clear_errors"], r["tracebacks"], r["partial_outputs"],
             r["resumes"], r["identical"], r.get("peak_mb") or "-"] for r in merged.values()]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    totals = {k: sum(r[k] for r in merged.values()) for k in ("cases", "tracebacks", "partial_outputs",
                                                                "resumes", "identical")}
    lines.append(f"\n{totals['cases']} cases; tracebacks {totals['tracebacks']} (must be 0); partial outputs "
                 f"under a final name {totals['partial_outputs']} (must be 0); identical after rerun "
                 f"{totals['identical']}/{totals['resumes']} (must be all)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Kill a run, watch its output, resume it

@dataclass
class KillCase:
    """How one case ends its first run: after ``delay`` seconds, or at the first poll where ``trigger``
    (a function of the output's and staging's listings) holds. Both None: not killed at all."""
    fault: str
    delay: float | None = None
    trigger: object = None


def watch(proc: Proc, final: Path, complete: dict[str, int], case: KillCase, staging: Path | None,
          timeout: float = 600) -> tuple[bool, bool]:
    """Poll ``final`` (and ``staging``) until ``proc`` ends or the case kills it. Returns (partial seen,
    killed): partial means that something stood under the final name whose listing was not ``complete``."""
    started = time.monotonic()
    partial = killed = False
    while proc.poll() is None:
        now = listing(final)
        if now is not None and now != complete:
            partial = True
        if case.trigger is not None and case.trigger(now, listing(staging) if staging else None, listing_temp(final)):
            proc.kill()
            killed = True
        elif case.delay is not None and time.monotonic() - started >= case.delay:
            proc.kill()
            killed = True
        if killed:
            break
        if time.monotonic() - started > timeout:
            proc.kill()
            raise TimeoutError(f"run into {final} took more than {timeout} s")
        time.sleep(0.002)
    proc.wait()
    now = listing(final)
    if now is not None and now != complete:
        partial = True
    return partial, killed


def listing_temp(final: Path) -> dict[str, int]:
    """Temporary files beside ``final`` (atomic writes in progress)."""
    try:
        return {e.name: e.stat().st_size for e in os.scandir(final.parent)
                if e.name.startswith(f".{final.name}.") and e.name.endswith(".tmp")}
    except FileNotFoundError:
        return {}


def kill_cases(n_random: int, seconds: float, seed: int, triggers: dict[str, object]) -> list[KillCase]:
    """``n_random`` kills at seeded uniform times in [0, seconds], then one case per named trigger."""
    rng = random.Random(seed)
    out = [KillCase("kill at a random time", delay=rng.uniform(0.0, seconds)) for _ in range(n_random)]
    out += [KillCase(f"kill {name}", trigger=trigger) for name, trigger in triggers.items()]
    return out


def run_kill_case(launcher: Launcher, tally: Tally, command: str, argv: list[str], final: Path,
                  reference: dict[str, bytes], case: KillCase, resume_flag: str | None = "--resume") -> list[str]:
    """One case: start, kill as the case says, rerun (with ``resume_flag``) unless the output is already
    there, compare with ``reference``. Returns the problems found (empty: all good)."""
    problems = []
    row = tally.row(command, case.fault)
    row.cases += 1
    complete = {name: len(data) for name, data in reference.items()} if "" not in reference else \
        {"": len(reference[""])}
    staging = final.with_name(final.name + ".partial")
    proc = launcher.start(argv)
    partial, killed = watch(proc, final, complete, case, staging)
    first = proc.wait()
    row.ran(first)
    if first.traceback:
        row.tracebacks += 1
        problems.append(f"{case.fault}: traceback in the first run:\n{first.stderr[-2000:]}")
    elif not killed and first.code != 0:
        problems.append(f"{case.fault}: first run failed ({first.code}): {first.stderr[-500:]}")
    if not final.exists():
        rerun = launcher.run(argv + ([resume_flag] if resume_flag else []))
        if rerun.traceback:
            row.tracebacks += 1
        if rerun.code != 0:
            problems.append(f"{case.fault}: rerun failed ({rerun.code}): {rerun.stderr[-1000:]}")
        row.resumes += 1
        if final.exists() and not differences(snapshot(final), reference):
            row.identical += 1
        else:
            problems.append(f"{case.fault}: rerun differs from the uninterrupted run in "
                            f"{differences(snapshot(final), reference) if final.exists() else 'everything'}")
    elif differences(snapshot(final), reference):
        partial = True
    orphans = sorted(p.name for p in final.parent.glob(f".{final.name}.*.tmp"))
    if orphans:
        problems.append(f"{case.fault}: temporaries left beside the output: {orphans}")
    if partial:
        row.partial_outputs += 1
        problems.append(f"{case.fault}: an incomplete output stood under {final}")
    return problems
