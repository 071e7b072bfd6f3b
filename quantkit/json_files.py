"""JSON files read strictly: no key twice, no NaN or Infinity, and one clear error naming the file.

No torch here: the runtime's tokenizer process and the configuration read these before torch is imported."""
from __future__ import annotations

import json
from pathlib import Path

from quantkit.errors import CheckpointError


def _unique_keys(pairs: list) -> dict:
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate key '{next(n for n in names if names.count(n) > 1)}'")
    return dict(pairs)


def _not_a_number(token: str):
    raise ValueError(f"{token} is not a JSON number")


def loads_json(text: str | bytes):
    """JSON as its standard defines it. Python's parser accepts a bare NaN or Infinity, and keeps the last of
    two values under one key, which hides one from any reader that keeps the first: both are refused."""
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_not_a_number)


def read_json_object(path: str | Path) -> dict:
    """A JSON file holding an object, read strictly (``loads_json``), or one clear error naming it
    (transformers reports a malformed config from deep inside its loader)."""
    path = Path(path)
    try:
        value = loads_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_config_json(directory: str | Path) -> dict:
    """``directory``'s config.json as a dict (``read_json_object``)."""
    return read_json_object(Path(directory) / "config.json")
