"""The documentation site: it builds with no warning (``mkdocs build --strict``: broken links
and anchors, pages missing from the navigation), its generated reference lists every command,
option and configuration field, and every code block of every page runs as a reader runs it
(``docs/contributing.md``), against ``millpond local``.

The walk-through and the Spark page start Spark: they run in ``tests/spark/test_docs_spark.py``.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from millpond.localstack import S3Endpoint
from millpond.storage import open_store
from tests.docs.snippets import (
    DOCS,
    OUTPUT,
    ROOT,
    RUN,
    LocalServers,
    blocks,
    local_servers,
    pages,
    reader_environment,
    run_page,
)

SPARK_PAGES = ("walkthrough.md", "user-guide/spark.md")
"""Run with the Spark tests (``tests/spark/test_docs_spark.py``)."""


@pytest.fixture(scope="module")
def servers() -> Iterator[LocalServers]:
    """One ``millpond local`` for every page of this module, emptied before each page."""
    with local_servers() as running:
        yield running


def _empty(servers: LocalServers) -> None:
    """Every object out of the bucket and every table out of the database."""
    variables = servers.variables
    endpoint = S3Endpoint(
        endpoint=variables["AWS_ENDPOINT_URL"],
        bucket="millpond",
        access_key_id=variables["AWS_ACCESS_KEY_ID"],
        secret_access_key=variables["AWS_SECRET_ACCESS_KEY"],
    )
    store = open_store(endpoint.url, endpoint.store_options())
    assert store.delete_many([info.path for info in store.list()]) == []
    import adbc_driver_postgresql.dbapi as postgres

    with (
        postgres.connect(variables["MILLPOND_SINK"], autocommit=True) as conn,
        conn.cursor() as cur,
    ):
        cur.execute("DROP SCHEMA public CASCADE")
        cur.execute("CREATE SCHEMA public")


@pytest.mark.parametrize("page", [p for p in pages() if p not in SPARK_PAGES])
def test_every_block_of_the_page_runs(page: str, servers: LocalServers, tmp_path: Path) -> None:
    _empty(servers)
    run = run_page(page, servers.env, tmp_path)
    assert run.returncode == 0, run.failure()


def test_every_block_runs_or_says_why_not() -> None:
    """A block in a language the test does not run is output (``text``), a file for later
    blocks (titled) or marked with its reason: none is left unrun by accident."""
    unaccounted = [
        f"{block.where} ({block.language or 'no language'})"
        for page in pages()
        for block in blocks(page)
        if block.skip is None and block.title is None and block.language not in RUN | OUTPUT
    ]
    assert unaccounted == []
    skipped = [block for page in pages() for block in blocks(page) if block.skip]
    assert all(len(block.skip or "") > 10 for block in skipped)  # a reason, not a shrug
    runnable = [b for p in pages() for b in blocks(p) if b.language in RUN and not b.skip]
    assert len(skipped) < len(runnable) / 3, "most blocks run"


def test_every_block_of_the_readme_runs_on_a_page() -> None:
    """The README's examples are the pages' (the walk-through's, the Spark page's, ...), so the
    test that runs a page runs them: each README block is a block of a page, character for
    character, or says why it is not run."""
    shown = {block.text for page in pages() for block in blocks(page)}
    readme = blocks("../README.md")
    assert len(readme) > 10
    elsewhere = [b.where for b in readme if b.skip is None and b.text not in shown]
    assert elsewhere == [], "README blocks on no page of docs/ (so run by no test)"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mkdocs build --strict`` into a directory of this test's; fails on any warning."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=reader_environment(),
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stdout + done.stderr, done.stdout + done.stderr
    return out


def test_the_site_builds_without_a_warning(site: Path) -> None:
    for page in pages():
        built = site / page.removesuffix(".md").removesuffix("index") / "index.html"
        assert built.is_file(), page
    for generated in ("reference/cli", "reference/config", "architecture"):
        assert (site / generated / "index.html").is_file(), generated


def test_the_cli_reference_lists_every_command_and_option(site: Path) -> None:
    from millpond.cli.main import command_parser, command_summaries

    html = (site / "reference" / "cli" / "index.html").read_text()
    sections = re.split(r"<h2 ", html)
    for name in command_summaries():
        section = next(s for s in sections if s.startswith(f'id="millpond-{name}"'))
        shown = " ".join(re.findall(r"<code>([^<]*)</code>", section))
        for action in command_parser(name)._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help") and action.help != "==SUPPRESS==":
                    assert option in re.findall(r"--?[\w-]+", shown), (name, option)


def test_the_config_reference_lists_every_field(site: Path) -> None:
    from millpond.common.retry import RetryPolicy
    from millpond.consumer import ConsumerConfig
    from millpond.gc import GarbageCollectorConfig
    from millpond.producer.config import ProducerConfig

    html = (site / "reference" / "config" / "index.html").read_text()
    for cls in (ProducerConfig, ConsumerConfig, GarbageCollectorConfig, RetryPolicy):
        for item in dataclasses.fields(cls):
            assert f"<code>{item.name}</code>" in html, (cls.__name__, item.name)
    from millpond.producer.spark.options import SPARK_ONLY_KEYS

    for key in SPARK_ONLY_KEYS:
        assert f"<code>{key}</code>" in html, key


def test_the_performance_page_renders_every_result(site: Path) -> None:
    html = (site / "performance" / "index.html").read_text()
    import json

    summary = json.loads((ROOT / "bench" / "results" / "summary.json").read_text())
    for bench in summary["benchmarks"]:
        assert f"<code>{bench['name']}</code>" in html, bench["name"]
    charts = re.findall(r'<img[^>]+src="([^"]+\.png)"', html)
    assert charts
    for chart in charts:
        assert (site / "performance" / chart).is_file(), chart
    assert DOCS.is_dir()
