"""``millpond consume`` as a newcomer meets it (issue 47): a run from a scheduler against a
database that does not answer ends, naming it; an error is printed once; ``--help`` names the
default table and the column every table gains."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa

from millpond import Producer, ProducerConfig
from millpond.localstack._process import free_ports
from tests.support import run_cli


def _queue_with(tmp_path: Path, *tables: str | None) -> str:
    """A file queue holding one batch per table named (``None``: a batch naming none)."""
    store = (tmp_path / "queue").as_uri()
    with Producer(ProducerConfig(store=store, wal_dir=str(tmp_path / "wal"))) as producer:
        for n, table in enumerate(tables):
            producer.produce_arrow(pa.table({"id": [n]}), table=table).wait()
    return store


def test_exit_when_idle_gives_up_on_a_database_that_does_not_answer_naming_it(
    tmp_path: Path,
) -> None:
    """It retried for ever, two warnings a try: a run from a scheduler never ended."""
    store = _queue_with(tmp_path, None)
    closed = free_ports(1)[0]
    sink = f"postgresql://millpond@127.0.0.1:{closed}/warehouse"
    began = time.monotonic()
    done = run_cli(
        *("consume", store, "--sink", sink, "--exit-when-idle", "--start-timeout", "2"),
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - began < 30
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("millpond consume: could not read the sink's last sequence within 2 s")
    assert "(--start-timeout)" in last
    assert f"127.0.0.1:{closed}/warehouse" in last  # the database it could not reach
    assert "Connection refused" in last
    warnings = [x for x in done.stderr.splitlines() if " WARNING " in x]
    assert warnings  # each try said once that it would retry
    assert all("could not read the sink's last sequence, retrying in" in x for x in warnings)


def test_exit_when_idle_has_a_start_timeout_by_default_and_a_service_none() -> None:
    from millpond.cli.main import command_parser
    from millpond.consumer.app.command import EXIT_WHEN_IDLE_START_TIMEOUT, start_timeout

    parser = command_parser("consume")
    base = ["file:///q", "--sink", "sqlite:////tmp/x.db"]
    assert start_timeout(parser.parse_args([*base, "--exit-when-idle"])) == 120.0
    assert EXIT_WHEN_IDLE_START_TIMEOUT == 120.0
    assert start_timeout(parser.parse_args(base)) is None  # a service waits it out
    assert start_timeout(parser.parse_args([*base, "--start-timeout", "30"])) == 30.0


def test_a_stopped_service_names_its_error_once(tmp_path: Path) -> None:
    """The error was printed twice: in an ERROR log line and again as the final line."""
    store = _queue_with(tmp_path, None, "audit")
    database = tmp_path / "rows.db"
    done = run_cli(
        *("consume", store, "--sink", f"sqlite:///{database}", "--table", "events"),
        "--exit-when-idle",
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    why = "which this consumer may not write"
    assert done.stderr.count(why) == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("millpond consume: ")
    assert why in lines[-1]
    assert any("stopping after sequence 0; nothing after it is written" in x for x in lines)
    assert any("to set it aside: millpond quarantine" in x for x in lines)


def test_help_names_the_default_table_and_the_sequence_column() -> None:
    """``millpond_rows`` and ``_millpond_sequence`` appeared nowhere a user looks."""
    shown = " ".join(run_cli("consume", "--help").stdout.split())
    assert "(default millpond_rows)" in shown
    assert "default _millpond_sequence" in shown
    assert "added to every table the consumer writes" in shown


def test_status_flags_a_consumer_after_two_missed_reports() -> None:
    """A SIGKILLed consumer still read "running … reported 6.1 s ago", flagged after 28 s."""
    from millpond.consumer.app._report import ServiceReport, ServiceState, report_text

    sent = 1_000_000
    report = ServiceReport(
        state=ServiceState.RUNNING, queue="q", epoch=1, updated_ms=sent, interval=5.0
    )

    def line(after_s: float) -> str:
        return report_text(report, now_ms=sent + int(after_s * 1000), epoch=1)[0]

    assert "NO REPORT" not in line(6.1)  # one report late: the store may be slow
    assert "NO REPORT" not in line(10.9)
    assert "NO REPORT FOR 11 s (2 missed, one every 5 s expected): is it alive?" in line(11.1)
    assert "(4 missed" in line(21.5)
    stopped = ServiceReport(state=ServiceState.STOPPED, queue="q", updated_ms=sent, interval=5.0)
    assert not stopped.stale(sent + 100_000)


def test_status_without_a_sink_says_what_its_lag_cannot_know(tmp_path: Path) -> None:
    """Without --sink it showed 30 s of lag for rows already in the database."""
    store = _queue_with(tmp_path, None)
    shown = run_cli("status", store).stdout
    lag = next(x for x in shown.splitlines() if x.startswith("consumer lag"))
    assert "at most: the oldest entry not yet dequeued, which the consumer may have" in lag
    assert "(--sink reads what the database holds)" in lag
    database = tmp_path / "rows.db"
    sink = ("--sink", f"sqlite:///{database}")
    assert run_cli("consume", store, *sink, "--exit-when-idle").returncode == 0
    with_sink = run_cli("status", store, *sink).stdout
    lag = next(x for x in with_sink.splitlines() if x.startswith("consumer lag"))
    assert lag.split() == ["consumer", "lag", "0.0", "s"]
