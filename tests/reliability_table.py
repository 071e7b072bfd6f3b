"""Run tests/test_reliability.py and the hostile-input suites (FILES) with every case and print one table
(`make test-reliability`).

    python tests/reliability_table.py [pytest args...]

QUANTKIT_RELIABILITY_CASES=full is set for the run; each test appends its rows to a JSON-lines record,
summed here per command and fault kind. The exit code is pytest's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from reliability import CASES_ENV, RECORD_ENV, format_rows  # noqa: E402

# the tests that record rows (tests/reliability.py)
FILES = ("test_reliability.py", "test_hostile_inputs.py", "test_hostile_paths.py")


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "rows.jsonl"
        env = {**os.environ, CASES_ENV: os.environ.get(CASES_ENV) or "full", RECORD_ENV: str(record)}
        started = time.monotonic()
        code = subprocess.call([sys.executable, "-m", "pytest", *(str(HERE / f) for f in FILES), "-q",
                                "-p", "no:cacheprovider", *argv], env=env, cwd=HERE.parent)
        seconds = time.monotonic() - started
        rows = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    print()
    print(format_rows(rows))
    print(f"pytest exit code {code}; {seconds / 60:.1f} min")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
