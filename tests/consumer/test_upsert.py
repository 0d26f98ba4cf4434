"""Issue 46, deliverable 1: upsert by key, exactly once, on SQLite and PostgreSQL.

A re-sent key used to stop the consumer for good ("duplicate key value violates unique
constraint ... [23505, permanent]"): every batch was appended. A table may now be upserted by
key (``TableSettings("upsert", key, delete_column)``, ``--mode upsert --key ...``): the last row
of a key in queue order wins, a true delete marker deletes its key, a table the sink creates
gets a primary key on the key columns, and an existing one without a unique index on them is
refused at start, naming the index to create. What a group leaves does not depend on how the
batches were grouped, and a group written again leaves the same state.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from consumer_support import Database, QueueWriter, arrow_batch
from test_table_identity import Consume, _dequeues_held, _queued, _wait_for

from millpond.consumer import ConsumedBatch
from millpond.consumer.sinks import SinkError, SinkTables, TableSettings
from millpond.formats.arrow import encode_ipc
from millpond.formats.manifest import Metadata
from millpond.storage import open_store

Row = dict[str, Any]


def _batch(sequence: int, rows: Sequence[Row] | pa.Table) -> ConsumedBatch:
    table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(list(rows))
    return dataclasses.replace(arrow_batch(sequence, table), queue="q")


def _upsert(key: Sequence[str], delete_column: str | None = None, **options: Any) -> dict[str, Any]:
    """Sink options: the sink's own table upserted by ``key``."""
    settings = TableSettings("upsert", tuple(key), delete_column)
    return {"tables": SinkTables(default=settings), "sequence_column": None, **options}


def _state(database: Database, table: str, columns: str) -> list[tuple[Any, ...]]:
    return database.query(f'SELECT {columns} FROM "{table}" ORDER BY {columns}')


def _model(
    batches: Sequence[Sequence[Row]], key: Sequence[str], delete_column: str | None = None
) -> dict[tuple[Any, ...], Row]:
    """What writing the rows one at a time, in queue order, leaves."""
    state: dict[tuple[Any, ...], Row] = {}
    for rows in batches:
        for row in rows:
            k = tuple(row[c] for c in key)
            if delete_column is not None and row.get(delete_column):
                state.pop(k, None)
            else:
                state[k] = {c: v for c, v in row.items() if c != delete_column}
    return state


def test_the_last_row_of_a_key_wins_within_and_across_groups(database: Database) -> None:
    batches = [
        [{"id": 1, "v": "a"}, {"id": 2, "v": "b"}, {"id": 1, "v": "c"}],  # 1 twice in a batch
        [{"id": 2, "v": "d"}, {"id": 3, "v": "e"}],  # 2 again, in the same group
        [{"id": 1, "v": "f"}, {"id": 4, "v": "g"}, {"id": 4, "v": "h"}],  # a later group
    ]
    with database.sink(**_upsert(["id"])) as sink:
        assert sink.write_many([_batch(0, batches[0]), _batch(1, batches[1])]) == [True, True]
        assert sink.write(_batch(2, batches[2]))
        assert sink.rows_written == 8
    assert _state(database, database.table, "id, v") == [(1, "f"), (2, "d"), (3, "e"), (4, "h")]
    expected = _model(batches, ["id"])
    assert sorted((k[0], r["v"]) for k, r in expected.items()) == [
        (1, "f"),
        (2, "d"),
        (3, "e"),
        (4, "h"),
    ]
    # The table the sink made has the key as its primary key: the database itself refuses
    # a second row of a key.
    with pytest.raises(Exception, match=r"(?i)unique|duplicate|constraint"):
        database.query(f"INSERT INTO \"{database.table}\" (id, v) VALUES (1, 'x')")


def test_a_delete_marker_deletes_its_key(database: Database) -> None:
    batches = [
        [{"id": 1, "v": "a", "gone": False}, {"id": 2, "v": "b", "gone": None}],
        # 1 deleted and written again in one batch; 2 deleted; 9 never was there.
        [
            {"id": 1, "v": "x", "gone": True},
            {"id": 1, "v": "c", "gone": False},
            {"id": 2, "v": "b", "gone": True},
            {"id": 9, "v": "z", "gone": True},
        ],
        [{"id": 3, "v": "d", "gone": False}, {"id": 3, "v": "d", "gone": True}],
    ]
    with database.sink(**_upsert(["id"], "gone")) as sink:
        assert sink.write_many([_batch(i, rows) for i, rows in enumerate(batches)])
    assert _state(database, database.table, "id, v") == [(1, "c")]
    expected = _model(batches, ["id"], "gone")
    assert [(k[0], r["v"]) for k, r in expected.items()] == [(1, "c")]
    # The marker is not a column of the table.
    columns = database.query(f'SELECT * FROM "{database.table}"')
    assert len(columns[0]) == 2


def test_a_composite_key(database: Database) -> None:
    batches = [
        [{"region": "eu", "id": 1, "n": 1}, {"region": "us", "id": 1, "n": 2}],
        [{"region": "eu", "id": 1, "n": 3}, {"region": "eu", "id": 2, "n": 4}],
        [{"region": "us", "id": 1, "n": 5, "del": True}],
    ]
    with database.sink(**_upsert(["region", "id"], "del")) as sink:
        sink.write_many([_batch(0, batches[0]), _batch(1, batches[1])])
        sink.write(_batch(2, batches[2]))
    assert _state(database, database.table, "region, id, n") == [("eu", 1, 3), ("eu", 2, 4)]


def test_what_a_group_leaves_does_not_depend_on_its_grouping(database: Database) -> None:
    """A batch that lacks a column leaves that column of its keys alone, whether the consumer
    wrote it in one group with the batch before or after it."""
    batches = [
        pa.table({"id": [1, 2], "v": ["a", "b"], "note": ["n1", "n2"]}),
        pa.table({"id": [1], "v": ["c"]}),  # no note: 1 keeps n1
        pa.table({"id": [2, 3], "v": ["d", "e"], "note": [None, "n3"]}),  # 2's note: NULL
    ]
    grouped, single = Database(database.kind, database.url), Database(database.kind, database.url)
    with grouped.sink(**_upsert(["id"])) as sink:
        sink.write_many([_batch(i, t) for i, t in enumerate(batches)])
    with single.sink(**_upsert(["id"])) as sink:
        for i, t in enumerate(batches):
            sink.write(_batch(i, t))
    expected = [(1, "c", "n1"), (2, "d", None), (3, "e", "n3")]
    assert _state(grouped, grouped.table, "id, v, note") == expected
    assert _state(single, single.table, "id, v, note") == expected


def test_a_produce_call_is_one_write_whatever_batch_it_shares(database: Database) -> None:
    """Two calls in one batch object (a producer batches its calls) leave what they leave as
    two batches: the second call, without ``note``, leaves the first one's note alone."""
    calls = [
        pa.table({"id": [1], "v": ["a"], "note": ["kept"]}),
        pa.table({"id": [1], "v": ["b"]}),
    ]
    entries = [entry for call in calls for entry in encode_ipc(call)]
    items = (Metadata(0, 1, b""), Metadata(1, 2, b""))
    shared = ConsumedBatch(tuple(entries), 0, "ingest/0.batch", items, queue="q")
    one, apart = Database(database.kind, database.url), Database(database.kind, database.url)
    with one.sink(**_upsert(["id"])) as sink:
        assert sink.write(shared)
    with apart.sink(**_upsert(["id"])) as sink:
        assert sink.write_many([_batch(0, calls[0]), _batch(1, calls[1])]) == [True, True]
    assert _state(one, one.table, "id, v, note") == [(1, "b", "kept")]
    assert _state(apart, apart.table, "id, v, note") == [(1, "b", "kept")]


def test_a_group_written_again_leaves_the_same_state(database: Database) -> None:
    """Skipped when its progress is there; and the merge itself is idempotent: with the
    progress rows taken away by hand, writing the group again changes nothing."""
    group = [
        _batch(0, [{"id": 1, "v": "a", "gone": False}, {"id": 2, "v": "b", "gone": False}]),
        _batch(1, [{"id": 1, "v": "c", "gone": False}, {"id": 2, "v": "b", "gone": True}]),
    ]
    with database.sink(**_upsert(["id"], "gone")) as sink:
        assert sink.write_many(group) == [True, True]
    first = _state(database, database.table, "id, v")
    with database.sink(**_upsert(["id"], "gone")) as sink:  # a restarted consumer
        assert sink.write_many(group) == [False, False]
    assert _state(database, database.table, "id, v") == first == [(1, "c")]
    _execute(database, f'DELETE FROM "{database.progress}"')
    with database.sink(**_upsert(["id"], "gone")) as sink:
        assert sink.write_many(group) == [True, True]
    assert _state(database, database.table, "id, v") == first


def _postgres_commit(database: Database, sql: str) -> None:
    import adbc_driver_postgresql.dbapi as pg

    with pg.connect(database.url, autocommit=True) as conn, conn.cursor() as cur:
        cur.execute(sql)


def _execute(database: Database, sql: str) -> None:
    if database.kind == "postgres":
        _postgres_commit(database, sql)
        return
    import sqlite3

    with sqlite3.connect(database.url.removeprefix("sqlite://")) as conn:
        conn.execute(sql)


def test_an_existing_table_without_a_unique_index_is_refused_at_start(
    database: Database,
) -> None:
    _execute(database, f'CREATE TABLE "{database.table}" (id BIGINT, v TEXT)')
    with database.sink(**_upsert(["id"])) as sink:
        with pytest.raises(SinkError) as refused:
            sink.last_sequence("q")  # what the service calls before it takes over
        assert not refused.value.transient
        message = str(refused.value)
        assert database.table in message
        assert "unique index" in message
        hint = message[message.index("CREATE UNIQUE INDEX") :]
        _execute(database, hint)  # the statement it names makes the table usable
        assert sink.last_sequence("q") is None
        assert sink.write(_batch(0, [{"id": 1, "v": "a"}, {"id": 1, "v": "b"}]))
    assert _state(database, database.table, "id, v") == [(1, "b")]


def test_rows_without_their_whole_key_are_refused_for_good(database: Database) -> None:
    with database.sink(**_upsert(["id"], "gone")) as sink:
        cases = {
            "no key column 'id'": [{"v": "a"}],
            "null in 1 of 2 rows": [{"id": 1, "v": "a"}, {"id": None, "v": "b"}],
            "must be boolean": [{"id": 1, "gone": "yes"}],
        }
        for sequence, (why, rows) in enumerate(cases.items()):
            with pytest.raises(SinkError, match=why) as refused:
                sink.write(_batch(sequence, rows))
            assert not refused.value.transient
            assert f"sequence {sequence}" in str(refused.value)
        assert sink.last_sequence("q") is None  # nothing of them was recorded


# -- a SIGKILL between the write and the dequeue ------------------------------------------------

_KEYS = 50
_BATCHES = 12


def _upsert_batches() -> list[list[Row]]:
    """Batches over 50 keys: keys repeated inside batches and across them, every third row of
    a later batch deleting its key."""
    batches = []
    for b in range(_BATCHES):
        rows = [
            {"k": (b * 7 + i) % _KEYS, "v": f"b{b}-r{i}", "gone": b > 3 and i % 3 == 0}
            for i in range(40)
        ]
        batches.append(rows)
    return batches


@pytest.fixture
def consume() -> Iterator[Callable[..., Consume]]:
    started: list[Consume] = []

    def start(*args: str) -> Consume:
        started.append(Consume(*args))
        return started[-1]

    yield start
    for process in started:
        process.kill()


def test_a_sigkill_between_the_write_and_the_dequeue_leaves_the_same_state(
    database: Database, tmp_path: Path, consume: Callable[..., Consume]
) -> None:
    """``millpond consume --mode upsert`` SIGKILLed once its groups are committed and before
    it dequeued them; the restart skips them: the state is the last write per key, once."""
    root = tmp_path / "queue"
    url = root.as_uri()
    batches = _upsert_batches()
    writer = QueueWriter(open_store(url))
    for rows in batches:
        writer.append(encode_ipc(pa.Table.from_pylist(rows)))
    options = ["--progress-table", database.progress, "--max-group", "4", "--sequence-column", ""]
    options += ["--mode", "upsert", "--key", "k", "--delete-column", "gone"]
    expected = sorted((k[0], r["v"]) for k, r in _model(batches, ["k"], "gone").items())
    progress = f'SELECT count(*) FROM "{database.progress}"'

    killed = consume(url, database.url, database.table, *options)
    _wait_for(lambda: "consuming" in killed.stderr, "the consumer to take over")
    with _dequeues_held(root):
        _wait_for(lambda: _count(database, progress) == _BATCHES, "every batch to be written")
        killed.kill()
    assert killed.proc.returncode == -signal.SIGKILL
    assert _state(database, database.table, "k, v") == expected
    assert _queued(url) == list(range(_BATCHES))

    restarted = consume(url, database.url, database.table, *options, "--exit-when-idle")
    assert restarted.wait() == 0, restarted.stderr
    assert _state(database, database.table, "k, v") == expected
    assert _queued(url) == []
    sequences = database.query(f'SELECT sequence, duplicate FROM "{database.progress}"')
    assert sorted(sequences) == [(s, False) for s in range(_BATCHES)] or sorted(sequences) == [
        (s, 0) for s in range(_BATCHES)
    ]


def _count(database: Database, sql: str) -> int:
    try:
        return int(database.query(sql)[0][0])
    except Exception:  # not there yet
        return 0


def test_upsert_needs_its_key_on_the_command_line(tmp_path: Path) -> None:
    from tests.support import run_cli

    url = (tmp_path / "q").as_uri()
    sink = f"sqlite://{tmp_path / 'sink.db'}"
    for flags, why in [
        (["--mode", "upsert"], "key"),
        (["--key", "id"], "upsert"),
        (["--mode", "append", "--delete-column", "d"], "upsert"),
    ]:
        done = run_cli("consume", url, "--sink", sink, "--create", *flags)
        assert done.returncode == 2, done.stderr
        assert why in done.stderr
    assert not (tmp_path / "sink.db").exists()
