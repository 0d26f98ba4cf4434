"""The repository passes its own linter, so ``make test`` (what CI runs) catches what
``make lint`` would: a change that breaks ``ruff check``, ``ruff format`` or an import
contract fails CI.

Commit d2458ce reached ``main`` with a 128-column docstring line and a green CI, because CI
ran the tests only.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
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


def test_import_contracts_are_kept(tmp_path: Path) -> None:
    """The dependency rules of ``pyproject.toml`` (``[tool.importlinter]``: producer, consumer
    and gc import the core and never each other; the core imports no role): import-linter
    reads the package as installed, so the tree is laid out here the way ``package-dir`` maps
    it, one symlink per entry, and checked without building anything."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        config = tomllib.load(f)
    package_dir = config["tool"]["setuptools"]["package-dir"]
    package = tmp_path / "millpond"
    package.mkdir()
    for entry in (ROOT / package_dir["millpond"]).iterdir():
        (package / entry.name).symlink_to(entry)
    for name, source in package_dir.items():
        if name != "millpond":
            (package / name.removeprefix("millpond.")).symlink_to(ROOT / source)
    lint_imports = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [lint_imports, "--config", ROOT / "pyproject.toml", "--no-cache", "--no-logo"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"lint-imports:\n{done.stdout}{done.stderr}"
    contracts = len(config["tool"]["importlinter"]["contracts"])
    assert f"Contracts: {contracts} kept, 0 broken." in done.stdout, done.stdout
