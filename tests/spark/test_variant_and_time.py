"""Spark 4 types beyond the matrix, end to end: ``variant`` reaches PostgreSQL and SQLite as the
JSON it holds (checked against PySpark's own decoder) and ``time`` as a time of day;
``to_arrow()`` keeps exactly what Spark wrote; ``interval year to month`` is refused on the
driver, naming the column, before any task runs."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pytest

from millpond.consumer import ConsumedBatch
from millpond.consumer.sinks._variant import is_variant, variant_json
from millpond.formats.batch import decode_batch
from millpond.localstack import PostgresServer, S3Endpoint
from tests.spark.spark_support import Queue, consume_with_cli, sqlite_url

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DOCS = [
    '{"a": [1, 2.5, "x"], "b": null}',
    '"plain"',
    "12345678901234567890123.000000000001",
    "-0.0",
    "1e300",
    "[]",
    "{}",
    '{"é": {"nested": [true, false, null, {"z": 1, "a": 2}]}}',
    '"' + "long " * 100 + '"',
    "[" + ",".join(str(i) for i in range(300)) + "]",
    "{" + ",".join(f'"k{i}": [{i}, "v{i}"]' for i in range(300)) + "}",
]
TIMES = ["12:34:56.123456", "00:00:00", "23:59:59.999999"]


def _frame(spark: SparkSession) -> Any:
    rows = ", ".join(f"({i}, '{doc}', '{TIMES[i % len(TIMES)]}')" for i, doc in enumerate(DOCS))
    return spark.sql(
        "SELECT id, parse_json(doc) AS v, array(parse_json(doc)) AS va, "
        "CAST(t AS TIME) AS t "
        f"FROM VALUES {rows} AS x(id, doc, t)"
    )


def _written(queue: Queue) -> pa.Table:
    store = queue.store()
    tables = []
    for entry in queue.entries():
        batch = ConsumedBatch(
            entries=tuple(decode_batch(store.get(entry.location).data)),
            sequence=entry.sequence,
            location=entry.location,
        )
        tables.append(batch.to_arrow())
    return pa.concat_tables(tables).sort_by("id")


def _postgres(url: str, table: str) -> tuple[dict[str, str], list[tuple[Any, ...]]]:
    import adbc_driver_postgresql.dbapi as pg

    with pg.connect(url) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
            f"WHERE attrelid = '\"{table}\"'::regclass AND attnum > 0 AND NOT attisdropped"
        )
        types = {str(name): str(sql) for name, sql in cur.fetchall()}
        cur.execute(f'SELECT id, v::text, va::text, t::text FROM "{table}" ORDER BY id')
        rows = cur.fetchall()
        conn.rollback()
    return types, rows


def test_variant_and_time_arrive_as_json_and_times_of_day(
    spark: SparkSession, moto_s3: S3Endpoint, postgres_server: PostgresServer, tmp_path: Path
) -> None:
    from pyspark.sql.variant_utils import VariantUtils

    queues = {"postgres": Queue(moto_s3), "sqlite": Queue(moto_s3)}
    spark.conf.set("spark.sql.timeType.enabled", "true")  # TIME is opt-in in Spark 4
    try:
        for queue in queues.values():
            frame = _frame(spark)
            frame.write.format("millpond").options(**queue.options()).mode("append").save()
    finally:
        spark.conf.unset("spark.sql.timeType.enabled")

    # to_arrow() is exactly what Spark handed over, and the decoder agrees with PySpark's.
    written = _written(queues["postgres"])
    assert is_variant(written.schema.field("v").type)
    assert written.schema.field("t").type == pa.time64("ns")
    for row in written.to_pylist():
        value, metadata = row["v"]["value"], row["v"]["metadata"]
        assert json.loads(variant_json(value, metadata)) == json.loads(
            VariantUtils.to_json(value, metadata)
        ), DOCS[row["id"]][:80]
        assert json.loads(variant_json(value, metadata)) == json.loads(DOCS[row["id"]])
    expected = {i: json.loads(doc) for i, doc in enumerate(DOCS)}

    consume_with_cli(queues["postgres"], postgres_server.url, "variants")
    types, rows = _postgres(postgres_server.url, "variants")
    assert (types["v"], types["va"], types["t"]) == ("json", "json", "time without time zone")
    assert [row[0] for row in rows] == list(range(len(DOCS)))
    for id_, v, va, t in rows:
        assert json.loads(v) == expected[id_], f"postgres id={id_}: {v[:80]}"
        assert json.loads(va) == [expected[id_]]
        assert t == TIMES[id_ % len(TIMES)]

    sqlite = tmp_path / "variants.db"
    consume_with_cli(queues["sqlite"], sqlite_url(sqlite), "variants")
    with contextlib.closing(sqlite3.connect(sqlite)) as conn:
        declared = {r[1]: r[2] for r in conn.execute('PRAGMA table_info("variants")')}
        stored = conn.execute('SELECT id, v, va, t FROM "variants" ORDER BY id').fetchall()
    assert (declared["v"], declared["t"]) == ("JSON_TEXT", "TIME")
    for id_, v, va, t in stored:
        assert json.loads(v) == expected[id_], f"sqlite id={id_}: {v[:80]}"
        assert json.loads(va) == [expected[id_]]
        # the documented SQLite form: 'HH:MM:SS.ffffff', always six digits
        assert t == dt.time.fromisoformat(TIMES[id_ % len(TIMES)]).isoformat("microseconds")


@pytest.mark.parametrize(
    ("select", "column"),
    [
        # top level: pyarrow failed inside the task with "KeyError: 21"
        ("INTERVAL '1-2' YEAR TO MONTH AS span", "span"),
        # nested: the job succeeded and left a batch no consumer could turn into rows
        ("named_struct('span', INTERVAL '1-2' YEAR TO MONTH) AS plan", "plan.span"),
    ],
)
def test_a_year_month_interval_is_refused_on_the_driver_naming_the_column(
    spark: SparkSession, moto_s3: S3Endpoint, select: str, column: str
) -> None:
    queue = Queue(moto_s3)
    frame = spark.sql(f"SELECT 1 AS id, {select}")
    with pytest.raises(Exception) as caught:
        frame.write.format("millpond").options(**queue.options()).mode("append").save()
    message = str(caught.value)
    assert f"column {column!r}" in message, message[-2000:]
    assert "interval year to month" in message
    assert "KeyError" not in message
    assert queue.entries() == []
