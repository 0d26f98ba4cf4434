"""What a fresh clone's install prints and installs (issue 47): ``make demo`` printed about 40
lines of setuptools deprecation warnings about the licence table; ``make test`` must have
what the docs test and ``millpond local`` need."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_licence_is_an_spdx_expression_setuptools_takes_without_a_warning() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"  # a table warned on every install
    requires = project["build-system"]["requires"]
    setuptools = next(r for r in requires if r.startswith("setuptools"))
    assert setuptools == "setuptools>=77"  # the first to take an SPDX string


def test_the_install_stamp_installs_the_docs_and_local_extras() -> None:
    makefile = (ROOT / "Makefile").read_text()
    install = re.search(r"pip install --quiet -e '\.\[([a-z,]+)\]'", makefile)
    assert install is not None
    assert {"dev", "docs", "local"} <= set(install.group(1).split(","))
    assert re.search(r"^docs: \$\(STAMP\)\n\t.*mkdocs build --strict$", makefile, re.M)
