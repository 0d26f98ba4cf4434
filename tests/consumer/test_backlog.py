"""The consumer with a backlog: dequeues in proportion to it, and the time bound on held acks."""

from __future__ import annotations

import time
import uuid
from typing import Any

from consumer_support import FAST_RETRY, MANIFEST, QueueWriter

from millpond.consumer import Consumer, ConsumerConfig
from millpond.formats.manifest import PendingEntry
from millpond.queue import read_manifest
from millpond.storage import ObjectStore, open_store


class _SteppedClock:
    """Real wall clock and sleep; a monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


def _fresh() -> ObjectStore:
    return open_store(f"memory://backlog-{uuid.uuid4().hex}")


def _fill(store: ObjectStore, count: int) -> list[str]:
    """``count`` batch objects, enqueued 500 to an append."""
    writer = QueueWriter(store)
    locations = [writer.upload([b"%d" % i]) for i in range(count)]
    for begin in range(0, count, 500):
        writer.queue.append([PendingEntry(loc) for loc in locations[begin : begin + 500]])
    return locations


def _consumer(store: ObjectStore, **overrides: Any) -> Consumer:
    # The manifest's own dequeues are what these tests look at: no backlog index (on by
    # default, it would take these backlogs out of the manifest at the start).
    options: dict[str, Any] = {
        "store": store,
        "gc_enabled": False,
        "retry": FAST_RETRY,
        "backlog_index": False,
    }
    options.update(overrides)
    return Consumer(ConsumerConfig(**options))


def _queued(store: ObjectStore) -> list[int]:
    return [e.sequence for e in read_manifest(store, MANIFEST).manifest.entries]


def _drain_counting_bytes(store: ObjectStore, consumer: Consumer) -> tuple[int, int]:
    """Deliver and ack everything; returns (dequeues, manifest bytes the dequeues wrote)."""
    written = 0
    dequeues = consumer.counters.get("dequeues")
    while (batch := consumer.next_batch()) is not None:
        consumer.ack(batch.sequence)
        if consumer.counters.get("dequeues") != dequeues:
            dequeues = consumer.counters.get("dequeues")
            written += len(store.get(MANIFEST).data)
    consumer.close()
    written += len(store.get(MANIFEST).data)
    return consumer.counters.get("dequeues"), written


def test_draining_a_backlog_dequeues_in_proportion_to_it() -> None:
    store = _fresh()
    locations = _fill(store, 1500)
    consumer = _consumer(store, ack_batch_size=10)
    consumer.initialize()
    delivered = []
    dequeues_seen = [0]
    while (batch := consumer.next_batch()) is not None:
        delivered.append(batch.location)
        consumer.ack(batch.sequence)
        if consumer.counters.get("dequeues") not in dequeues_seen:
            dequeues_seen.append(consumer.counters.get("dequeues"))
            # Through the ack and no further: the manifest still holds everything after it.
            assert _queued(store) == list(range(batch.sequence + 1, 1500))
    consumer.close()
    assert delivered == locations
    assert _queued(store) == []
    # A fixed step of 10 would take 150 dequeues; 10% of what remains takes ~50.
    assert consumer.counters.get("dequeues") < 60


def test_proportional_drain_writes_linear_bytes_fixed_step_quadratic() -> None:
    sizes = (500, 2000)
    fixed: list[int] = []
    proportional: list[int] = []
    for n in sizes:
        for fraction, out in ((0.0, fixed), (0.1, proportional)):
            store = _fresh()
            _fill(store, n)
            consumer = _consumer(store, ack_batch_size=10, dequeue_fraction=fraction)
            consumer.initialize()
            out.append(_drain_counting_bytes(store, consumer)[1])
    # Four times the backlog: about sixteen times the bytes with a fixed step, about four
    # times proportionally.
    assert fixed[1] / fixed[0] > 12
    assert proportional[1] / proportional[0] < 6


def test_an_idle_consumer_dequeues_held_acks_after_the_max_delay() -> None:
    store = _fresh()
    _fill(store, 5)
    clock = _SteppedClock()
    consumer = _consumer(store, ack_batch_size=100, dequeue_max_delay=30.0, clock=clock)
    consumer.initialize()
    for _ in range(2):
        batch = consumer.next_batch()
        assert batch is not None
        consumer.ack(batch.sequence)
    assert _queued(store) == [0, 1, 2, 3, 4]
    clock.offset += 29.0
    batch = consumer.next_batch()
    assert batch is not None
    consumer.ack(batch.sequence)  # 29 s after the first held ack: still held
    assert _queued(store) == [0, 1, 2, 3, 4]
    clock.offset += 1.0
    batch = consumer.next_batch()
    assert batch is not None
    consumer.ack(batch.sequence)  # 30 s: the ack dequeues everything acked
    assert _queued(store) == [4]
    batch = consumer.next_batch()
    assert batch is not None
    consumer.ack(batch.sequence)
    assert consumer.next_batch() is None
    assert _queued(store) == [4]  # just acked: held
    clock.offset += 30.0
    assert consumer.next_batch() is None  # idle, past the delay: dequeued without an ack
    assert _queued(store) == []
    consumer.close()
