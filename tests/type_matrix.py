"""The type fidelity matrix: one column per Spark SQL type, three rows (extremes, more
extremes, all nulls), and what each value must read back as from PostgreSQL and SQLite.

The expectations are written out by hand, value by value, from the mapping the docs'
types page shows; they are not computed by the code under test.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

UTC = dt.UTC
LONG_TEXT = "héllo wörld ✓ 日本語 🎉 " + "x" * 100_000
TS_A = dt.datetime(2024, 3, 10, 7, 30, 0, 1, tzinfo=UTC)  # 03:30 EDT, the morning clocks jump
TS_B = dt.datetime(1969, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC)
NTZ_A = dt.datetime(2024, 3, 10, 2, 30)  # a wall time that does not exist in New York
NTZ_B = dt.datetime(9999, 12, 31, 23, 59, 59, 999_999)
DTI_A = dt.timedelta(days=1, hours=2, minutes=3, seconds=4, microseconds=5)

COLUMNS = [
    "id", "b", "i8", "i16", "i32", "i64", "f32", "f64", "d38", "d38max", "dneg", "s", "bin",
    "d", "ts", "tsntz", "dti", "arr", "m", "st", "nested", "nul",
]  # fmt: skip

ROWS: list[dict[str, Any]] = [
    {
        "id": 0,
        "b": True,
        "i8": -128,
        "i16": -32768,
        "i32": -(2**31),
        "i64": -(2**63),
        "f32": 1.5,
        "f64": float("nan"),
        "d38": Decimal("-1234567890123456789012345678.0123456789"),
        "d38max": Decimal("9" * 38),
        "dneg": Decimal("1.23E+4"),
        "s": "",
        "bin": b"",
        "d": dt.date(1, 1, 1),
        "ts": TS_A,
        "tsntz": NTZ_A,
        "dti": DTI_A,
        "arr": [1, None, 3],
        "m": {"a": 1, "é": None},
        "st": {"x": 1, "y": "z"},
        "nested": [{"k": {1: [1.5, float("inf")]}, "t": TS_A}],
        "nul": None,
    },
    {
        "id": 1,
        "b": False,
        "i8": 127,
        "i16": 32767,
        "i32": 2**31 - 1,
        "i64": 2**63 - 1,
        "f32": float("inf"),
        "f64": float("-inf"),
        "d38": Decimal("0.0000000001"),
        "d38max": Decimal("-" + "9" * 38),
        "dneg": Decimal("-9.99E+4"),
        "s": LONG_TEXT,
        "bin": bytes(range(256)),
        "d": dt.date(9999, 12, 31),
        "ts": TS_B,
        "tsntz": NTZ_B,
        "dti": dt.timedelta(0),
        "arr": [],
        "m": {},
        "st": {"x": None, "y": ""},
        "nested": [],
        "nul": None,
    },
    {"id": 2, **{column: None for column in COLUMNS[1:]}},
]

_JSON_A = {
    "arr": "[1,null,3]",
    "m": '{"a":1,"é":null}',
    "st": '{"x":1,"y":"z"}',
    "nested": '[{"k":{"1":[1.5,"Infinity"]},"t":"2024-03-10T07:30:00.000001+00:00"}]',
}
_JSON_B = {"arr": "[]", "m": "{}", "st": '{"x":null,"y":""}', "nested": "[]"}
TABLE_COLUMNS = [c for c in COLUMNS if c != "nul"]
"""The columns a table gets: an all-null (void) column gets none until values come."""

POSTGRES_TEXT: list[dict[str, str | None]] = [
    {
        "id": "0", "b": "true", "i8": "-128", "i16": "-32768", "i32": "-2147483648",
        "i64": "-9223372036854775808", "f32": "1.5", "f64": "NaN",
        "d38": "-1234567890123456789012345678.0123456789", "d38max": "9" * 38,
        "dneg": "12300", "s": "", "bin": "\\x", "d": "0001-01-01",
        "ts": "2024-03-10 07:30:00.000001+00", "tsntz": "2024-03-10 02:30:00",
        "dti": "26:03:04.000005", **_JSON_A,
    },
    {
        "id": "1", "b": "false", "i8": "127", "i16": "32767", "i32": "2147483647",
        "i64": "9223372036854775807", "f32": "Infinity", "f64": "-Infinity",
        "d38": "0.0000000001", "d38max": "-" + "9" * 38, "dneg": "-99900", "s": LONG_TEXT,
        "bin": "\\x" + bytes(range(256)).hex(), "d": "9999-12-31",
        "ts": "1969-12-31 23:59:59.999999+00", "tsntz": "9999-12-31 23:59:59.999999",
        "dti": "00:00:00", **_JSON_B,
    },
    {"id": "2", **{column: None for column in TABLE_COLUMNS[1:]}},
]  # fmt: skip
"""Each value as PostgreSQL prints it (``column::text``, session time zone UTC)."""

POSTGRES_TYPES = {
    "id": "bigint", "b": "boolean", "i8": "smallint", "i16": "smallint", "i32": "integer",
    "i64": "bigint", "f32": "real", "f64": "double precision", "d38": "numeric(38,10)",
    "d38max": "numeric(38,0)", "dneg": "numeric(3,-2)", "s": "text", "bin": "bytea",
    "d": "date", "ts": "timestamp with time zone", "tsntz": "timestamp without time zone",
    "dti": "interval", "arr": "json", "m": "json", "st": "json", "nested": "json",
}  # fmt: skip

SQLITE_VALUES: list[dict[str, Any]] = [
    {
        "id": 0, "b": 1, "i8": -128, "i16": -32768, "i32": -(2**31), "i64": -(2**63),
        "f32": 1.5, "f64": "NaN", "d38": "-1234567890123456789012345678.0123456789",
        "d38max": "9" * 38, "dneg": "12300", "s": "", "bin": b"", "d": "0001-01-01",
        "ts": "2024-03-10T07:30:00.000001+00:00", "tsntz": "2024-03-10T02:30:00.000000",
        "dti": 93_784_000_005, **_JSON_A,
    },
    {
        "id": 1, "b": 0, "i8": 127, "i16": 32767, "i32": 2**31 - 1, "i64": 2**63 - 1,
        "f32": float("inf"), "f64": float("-inf"), "d38": "0.0000000001",
        "d38max": "-" + "9" * 38, "dneg": "-99900", "s": LONG_TEXT, "bin": bytes(range(256)),
        "d": "9999-12-31", "ts": "1969-12-31T23:59:59.999999+00:00",
        "tsntz": "9999-12-31T23:59:59.999999", "dti": 0, **_JSON_B,
    },
    {"id": 2, **{column: None for column in TABLE_COLUMNS[1:]}},
]  # fmt: skip
"""Each value as Python's sqlite3 reads it."""

SQLITE_TYPES = {
    "id": "INTEGER", "b": "BOOLEAN", "i8": "INTEGER", "i16": "INTEGER", "i32": "INTEGER",
    "i64": "INTEGER", "f32": "REAL", "f64": "REAL", "d38": "DECIMAL_TEXT(38,10)",
    "d38max": "DECIMAL_TEXT(38,0)", "dneg": "DECIMAL_TEXT(3,-2)", "s": "TEXT", "bin": "BLOB",
    "d": "DATE", "ts": "TIMESTAMPTZ", "tsntz": "TIMESTAMP", "dti": "INTERVAL", "arr": "JSON_TEXT",
    "m": "JSON_TEXT", "st": "JSON_TEXT", "nested": "JSON_TEXT",
}  # fmt: skip


def arrow_schema(zone: str) -> pa.Schema:
    """The Arrow schema Spark hands the data source for :func:`spark_schema` (all nullable)."""
    return pa.schema(
        [
            ("id", pa.int64()),
            ("b", pa.bool_()),
            ("i8", pa.int8()),
            ("i16", pa.int16()),
            ("i32", pa.int32()),
            ("i64", pa.int64()),
            ("f32", pa.float32()),
            ("f64", pa.float64()),
            ("d38", pa.decimal128(38, 10)),
            ("d38max", pa.decimal128(38, 0)),
            ("dneg", pa.decimal128(3, -2)),
            ("s", pa.string()),
            ("bin", pa.binary()),
            ("d", pa.date32()),
            ("ts", pa.timestamp("us", tz=zone)),
            ("tsntz", pa.timestamp("us")),
            ("dti", pa.duration("us")),
            ("arr", pa.list_(pa.field("element", pa.int32()))),
            ("m", pa.map_(pa.string(), pa.int32())),
            ("st", pa.struct([("x", pa.int32()), ("y", pa.string())])),
            (
                "nested",
                pa.list_(
                    pa.field(
                        "element",
                        pa.struct(
                            [
                                (
                                    "k",
                                    pa.map_(
                                        pa.int32(), pa.list_(pa.field("element", pa.float64()))
                                    ),
                                ),
                                ("t", pa.timestamp("us", tz=zone)),
                            ]
                        ),
                    )
                ),
            ),
            ("nul", pa.null()),
        ]
    )


def arrow_table(zone: str) -> pa.Table:
    """The matrix as an Arrow table, as Spark would hand it over in a session in ``zone``."""
    schema = arrow_schema(zone)
    rows = []
    for row in ROWS:
        converted = dict(row)
        for key in ("m",):
            if converted[key] is not None:
                converted[key] = list(converted[key].items())
        if converted["nested"]:
            converted["nested"] = [
                {**item, "k": list(item["k"].items())} for item in converted["nested"]
            ]
        rows.append(converted)
    return pa.Table.from_pylist(rows, schema=schema)


def spark_schema() -> StructType:
    from pyspark.sql import types as T

    return T.StructType(
        [
            T.StructField("id", T.LongType()),
            T.StructField("b", T.BooleanType()),
            T.StructField("i8", T.ByteType()),
            T.StructField("i16", T.ShortType()),
            T.StructField("i32", T.IntegerType()),
            T.StructField("i64", T.LongType()),
            T.StructField("f32", T.FloatType()),
            T.StructField("f64", T.DoubleType()),
            T.StructField("d38", T.DecimalType(38, 10)),
            T.StructField("d38max", T.DecimalType(38, 0)),
            T.StructField("dneg", T.DecimalType(3, -2)),
            T.StructField("s", T.StringType()),
            T.StructField("bin", T.BinaryType()),
            T.StructField("d", T.DateType()),
            T.StructField("ts", T.TimestampType()),
            T.StructField("tsntz", T.TimestampNTZType()),
            T.StructField("dti", T.DayTimeIntervalType()),
            T.StructField("arr", T.ArrayType(T.IntegerType())),
            T.StructField("m", T.MapType(T.StringType(), T.IntegerType())),
            T.StructField(
                "st",
                T.StructType(
                    [T.StructField("x", T.IntegerType()), T.StructField("y", T.StringType())]
                ),
            ),
            T.StructField(
                "nested",
                T.ArrayType(
                    T.StructType(
                        [
                            T.StructField(
                                "k", T.MapType(T.IntegerType(), T.ArrayType(T.DoubleType()))
                            ),
                            T.StructField("t", T.TimestampType()),
                        ]
                    )
                ),
            ),
            T.StructField("nul", T.NullType()),
        ]
    )


def same(a: Any, b: Any) -> bool:
    """Equality where NaN equals NaN (floats inside lists and dicts too)."""
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b) and type(a) is type(b)


def postgres_rows(url: str, table: str) -> list[dict[str, str | None]]:
    """Every row of the matrix table as PostgreSQL prints it, in UTC, by ``id``."""
    import adbc_driver_postgresql.dbapi as pg

    select = ", ".join(f'"{c}"::text' for c in TABLE_COLUMNS)
    with pg.connect(url) as conn, conn.cursor() as cur:
        cur.execute("SET TIME ZONE 'UTC'")
        cur.execute(f'SELECT {select} FROM "{table}" ORDER BY id, _millpond_sequence')
        rows = cur.fetchall()
        conn.rollback()
    return [dict(zip(TABLE_COLUMNS, row, strict=True)) for row in rows]


def postgres_types(url: str, table: str) -> dict[str, str]:
    import adbc_driver_postgresql.dbapi as pg

    with pg.connect(url) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
            f"WHERE attrelid = '\"{table}\"'::regclass AND attnum > 0 AND NOT attisdropped "
            "ORDER BY attnum"
        )
        rows = cur.fetchall()
        conn.rollback()
    return {str(name): str(sql) for name, sql in rows}


def sqlite_rows(path: str, table: str) -> list[dict[str, Any]]:
    import contextlib
    import sqlite3

    select = ", ".join(f'"{c}"' for c in TABLE_COLUMNS)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute(
            f'SELECT {select} FROM "{table}" ORDER BY id, _millpond_sequence'
        ).fetchall()
    return [dict(zip(TABLE_COLUMNS, row, strict=True)) for row in rows]


def sqlite_types(path: str, table: str) -> dict[str, str]:
    import contextlib
    import sqlite3

    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute(f'PRAGMA table_info("{table}")').fetchall()
    return {str(row[1]): str(row[2]) for row in rows}


def check_database(kind: str, url: str, table: str, copies: int) -> None:
    """The matrix table holds ``copies`` of every row, each value as documented."""
    if kind == "postgres":
        rows: list[dict[str, Any]] = postgres_rows(url, table)
        types = postgres_types(url, table)
        expected: list[dict[str, Any]] = POSTGRES_TEXT
        expected_types = POSTGRES_TYPES
    else:
        path = url.removeprefix("sqlite://")
        path = "/" + path.lstrip("/")
        rows = sqlite_rows(path, table)
        types = sqlite_types(path, table)
        expected = SQLITE_VALUES
        expected_types = SQLITE_TYPES
    assert {k: v for k, v in types.items() if k != "_millpond_sequence"} == expected_types
    assert len(rows) == copies * len(expected)
    for index, row in enumerate(rows):
        want = expected[index // copies]
        for column in TABLE_COLUMNS:
            assert same(row[column], want[column]), (
                f"{kind} row id={want['id']} column {column}: "
                f"found {str(row[column])[:200]!r}, expected {str(want[column])[:200]!r}"
            )
