"""One writer per output: an exclusive lock file beside the output while a run writes it.

``<out>.lock`` holds the writer's pid and host name (for the message a second run gets). The lock
itself is ``fcntl.flock`` on that file, which the kernel drops when its holder exits, however it
exits: a lock file left by a killed run is stale, and the next run takes it over without asking.

The lock file is opened without following a symbolic link and must be a plain file of its own (one
link, no device or pipe): the pid line is written into it, so a link would write it into another file.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import os
import socket
import stat
from pathlib import Path

from quantkit.atomic import OutputWriteError
from quantkit.errors import QuantkitError


class OutputLockedError(QuantkitError, RuntimeError):
    """Another live process is writing the same output."""


# The locks this process holds, by lock file. A process does not exclude itself: a run that stopped
# without finishing (an error, or a test's stop_after_layers) and is resumed in the same process takes
# its own lock over.
_HELD: dict[Path, "OutputLock"] = {}

# O_NOFOLLOW: a symbolic link under the lock's name is an error (ELOOP), never followed; O_NONBLOCK: opening
# a named pipe put there does not wait for a writer (it is then refused as not a plain file).
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def lock_path(out: str | os.PathLike) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".lock")


class OutputLock:
    """``with OutputLock(out): ...`` or ``acquire()`` / ``release()``; raises OutputLockedError when held."""

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)
        self.path = lock_path(out)
        self._fd: int | None = None

    def acquire(self) -> "OutputLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputWriteError(f"cannot write {self.out}: cannot make its folder {self.path.parent} "
                                   f"({e.strerror or e})") from e
        key = self._key()
        previous = _HELD.get(key)
        if previous is not None and previous._fd is not None:
            self._fd, previous._fd = previous._fd, None
            _HELD[key] = self
            return self
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise OutputLockedError(f"{self.out} is being written by another quantkit run ({holder}; lock file "
                                        f"{self.path}): wait for it to finish, or choose another --out") from None
            try:  # the holder we waited on may have removed the file: then lock the new one
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        _HELD[key] = self
        return self

    def _key(self) -> Path:
        """The lock's name with its folder resolved, not the lock file itself (which may be a link to refuse)."""
        return self.path.parent.resolve() / self.path.name

    def _open(self) -> int:
        """The lock file's descriptor, created if need be; refused unless it is a plain file of its own."""
        try:
            fd = os.open(self.path, _OPEN_FLAGS, 0o644)
        except OSError as e:
            reason = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror or str(e)
            raise OutputWriteError(f"cannot write {self.out}: its lock file {self.path} cannot be made ({reason}); "
                                   "choose another --out, or remove what is there") from e
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            raise OutputWriteError(f"cannot write {self.out}: its lock file {self.path} is not a plain file of its "
                                   "own (a hard link, a pipe or a device); remove it")
        return fd

    def release(self) -> None:
        if self._fd is None:
            return
        if _HELD.get(self._key()) is self:
            del _HELD[self._key()]
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"


@atexit.register
def _release_all() -> None:
    """A run that ends with an error (not a kill) leaves no lock file behind."""
    for held in list(_HELD.values()):
        held.release()
