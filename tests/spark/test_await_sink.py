"""``.option("await_sink", ...)``: a Spark batch job, and each micro-batch of a stream, returns
only once ``millpond consume`` (a real process) has written its rows into the database; when
the time runs out, it fails naming what the consumer is doing."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
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


def _service(queue: Queue, sink: str) -> CliProcess:
    """``millpond consume`` (a real process) writing ``queue`` into the table ``rows`` of
    ``sink``, once it says it is consuming."""
    options = [f"--store-option={k}={v}" for k, v in queue.endpoint.store_options().items()]
    env = {**os.environ, "AWS_METADATA_ENDPOINT": f"http://127.0.0.1:{free_ports(1)[0]}"}
    service = CliProcess(
        *("--log-level", "INFO", "consume", queue.url, "--create", *options),
        *("--sink", sink, "--table", "rows", "--poll-interval", "0.5"),
        *("--report-interval", "1", "--no-gc"),
        env=env,
    )
    _until(lambda: "consuming" in service.stderr or service.proc.poll() is not None, "a start")
    assert service.proc.poll() is None, service.stderr
    return service


def _until(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def consumer_service(moto_s3: S3Endpoint, tmp_path: Path) -> Iterator[tuple[Queue, Path]]:
    """A queue of its own and ``millpond consume`` writing it into a SQLite table ``rows``."""
    queue = Queue(moto_s3)
    database = tmp_path / "sink.db"
    service = _service(queue, sqlite_url(database))
    try:
        yield queue, database
        assert service.stop() == 0, service.stderr
    finally:
        service.kill()


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


def test_a_job_fails_naming_the_consumer_when_it_is_behind_and_when_it_stopped(
    spark: SparkSession, moto_s3: S3Endpoint, tmp_path: Path
) -> None:
    """The service behind (another transaction holds the SQLite database locked, so its write
    fails and it retries), then stopped (SIGTERM): a job with ``await_sink`` fails when its
    time runs out, saying which; its rows are in the queue all along."""
    queue = Queue(moto_s3)
    database = tmp_path / "sink.db"
    service = _service(queue, f"{sqlite_url(database)}?busy_timeout_ms=100")
    frame = spark.range(100, numPartitions=1).selectExpr("id", "id % 7 AS key")

    def job(wait: str) -> None:
        frame.write.format("millpond").options(**queue.options(await_sink=wait)).mode(
            "append"
        ).save()

    try:
        job("120s")
        assert _rows(database) == 100
        lock = sqlite3.connect(database, isolation_level=None)
        try:
            lock.execute("BEGIN IMMEDIATE")
            with pytest.raises(Exception, match="behind by") as behind:
                job("3s")
            lock.execute("ROLLBACK")
        finally:
            lock.close()
        assert "not in the database after" in str(behind.value)
        assert "retrying" in str(behind.value)  # the lock the service meets, in its words
        _until(lambda: _rows(database) == 200, "the service to write the job once unlocked")
        assert service.stop() == 0, service.stderr
        with pytest.raises(Exception, match="the consumer is not running") as stopped:
            job("2s")
        assert "The entries are in the queue" in str(stopped.value)
        assert _rows(database) == 200
    finally:
        service.kill()
