"""The collector the consumer runs in its own process: it collects, and it stops when fenced."""

from __future__ import annotations

import time
from typing import Any

import pytest
from consumer_support import FAST_RETRY, QueueWriter, open_target

from millpond.consumer import Consumer, ConsumerConfig
from millpond.storage.store import ObjectStore
from tests.support import ManualClock, TestClockStore


@pytest.fixture
def store(store_target: Any) -> ObjectStore:
    return open_target(store_target)


def _wait_for(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _exists(store: ObjectStore, path: str) -> bool:
    return any(info.path == path for info in store.list("ingest", recursive=False))


def test_consumer_collects_what_it_dequeued(store: ObjectStore) -> None:
    clock = ManualClock(int(time.time() * 1000))
    writer = QueueWriter(store, clock=clock)
    done = [writer.append([b"%d" % i])[1] for i in range(3)]
    clock.advance(1)  # the queue's head must be strictly younger than what GC may take
    waiting = writer.append([b"later"])[1]
    consumer = Consumer(
        ConsumerConfig(
            store=TestClockStore(store, clock),
            gc_interval=0.05,
            gc_grace_period=60.0,
            clock=clock,
            retry=FAST_RETRY,
        )
    )
    consumer.initialize()
    try:
        _consume_and_collect(consumer, clock, store, done, waiting)
    finally:
        consumer.close()


def _consume_and_collect(
    consumer: Consumer, clock: ManualClock, store: ObjectStore, done: list[str], waiting: str
) -> None:
    for _ in done:
        batch = consumer.next_batch()
        assert batch is not None
        consumer.ack(batch.sequence)
    consumer.flush()
    collector = consumer.collector
    assert collector is not None
    _wait_for(lambda: collector.counters.get("gc_passes") >= 2)
    assert all(_exists(store, path) for path in done)  # within the grace period
    clock.advance(61)
    _wait_for(lambda: not any(_exists(store, path) for path in done))
    assert _exists(store, waiting)
    consumer.close()
    assert not collector.running


def test_collector_stops_when_the_consumer_is_fenced(store: ObjectStore) -> None:
    clock = ManualClock(int(time.time() * 1000))
    writer = QueueWriter(store, clock=clock)
    writer.append([b"a"])
    old = Consumer(
        ConsumerConfig(
            store=TestClockStore(store, clock),
            gc_interval=0.05,
            gc_grace_period=1.0,
            clock=clock,
            retry=FAST_RETRY,
        )
    )
    old.initialize()
    new = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=FAST_RETRY))
    try:
        collector = old.collector
        assert collector is not None
        _wait_for(lambda: collector.counters.get("gc_passes") >= 1)
        new.initialize()
        # The old collector sees the new epoch in its next snapshot and ends, deleting nothing.
        _wait_for(lambda: not collector.running)
        orphan = writer.upload([b"orphan"])
        clock.advance(3600)
        time.sleep(0.2)  # several intervals of the stopped collector
        assert _exists(store, orphan)
    finally:
        old.close()
        new.close()
