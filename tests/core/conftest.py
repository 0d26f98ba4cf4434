"""Figures the core tests measure (contention), shown in the terminal summary.

Output captured by pytest is only shown for failing tests, so a test records its figures as a
``millpond_figure`` user property (``record_figure``) and they are printed once at the end of
the run, with or without ``-s``. User properties travel with the test's report, so this works
when the suite runs on several workers (``pytest -n``) too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

FIGURE_KEY = "millpond_figure"


def record_figure(
    record_property: Callable[[str, object], None], title: str, figures: dict[str, Any]
) -> None:
    """Keep ``figures`` for the terminal summary of this run."""
    record_property(FIGURE_KEY, json.dumps([title, figures]))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    figures = [
        json.loads(value)
        for report in terminalreporter.stats.get("passed", [])
        for key, value in getattr(report, "user_properties", ())
        if key == FIGURE_KEY
    ]
    if not figures:
        return
    terminalreporter.section("millpond core figures")
    for title, values in sorted(figures, key=lambda item: item[0]):
        terminalreporter.write_line(f"{title}: {json.dumps(values)}")
