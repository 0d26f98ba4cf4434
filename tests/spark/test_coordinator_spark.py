"""The Spark driver's commit through ``millpond coordinator`` (``.option("coordinator", url)``),
and directly when the coordinator does not answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from millpond.coordinator.rounds import AppendCoordinator
from millpond.coordinator.server import CoordinatorServer
from millpond.coordinator.wire import TOKEN_ENV
from millpond.localstack import S3Endpoint
from millpond.queue.claim import queue_identity
from tests.spark.spark_support import Queue
from tests.spark.test_datasource import numbered

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ROWS = 5_000
BATCH_JOB = Path(__file__).with_name("batch_job.py")


def _write(spark: SparkSession, queue: Queue, coordinator: str) -> dict[str, object]:
    numbered(spark, ROWS).write.format("millpond").options(
        **queue.options(
            flush_size_bytes="64KiB", receipt_path="receipts/job.json", coordinator=coordinator
        )
    ).mode("append").save()
    receipt: dict[str, object] = json.loads(queue.store().get("receipts/job.json").data)
    return receipt


def test_a_job_commits_through_the_coordinator(spark: SparkSession, moto_s3: S3Endpoint) -> None:
    queue = Queue(moto_s3)
    store = queue.store()
    coordinator = AppendCoordinator(
        store, "ingest/manifest", queue=queue_identity(store.url, "ingest/manifest")
    )
    with CoordinatorServer(coordinator) as server:
        receipt = _write(spark, queue, server.url)
        stats = coordinator.stats()
    entries = queue.entries()
    assert sorted(queue.table().column("id").to_pylist()) == list(range(ROWS))
    assert stats["entries_appended"] == len(entries), stats  # the coordinator appended them all
    assert stats["manifest_writes"] == 1, stats
    manifest = receipt["manifest"]
    assert isinstance(manifest, dict)
    assert manifest.get("coordinator_appends") == 1, receipt
    assert manifest.get("manifest_writes", 0) == 0, receipt  # the driver wrote no manifest


def test_a_driver_started_with_the_coordinators_token_commits_through_it(
    moto_s3: S3Endpoint,
) -> None:
    """``MILLPOND_COORDINATOR_TOKEN`` in the environment the Spark application starts with
    reaches the driver's commit (a Python worker the JVM starts): its own process, so the
    variable is there from the start, as in a deployment."""
    queue = Queue(moto_s3)
    store = queue.store()
    coordinator = AppendCoordinator(
        store, "ingest/manifest", queue=queue_identity(store.url, "ingest/manifest")
    )
    with CoordinatorServer(coordinator, token="driver-token") as server:
        options = queue.options(receipt_path="receipts/job.json", coordinator=server.url)
        result = subprocess.run(
            [sys.executable, str(BATCH_JOB), str(ROWS), json.dumps(options)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            env={**os.environ, TOKEN_ENV: "driver-token"},
        )
        stats = coordinator.stats()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done" in result.stdout
    assert sorted(queue.table().column("id").to_pylist()) == list(range(ROWS))
    assert stats["entries_appended"] == len(queue.entries()), stats
    receipt = json.loads(store.get("receipts/job.json").data)
    assert receipt["manifest"].get("coordinator_appends") == 1, receipt
    assert receipt["manifest"].get("direct_appends", 0) == 0, receipt


def test_a_job_commits_directly_when_the_coordinator_is_down(
    spark: SparkSession, moto_s3: S3Endpoint
) -> None:
    queue = Queue(moto_s3)
    store = queue.store()
    server = CoordinatorServer(
        AppendCoordinator(
            store, "ingest/manifest", queue=queue_identity(store.url, "ingest/manifest")
        )
    )
    url = server.url
    server.close()  # nothing listens there any more
    receipt = _write(spark, queue, url)
    assert sorted(queue.table().column("id").to_pylist()) == list(range(ROWS))
    manifest = receipt["manifest"]
    assert isinstance(manifest, dict)
    assert manifest.get("coordinator_appends", 0) == 0, receipt
    assert manifest.get("direct_appends") == 1, receipt
    assert manifest.get("manifest_writes") == 1, receipt
