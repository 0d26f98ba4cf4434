"""Issue 46: ``.option("table", ...)`` on the Spark writer, batch and streaming: one queue, one
consumer, several tables, one of them upserted."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from millpond.consumer import Consumer, ConsumerConfig
from millpond.consumer.app.service import ConsumerService
from millpond.consumer.sinks import SinkTables, TableSettings, open_sink
from millpond.errors import ConfigError
from millpond.formats.routing import split_table
from millpond.localstack import S3Endpoint
from tests.spark.spark_support import Queue, sqlite_url
from tests.spark.test_streaming import write_files

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def _consume(queue: Queue, database: Path) -> None:
    """``millpond consume --table events --config`` with orders upserted by id."""
    import threading

    tables = SinkTables({"orders": TableSettings("upsert", ("id",)), "customers": TableSettings()})
    config = ConsumerConfig(
        store=queue.url, store_options=queue.endpoint.store_options(), gc_enabled=False
    )
    with open_sink(sqlite_url(database), table="events", tables=tables) as sink:
        ConsumerService(Consumer(config), sink).run(threading.Event(), until_idle=True)


def _query(database: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(database) as db:
        return db.execute(sql).fetchall()


def test_batch_jobs_and_a_stream_write_their_own_tables(
    spark: SparkSession, moto_s3: S3Endpoint, tmp_path: Path
) -> None:
    queue = Queue(moto_s3)
    orders = spark.range(100, numPartitions=3).selectExpr("id", "'new' AS status")
    orders.write.format("millpond").options(**queue.options(table="orders")).mode("append").save()
    paid = spark.range(0, 100, 2, numPartitions=2).selectExpr("id", "'paid' AS status")
    paid.write.format("millpond").options(**queue.options(table="orders", commit="task")).mode(
        "append"
    ).save()
    customers = spark.range(10, numPartitions=2).selectExpr("id AS customer_id")
    customers.write.format("millpond").options(**queue.options(table="customers")).mode(
        "append"
    ).save()
    input_dir = tmp_path / "in"
    write_files(input_dir, 0, 2, 50)
    (
        spark.readStream.schema("id BIGINT, file INT")
        .json(str(input_dir))
        .writeStream.format("millpond")
        .options(**queue.options())  # no table: the consumer's own (events)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
        .awaitTermination()
    )
    named = {split_table(i.payload)[0] for e in queue.entries() for i in e.metadata}
    assert named == {"orders", "customers", None}
    database = tmp_path / "sink.db"
    _consume(queue, database)
    statuses = _query(database, "SELECT status, count(*) FROM orders GROUP BY status")
    assert sorted(statuses) == [("new", 50), ("paid", 50)]  # upserted: one row per id
    assert _query(database, "SELECT count(DISTINCT id), count(*) FROM orders") == [(100, 100)]
    assert _query(database, "SELECT count(*) FROM customers") == [(10,)]
    assert _query(database, "SELECT count(*) FROM events") == [(100,)]


def test_a_stream_names_its_table_in_every_micro_batch(
    spark: SparkSession, moto_s3: S3Endpoint, tmp_path: Path
) -> None:
    queue = Queue(moto_s3)
    input_dir = tmp_path / "in"
    write_files(input_dir, 0, 3, 20)
    (
        spark.readStream.schema("id BIGINT, file INT")
        .option("maxFilesPerTrigger", 1)
        .json(str(input_dir))
        .writeStream.format("millpond")
        .options(**queue.options(table="customers"))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
        .awaitTermination()
    )
    payloads = [item.payload for entry in queue.entries() for item in entry.metadata]
    assert len(payloads) >= 3
    assert all(p.startswith(b'millpond.table=customers\n{"spark":') for p in payloads)
    database = tmp_path / "sink.db"
    _consume(queue, database)
    assert _query(database, "SELECT count(*) FROM customers") == [(60,)]


def test_a_bad_table_fails_the_job_before_any_task(
    spark: SparkSession, moto_s3: S3Endpoint
) -> None:
    queue = Queue(moto_s3)
    with pytest.raises(Exception, match="table") as failed:
        spark.range(3).write.format("millpond").options(**queue.options(table="a b")).mode(
            "append"
        ).save()
    assert "ConfigError" in str(failed.value) or isinstance(failed.value, ConfigError)
    assert queue.entries() == []
