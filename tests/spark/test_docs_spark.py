"""The pages of the documentation that start Spark, run as a reader runs them
(``docs/contributing.md``): the walk-through, from its first command to its last, and the
Spark page. With the Spark tests, so their JVMs map the suite's class archive."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.snippets import LocalServers, local_servers, reader_environment, run_page

# The walk-through starts `millpond local` itself and stops it at its end; when it fails
# before that, the test stops it (the page's own variable, by PID).
_STOP_WHAT_THE_PAGE_STARTED = (
    '[ -z "${MILLPOND_LOCAL_PID:-}" ] || kill "$MILLPOND_LOCAL_PID" 2>/dev/null || true'
)


@pytest.mark.slow
def test_the_walkthrough_runs_as_written_and_counts_every_row_once(tmp_path: Path) -> None:
    """Spark into a local S3 (``millpond local``), the consumer into PostgreSQL, killed with
    SIGKILL, started again: 200,000 rows, 200,000 distinct ids."""
    run = run_page(
        "walkthrough.md",
        reader_environment(),
        tmp_path,
        timeout=600,
        on_exit=_STOP_WHAT_THE_PAGE_STARTED,
    )
    assert run.returncode == 0, run.failure()
    assert "200,000 rows enqueued" in run.output
    assert " 200000 | 200000" in run.output, run.output[-4000:]  # rows | distinct ids
    assert "all checks passed" in run.output  # doctor


@pytest.fixture
def servers() -> Iterator[LocalServers]:
    with local_servers() as running:
        yield running


@pytest.mark.slow
def test_the_spark_page_runs(servers: LocalServers, tmp_path: Path) -> None:
    run = run_page("user-guide/spark.md", servers.env, tmp_path, timeout=600)
    assert run.returncode == 0, run.failure()
