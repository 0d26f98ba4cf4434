"""Issue 44, "Exactly once at the seams": cases 1 and 7, one regression test per way in.

Case 1. **The same table spelled another way gets every row again.** Progress and ownership were
keyed by the table name as typed: a consumer SIGKILLed between its writes and its dequeue and
restarted with ``--table EVENTS`` (SQLite: the same table as ``events``) or ``--table
public.kill3`` (PostgreSQL: the same table as ``kill3``) found no progress and wrote every row a
second time, and a consumer of another queue reached a table it did not own through
``public.orders``. Now both are keyed by the table the database resolves.

Case 7. **A mistyped SQLite path makes a new database.** ``--sink sqlite:////nonexistent/dir/x.db``
created the directory, took the queue over and exited 0, and ``status --sink`` refused the
four-slash URL the demo prints while ``consume`` and ``doctor`` took it. Now every command reads
``--sink`` with one parser, a missing directory is an error naming it, and a refused start
leaves nothing behind.

The consumers here are real ``millpond consume`` processes on a ``file://`` queue. To stop one
between its writes and its dequeue, the test holds the manifest's write lock the way the file
store takes it (``flock`` on the manifest's lock file, shared by every process of the host): the
consumer writes everything into the database and cannot dequeue, and is SIGKILLed there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from consumer_support import MANIFEST, Database, QueueWriter, arrow_batch, numbered

from millpond.consumer import ConsumedBatch
from millpond.consumer.app._sink_progress import ProgressReader
from millpond.consumer.sinks import SinkError, open_sink
from millpond.localstack._process import free_ports
from millpond.queue import read_manifest
from millpond.queue.claim import queue_identity
from millpond.storage import open_store
from millpond.storage.file_store import FileStore
from tests.invariants import assert_exactly_once
from tests.support import CliProcess, run_cli

ROWS = 5_000
BATCHES = 20  # 100,000 numbered rows, as in the issue


# -- helpers -----------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    """No cloud credentials: the instance metadata service is a closed loopback port."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "AWS_METADATA_ENDPOINT": f"http://127.0.0.1:{free_ports(1)[0]}",
    }


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=_env())


class Consume(CliProcess):
    """A ``millpond consume`` process whose stderr is collected line by line."""

    def __init__(self, store_url: str, sink: str, table: str, *extra: str) -> None:
        command = ["--log-level", "INFO", "consume", store_url, "--sink", sink]
        command += ["--table", table, "--no-gc", "--poll-interval", "0.1"]
        super().__init__(*command, "--progress-interval", "1", *extra, env=_env())


@pytest.fixture
def consumers() -> Iterator[Callable[..., Consume]]:
    """Starts ``millpond consume`` processes; any still running at the end are killed."""
    started: list[Consume] = []

    def start(*args: str) -> Consume:
        started.append(Consume(*args))
        return started[-1]

    yield start
    for process in started:
        process.kill()


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@contextlib.contextmanager
def _dequeues_held(root: Path) -> Iterator[None]:
    """Hold the manifest's write lock as the file store takes it (every conditional write of
    the manifest waits for it, from any process): a consumer can write into its sink, and
    cannot dequeue, until this returns."""
    store = FileStore(root)
    with store._locked(store._path(MANIFEST)):
        yield


def _queue(tmp_path: Path, batches: int = BATCHES, rows: int = ROWS) -> tuple[Path, str]:
    """A ``file://`` queue holding ``batches`` Arrow batches of numbered rows."""
    root = tmp_path / "queue"
    url = root.as_uri()
    writer = QueueWriter(open_store(url))
    for i in range(batches):
        writer.append_arrow(numbered(i * rows, rows))
    return root, url


def _queued(url: str) -> list[int]:
    return [e.sequence for e in read_manifest(open_store(url), MANIFEST).manifest.entries]


def _pg_execute(url: str, *statements: str) -> None:
    import adbc_driver_postgresql.dbapi as pg

    with contextlib.closing(pg.connect(url, autocommit=True)) as conn, conn.cursor() as cur:
        for statement in statements:
            cur.execute(statement)


@pytest.fixture
def pg_schema(postgres_server: Any) -> Iterator[str]:
    """A schema of its own in the session PostgreSQL (the sweeper drops only ``public``)."""
    schema = f"s_{uuid.uuid4().hex[:8]}"
    _pg_execute(postgres_server.url, f"CREATE SCHEMA {schema}")
    yield schema
    _pg_execute(postgres_server.url, f"DROP SCHEMA {schema} CASCADE")


# -- case 1 ------------------------------------------------------------------------------------

# (database, first spelling, second spelling, the table as the database resolves it)
_SPELLINGS = [
    pytest.param("sqlite", "events", "EVENTS", "events", id="sqlite-events-EVENTS"),
    pytest.param("sqlite", "events", "main.events", "events", id="sqlite-events-main.events"),
    pytest.param("sqlite", "Events", '"MAIN"."EVENTS"', "events", id="sqlite-Events-quoted-MAIN"),
    pytest.param("postgres", "kill3", "public.kill3", "public.kill3", id="pg-kill3-public.kill3"),
    pytest.param("postgres", "public.kill3", '"kill3"', "public.kill3", id="pg-public-quoted"),
    pytest.param("postgres", "kill3", '"public"."kill3"', "public.kill3", id="pg-kill3-quoted"),
    pytest.param("postgres", "kill3", "{schema}.kill3", "{schema}.kill3", id="pg-search_path"),
]


@pytest.mark.parametrize(("kind", "first", "second", "resolved"), _SPELLINGS)
def test_case1_same_table_spelled_another_way_after_a_sigkill_gets_no_row_again(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    consumers: Callable[..., Consume],
    kind: str,
    first: str,
    second: str,
    resolved: str,
) -> None:
    """A consumer SIGKILLed after its writes and before its dequeue, restarted with another
    spelling of its table: before the fix the restart found no progress under the new
    spelling and wrote all 100,000 rows again (or, for ``main.events`` and quoted names,
    could not start at all)."""
    root, url = _queue(tmp_path)
    if kind == "sqlite":
        sink = f"sqlite://{tmp_path / 'sink.db'}"
    else:
        server = request.getfixturevalue("postgres_server")
        sink = server.url
        if "{schema}" in second:
            # A search_path naming another schema: an unqualified name lives there.
            schema = request.getfixturevalue("pg_schema")
            sink += f"?options=-csearch_path%3D{schema}"
            second, resolved = second.format(schema=schema), resolved.format(schema=schema)
    database = Database(kind, sink)
    table = ".".join(f'"{part}"' for part in resolved.split("."))
    # The progress table is next to the table on PostgreSQL (unqualified: where it resolves).
    progress = (
        table.rpartition(".")[0] + '."millpond_progress"'
        if "." in resolved
        else ('"millpond_progress"')
    )
    total = BATCHES * ROWS

    killed = consumers(url, sink, first)
    _wait_for(lambda: "consuming" in killed.stderr, "the first consumer to take over")
    with _dequeues_held(root):
        _wait_for(
            lambda: _count(database, f"SELECT count(*) FROM {progress}") == BATCHES,
            f"the first consumer to write all {BATCHES} batches",
        )
        killed.kill()
    assert killed.proc.returncode == -signal.SIGKILL
    # Killed between its writes and its dequeue: every row is in, every entry still queued.
    assert _count(database, f"SELECT count(*) FROM {table}") == total
    assert _queued(url) == list(range(BATCHES))

    restarted = consumers(url, sink, second, "--exit-when-idle")
    assert restarted.wait() == 0, restarted.stderr
    numbers = [n for (n,) in database.query(f"SELECT n FROM {table}")]
    expected = [b"%d" % n for n in range(total)]
    assert_exactly_once((b"%d" % n for n in numbers), expected, produced=expected)
    assert len(numbers) == total
    assert _queued(url) == []  # the restart dequeued what the killed one wrote
    # One progress, keyed by the table the database resolves, whatever the spelling.
    keys = database.query(f"SELECT target_table, count(*) FROM {progress} GROUP BY target_table")
    assert keys == [(resolved, BATCHES)]


def _batch(sequence: int, rows: pa.Table) -> ConsumedBatch:
    """Batch ``sequence`` of queue ``q``."""
    return dataclasses.replace(arrow_batch(sequence, rows), queue="q")


def _count(database: Database, sql: str) -> int:
    try:
        return int(database.query(sql)[0][0])
    except Exception:  # the table does not exist yet
        return 0


_API_SPELLINGS = {
    "sqlite": ["events", "EVENTS", "main.events", "Main.Events", '"events"', '"MAIN"."EVENTS"'],
    "postgres": ["kill3", "public.kill3", '"kill3"', '"public"."kill3"', 'public."kill3"'],
}


def test_case1_every_spelling_shares_one_progress_and_one_owner(database: Database) -> None:
    """Each spelling resumes after what the others wrote, skips what they wrote, and belongs
    to the queue the first one claimed the table for."""
    spellings = _API_SPELLINGS[database.kind]
    with open_sink(database.url, table=spellings[0], progress_table=database.progress) as sink:
        assert sink.last_sequence("q") is None
        assert sink.write(_batch(0, numbered(0, 10))) is True
    for i, spelling in enumerate(spellings[1:], start=1):
        with open_sink(database.url, table=spelling, progress_table=database.progress) as sink:
            assert sink.last_sequence("q") == i - 1, spelling
            # What another spelling wrote is skipped, not written again.
            assert sink.write(_batch(i - 1, numbered(0, 10))) is False
            assert sink.write(_batch(i, numbered(i * 10, 10))) is True
            with pytest.raises(SinkError, match="holds the rows and progress of queue q"):
                sink.last_sequence("another-queue")
    table = "events" if database.kind == "sqlite" else '"public"."kill3"'
    numbers = sorted(n for (n,) in database.query(f"SELECT n FROM {table}"))
    assert numbers == list(range(len(spellings) * 10))
    keys = database.query(f'SELECT DISTINCT target_table FROM "{database.progress}"')
    assert keys == [("events" if database.kind == "sqlite" else "public.kill3",)]


@pytest.mark.parametrize(
    ("kind", "owned", "reached"),
    [
        pytest.param("sqlite", "orders", "ORDERS", id="sqlite"),
        pytest.param("postgres", "orders", "public.orders", id="postgres"),
    ],
)
def test_case1_another_queue_cannot_reach_a_table_through_another_spelling(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    consumers: Callable[..., Consume],
    kind: str,
    owned: str,
    reached: str,
) -> None:
    """``--table public.orders`` by a consumer of another queue: before the fix it wrote that
    queue's rows into ``orders`` and added columns to it; now it is refused before it takes its
    queue over, and the table is untouched."""
    if kind == "sqlite":
        sink = f"sqlite://{tmp_path / 'sink.db'}"
    else:
        sink = request.getfixturevalue("postgres_server").url
    database = Database(kind, sink)
    _owner_root, owner_url = _queue(tmp_path / "a", batches=2, rows=10)
    assert consumers(owner_url, sink, owned, "--exit-when-idle").wait() == 0
    columns = _columns(database, kind)
    # Another queue, whose rows have other columns.
    other_root = tmp_path / "b" / "queue"
    other_url = other_root.as_uri()
    writer = QueueWriter(open_store(other_url))
    for i in range(3):
        writer.append_arrow(numbered(100 + i, 1).append_column("extra", pa.array(["x"])))
    epoch = read_manifest(open_store(other_url), MANIFEST).manifest.epoch

    refused = consumers(other_url, sink, reached, "--exit-when-idle")
    assert refused.wait() == 1, refused.stderr
    assert "holds the rows and progress of queue" in refused.stderr
    assert queue_identity(open_store(owner_url).url, MANIFEST) in refused.stderr
    assert queue_identity(open_store(other_url).url, MANIFEST) in refused.stderr
    # Refused before it took its queue over; nothing written, nothing altered.
    assert read_manifest(open_store(other_url), MANIFEST).manifest.epoch == epoch
    assert _queued(other_url) == [0, 1, 2]
    assert _columns(database, kind) == columns
    table = "orders" if kind == "sqlite" else '"public"."orders"'
    assert sorted(n for (n,) in database.query(f"SELECT n FROM {table}")) == list(range(20))


def _columns(database: Database, kind: str) -> list[str]:
    if kind == "sqlite":
        return [row[1] for row in database.query("PRAGMA table_info(orders)")]
    return [
        row[0]
        for row in database.query(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = 'public' "
            "AND table_name = 'orders' ORDER BY ordinal_position"
        )
    ]


def _as_earlier_versions_left_it(database: Database, spellings: list[str]) -> None:
    """Record what the progress, quarantine and owners tables hold under each of
    ``spellings`` instead, as versions that kept the name as typed did (a copy of every row
    per spelling: with two, the state the issue left behind)."""
    progress, quarantine = f'"{database.progress}"', f'"{database.progress}_quarantine"'
    (current,) = database.query(f"SELECT DISTINCT target_table FROM {progress}")[0]
    columns = {
        progress: "sequence, location, row_count, duplicate, committed_at_ms",
        quarantine: "sequence, location, reason, dead_letter, quarantined_at_ms, "
        "replayed_at_ms, replayed_rows",
        '"millpond_owners"': "queue, claimed_at_ms",
    }
    statements = [
        f"INSERT INTO {kept} (target_table, {names}) SELECT '{spelling}', {names} "
        f"FROM {kept} WHERE target_table = '{current}'"
        for spelling in set(spellings) - {current}
        for kept, names in columns.items()
    ]
    if current not in spellings:
        statements += [f"DELETE FROM {kept} WHERE target_table = '{current}'" for kept in columns]
    _execute(database, *statements)


def _execute(database: Database, *statements: str) -> None:
    if database.kind == "sqlite":
        path = database.url.removeprefix("sqlite://")
        with contextlib.closing(sqlite3.connect(path)) as conn, conn:
            for statement in statements:
                conn.execute(statement)
        return
    _pg_execute(database.url, "BEGIN", *statements, "COMMIT")


# (the database, spellings an earlier version recorded, the spelling a consumer now uses, the
# table as the database resolves it)
_EARLIER = [
    pytest.param("sqlite", ["EVENTS"], "events", "events", id="sqlite-EVENTS"),
    pytest.param("sqlite", ["events", "EVENTS"], "Main.events", "events", id="sqlite-doubled"),
    pytest.param("postgres", ["kill3"], "public.kill3", "public.kill3", id="pg-kill3"),
    pytest.param(
        "postgres", ["kill3", "public.kill3"], "public.kill3", "public.kill3", id="pg-doubled"
    ),
]


@pytest.mark.parametrize(("kind", "spellings", "now", "key"), _EARLIER)
def test_case1_progress_recorded_under_typed_names_by_earlier_versions_is_found(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    kind: str,
    spellings: list[str],
    now: str,
    key: str,
) -> None:
    """A database upgraded from a version that keyed progress by the name as typed (with two
    spellings, in the state the issue left it: the same sequences recorded under each): the
    table's progress is found under any spelling, read-only by ``status`` and by a consumer,
    which moves it to the resolved name without writing anything twice."""
    database = _database(request, tmp_path, kind)
    with open_sink(database.url, table=spellings[0], progress_table=database.progress) as sink:
        sink.last_sequence("q")
        for i in range(3):
            sink.write(_batch(i, numbered(i * 10, 10)))
    _as_earlier_versions_left_it(database, spellings)
    recorded = database.query(f'SELECT DISTINCT target_table FROM "{database.progress}"')
    assert sorted(row[0] for row in recorded) == sorted(spellings)

    # status, read-only, finds it.
    reader = ProgressReader(database.url, table=now, progress_table=database.progress)
    assert reader.read().last_sequence == 2
    with open_sink(database.url, table=now, progress_table=database.progress) as sink:
        assert sink.last_sequence("q") == 2
        assert sink.write(_batch(2, numbered(20, 10))) is False
        assert sink.write(_batch(3, numbered(30, 10))) is True
        with pytest.raises(SinkError, match="holds the rows and progress of queue q"):
            sink.last_sequence("another-queue")
    rows = database.query(
        f'SELECT target_table, sequence, duplicate FROM "{database.progress}" ORDER BY sequence'
    )
    assert [(r[0], r[1], bool(r[2])) for r in rows] == [(key, s, False) for s in range(4)]
    owners = "millpond_owners" if kind == "sqlite" else "public.millpond_owners"
    assert database.query(f"SELECT target_table, queue FROM {owners}") == [(key, "q")]


def _database(request: pytest.FixtureRequest, tmp_path: Path, kind: str) -> Database:
    if kind == "sqlite":
        return Database("sqlite", f"sqlite://{tmp_path / 'sink.db'}")
    return Database("postgres", request.getfixturevalue("postgres_server").url)


@pytest.mark.parametrize(
    ("kind", "spellings", "now"),
    [
        pytest.param("sqlite", ["events", "EVENTS"], "Main.events", id="sqlite"),
        pytest.param("postgres", ["kill3", "public.kill3"], "public.kill3", id="postgres"),
    ],
)
def test_case1_a_table_two_spellings_gave_to_two_queues_is_refused(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, spellings: list[str], now: str
) -> None:
    """The issue's ``--table public.orders`` run left one table recorded for two queues under
    two spellings: its rows are of both, and no consumer of either may go on in it."""
    database = _database(request, tmp_path, kind)
    with open_sink(database.url, table=spellings[0], progress_table=database.progress) as sink:
        sink.last_sequence("q")
        sink.write(_batch(0, numbered(0, 10)))
    _as_earlier_versions_left_it(database, spellings)
    _execute(
        database,
        f"UPDATE millpond_owners SET queue = 'other' WHERE target_table = '{spellings[1]}'",
    )
    for queue in ("q", "other"):
        with (
            open_sink(database.url, table=now, progress_table=database.progress) as sink,
            pytest.raises(SinkError, match="one table under two names") as refused,
        ):
            sink.last_sequence(queue)
        assert "for queue q" in str(refused.value)
        assert "for queue other" in str(refused.value)
    # Nothing was moved: the refusal rolled back.
    recorded = database.query(f'SELECT DISTINCT target_table FROM "{database.progress}"')
    assert sorted(row[0] for row in recorded) == sorted(spellings)


# -- case 7 ------------------------------------------------------------------------------------


def test_case7_a_mistyped_sqlite_path_makes_no_new_database(
    tmp_path: Path, consumers: Callable[..., Consume]
) -> None:
    """``--sink sqlite:////nonexistent/dir/x.db`` (four slashes, as the demo prints): before the
    fix the consumer created the directory and the database, took the queue over and exited 0
    with every entry written there."""
    _root, url = _queue(tmp_path, batches=3, rows=10)
    epoch = read_manifest(open_store(url), MANIFEST).manifest.epoch
    missing = tmp_path / "nonexistent" / "dir"
    consume = consumers(url, f"sqlite:///{missing / 'x.db'}", "events", "--exit-when-idle")
    assert consume.wait() == 2, consume.stderr
    assert f"found no directory {missing}" in consume.stderr
    assert not (tmp_path / "nonexistent").exists()
    # Refused before anything was written anywhere: the queue was not taken over.
    assert read_manifest(open_store(url), MANIFEST).manifest.epoch == epoch
    assert _queued(url) == [0, 1, 2]


@pytest.mark.parametrize(
    "command",
    [
        ["status", "{url}"],
        ["doctor", "{url}"],
        ["quarantine", "{url}", "--sequence", "0", "--reason", "why"],
        ["replay", "{url}", "--sequence", "0"],
    ],
    ids=["status", "doctor", "quarantine", "replay"],
)
def test_case7_every_command_refuses_a_missing_directory_naming_it(
    tmp_path: Path, command: list[str]
) -> None:
    """Every command that takes ``--sink`` reads it as ``consume`` does: before the fix
    ``doctor`` and ``quarantine`` made the directory, ``status`` named only the file."""
    _root, url = _queue(tmp_path, batches=1, rows=10)
    missing = tmp_path / "nonexistent" / "dir"
    args = [word.format(url=url) for word in command]
    done = _cli(*args, "--sink", f"sqlite:///{missing / 'x.db'}")
    assert done.returncode in (1, 2), done.stdout + done.stderr
    assert f"found no directory {missing}" in done.stdout + done.stderr
    assert not (tmp_path / "nonexistent").exists()


def test_case7_status_reads_the_four_slash_url_consume_wrote_through(
    tmp_path: Path, consumers: Callable[..., Consume]
) -> None:
    """Before the fix ``status --sink sqlite:////…`` failed ("invalid uri authority") where
    ``consume`` had written through the very same URL."""
    _root, url = _queue(tmp_path, batches=3, rows=10)
    path = tmp_path / "sink.db"
    four, three = f"sqlite:///{path}", f"sqlite://{path}"
    assert four.startswith("sqlite:////")
    assert not three.startswith("sqlite:////")
    assert consumers(url, four, "events", "--exit-when-idle").wait() == 0
    for sink in (four, three):
        done = _cli("status", url, "--sink", sink, "--table", "events", "--output", "json")
        assert done.returncode == 0, done.stderr
        assert '"rows": 30' in done.stdout
        assert '"last_sequence": 2' in done.stdout
    # One database: both spellings of the URL open the same file.
    assert open_sink(four).path == open_sink(three).path == path


def test_case7_a_refused_start_leaves_nothing_behind(
    database: Database, consumers: Callable[..., Consume], tmp_path: Path
) -> None:
    """A consumer of another queue with a progress table of its own, pointed at a table that
    is taken: before the fix it was refused after creating its progress and quarantine tables,
    which stayed."""
    with database.sink() as sink:
        sink.last_sequence("q")
        sink.write(_batch(0, numbered(0, 10)))
    _root, url = _queue(tmp_path, batches=1, rows=10)
    progress = f"p_{uuid.uuid4().hex[:8]}"
    refused = consumers(
        url, database.url, database.table, "--progress-table", progress, "--exit-when-idle"
    )
    assert refused.wait() == 1, refused.stderr
    assert "holds the rows and progress of queue q" in refused.stderr
    assert _tables(database, progress) == []


def test_case7_doctor_leaves_nothing_behind(database: Database, tmp_path: Path) -> None:
    """``doctor --sink`` probes in a transaction it rolls back: before the fix connecting
    created the progress, quarantine and owners tables, which stayed."""
    _root, url = _queue(tmp_path, batches=1, rows=10)
    if database.kind == "sqlite":  # an empty database file
        sqlite3.connect(database.url.removeprefix("sqlite://")).close()
    done = _cli("doctor", url, *database.sink_arguments())
    assert "PASS  sink" in done.stdout, done.stdout + done.stderr
    assert _tables(database, database.progress) == []
    assert _tables(database, "millpond_owners") == []


def _tables(database: Database, prefix: str) -> list[str]:
    if database.kind == "sqlite":
        sql = f"SELECT name FROM sqlite_master WHERE name LIKE '{prefix}%'"
    else:
        sql = f"SELECT relname FROM pg_class WHERE relname LIKE '{prefix}%'"
    return sorted(row[0] for row in database.query(sql))
