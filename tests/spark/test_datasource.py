"""The ``millpond`` data source in a real Spark session: batch writes, task failures, options."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pytest

from millpond.localstack import S3Endpoint
from millpond.localstack._process import free_ports
from tests.spark.spark_support import Queue, sqlite_url

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

ROWS = 20_000


def numbered(spark: SparkSession, rows: int = ROWS, partitions: int = 4) -> DataFrame:
    return spark.range(rows, numPartitions=partitions).selectExpr(
        "id", "concat('key-', id % 97) AS key", "CAST(id AS DOUBLE) * 0.5 AS value"
    )


def fail_first_attempt(
    partition: int, after_batches: int
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` step that raises in attempt 0 of one partition, mid-way."""

    def step(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        context = TaskContext.get()
        assert context is not None
        for index, batch in enumerate(batches):
            if (context.partitionId(), context.attemptNumber(), index) == (
                partition,
                0,
                after_batches,
            ):
                raise RuntimeError("injected failure of the first attempt")
            yield batch

    return step


def sqlite_ids(path: Path, table: str = "rows") -> list[int]:
    with sqlite3.connect(path) as db:
        return [row[0] for row in db.execute(f'SELECT id FROM "{table}" ORDER BY id')]


def test_a_job_enqueues_every_row_once_in_one_append(
    spark: SparkSession, moto_s3: S3Endpoint
) -> None:
    queue = Queue(moto_s3)
    numbered(spark).write.format("millpond").options(
        **queue.options(flush_size_bytes="64KiB", receipt_path="receipts/job.json")
    ).mode("append").save()
    table = queue.table()
    assert sorted(table.column("id").to_pylist()) == list(range(ROWS))
    assert table.schema.names == ["id", "key", "value"]
    entries = queue.entries()
    assert len(entries) > 4  # several batch objects per task: flush_size_bytes is honoured
    assert all(queue.store().head(e.location).size <= 64 * 1024 for e in entries)
    receipt = queue.store().get("receipts/job.json").data
    assert b'"manifest_writes": 1' in receipt  # one CAS for the whole job
    assert f'"rows": {ROWS}'.encode() in receipt


def test_a_failed_first_attempt_leaves_every_row_in_the_database_once(
    spark: SparkSession, moto_s3: S3Endpoint, tmp_path: Path
) -> None:
    queue = Queue(moto_s3)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "500")
    try:
        numbered(spark).mapInArrow(
            fail_first_attempt(partition=1, after_batches=6), "id long, key string, value double"
        ).write.format("millpond").options(**queue.options(flush_size_bytes="16KiB")).mode(
            "append"
        ).save()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    entries = queue.entries()
    batches = [path for path in queue.objects() if path.endswith(".batch")]
    # The failed attempt uploaded batches that were never enqueued: GC's to remove.
    assert len(batches) > len(entries)
    db = tmp_path / "rows.db"
    assert queue.consume_into(sqlite_url(db)) == ROWS
    assert sqlite_ids(db) == list(range(ROWS))


def test_a_bad_option_fails_the_job_before_any_task_naming_it(
    spark: SparkSession, moto_s3: S3Endpoint
) -> None:
    queue = Queue(moto_s3)
    cases = {
        "flush_size_bytes": {"flush_size_bytes": "lots"},
        "flush_size": {"flush_size": "1MiB"},  # not an option at all
        "commit": {"commit": "sometimes"},
        "gc_grace_period": {"gc_grace_period": "-1"},
        "batch_compression": {"batch_compression": "lz4"},
        "store": {"store": "memory://"},
    }
    for key, bad in cases.items():
        with pytest.raises(Exception, match=rf"{key}: ") as info:
            numbered(spark, 100).write.format("millpond").options(**queue.options(**bad)).mode(
                "append"
            ).save()
        assert "ConfigError" in str(info.value)
    with pytest.raises(Exception, match=r"mode: expected append"):
        numbered(spark, 100).write.format("millpond").options(**queue.options()).mode(
            "overwrite"
        ).save()
    assert queue.objects() == []  # no task ran: nothing uploaded, nothing enqueued


def test_an_unreachable_store_fails_the_job_at_once(
    spark: SparkSession, moto_s3: S3Endpoint
) -> None:
    queue = Queue(moto_s3)
    (closed_port,) = free_ports(1)
    options = queue.options(aws_endpoint=f"http://127.0.0.1:{closed_port}")
    with pytest.raises(Exception, match=r"is unreachable") as info:
        numbered(spark, 100).write.format("millpond").options(**options).mode("append").save()
    assert "StorageError" in str(info.value)
    assert "secret" not in str(info.value).lower()  # credentials never in messages


def test_a_store_lost_mid_job_fails_it_and_enqueues_nothing(
    spark: SparkSession, moto_s3: S3Endpoint
) -> None:
    # check_store=false skips the up-front probe, so the tasks meet the dead endpoint.
    queue = Queue(moto_s3)
    (closed_port,) = free_ports(1)
    options = queue.options(
        aws_endpoint=f"http://127.0.0.1:{closed_port}",
        check_store="false",
        **{"retry.max_attempts": "2", "retry.max_elapsed": "1s"},
    )
    with pytest.raises(Exception, match=r"upload gave up"):
        numbered(spark, 100, partitions=2).write.format("millpond").options(**options).mode(
            "append"
        ).save()
    assert queue.objects() == []


def test_an_empty_dataframe_enqueues_nothing(spark: SparkSession, moto_s3: S3Endpoint) -> None:
    queue = Queue(moto_s3)
    numbered(spark, 0).write.format("millpond").options(**queue.options()).mode("append").save()
    assert queue.entries() == []


def test_save_path_names_the_store(spark: SparkSession, moto_s3: S3Endpoint) -> None:
    queue = Queue(moto_s3)
    options = queue.options()
    url = options.pop("store")
    numbered(spark, 1000).write.format("millpond").options(**options).mode("append").save(url)
    assert queue.table().num_rows == 1000
