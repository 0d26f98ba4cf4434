"""Streaming writes: one append per micro-batch, and no micro-batch enqueued twice or lost when
the process running the query is SIGKILLed and restarted from its checkpoint."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from millpond.localstack import S3Endpoint
from tests.spark.spark_support import Queue

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

STREAM_JOB = Path(__file__).with_name("stream_job.py")


def write_files(directory: Path, first: int, count: int, rows: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for file in range(first, first + count):
        lines = [json.dumps({"id": file * rows + i, "file": file}) for i in range(rows)]
        tmp = directory / f".f{file:04d}.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        tmp.rename(directory / f"f{file:04d}.json")  # the file source must never see half a file


def spark_fields(queue: Queue) -> list[dict[str, object]]:
    return [
        json.loads(item.payload)["spark"] for entry in queue.entries() for item in entry.metadata
    ]


def run_stream(spark: SparkSession, queue: Queue, input_dir: Path, checkpoint: Path) -> str:
    query = (
        spark.readStream.schema("id BIGINT, file INT")
        .option("maxFilesPerTrigger", 1)
        .json(str(input_dir))
        .writeStream.format("millpond")
        .options(**queue.options())
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return str(query.id)


def test_each_micro_batch_is_one_append_tagged_with_query_and_batch(
    spark: SparkSession, moto_s3: S3Endpoint, tmp_path: Path
) -> None:
    queue = Queue(moto_s3)
    input_dir, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    write_files(input_dir, 0, 3, 100)
    query_id = run_stream(spark, queue, input_dir, checkpoint)
    write_files(input_dir, 3, 2, 100)
    assert run_stream(spark, queue, input_dir, checkpoint) == query_id  # restarted
    fields = spark_fields(queue)
    assert {f["query"] for f in fields} == {query_id}
    assert sorted({int(f["batch"]) for f in fields}) == [0, 1, 2, 3, 4]  # type: ignore[call-overload]
    assert sorted(queue.table().column("id").to_pylist()) == list(range(500))


def test_streaming_without_a_checkpoint_or_query_id_is_refused(
    spark: SparkSession, moto_s3: S3Endpoint, tmp_path: Path
) -> None:
    queue = Queue(moto_s3)
    write_files(tmp_path / "in", 0, 1, 10)
    stream = (
        spark.readStream.schema("id BIGINT, file INT")
        .json(str(tmp_path / "in"))
        .writeStream.format("millpond")
        .options(**queue.options())
    )
    spark.conf.set("spark.sql.streaming.checkpointLocation", str(tmp_path / "ckpts"))
    try:
        with pytest.raises(Exception, match="checkpointLocation: "):
            stream.trigger(availableNow=True).start().awaitTermination()
    finally:
        spark.conf.unset("spark.sql.streaming.checkpointLocation")


@pytest.mark.slow
def test_a_killed_query_restarted_from_its_checkpoint_enqueues_each_batch_once(
    moto_s3: S3Endpoint, tmp_path: Path
) -> None:
    files, rows = 8, 50
    queue = Queue(moto_s3)
    input_dir, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    write_files(input_dir, 0, files, rows)
    options = json.dumps(queue.options())
    rng = random.Random(5)
    kills = 0
    for round_ in range(2):
        before = len(queue.entries())
        log = (tmp_path / f"run{round_}.log").open("w")
        job = subprocess.Popen(
            [sys.executable, str(STREAM_JOB), str(input_dir), str(checkpoint), options],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
        )
        try:
            assert job.stdout is not None
            assert job.stdout.readline().startswith("query "), tmp_path / f"run{round_}.log"
            if round_ % 2 == 0:
                # Right after an append lands: most likely before Spark records the batch
                # in its commit log, so the restarted query runs that batch again.
                deadline = time.monotonic() + 120
                while len(queue.entries()) == before and time.monotonic() < deadline:
                    if job.poll() is not None:
                        break
                    time.sleep(0.01)
            else:
                time.sleep(rng.uniform(0.5, 4.0))
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                kills += 1
            job.wait()
            log.close()
    final = subprocess.run(
        [sys.executable, str(STREAM_JOB), str(input_dir), str(checkpoint), options],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert final.returncode == 0, final.stderr[-3000:]
    assert "done" in final.stdout
    assert kills == 2
    batches = Counter(int(str(f["batch"])) for f in spark_fields(queue))
    assert sorted(batches) == list(range(files))  # none missing
    ids = queue.table().column("id").to_pylist()
    assert sorted(ids) == list(range(files * rows))  # none twice
