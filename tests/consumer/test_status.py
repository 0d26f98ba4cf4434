"""``millpond status``: queue length, bytes referenced, ages and lag, as text and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from consumer_support import MANIFEST, QueueWriter, open_target

from millpond.consumer.app.status import queue_status
from millpond.errors import NotFoundError
from millpond.queue import QueueConsumer
from millpond.storage.store import ObjectStore
from tests.support import ManualClock

T0 = 1_700_000_000_000


@pytest.fixture
def store(store_target: Any) -> ObjectStore:
    return open_target(store_target)


def test_status_of_a_queue(store: ObjectStore) -> None:
    clock = ManualClock(T0)
    writer = QueueWriter(store, clock=clock)
    sizes = []
    for i in range(4):
        _seq, location = writer.append([b"x" * (10 * (i + 1))], ingestion_ms=T0 - 5_000 + i)
        sizes.append(store.head(location).size)
        clock.advance(1)
    consumer = QueueConsumer(store, MANIFEST)
    consumer.initialize()
    consumer.dequeue(0)
    clock.advance(30)
    status = queue_status(store, MANIFEST, clock=clock, measure_bytes=True)
    assert status.epoch == 1
    assert status.queue_length == 3
    assert (status.first_sequence, status.next_sequence) == (1, 4)
    assert status.bytes_referenced == sum(sizes[1:])
    assert status.missing_objects == 0
    assert status.oldest_entry_age_seconds == pytest.approx(33.0)
    assert status.consumer_lag_seconds == pytest.approx(5 + 34 - 0.001)


def test_status_counts_missing_objects_and_empty_queues(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    _seq, location = writer.append([b"a"])
    writer.append([b"b"])
    store.delete_many([location])
    status = queue_status(store, MANIFEST, measure_bytes=True)
    assert status.missing_objects == 1
    consumer = QueueConsumer(store, MANIFEST)
    consumer.initialize()
    consumer.dequeue(1)
    empty = queue_status(store, MANIFEST, measure_bytes=True)
    assert (empty.queue_length, empty.bytes_referenced, empty.consumer_lag_seconds) == (0, 0, 0.0)
    assert empty.oldest_entry_age_seconds is None


def test_status_without_a_manifest(store: ObjectStore) -> None:
    with pytest.raises(NotFoundError):
        queue_status(store, MANIFEST)


def _status_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "millpond.cli", "status", url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_status_command_text_and_json(tmp_path: Path) -> None:
    url = (tmp_path / "store").as_uri()
    from millpond.storage import open_store

    writer = QueueWriter(open_store(url))
    for i in range(3):
        writer.append([b"payload-%d" % i])

    as_json = _status_cli(url, "--output", "json", "--bytes")
    assert as_json.returncode == 0, as_json.stderr
    record = json.loads(as_json.stdout)
    assert record["queue_length"] == 3
    assert record["bytes_referenced"] > 0
    assert record["epoch"] == 0
    assert record["metrics"]["millpond_queue_length"] == 3
    assert record["metrics"]["millpond_queue_bytes"] == record["bytes_referenced"]
    cheap = json.loads(
        _status_cli(url, "--output", "json").stdout
    )  # the default reads the manifest only
    assert cheap["bytes_referenced"] is None
    assert cheap["queue_length"] == 3
    text = _status_cli(url)
    assert text.returncode == 0, text.stderr
    for label in ("queue length", "bytes referenced", "oldest entry", "consumer lag", "epoch"):
        assert label in text.stdout
    missing = _status_cli(url, "--manifest-path", "nowhere/manifest")
    assert missing.returncode == 1
    assert "nowhere/manifest" in missing.stderr


def test_status_flags_a_replaced_manifest(tmp_path: Path) -> None:
    url = (tmp_path / "store").as_uri()
    from millpond.consumer import Consumer, ConsumerConfig
    from millpond.storage import open_store

    store = open_store(url)
    QueueWriter(store).append([b"old"])
    with Consumer(ConsumerConfig(store=store, gc_enabled=False)) as consumer:
        consumer.initialize()  # epoch 1, recorded
    healthy = queue_status(store, MANIFEST)
    assert (healthy.epoch, healthy.recorded_epoch, healthy.replaced) == (1, 1, False)
    assert not store.delete_many([MANIFEST])
    QueueWriter(store).append([b"new"])  # created again, epoch 0
    replaced = queue_status(store, MANIFEST)
    assert (replaced.epoch, replaced.recorded_epoch, replaced.replaced) == (0, 1, True)

    assert json.loads(_status_cli(url, "--output", "json").stdout)["replaced"] is True
    text = _status_cli(url)
    assert text.returncode == 0, text.stderr
    assert "epoch            0 (MANIFEST REPLACED: a consumer of this queue held epoch 1" in (
        text.stdout
    )
