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
from typing import Any

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


def _lay_out_package(tmp_path: Path) -> dict[str, Any]:
    """Lay ``millpond`` out in ``tmp_path`` the way ``package-dir`` maps it, one symlink per
    entry (import-linter and grimp read the package as installed; nothing is built); the
    ``pyproject.toml`` it was read from."""
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
    return config


def test_import_contracts_are_kept(tmp_path: Path) -> None:
    """The dependency rules of ``pyproject.toml`` (``[tool.importlinter]``: producer, consumer
    and gc import the core and never each other; the core imports no role; no cycles between
    siblings), checked on the package as installed."""
    config = _lay_out_package(tmp_path)
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


_FIND_CYCLES = """
import grimp

graph = grimp.build_graph("millpond")
cycles = set()
for importer in graph.modules:
    for imported in graph.find_modules_directly_imported_by(importer):
        back = graph.find_shortest_chain(imported, importer)
        if back is not None:
            cycle = (importer, *back[:-1])
            start = cycle.index(min(cycle))
            cycles.add(cycle[start:] + cycle[:start])
for cycle in sorted(cycles):
    print(" -> ".join((*cycle, cycle[0])))
"""


def test_no_module_imports_itself_back(tmp_path: Path) -> None:
    """No import cycle between any two modules of millpond, also through a package's
    ``__init__`` (which import-linter's ``acyclic_siblings`` contract does not look at). Every
    import counts, in a function or under ``TYPE_CHECKING`` too: a cycle there is one import
    away from failing at import time (issue 45 found three: the coordinator's three modules,
    the store and its adapters, and the Spark package and its session helper)."""
    _lay_out_package(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _FIND_CYCLES],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "", f"import cycles in millpond:\n{done.stdout}"


def test_every_package_folder_is_installed() -> None:
    """A package folder missing from ``[tool.setuptools] packages`` is left out of a plain
    install (``pip install .``, what ``make lint`` and ``make typecheck`` read): the editable
    install of the suite still finds it, so nothing else would notice (``millpond.coordinator``
    was missing)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder: name for name, folder in config["package-dir"].items()}
    found = set()
    for folder, name in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            if "__pycache__" not in relative.parts:
                found.add(".".join((name, *relative.parts)))
    assert found - set(config["packages"]) == set(), "not in [tool.setuptools] packages"
