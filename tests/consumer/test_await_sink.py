"""``WriteHandle.wait_written()`` against ``millpond consume`` as a real process, on SQLite and
PostgreSQL: it returns once the service has written the batch (the rows are in the table when
it returns), and when the time runs out it says what the service is doing — behind (a table
another transaction holds locked, which the service retries), stopped (SIGTERM), stopped on a
batch the database refuses (which, and why) — or that it set the batch aside."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pyarrow as pa
import pytest
from consumer_support import Database, numbered

from millpond import Producer, ProducerConfig, SinkWaitError, SinkWaitTimeoutError
from millpond.localstack._process import free_ports
from millpond.queue import read_written
from millpond.storage import open_store
from tests.support import CliProcess


class Service(CliProcess):
    """``millpond consume`` on a file store: polls every 0.2 s at most, reports every second."""

    def __init__(self, store: str, database: Database, *extra: str) -> None:
        env = {
            **os.environ,
            # No cloud credentials here: nothing may ask an instance metadata service.
            "AWS_METADATA_ENDPOINT": f"http://127.0.0.1:{free_ports(1)[0]}",
        }
        super().__init__(
            *("--log-level", "INFO", "consume", store, "--create", *database.sink_arguments()),
            *("--poll-interval", "0.2", "--report-interval", "1", "--no-gc", *extra),
            env=env,
        )
        _until(lambda: "consuming" in self.stderr or self.proc.poll() is not None, "a start")


def _until(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def services() -> Iterator[Callable[..., Service]]:
    """Starts services for a test; any still running at the end are killed (by PID)."""
    started: list[Service] = []

    def start(store: str, database: Database, *extra: str) -> Service:
        started.append(Service(store, database, *extra))
        return started[-1]

    yield start
    for service in started:
        service.kill()


@pytest.fixture
def producer(tmp_path: Path) -> Iterator[Producer]:
    with Producer(ProducerConfig(store=_store(tmp_path), wal_dir=str(tmp_path / "wal"))) as p:
        yield p


def _store(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


def _same_tables(database: Database, url: str) -> Database:
    other = Database(database.kind, url)
    other.table, other.progress = database.table, database.progress
    return other


def _quick_to_give_up_on_locks(database: Database) -> Database:
    """The same tables, through a URL whose lock waits end at once: a locked table is a
    transient error the service retries (and says so), not a wait inside the database."""
    if database.kind == "sqlite":
        return _same_tables(database, f"{database.url}?busy_timeout_ms=100")
    return _same_tables(database, f"{database.url}?options={quote('-c lock_timeout=200')}")


@contextlib.contextmanager
def _table_locked(database: Database) -> Iterator[None]:
    """Another transaction holds the target table (SQLite: the database) write-locked; on
    PostgreSQL nothing else reads it meanwhile (ACCESS EXCLUSIVE)."""
    if database.kind == "sqlite":
        path = database.url.removeprefix("sqlite://")
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as lock:
            lock.execute("BEGIN IMMEDIATE")
            yield
            lock.execute("ROLLBACK")
        return
    import adbc_driver_postgresql.dbapi as pg

    with pg.connect(database.url) as conn, conn.cursor() as cur:
        cur.execute(f'LOCK TABLE "{database.table}" IN ACCESS EXCLUSIVE MODE')
        yield
        conn.rollback()


def test_wait_written_returns_once_the_rows_are_in_and_times_out_while_the_service_is_behind(
    tmp_path: Path,
    database: Database,
    producer: Producer,
    services: Callable[..., Service],
) -> None:
    service = services(_store(tmp_path), _quick_to_give_up_on_locks(database))
    first = producer.produce_arrow(numbered(0, 10))
    first.wait_written(60)
    assert database.count() == 10  # in the table when it returns: no polling here
    with _table_locked(database):
        second = producer.produce_arrow(numbered(10, 10))
        with pytest.raises(SinkWaitTimeoutError) as info:
            second.wait_written(3)
        err = info.value
        assert (err.reason, err.waiting_for, err.written_through) == (
            "behind",
            second.sequence,
            first.sequence,
        )
        assert "the consumer is behind by 1 entries" in str(err)
        assert "retrying" in str(err)  # the lock the service meets, in its own words
    second.wait_written(60)  # the lock is gone: the service writes it
    assert database.count() == 20
    assert service.stop() == 0, service.stderr


def test_wait_written_times_out_naming_a_service_that_stopped(
    tmp_path: Path,
    database: Database,
    producer: Producer,
    services: Callable[..., Service],
) -> None:
    service = services(_store(tmp_path), database)
    producer.produce_arrow(numbered(0, 10)).wait_written(60)
    assert service.stop() == 0, service.stderr  # SIGTERM
    late = producer.produce_arrow(numbered(10, 10))
    with pytest.raises(SinkWaitTimeoutError) as info:
        late.wait_written(2)
    err = info.value
    assert err.reason == "not_running"
    assert "the consumer is not running: it stopped" in str(err)
    assert "behind by 1" in str(err)
    assert "The entries are in the queue" in str(err)
    assert database.count() == 10


def test_wait_written_names_the_batch_the_service_stopped_on_and_why(
    tmp_path: Path,
    database: Database,
    producer: Producer,
    services: Callable[..., Service],
) -> None:
    service = services(_store(tmp_path), database)
    producer.produce_arrow(numbered(0, 10)).wait_written(60)
    # A string where the column n holds integers: refused for good.
    poison = producer.produce_arrow(pa.table({"n": ["eleven"], "label": ["x"]}))
    producer.flush()  # a batch of its own
    after = producer.produce_arrow(numbered(11, 5))
    assert service.wait() == 1, service.stderr  # stopped on the poison batch
    mark = read_written(open_store(_store(tmp_path)), "ingest")
    assert mark is not None
    assert mark.error is not None
    assert "n" in mark.error
    for handle in (poison, after):
        with pytest.raises(SinkWaitTimeoutError) as info:
            handle.wait_written(1)
        err = info.value
        assert (err.reason, err.stopped_on) == ("stopped_on_batch", poison.sequence)
        stopped = f"the consumer is stopped on sequence {poison.sequence}: {mark.error}"
        assert stopped in str(err)  # which batch, and the service's own words for why
    assert database.count() == 10


def test_a_batch_the_service_sets_aside_fails_the_wait_and_later_ones_return(
    tmp_path: Path,
    producer: Producer,
    services: Callable[..., Service],
) -> None:
    database = Database("sqlite", f"sqlite://{tmp_path / 'sink.db'}")
    service = services(_store(tmp_path), database, "--on-bad-batch", "quarantine")
    producer.produce_arrow(numbered(0, 10)).wait_written(60)
    poison = producer.produce_arrow(pa.table({"n": ["eleven"], "label": ["x"]}))
    producer.flush()  # a batch of its own: the service sets aside whole batches
    after = producer.produce_arrow(numbered(11, 5))
    after.wait_written(60)  # not in the set-aside batch: its rows are in
    assert database.count() == 15
    with pytest.raises(SinkWaitError) as info:
        poison.wait_written(60)
    err = info.value
    assert not isinstance(err, TimeoutError)
    assert (err.reason, err.set_aside) == ("set_aside", (poison.sequence,))
    assert "--on-bad-batch quarantine" in str(err)
    assert f"millpond replay ... --sequence {poison.sequence}" in str(err)
    assert service.stop() == 0, service.stderr
    # A service started again still knows (the mark carries set-aside batches over).
    again = services(_store(tmp_path), database)
    producer.produce_arrow(numbered(16, 1)).wait_written(60)
    with pytest.raises(SinkWaitError):
        poison.wait_written(5)
    assert again.stop() == 0, again.stderr


def test_a_takeover_goes_on_from_the_sink_and_the_fenced_service_says_nothing_more(
    tmp_path: Path,
    producer: Producer,
    services: Callable[..., Service],
) -> None:
    database = Database("sqlite", f"sqlite://{tmp_path / 'sink.db'}")
    older = services(_store(tmp_path), database)
    producer.produce_arrow(numbered(0, 10)).wait_written(60)
    newer = services(_store(tmp_path), database)
    assert older.wait() == 3, older.stderr  # fenced
    mark = read_written(open_store(_store(tmp_path)), "ingest")
    assert mark is not None
    assert mark.state == "running"  # the newer one's: a fenced service writes no last word
    handle = producer.produce_arrow(numbered(10, 10))
    handle.wait_written(60)
    assert database.count() == 20
    mark = read_written(open_store(_store(tmp_path)), "ingest")
    assert mark is not None
    assert mark.written_through == handle.sequence
    assert newer.stop() == 0, newer.stderr


def test_a_batch_set_aside_by_hand_fails_the_wait_once_the_service_moves_past_it(
    tmp_path: Path,
    producer: Producer,
    services: Callable[..., Service],
) -> None:
    """The default: the service stops on the batch; an operator runs ``millpond quarantine``
    and starts it again. A waiter for that batch then fails naming it, instead of taking the
    service's written-through (now past it) for its rows being in the table."""
    database = Database("sqlite", f"sqlite://{tmp_path / 'sink.db'}")
    store = _store(tmp_path)
    stopped = services(store, database)
    producer.produce_arrow(numbered(0, 10)).wait_written(60)
    poison = producer.produce_arrow(pa.table({"n": ["eleven"], "label": ["x"]}))
    assert stopped.wait() == 1, stopped.stderr
    assert poison.sequence is not None
    quarantine = CliProcess(
        *("quarantine", store, "--sequence", str(poison.sequence), "--reason", "bad export"),
        *database.sink_arguments(),
    )
    assert quarantine.wait() == 0, quarantine.stderr
    again = services(store, database)
    producer.produce_arrow(numbered(11, 5)).wait_written(60)
    with pytest.raises(SinkWaitError, match=f"quarantined; sequence {poison.sequence}: bad export"):
        poison.wait_written(60)
    assert again.stop() == 0, again.stderr
