"""Producers inside executors: ``commit="task"``, ``foreachPartition``, ``mapInArrow``, and the
WAL slots that let a later worker recover what a dead one staged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pytest

from millpond.localstack import S3Endpoint
from millpond.localstack._process import free_ports
from millpond.producer.spark import (
    WRITE_RESULT_SCHEMA,
    close_executor_producers,
    executor_producer,
    partition_producer,
    write_arrow_partitions,
)
from tests.spark.spark_support import Queue

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ROWS = 10_000


def test_commit_task_publishes_from_every_task(
    spark: SparkSession, moto_s3: S3Endpoint, tmp_path: Path
) -> None:
    queue = Queue(moto_s3)
    options = queue.options(commit="task", wal_dir=tmp_path / "wal")
    spark.range(ROWS, numPartitions=4).write.format("millpond").options(**options).mode(
        "append"
    ).save()
    assert sorted(queue.table().column("id").to_pylist()) == list(range(ROWS))
    # Each Python worker took a slot of its own under wal_dir.
    slots = sorted(p.name for p in (tmp_path / "wal").glob("*/slot-*.lock"))
    assert slots
    assert slots[0] == "slot-000.lock"


def test_commit_task_producers_share_a_coordinator_one_of_them_hosts(
    spark: SparkSession, moto_s3: S3Endpoint, tmp_path: Path
) -> None:
    """``host_coordinator=true``: the Python workers' producers elect one of themselves to
    append for all (the election file of this queue appears), and every row arrives once."""
    from millpond.coordinator.hosted import election_path
    from millpond.queue.claim import queue_identity

    queue = Queue(moto_s3)
    options = queue.options(commit="task", wal_dir=tmp_path / "wal", host_coordinator="true")
    spark.range(ROWS, numPartitions=4).write.format("millpond").options(**options).mode(
        "append"
    ).save()
    ids = queue.table().column("id").to_pylist()
    assert sorted(ids) == list(range(ROWS))
    locations = [entry.location for entry in queue.entries()]
    assert len(locations) == len(set(locations))
    identity = queue_identity(queue.store().url, "ingest/manifest")
    elected = election_path(identity, queue.store().location())
    assert elected.exists(), "no worker hosted this queue's coordinator"


def test_foreach_partition_with_the_partition_producer(
    spark: SparkSession, moto_s3: S3Endpoint, tmp_path: Path
) -> None:
    queue = Queue(moto_s3)
    options = queue.options(wal_dir=str(tmp_path / "wal"), flush_interval="50ms")

    def write(rows: Iterator[object]) -> None:
        ids = [row.id for row in rows]  # type: ignore[attr-defined]
        if not ids:
            return
        with partition_producer(options) as producer:
            producer.produce_arrow(pa.record_batch({"id": pa.array(ids, pa.int64())}))

    spark.range(ROWS, numPartitions=3).foreachPartition(write)
    assert sorted(queue.table().column("id").to_pylist()) == list(range(ROWS))


def test_map_in_arrow_writes_and_reports_each_partition(
    spark: SparkSession, moto_s3: S3Endpoint, tmp_path: Path
) -> None:
    queue = Queue(moto_s3)
    options = queue.options(wal_dir=str(tmp_path / "wal"))
    report = (
        spark.range(ROWS, numPartitions=4)
        .mapInArrow(write_arrow_partitions(options), WRITE_RESULT_SCHEMA)
        .collect()
    )
    assert sorted(row.partition for row in report) == [0, 1, 2, 3]
    assert sum(row.rows for row in report) == ROWS
    assert sorted(queue.table().column("id").to_pylist()) == list(range(ROWS))


def test_a_bad_option_fails_on_the_driver() -> None:
    with pytest.raises(ValueError, match="flush_interval: "):
        write_arrow_partitions({"store": "s3://bucket", "flush_interval": "soon"})


def test_the_next_process_on_a_slot_publishes_what_a_killed_one_staged(
    moto_s3: S3Endpoint, tmp_path: Path
) -> None:
    queue = Queue(moto_s3)
    wal_root = tmp_path / "wal"
    (closed_port,) = free_ports(1)
    dead_options = queue.options(wal_dir=wal_root, aws_endpoint=f"http://127.0.0.1:{closed_port}")
    holder = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("slot_holder.py")),
            json.dumps(dead_options),
            "500",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        assert line.startswith("staged "), line
        assert line.rstrip().endswith("slot-000/wal"), line
        # While the holder lives, its slot is taken: this process gets the next one.
        live = executor_producer(queue.options(wal_dir=wal_root))
        assert str(live.config.wal_dir).endswith("slot-001/wal")
        close_executor_producers()
        assert queue.entries() == []  # the holder could not publish
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    recovering = executor_producer(queue.options(wal_dir=wal_root))
    assert str(recovering.config.wal_dir).endswith("slot-000/wal")
    close_executor_producers()  # publishes what it replayed
    assert sorted(queue.table().column("id").to_pylist()) == list(range(500))
