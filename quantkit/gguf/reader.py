"""Opening a GGUF file that may come from anywhere (the Hub, a user's disk) with one clear error.

gguf-py meets a malformed file with whatever its parsing hits (IndexError, ValueError from NumPy,
struct errors, a memory map past the end), so every reader in quantkit opens files here and names
the file and the cause in an error of its own choosing.
"""
from __future__ import annotations

from pathlib import Path


def open_gguf(path: str | Path, error: type[Exception] = ValueError):
    """``gguf.GGUFReader`` of ``path``, or ``error`` naming the file if it is not a readable GGUF file."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as cause:
        raise error(f"{path} is not a readable GGUF file ({type(cause).__name__}: {cause})") from cause
