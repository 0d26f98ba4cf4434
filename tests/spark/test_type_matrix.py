"""Every Spark SQL type, end to end: ``format("millpond")`` in a UTC and a New York session,
``millpond consume`` (the real CLI process) into PostgreSQL and into SQLite, read back value
by value against the documented mapping; and ``ConsumedBatch.to_arrow()`` of the same batches
gives back exactly the Arrow types and values Spark handed over."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from millpond.consumer import ConsumedBatch
from millpond.formats.batch import decode_batch
from millpond.localstack import PostgresServer, S3Endpoint
from tests.spark.spark_support import Queue, consume_with_cli, sqlite_url
from tests.type_matrix import COLUMNS, ROWS, arrow_schema, arrow_table, check_database, same

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ZONES = ("Etc/UTC", "America/New_York")


def _write_matrix(spark: SparkSession, queue: Queue, zone: str) -> None:
    conf = {
        "spark.sql.session.timeZone": zone,
        # Spark refuses negative-scale decimals unless asked; the matrix has one.
        "spark.sql.legacy.allowNegativeScaleOfDecimal": "true",
    }
    before = {key: spark.conf.get(key, None) for key in conf}
    try:
        for key, value in conf.items():
            spark.conf.set(key, value)
        from tests.type_matrix import spark_schema

        rows = [tuple(row[c] for c in COLUMNS) for row in ROWS]
        df = spark.createDataFrame(rows, spark_schema()).repartition(2)
        df.write.format("millpond").options(**queue.options()).mode("append").save()
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)


def _check_to_arrow(queue: Queue) -> None:
    store = queue.store()
    seen: dict[str, int] = {}
    for entry in queue.entries():
        batch = ConsumedBatch(
            entries=tuple(decode_batch(store.get(entry.location).data)),
            sequence=entry.sequence,
            location=entry.location,
        )
        table = batch.to_arrow()
        zone = table.schema.field("ts").type.tz
        assert zone in ZONES
        expected_schema = arrow_schema(zone)
        for column in COLUMNS:
            assert table.schema.field(column).type == expected_schema.field(column).type, column
        expected = {row["id"]: row for row in arrow_table(zone).to_pylist()}
        for row in table.to_pylist():
            for column in COLUMNS:
                assert same(row[column], expected[row["id"]][column]), (
                    f"to_arrow id={row['id']} {column}: {str(row[column])[:100]}"
                )
            seen[zone] = seen.get(zone, 0) + 1
    assert seen == {zone: len(ROWS) for zone in ZONES}


def test_every_spark_type_arrives_intact(
    spark: SparkSession, moto_s3: S3Endpoint, postgres_server: PostgresServer, tmp_path: Path
) -> None:
    queues = {"postgres": Queue(moto_s3), "sqlite": Queue(moto_s3)}
    for queue in queues.values():
        for zone in ZONES:
            _write_matrix(spark, queue, zone)
    _check_to_arrow(queues["postgres"])

    table = f"matrix_{uuid.uuid4().hex[:8]}"
    consume_with_cli(queues["postgres"], postgres_server.url, table)
    check_database("postgres", postgres_server.url, table, copies=len(ZONES))

    sqlite = sqlite_url(tmp_path / "matrix.db")
    consume_with_cli(queues["sqlite"], sqlite, table)
    check_database("sqlite", sqlite, table, copies=len(ZONES))
