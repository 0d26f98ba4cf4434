"""Issue 46, deliverable 2: many tables from one queue, on SQLite and PostgreSQL.

One queue used to feed one table: a Spark application writing ``orders``, ``customers`` and
``events`` needed three queues and three consumer services. A batch's metadata items may now
name their table (``millpond.table=``); the consumer writes each item's rows into its table in
the batch's one transaction, with the queue's one progress row, and writes only the tables it
is allowed to (``--tables``, ``--config``): any other is a bad batch.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from consumer_support import FAST_RETRY, Database, QueueWriter

from millpond.consumer import ConsumedBatch, Consumer, ConsumerConfig
from millpond.consumer.app.quarantine import replay
from millpond.consumer.app.service import ConsumerService
from millpond.consumer.sinks import SinkError, SinkTables, TableSettings, load_tables
from millpond.errors import ConfigError, MillpondError
from millpond.formats.arrow import encode_ipc
from millpond.formats.manifest import Metadata
from millpond.formats.routing import with_table
from millpond.producer import Producer, ProducerConfig
from millpond.queue import read_manifest
from millpond.queue.claim import queue_identity
from millpond.storage import ObjectStore, open_store
from tests.support import run_cli

Part = tuple[str | None, pa.Table]


def _routed(sequence: int, parts: list[Part], queue: str = "q") -> ConsumedBatch:
    """A batch of ``parts``, each one metadata item naming its table (``None``: none)."""
    entries: list[bytes] = []
    items: list[Metadata] = []
    for table, rows in parts:
        payload = b"app" if table is None else with_table(b"app", table)
        items.append(Metadata(len(entries), 1_000 + sequence, payload))
        entries += encode_ipc(rows)
    return ConsumedBatch(
        entries=tuple(entries),
        sequence=sequence,
        location=f"ingest/{sequence:026d}.batch",
        metadata=tuple(items),
        queue=queue,
    )


class Names:
    """Fresh table names for one test."""

    def __init__(self) -> None:
        suffix = uuid.uuid4().hex[:6]
        self.orders = f"orders_{suffix}"
        self.customers = f"customers_{suffix}"
        self.events = f"events_{suffix}"


def _three(names: Names) -> SinkTables:
    return SinkTables(
        {
            names.orders: TableSettings("upsert", ("order_id",)),
            names.customers: TableSettings("upsert", ("region", "id"), "deleted"),
            names.events: TableSettings(),
        }
    )


def _rows(database: Database, table: str, columns: str) -> list[tuple[Any, ...]]:
    return database.query(f'SELECT {columns} FROM "{table}" ORDER BY {columns}')


def test_three_tables_from_one_queue_with_schema_drift_in_one(database: Database) -> None:
    names = Names()
    t = pa.table
    group = [
        _routed(
            0,
            [
                (names.orders, t({"order_id": [1, 2], "total": [10.0, 20.0]})),
                (names.events, t({"e": pa.array([1, 2], pa.int32())})),
                (None, t({"own": [1]})),
            ],
        ),
        _routed(
            1,
            [
                (
                    names.customers,
                    t({"region": ["eu", "us"], "id": [1, 1], "deleted": [False] * 2}),
                ),
                (names.orders, t({"order_id": [1], "total": [11.0]})),
            ],
        ),
    ]
    # The events table drifts: a wider type and a new column.
    drifted = t({"e": pa.array([3_000_000_000], pa.int64()), "note": ["wide"]})
    later = _routed(2, [(names.events, drifted), (names.customers, _deleting("us", 1))])
    with database.sink(tables=_three(names), sequence_column=None) as sink:
        assert sink.last_sequence("q") is None
        assert sink.write_many(group) == [True, True]
        assert sink.write(later)
        assert sink.last_sequence("q") == 2
        assert sink.rows_written == 2 + 2 + 1 + 2 + 1 + 1 + 1
    assert _rows(database, names.orders, "order_id, total") == [(1, 11.0), (2, 20.0)]
    assert _rows(database, names.customers, "region, id") == [("eu", 1)]
    events = database.query(f'SELECT e, note FROM "{names.events}" ORDER BY e')
    assert events == [(1, None), (2, None), (3_000_000_000, "wide")]
    assert _rows(database, database.table, "own") == [(1,)]
    # One progress for the queue, under the sink's own table, one row per batch.
    progress = database.query(
        f'SELECT target_table, sequence, row_count FROM "{database.progress}" ORDER BY sequence'
    )
    own = _resolved(database, database.table)
    assert progress == [(own, 0, 5), (own, 1, 3), (own, 2, 2)]
    # Every table the queue wrote is the queue's.
    owners = dict(database.query("SELECT target_table, queue FROM millpond_owners"))
    for table in (database.table, names.orders, names.customers, names.events):
        assert owners[_resolved(database, table)] == "q"


def test_copies_into_several_tables_warn_nothing_in_the_server_log(postgres_server: Any) -> None:
    # With the connection's autocommit off, the driver sent BEGIN before every bulk copy,
    # inside the sink's open transaction: the server logged "there is already a transaction
    # in progress" once per COPY (a group over ten tables: ten warnings a transaction).
    database = Database("postgres", postgres_server.url)
    names = Names()
    tables = [names.orders, names.customers, names.events]
    log = Path(postgres_server.root) / "postgres.log"
    before = log.stat().st_size
    batches = [
        _routed(n, [(table, pa.table({"n": [n, n + 100]})) for table in tables]) for n in range(3)
    ]
    with database.sink(tables=SinkTables({t: TableSettings() for t in tables})) as sink:
        assert sink.write_many(batches[:2]) == [True, True]
        assert sink.write(batches[2])
    with log.open("rb") as text:
        text.seek(before)
        written = text.read().decode(errors="replace")
    assert "already a transaction in progress" not in written
    assert "COPY" not in written  # no statement failed either
    for table in tables:
        assert _rows(database, table, "n") == [(0,), (1,), (2,), (100,), (101,), (102,)]


def _deleting(region: str, id_: int) -> pa.Table:
    return pa.table({"region": [region], "id": [id_], "deleted": [True]})


def _resolved(database: Database, table: str) -> str:
    return f"public.{table}" if database.kind == "postgres" else table


# (database, allowed as given, spellings batches use)
_SPELLINGS = {
    "sqlite": ("{t}", ["{T}", "main.{t}", '"{t}"', '"MAIN"."{T}"']),
    "postgres": ("{t}", ["public.{t}", '"public"."{t}"', '"{t}"']),
}


def test_every_spelling_of_an_allowed_table_is_that_table(database: Database) -> None:
    table = f"orders_{uuid.uuid4().hex[:6]}"
    allowed, spellings = _SPELLINGS[database.kind]
    tables = SinkTables({allowed.format(t=table): TableSettings("upsert", ("id",))})
    with database.sink(tables=tables, sequence_column=None) as sink:
        for sequence, spelled in enumerate(spellings):
            name = spelled.format(t=table, T=table.upper())
            rows = pa.table({"id": [1, sequence + 10], "v": [f"by {name}", "x"]})
            assert sink.write(_routed(sequence, [(name, rows)]))
    last = spellings[-1].format(t=table, T=table.upper())
    assert _rows(database, table, "id, v")[0] == (1, f"by {last}")
    owners = database.query("SELECT target_table FROM millpond_owners")
    assert sorted(o for (o,) in owners if table in o) == [_resolved(database, table)]
    if database.kind == "postgres":  # allowed as public.orders, named as orders: the same
        qualified = SinkTables({f"public.{table}": TableSettings("upsert", ("id",))})
        with database.sink(tables=qualified, sequence_column=None) as sink:
            assert sink.write(_routed(50, [(table, pa.table({"id": [1], "v": ["plain"]}))]))
        assert _rows(database, table, "id, v")[0] == (1, "plain")


def test_patterns_allow_what_they_match_and_never_the_sinks_own_records(
    database: Database,
) -> None:
    suffix = uuid.uuid4().hex[:6]
    tables = SinkTables({f"audit_{suffix}_*": TableSettings(), "*": TableSettings()})
    one = pa.table({"a": [1]})
    with database.sink(tables=SinkTables({f"audit_{suffix}_*": TableSettings()})) as sink:
        assert sink.write(_routed(0, [(f"audit_{suffix}_1", one)]))
        with pytest.raises(SinkError, match="may not write") as refused:
            sink.write(_routed(1, [(f"auditx_{suffix}", one)]))
        assert not refused.value.transient
        assert "sequence 1" in str(refused.value)
    with database.sink(tables=tables) as sink:
        for sequence, kept in enumerate([database.progress, "millpond_owners"], start=1):
            with pytest.raises(SinkError, match="may not write"):
                sink.write(_routed(sequence, [(kept, one)]))
        if database.kind == "postgres":  # not cut short onto another table's name
            with pytest.raises(SinkError, match="63 bytes"):
                sink.write(_routed(3, [(f"audit_{suffix}_" + "x" * 60, one)]))
    assert _rows(database, f"audit_{suffix}_1", "a") == [(1,)]


def test_another_queues_table_is_refused_at_start_naming_both(database: Database) -> None:
    names = Names()
    tables = SinkTables({names.orders: TableSettings()})
    with database.sink(tables=tables) as sink:
        sink.write(_routed(0, [(names.orders, pa.table({"a": [1]}))], queue="queue-a"))
    other = Database(database.kind, database.url)  # queue B: another own table, same orders
    with other.sink(tables=tables) as sink:
        with pytest.raises(SinkError, match="queue-a") as refused:
            sink.last_sequence("queue-b")
        assert "queue-b" in str(refused.value)
        assert names.orders in str(refused.value)
    # By a pattern, which the start cannot check: the write is refused, nothing written.
    with other.sink(tables=SinkTables({"orders_*": TableSettings()})) as sink:
        assert sink.last_sequence("queue-b") is None
        with pytest.raises(SinkError, match="queue-a"):
            sink.write(_routed(0, [(names.orders, pa.table({"a": [2]}))], queue="queue-b"))
    assert _rows(database, names.orders, "a") == [(1,)]


# -- the service: a batch naming a table it may not write is a bad batch ------------------------


@pytest.fixture
def store() -> ObjectStore:
    return open_store(f"memory://{uuid.uuid4().hex}")


def _queue(store: ObjectStore, parts: list[list[Part]]) -> None:
    writer = QueueWriter(store)
    for batch in parts:
        entries: list[bytes] = []
        items = []
        for table, rows in batch:
            payload = b"" if table is None else with_table(b"", table)
            items.append(Metadata(len(entries), 1, payload))
            entries += encode_ipc(rows)
        writer.enqueue(writer.upload(entries), items)


def _serve(store: ObjectStore, database: Database, tables: SinkTables, **options: Any) -> None:
    consumer = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=FAST_RETRY))
    with database.sink(tables=tables, sequence_column=None) as sink:
        ConsumerService(consumer, sink, **options).run(threading.Event(), until_idle=True)


def test_a_batch_naming_a_table_not_allowed_stops_or_is_set_aside(
    store: ObjectStore, database: Database
) -> None:
    names = Names()
    allowed = SinkTables({names.orders: TableSettings("upsert", ("id",))})
    _queue(
        store,
        [
            [(names.orders, pa.table({"id": [1], "v": ["a"]}))],
            [(names.orders, pa.table({"id": [1], "v": ["b"]})), ("secrets", pa.table({"x": [1]}))],
            [(names.orders, pa.table({"id": [2], "v": ["c"]}))],
        ],
    )
    with pytest.raises(MillpondError) as stopped:
        _serve(store, database, allowed)
    assert "sequence 1" in str(stopped.value)
    assert "secrets" in str(stopped.value)
    assert _rows(database, names.orders, "id, v") == [(1, "a")]  # nothing of 1, nor after it

    _serve(store, database, allowed, on_bad_batch="quarantine")
    assert _rows(database, names.orders, "id, v") == [(1, "a"), (2, "c")]
    assert read_manifest(store, "ingest/manifest").manifest.entries == ()
    # Allowed now: its replay writes both its parts, each into its table.
    config = ConsumerConfig(store=store, gc_enabled=False, retry=FAST_RETRY)
    more = SinkTables({"secrets": TableSettings()}).merged(allowed)
    with database.sink(tables=more, sequence_column=None) as sink:
        assert replay(config, sink, sequence=1).rows == 2
    assert _rows(database, names.orders, "id, v") == [(1, "b"), (2, "c")]
    assert _rows(database, "secrets", "x") == [(1,)]
    queue = queue_identity(store.url, "ingest/manifest")
    assert database.query(
        f"SELECT target_table, queue FROM millpond_owners WHERE queue = '{queue}' "
        "ORDER BY target_table"
    ) == sorted((_resolved(database, t), queue) for t in (database.table, names.orders, "secrets"))


# -- the command line: --config, --tables ------------------------------------------------------


def test_consume_writes_what_producers_name_per_its_config(
    tmp_path: Path, postgres_server: Any
) -> None:
    """``produce_arrow(..., table=)`` from Python, ``millpond consume --config --tables``."""
    names = Names()
    url = (tmp_path / "queue").as_uri()
    config = tmp_path / "sink.toml"
    config.write_text(
        f'[tables.{names.orders}]\nmode = "upsert"\nkey = ["order_id"]\n\n'
        f'[tables.{names.customers}]\nmode = "upsert"\nkey = ["id"]\n'
        'delete_column = "deleted"\n'
    )
    with Producer(ProducerConfig(store=url, wal_dir=tmp_path / "wal")) as producer:
        producer.produce_arrow(
            pa.table({"order_id": [1, 2], "s": ["new", "new"]}), table=names.orders
        )
        producer.produce_arrow(pa.table({"order_id": [1], "s": ["paid"]}), table=names.orders)
        producer.produce_arrow(pa.table({"id": [7], "deleted": [False]}), table=names.customers)
        producer.produce_arrow(pa.table({"n": [1, 2, 3]}), table=names.events)
        producer.produce_arrow(pa.table({"n": [4]}))  # no table: --table
        producer.flush(timeout=30)
    database = Database("postgres", postgres_server.url)
    done = run_cli(
        "consume", url, *database.sink_arguments(), "--config", str(config),
        "--tables", f"{names.events[:-2]}*", "--exit-when-idle", "--no-gc",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert _rows(database, names.orders, "order_id, s") == [(1, "paid"), (2, "new")]
    assert _rows(database, names.customers, "id") == [(7,)]
    assert _rows(database, names.events, "n") == [(1,), (2,), (3,)]
    assert _rows(database, database.table, "n") == [(4,)]


def test_table_options_that_cannot_work_are_usage_errors(tmp_path: Path) -> None:
    url = (tmp_path / "q").as_uri()
    sink = ["--sink", f"sqlite://{tmp_path / 'sink.db'}", "--create", "--table", "orders"]
    bad = tmp_path / "bad.toml"
    cases = [
        ('[tables.orders]\nmode = "merge"\n', [], "tables.orders.mode"),
        ("[tables.orders]\nkeys = ['id']\n", [], "expected mode, key and delete_column"),
        ("[tables.analytics.orders]\nmode = 'append'\n", [], '"analytics.orders"'),
        ("tables = 1\n", [], "[tables.NAME]"),
        ("[tables.orders\n", [], "not TOML"),
        ('[tables.orders]\nmode = "upsert"\nkey = ["id"]\n', ["--mode", "upsert", "--key", "x"],
         "one place"),
        ("", ["--tables", "bad name"], "table name or pattern"),
    ]  # fmt: skip
    for text, flags, why in cases:
        bad.write_text(text)
        done = run_cli("consume", url, *sink, "--config", str(bad), *flags)
        assert done.returncode == 2, (text, done.stderr)
        assert why in done.stderr, (text, done.stderr)
    assert not (tmp_path / "sink.db").exists()
    assert not (tmp_path / "q").exists()


def test_load_tables_reads_names_patterns_and_quoted_schemas(tmp_path: Path) -> None:
    path = tmp_path / "sink.toml"
    path.write_text(
        '[tables.orders]\nmode = "upsert"\nkey = "order_id"\n\n'
        '[tables."analytics.customers"]\nmode = "upsert"\nkey = ["region", "id"]\n'
        'delete_column = "deleted"\n\n[tables."audit_*"]\n'
    )
    tables = load_tables(path)
    assert [(p.text, p.schema, p.name, p.wild, s.describe()) for p, s in tables.rules] == [
        ("orders", None, "orders", False, "upsert by (order_id)"),
        (
            "analytics.customers",
            "analytics",
            "customers",
            False,
            "upsert by (region, id), deleting where deleted",
        ),
        ("audit_*", None, "audit_*", True, "append"),
    ]
    with pytest.raises(ConfigError, match="delete_column"):
        TableSettings("upsert", ("id",), "id")
    with pytest.raises(ConfigError, match="key"):
        TableSettings("upsert", ("id", "id"))
