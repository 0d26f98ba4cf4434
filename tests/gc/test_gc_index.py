"""GC and the consumer's backlog index: indexed batch objects are referenced."""

from __future__ import annotations

from typing import Any

import pytest
from gc_support import FAST_RETRY, MANIFEST, PREFIX, T0, enqueue, open_target, paths, put_batch

from millpond.consumer import Consumer, ConsumerConfig
from millpond.gc import GarbageCollector, GarbageCollectorConfig
from millpond.queue import read_manifest
from millpond.queue.index import read_indexed
from millpond.storage.store import ObjectStore
from tests.support import ManualClock, TestClockStore

HOUR_MS = 3_600_000


@pytest.fixture
def store(store_target: Any) -> ObjectStore:
    return open_target(store_target)


def test_gc_keeps_every_indexed_batch_object(store: ObjectStore) -> None:
    orphan = put_batch(store, T0)
    queued = [put_batch(store, T0 + 1000 + i) for i in range(6)]
    enqueue(store, *queued)
    consumer = Consumer(
        ConsumerConfig(
            store=store,
            gc_enabled=False,
            retry=FAST_RETRY,
            backlog_index=True,
            backlog_index_threshold=3,
        )
    )
    consumer.initialize()
    assert read_manifest(store, MANIFEST).manifest.entries == ()
    assert [e.location for e in read_indexed(store, PREFIX)[1]] == queued
    clock = ManualClock(T0 + 2 * HOUR_MS)
    collector = GarbageCollector(
        GarbageCollectorConfig(
            store=TestClockStore(store, clock), clock=clock, gc_grace_period=60.0
        )
    )
    report = collector.run_once()
    assert report.deleted == (orphan,)
    # The index's oldest entry is the queue's floor: nothing from it on is even listed.
    assert report.queue_floor_ms == T0 + 1000
    assert report.kept == {}
    assert set(queued) <= paths(store)
    # Delivered and acked, they are no longer referenced: the next pass takes them.
    while (batch := consumer.next_batch()) is not None:
        consumer.ack(batch.sequence)
    consumer.close()
    report = collector.run_once()
    assert set(report.deleted) == set(queued)
