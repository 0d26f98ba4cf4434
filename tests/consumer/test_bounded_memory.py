"""A day-long backlog costs no memory (issue 48): the consumer's read-ahead, its backlog index,
the metrics sampler, ``millpond status`` and a GC pass hold a bounded number of entries
whatever the backlog.

Not a timing test: it counts the decoded manifest entries (:class:`ManifestEntry`) alive in the
process at every store request those make, on a queue of 2,000 entries and on one of 50,000,
built as the defaults leave a long backlog (index segments, the rest in the manifest), and
checks the most ever alive stays under one bound for both. Before issue 48 the consumer held
every waiting entry decoded (and the sampler a copy), status and GC decoded them all.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from consumer_support import MANIFEST, PREFIX

from millpond.common.clock import SystemClock
from millpond.consumer import Consumer, ConsumerConfig
from millpond.consumer.app._metrics import QueueSampler
from millpond.consumer.app.status import queue_status
from millpond.formats.batch import encode_batch
from millpond.formats.manifest import (
    ManifestEntry,
    Metadata,
    PendingEntry,
    append_entries,
    empty_manifest,
)
from millpond.queue import collect_once
from millpond.queue.index import IndexHead, Segment, encode_segment, head_path, oldest_batch_ms
from millpond.storage import ForwardingStore, GetResult, ObjectInfo, ObjectStore, open_store

SEGMENT = 1_000  # backlog_index_threshold's default: the queues are built as it leaves them
DELIVERED = 1_500  # crosses a segment boundary
BOUND = 300  # far below either backlog: a window, a group, a segment's worth is not needed


def _live_entries() -> int:
    gc.collect()
    return sum(1 for thing in gc.get_objects() if isinstance(thing, ManifestEntry))


class _Census(ForwardingStore):
    """Counts the decoded entries alive at every request (the most ever seen in ``most``)."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.most = 0
        self._batch_gets = 0

    def _count(self) -> None:
        self.most = max(self.most, _live_entries())

    def get(self, path: str) -> GetResult:
        # Every read of the queue, and one read of a batch object in 50 (they come by the
        # hundred: counting at each would only make the test slow).
        self._batch_gets += path.endswith(".batch")
        if not path.endswith(".batch") or self._batch_gets % 50 == 0:
            self._count()
        return self.inner.get(path)

    def get_if_changed(self, path: str, etag: str | None) -> GetResult | None:
        self._count()
        return self.inner.get_if_changed(path, etag)

    def get_tail(self, path: str, length: int, etag: str | None = None) -> GetResult | None:
        self._count()
        return self.inner.get_tail(path, length, etag)

    def list_range(
        self, prefix: str = "", *, start_after: str | None = None, end_before: str | None = None
    ) -> Iterator[ObjectInfo]:
        self._count()
        yield from self.inner.list_range(prefix, start_after=start_after, end_before=end_before)


def _build(store: ObjectStore, n: int) -> None:
    """``n`` one-record batches waiting: full segments in the index, the rest in the
    manifest; batch names and times from an hour ago."""
    from ulid import ULID

    start_ms = SystemClock().now_ms() - 3_600_000
    entries = []
    for i in range(n):
        name = str(ULID.from_int(((start_ms + i) << 80) | int.from_bytes(os.urandom(10), "big")))
        location = f"{PREFIX}/{name}.batch"
        store.put(location, encode_batch([b"%d" % i]))
        entries.append(ManifestEntry(i, location, (Metadata(0, start_ms + i, b"x"),)))
    indexed = n - n % SEGMENT
    segments = []
    for first in range(0, indexed, SEGMENT):
        chunk = entries[first : first + SEGMENT]
        path = f"{PREFIX}/_millpond/index/segments/{first:020d}-{first + SEGMENT - 1:020d}-e1"
        store.put(path, encode_segment(chunk, 1))
        oldest = oldest_batch_ms(e.location for e in chunk)
        segments.append(Segment(path, first, first + SEGMENT - 1, oldest))
    store.put(head_path(PREFIX), IndexHead(1, -1, tuple(segments)).encode())
    rest = [PendingEntry(e.location, e.metadata) for e in entries[indexed:]]
    store.put(MANIFEST, append_entries(empty_manifest(epoch=1, next_sequence=indexed), rest)[0])


def _queue(n: int) -> str:
    """A queue of ``n`` entries waiting, on a memory store of its own."""
    url = f"memory://bounded-{n}-{os.urandom(4).hex()}"
    _build(open_store(url), n)
    return url


def _most_alive(url: str, work: Callable[[ObjectStore], Any]) -> int:
    census = _Census(open_store(url))
    work(census)
    return census.most


def _drain_some(store: ObjectStore) -> None:
    """The service's loop on the defaults: groups taken, written, acked, the next taken."""
    config = ConsumerConfig(store=store, gc_enabled=False)
    assert (config.backlog_index, config.backlog_index_threshold) == (True, SEGMENT)  # defaults
    consumer = Consumer(config)
    consumer.initialize()
    held = []
    ack: int | None = None
    delivered = 0
    while delivered < DELIVERED:
        batches = consumer.next_batches(16, ack_through=ack)
        assert batches
        delivered += len(batches)
        ack = batches[-1].sequence
        held.append(consumer.held_entries())
    consumer.close()
    assert max(held) <= BOUND


@pytest.mark.parametrize("n", [2_000, 50_000])
def test_the_consumer_holds_a_window_not_the_backlog(n: int) -> None:
    assert _most_alive(_queue(n), _drain_some) <= BOUND


def _sample(store: ObjectStore) -> None:
    acked: list[int | None] = [None, 999, 1_499]
    sampler = QueueSampler(
        store, manifest_path=MANIFEST, data_path_prefix=PREFIX, acked=lambda: acked[0]
    )
    while acked:
        sampler.sample_once()
        gauges = sampler.gauges(acked[0])
        assert gauges is not None
        assert gauges.length > 0
        acked.pop(0)


@pytest.mark.parametrize("n", [2_000, 50_000])
def test_the_sampler_status_and_gc_hold_no_copy_of_the_backlog(n: int) -> None:
    url = _queue(n)
    assert _most_alive(url, _sample) <= BOUND
    status = []
    assert _most_alive(url, lambda store: status.append(queue_status(store, MANIFEST))) <= (BOUND)
    assert status[-1].queue_length == n
    collected = _most_alive(
        url,
        lambda store: collect_once(
            store,
            manifest_path=MANIFEST,
            data_path_prefix=PREFIX,
            clock=SystemClock(),
            grace_period=600.0,
        ),
    )
    assert collected <= BOUND
