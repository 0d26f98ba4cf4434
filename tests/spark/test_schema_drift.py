"""Schema drift across Spark jobs: two jobs with different but compatible schemas land in one
queue; ``to_arrow()`` and the SQLite and PostgreSQL tables hold both, missing columns null."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from millpond.consumer import Consumer, ConsumerConfig
from millpond.consumer.sinks import open_sink
from millpond.formats.arrow import unify_tables
from millpond.localstack import PostgresServer, S3Endpoint
from tests.spark.spark_support import Queue, sqlite_url

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def test_two_jobs_with_drifted_schemas_land_in_arrow_sqlite_and_postgres(
    spark: SparkSession, moto_s3: S3Endpoint, postgres_server: PostgresServer, tmp_path: Path
) -> None:
    queue = Queue(moto_s3)
    # Job 1: id, name, score as INT. Job 2: no name, score widened to BIGINT, a new column.
    spark.range(0, 100, numPartitions=2).selectExpr(
        "id", "concat('n', id) AS name", "CAST(id AS INT) AS score"
    ).write.format("millpond").options(**queue.options()).mode("append").save()
    spark.range(100, 200, numPartitions=2).selectExpr(
        "id", "id * 1000000000 AS score", "CAST(id AS DOUBLE) / 4 AS extra"
    ).write.format("millpond").options(**queue.options()).mode("append").save()

    db = tmp_path / "drift.db"
    tables = []
    config = ConsumerConfig(
        store=queue.url, store_options=moto_s3.store_options(), gc_enabled=False
    )
    with (
        open_sink(sqlite_url(db), table="drift", sequence_column=None) as lite,
        open_sink(postgres_server.url, table="drift", sequence_column=None) as pg,
        Consumer(config) as consumer,
    ):
        consumer.initialize()
        while (batch := consumer.next_batch()) is not None:
            tables.append(batch.to_arrow())
            assert lite.write(batch)
            assert pg.write(batch)
            consumer.ack(batch.sequence)

    arrow = unify_tables(tables).sort_by("id")
    assert arrow.schema.field("score").type == pa.int64()  # widened
    assert arrow.column_names == ["id", "name", "score", "extra"]
    assert arrow.column("name").null_count == 100
    assert arrow.column("extra").null_count == 100
    expected = [
        (
            i,
            f"n{i}" if i < 100 else None,
            i if i < 100 else i * 1_000_000_000,
            None if i < 100 else i / 4,
        )
        for i in range(200)
    ]
    assert (
        list(zip(*(arrow.column(c).to_pylist() for c in arrow.column_names), strict=True))
        == expected
    )

    with sqlite3.connect(db) as conn:
        lite_rows = conn.execute("SELECT id, name, score, extra FROM drift ORDER BY id").fetchall()
    assert lite_rows == expected

    import adbc_driver_postgresql.dbapi as pg_dbapi

    with pg_dbapi.connect(postgres_server.url) as conn, conn.cursor() as cur:
        cur.execute("SELECT id, name, score, extra FROM drift ORDER BY id")
        pg_rows = [tuple(row) for row in cur.fetchall()]
    assert pg_rows == expected
