"""Atomic writes: every output appears under its final name whole, or not at all, and never over an
existing one."""
from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from quantkit.errors import QuantkitError


class OutputWriteError(QuantkitError, RuntimeError):
    """An output could not be written (disk full, file size limit, read-only place); nothing was left
    under its name."""


class OutputExistsError(QuantkitError, FileExistsError):
    """The output is already there: quantkit never writes over one."""


def refuse_existing(out: str | os.PathLike) -> None:
    """The one refusal of every command that writes ``out``: before any work, and again at publishing,
    in case another run finished it meanwhile. A symbolic link is refused too, dangling or not: quantkit
    writes a new entry under the name the user gave, never through a link to somewhere else."""
    if os.path.islink(out):
        raise OutputExistsError(f"{out} already exists (a symbolic link to {os.readlink(out)}); choose another "
                                "--out or remove it")
    if os.path.lexists(out):
        raise OutputExistsError(f"{out} already exists; choose another --out or remove it")


# errno values that mean "the bytes could not be written here", as opposed to an input's read error.
_WRITE_ERRNOS = {errno.EFBIG, errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def _write_failure(error: BaseException) -> str | None:
    """Why ``error`` is a failed write, or None if it is some other error."""
    if isinstance(error, OSError):
        if error.errno in _WRITE_ERRNOS:
            return error.strerror
        if error.errno is None and "written" in str(error):  # numpy's tofile: "N requested and M written"
            return f"short write ({error})"
        return None
    if type(error).__name__ == "SafetensorError" and "I/O error" in str(error):  # safetensors' Rust writer
        return str(error).rpartition("I/O error: ")[2]
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _remove_orphaned_temps(path: Path) -> None:
    """Delete temporaries of ``path`` left by a killed process (a SIGKILL runs no cleanup; an 8B GGUF's
    is gigabytes). A temporary names its writer's PID, so a live writer's is never touched."""
    for temp in path.parent.glob(f".{glob.escape(path.name)}.*-*.tmp"):
        pid = temp.name[len(path.name) + 2:].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            remove_temporary(temp)


def remove_temporary(temp: Path) -> None:
    """Delete one temporary of ``atomic_path``: a file, or a private directory and what is in it."""
    if temp.is_dir():
        shutil.rmtree(temp, ignore_errors=True)
    else:
        temp.unlink(missing_ok=True)


def _temp_beside(path: Path, own_directory: bool) -> Path:
    _remove_orphaned_temps(path)
    prefix = f".{path.name}.{os.getpid()}-"
    if own_directory:
        return Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=path.parent)) / path.name
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    os.close(fd)
    # mkstemp creates 0600; give the file the mode an ordinary open() would (0666 less the umask).
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(name, 0o666 & ~umask)
    return Path(name)


@contextmanager
def atomic_path(path: str | os.PathLike, own_directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds.

    ``own_directory``: the temporary lies in a private directory beside ``path``, for writers that make
    temporaries of their own beside the file they are given (safetensors >= 0.7 writes a ``.tmpXXXXXX``
    and renames it): a kill then strands theirs inside ours, where the next write removes both."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_beside(path, own_directory)
    except OSError as e:
        raise OutputWriteError(f"cannot write {path}: {e.strerror or e}") from e
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:
        reason = _write_failure(e)
        if reason is None:
            raise
        raise OutputWriteError(f"cannot write {path}: {reason}; nothing was left under that name") from e
    finally:
        remove_temporary(tmp.parent if own_directory else tmp)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj) -> None:
    """Deterministic JSON: sorted keys, two-space indent, trailing newline."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def save_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    with atomic_path(path, own_directory=True) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def staging_dir(out: str | os.PathLike) -> Path:
    """Where the directory ``out`` is built until ``publish_dir`` renames it: ``<out>.partial``."""
    out = Path(out)
    return out.with_name(out.name + ".partial")


def existing_staging(staging: str | os.PathLike) -> bool:
    """Whether a staging directory is there. Anything else under its name is refused (a symbolic link,
    which would send the output's files to where it points, or a file): a staging is a directory that
    a run made itself."""
    try:
        mode = os.lstat(staging).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(mode):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a directory"
        raise OutputExistsError(f"{staging} is {kind}, not a staging directory a quantkit run made; remove it")
    return True


def make_staging(staging: str | os.PathLike) -> None:
    """Make the staging directory, or keep the one there (``existing_staging``'s refusals apply)."""
    try:
        os.mkdir(staging)
    except FileExistsError:
        existing_staging(staging)
    except OSError as e:
        raise OutputWriteError(f"cannot make {staging}: {e.strerror or e}") from e


def publish_dir(staging: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename a finished staging directory onto its final name (which must not exist)."""
    refuse_existing(final)
    existing_staging(staging)
    os.replace(staging, final)


def remove_tree(path: str | os.PathLike) -> None:
    shutil.rmtree(path, ignore_errors=True)
