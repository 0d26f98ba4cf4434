"""Figures the core tests measure (contention), shown in the terminal summary.

Output captured by pytest is only shown for failing tests, so measured figures are collected
here and printed once at the end of the run, with or without ``-s``.
"""

from __future__ import annotations

import json
from typing import Any

_FIGURES: list[tuple[str, dict[str, Any]]] = []


def record_figure(title: str, figures: dict[str, Any]) -> None:
    """Keep ``figures`` for the terminal summary of this run."""
    _FIGURES.append((title, figures))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FIGURES:
        return
    terminalreporter.section("millpond core figures")
    for title, figures in _FIGURES:
        terminalreporter.write_line(f"{title}: {json.dumps(figures)}")
