"""The PostgreSQL sink conforms a large write a slice at a time, the next slice on a thread
while the database copies the last: the rows arrive as one write would put them, in one
transaction, and an error names the row as it would without slices."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from consumer_support import Database, arrow_batch

from millpond.consumer.sinks import PostgresSink, SinkError, SinkTables, TableSettings

ROWS = 23  # slices of 4: five whole ones and a short one


def _rows(first: int, count: int) -> pa.Table:
    ids = list(range(first, first + count))
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "s": [f'row "{i}"\n' for i in ids],
            "st": pa.array(
                [None if i % 5 == 0 else {"x": i, "m": [("k", i)]} for i in ids],
                pa.struct([("x", pa.int64()), ("m", pa.map_(pa.string(), pa.int64()))]),
            ),
            "l": pa.array([[i, None] for i in ids], pa.list_(pa.int32())),
        }
    )


def _read(database: Database) -> list[tuple[Any, ...]]:
    return database.query(f'SELECT id, s, st::text, l::text FROM "{database.table}" ORDER BY id')


@pytest.fixture
def sliced(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Slices of 4 rows; records the row count of every insert the sink makes, and checks
    that a slice is made while the one before is inserted (on another thread)."""
    monkeypatch.setattr(PostgresSink, "_INSERT_SLICE_ROWS", 4)
    inserted: list[int] = []
    original_ingest = PostgresSink._ingest
    original_conform = PostgresSink._conform
    conforming: set[int] = set()

    def ingest(self: PostgresSink, cur: Any, rows: pa.Table, *args: Any, **kwargs: Any) -> None:
        inserted.append(rows.num_rows)
        original_ingest(self, cur, rows, *args, **kwargs)

    def conform(self: PostgresSink, rows: pa.Table, *args: Any) -> pa.Table:
        conforming.add(threading.get_ident())
        return original_conform(self, rows, *args)

    monkeypatch.setattr(PostgresSink, "_ingest", ingest)
    monkeypatch.setattr(PostgresSink, "_conform", conform)
    yield inserted
    assert conforming - {threading.get_ident()}, "no slice was made on the sink's thread"


def test_a_write_larger_than_a_slice_reads_back_as_one_write_puts_it(
    postgres_database: Database, sliced: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    with postgres_database.sink(sequence_column=None) as sink:
        assert sink.write_many([arrow_batch(0, _rows(0, 10)), arrow_batch(1, _rows(10, ROWS - 10))])
    assert sliced == [4, 4, 4, 4, 4, 3]
    got = _read(postgres_database)
    assert [row[0] for row in got] == list(range(ROWS))
    assert got[3] == (3, 'row "3"\n', '{"x":3,"m":{"k":3}}', "[3,null]")
    assert got[5][2] is None
    assert all(json.loads(row[2])["x"] == row[0] for row in got if row[2] is not None)
    # One slice of every row at once reads the same.
    other = Database("postgres", postgres_database.url)
    monkeypatch.setattr(PostgresSink, "_INSERT_SLICE_ROWS", None)
    with other.sink(sequence_column=None) as sink:
        sink.write_many([arrow_batch(0, _rows(0, 10)), arrow_batch(1, _rows(10, ROWS - 10))])
    assert _read(other) == got


def test_a_bad_value_in_a_late_slice_names_its_row_in_the_write_and_writes_nothing(
    postgres_database: Database, sliced: list[int]
) -> None:
    rows = _rows(0, ROWS)
    text = rows.column("s").to_pylist()
    text[21] = "nul \x00 here"  # in the sixth slice: row 1 of it, row 21 of the write
    rows = rows.set_column(1, "s", pa.array(text))
    with postgres_database.sink(sequence_column=None) as sink:
        with pytest.raises(SinkError, match=r"first at row 21 of the batch") as caught:
            sink.write(arrow_batch(0, rows))
        assert not caught.value.transient
        assert "column 's'" in str(caught.value)
        assert sink.last_sequence("") is None
    assert postgres_database.count() == 0
    assert sliced[:5] == [4, 4, 4, 4, 4]  # the slices before it went in, then were rolled back


def test_a_group_over_several_tables_makes_each_tables_rows_while_the_last_are_copied(
    postgres_database: Database, sliced: list[int]
) -> None:
    """Issue 46: a group spread over tables holds a few rows per table, each table's fewer
    than a slice; the next table's rows are still made on a thread while the database copies
    the last table's (the fixture checks), as with one large table (bench many_tables)."""
    from test_many_tables import _routed

    tables = [f"sliced_{i}_{uuid.uuid4().hex[:6]}" for i in range(3)]
    allowed = SinkTables({name: TableSettings() for name in tables})
    group = [_routed(i, [(name, _rows(i * 3, 3))]) for i, name in enumerate(tables)]
    with postgres_database.sink(sequence_column=None, tables=allowed) as sink:
        assert sink.write_many(group) == [True, True, True]
    assert sliced == [3, 3, 3]
    for i, name in enumerate(tables):
        found = postgres_database.query(f'SELECT id FROM "{name}" ORDER BY id')
        assert found == [(i * 3,), (i * 3 + 1,), (i * 3 + 2,)]
