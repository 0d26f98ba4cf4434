"""``.option("await_sink", ...)``: a Spark batch job, and each micro-batch of a stream, returns
only once ``millpond consume`` (a real process) has written its rows into the database; when
the time runs out, it fails naming what the consumer is doing."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from millpond import ConfigError, SinkWaitTimeoutError
from millpond.localstack import S3Endpoint
from millpond.localstack._process import free_ports
from millpond.producer.spark.datasource import await_sink
from millpond.producer.spark.options import SparkWriteSettings
from tests.spark.spark_support import Queue, sqlite_url
from tests.support import CliProcess

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def test_the_option_takes_a_duration() -> None:
    def parsed(value: str) -> float:
        options = {"store": "s3://bucket/q", "await_sink": value}
        return SparkWriteSettings.from_options(options).await_sink

    assert SparkWriteSettings.from_options({"store": "s3://bucket/q"}).await_sink == 0
    assert (parsed("600s"), parsed("10m"), parsed("90"), parsed("1h")) == (600, 600, 90, 3600)
    with pytest.raises(ConfigError, match=r"^await_sink: expected a duration"):
        parsed("soon")


def test_the_wait_fails_naming_the_consumer_when_none_writes(moto_s3: S3Endpoint) -> None:
    queue = Queue(moto_s3)
    settings = SparkWriteSettings.from_options(queue.options(await_sink="0.5s"))
    with pytest.raises(SinkWaitTimeoutError) as info:
        await_sink(settings, (0, 1, 2), what="millpond job j")
    message = str(info.value)
    assert message.startswith("millpond job j, sequences 0..2: not in the database after")
    assert "no consumer has said what it wrote" in message
    assert "The entries are in the queue" in message
    await_sink(settings, (), what="millpond job j")  # nothing enqueued: nothing to wait for


@pytest.fixture
def consumer_service(moto_s3: S3Endpoint, tmp_path: Path) -> Iterator[tuple[Queue, Path]]:
    """A queue of its own and ``millpond consume`` writing it into a SQLite table ``rows``."""
    queue = Queue(moto_s3)
    database = tmp_path / "sink.db"
    options = [f"--store-option={k}={v}" for k, v in moto_s3.store_options().items()]
    env = {**os.environ, "AWS_METADATA_ENDPOINT": f"http://127.0.0.1:{free_ports(1)[0]}"}
    service = CliProcess(
        *("--log-level", "INFO", "consume", queue.url, "--create", *options),
        *("--sink", sqlite_url(database), "--table", "rows", "--poll-interval", "0.5"),
        "--no-gc",
        env=env,
    )
    deadline = time.monotonic() + 60
    while "consuming" not in service.stderr:
        assert service.proc.poll() is None, service.stderr
        assert time.monotonic() < deadline, service.stderr
        time.sleep(0.05)
    yield queue, database
    assert service.stop() == 0, service.stderr


def _rows(database: Path) -> int:
    with sqlite3.connect(database) as db:
        return int(db.execute('SELECT count(*) FROM "rows"').fetchone()[0])


def test_a_job_and_each_micro_batch_return_with_their_rows_in_the_database(
    spark: SparkSession, consumer_service: tuple[Queue, Path], tmp_path: Path
) -> None:
    queue, database = consumer_service
    options = queue.options(await_sink="120s")
    spark.range(5000, numPartitions=2).selectExpr("id", "id % 7 AS key").write.format(
        "millpond"
    ).options(**options).mode("append").save()
    assert _rows(database) == 5000  # at once: the job returned after the consumer wrote them
    input_dir = tmp_path / "in"
    input_dir.mkdir()
    for file in range(3):
        lines = [json.dumps({"id": 10_000 + file * 100 + i, "key": file}) for i in range(100)]
        (input_dir / f"f{file}.json").write_text("\n".join(lines) + "\n")
    query = (
        spark.readStream.schema("id BIGINT, key BIGINT")
        .option("maxFilesPerTrigger", 1)
        .json(str(input_dir))
        .writeStream.format("millpond")
        .options(**options)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    assert _rows(database) == 5300  # the last micro-batch returned once its rows were in
