"""The repository passes its own linter, so ``make test`` (what CI runs) catches what
``make lint`` would: a change that breaks ``ruff check`` or ``ruff format`` fails CI.

Commit d2458ce reached ``main`` with a 128-column docstring line and a green CI, because CI
ran the tests only.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "args", [("check", "."), ("format", "--check", ".")], ids=["check", "format"]
)
def test_ruff_finds_nothing(args: tuple[str, ...]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"ruff {' '.join(args)}:\n{done.stdout}{done.stderr}"
