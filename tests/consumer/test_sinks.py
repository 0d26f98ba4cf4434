"""SQLite and PostgreSQL sinks: one transaction per batch, skips, schema drift, opaque rows."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from consumer_support import Database, arrow_batch

from millpond.consumer import ConsumedBatch, Metadata
from millpond.consumer.sinks import (
    EntryFormat,
    PostgresSink,
    SinkError,
    SQLiteSink,
    open_sink,
)
from millpond.errors import ConfigError, FormatError
from millpond.formats.arrow import encode_ipc

ROUNDS = 100  # fresh progress tables, each set up by SETUPS_AT_ONCE sinks together
SETUPS_AT_ONCE = 8


def test_write_records_rows_sequence_and_location_once(database: Database) -> None:
    with database.sink() as sink:
        assert sink.last_sequence("") is None
        assert sink.write(arrow_batch(0, pa.table({"n": [1, 2, 3]}))) is True
        assert sink.write(arrow_batch(1, pa.table({"n": [4]}))) is True
        # The same batch again (a resumed or fenced twin): skipped.
        assert sink.write(arrow_batch(1, pa.table({"n": [4]}))) is False
        # The same location enqueued twice by a recovering producer: skipped, but counted.
        again = arrow_batch(
            2, pa.table({"n": [4]}), location="ingest/00000000000000000000000001.batch"
        )
        assert sink.write(again) is False
        assert sink.last_sequence("") == 2
        assert sink.rows_written == 4
    rows = database.query(f'SELECT n, _millpond_sequence FROM "{database.table}" ORDER BY n')
    assert rows == [(1, 0), (2, 0), (3, 0), (4, 1)]
    progress = database.query(
        f'SELECT sequence, location, row_count, duplicate FROM "{database.progress}" '
        "ORDER BY sequence"
    )
    assert [(r[0], r[1], r[2], bool(r[3])) for r in progress] == [
        (0, "ingest/00000000000000000000000000.batch", 3, False),
        (1, "ingest/00000000000000000000000001.batch", 1, False),
        (2, "ingest/00000000000000000000000001.batch", 1, True),
    ]


def test_schema_drift_adds_nullable_columns_and_widens(database: Database) -> None:
    with database.sink() as sink:
        sink.write(arrow_batch(0, pa.table({"n": pa.array([1], pa.int32()), "s": ["a"]})))
        sink.write(arrow_batch(1, pa.table({"n": pa.array([2], pa.int64()), "x": [0.5]})))
        sink.write(arrow_batch(2, pa.table({"n": pa.array([2.5], pa.float64())})))
    rows = database.query(f'SELECT n, s, x FROM "{database.table}" ORDER BY n')
    assert rows == [(1, "a", None), (2, None, 0.5), (2.5, None, None)]


def test_entries_with_drifted_schemas_in_one_batch(database: Database) -> None:
    first = pa.table({"n": pa.array([1], pa.int16())})
    second = pa.table({"n": pa.array([2], pa.int64()), "tag": ["t"]})
    batch = ConsumedBatch(
        entries=(*encode_ipc(first), *encode_ipc(second)),
        sequence=0,
        location="ingest/00000000000000000000000000.batch",
    )
    with database.sink(sequence_column=None) as sink:
        assert sink.write(batch)
    assert database.query(f'SELECT n, tag FROM "{database.table}" ORDER BY n') == [
        (1, None),
        (2, "t"),
    ]


def test_opaque_entries_become_one_row_each(database: Database) -> None:
    batch = ConsumedBatch(
        entries=(b"e0", b"e1", b"e2"),
        sequence=7,
        location="ingest/00000000000000000000000007.batch",
        metadata=(Metadata(0, 100, b"first"), Metadata(2, 200, b"second")),
    )
    with database.sink() as sink:
        assert sink.write(batch)
        assert sink.last_sequence("") == 7
    rows = database.query(
        "SELECT sequence, entry_index, payload, ingestion_time_ms, metadata "
        f'FROM "{database.table}" ORDER BY entry_index'
    )
    assert [(r[0], r[1], bytes(r[2]), r[3], bytes(r[4])) for r in rows] == [
        (7, 0, b"e0", 100, b"first"),
        (7, 1, b"e1", 100, b"first"),
        (7, 2, b"e2", 200, b"second"),
    ]


def test_mixed_entries_need_an_explicit_format(database: Database) -> None:
    batch = ConsumedBatch(
        entries=(*encode_ipc(pa.table({"n": [1]})), b"plain"),
        sequence=0,
        location="ingest/00000000000000000000000000.batch",
    )
    with database.sink() as sink, pytest.raises(FormatError, match="set the entry format"):
        sink.write(batch)
    with database.sink(entry_format=EntryFormat.OPAQUE) as sink:
        assert sink.write(batch)
        assert sink.last_sequence("") == 0


def test_a_failed_transaction_leaves_nothing(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    with database.sink() as sink:
        sink.write(arrow_batch(0, pa.table({"n": [1]})))

        def explode(*args: Any) -> pa.Table:
            raise RuntimeError("crash between the progress row and the rows")

        monkeypatch.setattr(sink, "_prepare_table", explode)
        with pytest.raises(RuntimeError):
            sink.write(arrow_batch(1, pa.table({"n": [2]})))
        assert sink.last_sequence("") == 0
        monkeypatch.undo()
        assert sink.write(arrow_batch(1, pa.table({"n": [2]})))
    assert database.query(f'SELECT n FROM "{database.table}" ORDER BY n') == [(1,), (2,)]


def test_postgres_sinks_setting_up_a_fresh_database_at_once_all_get_in(
    postgres_database: Database,
) -> None:
    """Consumers starting together (a takeover, a restarted fleet) on a database that has no
    progress table yet each create the tables they need, IF NOT EXISTS, which PostgreSQL does
    not make safe against a concurrent CREATE: a session could fail with 'type "progress_…"
    already exists', a permanent error that stopped its consumer (seen in CI, in
    test_two_sinks_racing_on_one_batch_write_it_once), or with a duplicate key on pg_type.

    The window is narrow, so many fresh sets of tables are each set up by several sinks at
    once. Connections are opened beforehand and handed to each sink, whose first transaction
    sets up (inside it), so every round is a race of setups, not of connects."""
    import adbc_driver_postgresql.dbapi as pg

    conns = [pg.connect(postgres_database.url) for _ in range(SETUPS_AT_ONCE)]
    errors: list[BaseException] = []

    def setup(sink: Any, conn: Any, barrier: threading.Barrier) -> None:
        try:
            barrier.wait(timeout=60)
            sink._conn = conn
            sink._transaction_once(lambda cur: None)
        except BaseException as err:
            errors.append(err)

    try:
        for _ in range(ROUNDS):
            fresh = Database(postgres_database.kind, postgres_database.url)
            barrier = threading.Barrier(SETUPS_AT_ONCE)
            threads = [
                threading.Thread(target=setup, args=(fresh.sink(), conn, barrier)) for conn in conns
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not errors, repr(errors[0])
    finally:
        for conn in conns:
            conn.close()


@pytest.mark.parametrize("groups", [(1, 1), (3, 4)], ids=["one-by-one", "in-groups"])
def test_two_sinks_racing_on_one_batch_write_it_once(
    database: Database, groups: tuple[int, int]
) -> None:
    """A fenced consumer that has not noticed yet and its successor write the same batches."""
    batches = [arrow_batch(i, pa.table({"n": [i] * 50})) for i in range(24)]
    results: dict[str, list[bool]] = {"a": [], "b": []}

    def run(name: str, size: int) -> None:
        with database.sink() as sink:
            for start in range(0, len(batches), size):
                results[name].extend(sink.write_many(batches[start : start + size]))

    threads = [
        threading.Thread(target=run, args=(name, size))
        for name, size in zip(results, groups, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [a + b for a, b in zip(results["a"], results["b"], strict=True)] == [1] * 24
    assert database.query(f'SELECT count(*), count(DISTINCT n) FROM "{database.table}"') == [
        (1200, 24)
    ]


def test_unreconcilable_column_types_are_a_permanent_error(
    postgres_database: Database,
) -> None:
    """PostgreSQL only: a SQLite column takes any value."""
    database = postgres_database
    with database.sink() as sink:
        sink.write(arrow_batch(0, pa.table({"n": [1]})))
        with pytest.raises(SinkError, match="'n'") as info:
            sink.write(arrow_batch(1, pa.table({"n": ["text"]})))
        assert not info.value.transient
        assert sink.last_sequence("") == 0


def test_a_dropped_connection_reconnects(postgres_database: Database) -> None:
    database = postgres_database
    with database.sink() as sink:
        sink.write(arrow_batch(0, pa.table({"n": [1]})))
        terminated = database.query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND datname = current_database() "
            "AND backend_type = 'client backend'"
        )
        assert terminated
        assert sink.write(arrow_batch(1, pa.table({"n": [2]})))
        assert sink.last_sequence("") == 1
    assert database.query(f'SELECT n FROM "{database.table}" ORDER BY n') == [(1,), (2,)]


def test_an_unreachable_database_is_a_transient_error() -> None:
    sink = PostgresSink("postgresql://postgres:pw@127.0.0.1:1/millpond")
    with pytest.raises(SinkError) as info:
        sink.last_sequence("")
    assert info.value.transient
    assert "pw@" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "mysql://db/x",
        "sqlite://relative.db",
        "sqlite:relative.db",
        "postgresql:///nohost",
        "sqlite:///x.db?busy_timeout_ms=%C2%B2",  # a digit to isdigit(), not to int()
    ],
)
def test_open_sink_refuses_unknown_urls(url: str) -> None:
    with pytest.raises(ConfigError, match=r"sink|busy_timeout_ms"):
        open_sink(url)


def test_errors_never_show_the_password() -> None:
    with pytest.raises(ConfigError) as info:
        open_sink("mysql://user:s3cret@db/x")
    assert "s3cret" not in str(info.value)
    sink = PostgresSink("postgresql://user:s3cret@127.0.0.1:1/db")
    assert "s3cret" not in repr(sink)


def test_a_name_postgresql_would_cut_is_refused(postgres_server: Any) -> None:
    """PostgreSQL cut it without a word: a 70-byte table name and its first 63 bytes were one
    table whose progress the sink kept under two keys, so a consumer whose configuration
    changed from one spelling to the other wrote the batches still queued a second time."""
    long = "rows_" + "x" * 65
    for options, key in (
        ({"table": long}, "table"),
        ({"table": "s" * 64 + ".rows"}, "table"),
        ({"progress_table": "p" * 53}, "progress_table"),  # its "_quarantine" table: 64
    ):
        with pytest.raises(ConfigError) as info:
            open_sink(postgres_server.url, **options)
        assert info.value.key == key
        assert "keeps the first 63 bytes" in str(info.value)
    open_sink(postgres_server.url, table=long[:63], progress_table="p" * 52).close()


@pytest.mark.parametrize("table", ["", "1abc", "a;drop", "a.b.c", "x y"])
def test_table_names_are_plain_identifiers(tmp_path: Path, table: str) -> None:
    with pytest.raises(ConfigError, match="table"):
        SQLiteSink(tmp_path / "x.db", table=table)
    with pytest.raises(ConfigError, match="entry_format"):
        SQLiteSink(tmp_path / "x.db", entry_format="csv")
