"""Schema drift that converges: zone spellings, null columns, widening, names, refusals.

Each case writes real batches into SQLite and PostgreSQL and reads the table back; a change
that cannot be reconciled must be a permanent error naming table, column, both types and the
batch's sequence (the service stops on it instead of retrying forever).
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest
from consumer_support import Database, arrow_batch

from millpond.consumer import ConsumedBatch
from millpond.consumer.sinks import SinkError
from millpond.formats.arrow import encode_ipc, unify_tables

UTC = dt.UTC


def _column_types(database: Database) -> dict[str, str]:
    if database.kind == "sqlite":
        rows = database.query(f'PRAGMA table_info("{database.table}")')
        return {str(row[1]): str(row[2]) for row in rows}
    rows = database.query(
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
        f"WHERE attrelid = '\"{database.table}\"'::regclass AND attnum > 0 "
        "AND NOT attisdropped ORDER BY attnum"
    )
    return {str(name): str(sql) for name, sql in rows}


def _execute(database: Database, sql: str) -> None:
    import adbc_driver_postgresql.dbapi as pg

    with pg.connect(database.url) as conn, conn.cursor() as cur:
        cur.execute(sql)
        conn.commit()


def _instants(values: list[int], zone: str) -> pa.Table:
    return pa.table({"n": pa.array(values), "ts": pa.array(values, pa.timestamp("us", tz=zone))})


def test_time_zone_spellings_are_one_instant_type(database: Database) -> None:
    """Spark writes its session zone (``Etc/UTC``, ``America/New_York``); PostgreSQL reflects
    ``UTC``. Before the fix the second batch stopped the PostgreSQL consumer for good."""
    micros = 1_700_000_000_123_456
    with database.sink() as sink:
        assert sink.write(arrow_batch(0, _instants([micros], "Etc/UTC")))
        assert sink.write(arrow_batch(1, _instants([micros + 1], "Etc/UTC")))
        assert sink.write(arrow_batch(2, _instants([micros + 2], "America/New_York")))
        # Several zones in one transaction (a backlog written as a group).
        group = [
            arrow_batch(3, _instants([micros + 3], "UTC")),
            arrow_batch(4, _instants([micros + 4], "+05:30")),
        ]
        assert sink.write_many(group) == [True, True]
    rows = database.query(f'SELECT n, ts FROM "{database.table}" ORDER BY n')
    expected = [dt.datetime(2023, 11, 14, 22, 13, 20, 123_456 + i, tzinfo=UTC) for i in range(5)]
    if database.kind == "sqlite":
        assert [ts for _n, ts in rows] == [t.isoformat() for t in expected]
        assert _column_types(database)["ts"] == "TIMESTAMPTZ"
    else:
        assert [ts for _n, ts in rows] == expected
        assert _column_types(database)["ts"] == "timestamp with time zone"


def test_to_arrow_unifies_time_zone_spellings_and_null_columns() -> None:
    a = _instants([1], "Etc/UTC").append_column("x", pa.nulls(1))
    b = _instants([2], "UTC").append_column("x", pa.array([7], pa.int64()))
    batch = ConsumedBatch(
        entries=(*encode_ipc(a), *encode_ipc(b)), sequence=0, location="ingest/x.batch"
    )
    table = batch.to_arrow()
    assert table.schema.field("ts").type == pa.timestamp("us", tz="Etc/UTC")
    assert table.schema.field("x").type == pa.int64()
    assert table.column("ts").cast(pa.int64()).to_pylist() == [1, 2]
    assert table.column("x").to_pylist() == [None, 7]
    assert unify_tables([b, a]).schema.field("ts").type == pa.timestamp("us", tz="UTC")


def test_a_null_column_takes_the_type_of_the_first_batch_with_values(
    database: Database,
) -> None:
    """Before the fix an all-null first batch made the column TEXT (PostgreSQL) or untyped
    (SQLite), and a later int64 batch stopped the PostgreSQL consumer for good."""
    with database.sink() as sink:
        assert sink.write(arrow_batch(0, pa.table({"n": [1], "x": pa.nulls(1)})))
        assert sink.write(arrow_batch(1, pa.table({"n": [2], "x": pa.array([10], pa.int64())})))
        assert sink.write(arrow_batch(2, pa.table({"n": [3], "x": pa.nulls(1)})))
    types = _column_types(database)
    assert types["x"] == ("INTEGER" if database.kind == "sqlite" else "bigint")
    assert database.query(f'SELECT n, x FROM "{database.table}" ORDER BY n') == [
        (1, None),
        (2, 10),
        (3, None),
    ]


def test_an_all_null_table_is_retyped_by_the_first_values(database: Database) -> None:
    """A table whose columns so far held only NULLs (created as text) takes the first real
    type: the column holds no value, so nothing is lost by changing it."""
    with database.sink(sequence_column=None) as sink:
        assert sink.write(arrow_batch(0, pa.table({"x": pa.nulls(2)})))
        assert sink.write(arrow_batch(1, pa.table({"x": pa.array([1.5], pa.float64())})))
    assert _column_types(database)["x"] == (
        "REAL" if database.kind == "sqlite" else "double precision"
    )
    assert sorted(database.query(f'SELECT x FROM "{database.table}"'), key=str) == [
        (1.5,),
        (None,),
        (None,),
    ]


def test_widening_is_applied_with_alter(database: Database) -> None:
    with database.sink() as sink:
        sink.write(
            arrow_batch(
                0,
                pa.table(
                    {
                        "n": pa.array([1], pa.int32()),
                        "d": pa.array([Decimal("1.5")], pa.decimal128(5, 1)),
                    }
                ),
            )
        )
        sink.write(
            arrow_batch(
                1,
                pa.table(
                    {
                        "n": pa.array([2**40], pa.int64()),
                        "d": pa.array([Decimal("123456.789")], pa.decimal128(12, 3)),
                    }
                ),
            )
        )
        wide = _column_types(database)
        sink.write(
            arrow_batch(
                2,
                pa.table(
                    {"n": pa.array([2.0, 2.5], pa.float64()), "d": pa.array([7, 7], pa.int32())}
                ),
            )
        )
    after = _column_types(database)
    if database.kind == "sqlite":
        assert (wide["n"], wide["d"]) == ("INTEGER", "DECIMAL_TEXT(12,3)")
        assert (after["n"], after["d"]) == ("REAL", "DECIMAL_TEXT(13,3)")
        rows = database.query(
            f'SELECT n, typeof(n), d FROM "{database.table}" ORDER BY _millpond_sequence, n'
        )
        assert rows == [
            (1.0, "real", "1.5"),
            (float(2**40), "real", "123456.789"),
            (2.0, "real", "7"),
            (2.5, "real", "7"),
        ]
    else:
        assert (wide["n"], wide["d"]) == ("bigint", "numeric(12,3)")
        assert (after["n"], after["d"]) == ("double precision", "numeric(13,3)")
        rows = database.query(
            f'SELECT n, d::text FROM "{database.table}" ORDER BY _millpond_sequence, n'
        )
        assert rows == [
            (1.0, "1.500"),
            (float(2**40), "123456.789"),
            (2.0, "7.000"),
            (2.5, "7.000"),
        ]


def test_a_varchar_column_is_widened_for_longer_strings(postgres_database: Database) -> None:
    """PostgreSQL only (SQLite text has no length): a table made by hand with varchar(5)."""
    database = postgres_database
    _execute(database, f'CREATE TABLE "{database.table}" (s varchar(5))')
    with database.sink(sequence_column=None) as sink:
        assert sink.write(arrow_batch(0, pa.table({"s": ["short"]})))
        assert _column_types(database)["s"] == "character varying(5)"
        assert sink.write(arrow_batch(1, pa.table({"s": ["much longer é"]})))
    assert _column_types(database)["s"] == "character varying(13)"
    assert database.query(f'SELECT s FROM "{database.table}" ORDER BY s') == [
        ("much longer é",),
        ("short",),
    ]


def test_sqlite_compares_names_without_case(tmp_path: Path) -> None:
    database = Database("sqlite", f"sqlite://{tmp_path / 'names.db'}")
    with database.sink() as sink:
        assert sink.write(arrow_batch(0, pa.table({"Name": ["a"]})))
        # The same column for SQLite: written into it, not added (before the fix: "duplicate
        # column name", classified transient, retried forever).
        assert sink.write(arrow_batch(1, pa.table({"NAME": ["b"], "extra": [1]})))
        with pytest.raises(SinkError) as info:
            sink.write(arrow_batch(2, pa.table({"name": ["c"], "NaMe": ["d"]})))
    assert not info.value.transient
    message = str(info.value)
    assert "sequence 2" in message
    assert "'name'" in message
    assert "'NaMe'" in message
    assert list(_column_types(database)) == ["Name", "_millpond_sequence", "extra"]
    assert database.query(f'SELECT Name FROM "{database.table}" ORDER BY Name') == [("a",), ("b",)]


def test_postgres_truncates_long_names(postgres_database: Database) -> None:
    database = postgres_database
    long = "a_rather_long_column_name_" + "x" * 40 + "_first"  # 72 bytes
    clash = long[:63] + "_second"
    with database.sink() as sink:
        assert sink.write(arrow_batch(0, pa.table({long: [1]})))
        # PostgreSQL stored the name cut at 63 bytes; the same batch column goes into it
        # (before the fix: ADD COLUMN, 42701 duplicate column, retried forever).
        assert sink.write(arrow_batch(1, pa.table({long: [2]})))
        with pytest.raises(SinkError) as info:
            sink.write(arrow_batch(2, pa.table({long: [3], clash: [4]})))
    assert not info.value.transient
    message = str(info.value)
    assert "sequence 2" in message
    assert repr(long) in message
    assert repr(clash) in message
    assert "63 bytes" in message
    assert database.query(f'SELECT "{long[:63]}" FROM "{database.table}" ORDER BY 1') == [
        (1,),
        (2,),
    ]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (pa.array([1], pa.int64()), pa.array(["text"])),
        (pa.array([1], pa.timestamp("us", tz="UTC")), pa.array([1], pa.timestamp("us"))),
        (pa.array([True]), pa.array([1.5])),
    ],
    ids=["int-then-string", "instant-then-local", "bool-then-double"],
)
def test_an_unreconcilable_change_is_permanent_and_names_everything(
    database: Database, first: pa.Array, second: pa.Array
) -> None:
    with database.sink() as sink:
        assert sink.write(arrow_batch(0, pa.table({"v": first})))
        with pytest.raises(SinkError) as info:
            sink.write(arrow_batch(1, pa.table({"v": second})))
        assert not info.value.transient
        assert sink.last_sequence("") == 0
    message = str(info.value)
    assert database.table in message
    assert "column 'v'" in message
    assert "sequence 1" in message
    assert str(second.type) in message  # the batch's type
    declared = _column_types(database)["v"]
    assert declared in message  # the table's type
    assert database.count() == 1


def test_a_nul_character_is_refused_for_postgresql_naming_column_and_row(
    postgres_database: Database,
) -> None:
    # PostgreSQL text cannot hold U+0000: COPY said only 'invalid byte sequence for encoding
    # "UTF8": 0x00', naming no column. Inside JSON it is an escape, which json takes.
    table = pa.table({"s": ["ok", None, "bad\x00nul"], "st": [{"x": "a\x00b"}, None, None]})
    message = _refused(postgres_database, table)
    assert "column 's'" in message
    assert "first at row 2" in message
    assert "U+0000" in message
    with postgres_database.sink() as sink:
        assert sink.write(arrow_batch(1, table.drop_columns(["s"])))
    rows = postgres_database.query(
        f'SELECT st::text FROM "{postgres_database.table}" ORDER BY _millpond_sequence'
    )
    assert rows[0] == ('{"x":"a\\u0000b"}',)


def test_a_column_without_a_name_is_refused_for_postgresql_in_our_words(
    postgres_database: Database,
) -> None:
    # Before: PostgreSQL's 'zero-length delimited identifier at or near """"' from the DDL.
    message = _refused(postgres_database, pa.table({"n": [1], "": [2]}))
    assert "sequence 0" in message
    assert "column 1 has an empty name" in message
    assert "zero-length" not in message


def test_two_columns_of_one_name_are_refused_as_such(database: Database) -> None:
    # Before: "... are the same column in PostgreSQL (PostgreSQL keeps the first 63 bytes of
    # a name)" for two columns spelled alike, which is not why.
    table = pa.Table.from_arrays([pa.array([1]), pa.array([2])], names=["x", "x"])
    message = _refused(database, table)
    assert "the batch has two columns named 'x'" in message
    assert "63 bytes" not in message
    assert "ASCII case" not in message
    assert database.count() == 0


def _refused(database: Database, table: pa.Table) -> str:
    """The message of the permanent error writing ``table`` as batch 0 gives."""
    with database.sink() as sink, pytest.raises(SinkError) as info:
        sink.write(arrow_batch(0, table))
    assert not info.value.transient
    return str(info.value)
