"""A day-long backlog costs no memory (issue 48): the consumer's read-ahead, its backlog index,
the metrics sampler, ``millpond status`` and a GC pass hold a bounded number of entries
whatever the backlog.

Not a timing test: it counts the decoded manifest entries (:class:`ManifestEntry`) alive in the
process at every store request those make, on a queue of 2,000 entries and on one of 50,000,
built as the defaults leave a long backlog (index segments, the rest in the manifest), and
checks the most ever alive stays under one bound for both. Before issue 48 the consumer held
every waiting entry decoded (and the sampler a copy), status and GC decoded them all. The
undecoded bytes count too: the views over a manifest's or a segment's bytes
(:class:`ManifestView`) alive at once stay a handful (the manifest, the segment being read),
so no reader keeps the backlog's segments as bytes instead.
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
from millpond.consumer.app._metrics import BYTES_SPAN, QueueSampler
from millpond.consumer.app.status import queue_status
from millpond.formats.batch import encode_batch
from millpond.formats.manifest import (
    ManifestEntry,
    ManifestView,
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
VIEWS = 4  # the manifest and one segment, each perhaps while the next read replaces it


def _queue_objects() -> list[object]:
    """Decoded entries and views over a manifest's or a segment's bytes, alive now."""
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, (ManifestEntry, ManifestView))]


def _alive(before: frozenset[int]) -> tuple[int, int]:
    """Decoded entries and views alive now, but for those alive before the work began (other
    tests of this process may have left some: ``before`` holds their ids, and the census holds
    them, so no id is reused)."""
    entries = views = 0
    for thing in _queue_objects():
        if id(thing) not in before:
            entries += isinstance(thing, ManifestEntry)
            views += isinstance(thing, ManifestView)
    return entries, views


class _Census(ForwardingStore):
    """Counts the decoded entries alive at every request (the most ever seen in ``most``),
    and the views over queue bytes (``most_views``)."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.most = 0
        self.most_views = 0
        self.most_listed = 0  # objects one listing yielded, the most of any
        self._batch_gets = 0
        self._tails = 0
        self._earlier = _queue_objects()  # alive before: not the work's
        self._before = frozenset(map(id, self._earlier))

    def _count(self) -> None:
        entries, views = _alive(self._before)
        self.most = max(self.most, entries)
        self.most_views = max(self.most_views, views)

    def get(self, path: str) -> GetResult:
        # Every read of the queue, and one read of a batch object in 100 (they come by the
        # hundred: counting at each would only make the test slow; a census walks the whole
        # heap, a third of a second in a worker that has run other tests).
        self._batch_gets += path.endswith(".batch")
        if not path.endswith(".batch") or self._batch_gets % 100 == 0:
            self._count()
        return self.inner.get(path)

    def get_if_changed(self, path: str, etag: str | None) -> GetResult | None:
        self._count()
        return self.inner.get_if_changed(path, etag)

    def get_tail(self, path: str, length: int, etag: str | None = None) -> GetResult | None:
        # A fence check per group: one in four counted (a backlog held is held at every one).
        self._tails += 1
        if self._tails % 4 == 1:
            self._count()
        return self.inner.get_tail(path, length, etag)

    def list_range(
        self, prefix: str = "", *, start_after: str | None = None, end_before: str | None = None
    ) -> Iterator[ObjectInfo]:
        self._count()
        listing = self.inner.list_range(prefix, start_after=start_after, end_before=end_before)
        for listed, info in enumerate(listing, 1):
            self.most_listed = max(self.most_listed, listed)
            yield info


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
    """The most decoded entries alive at any request ``work`` made; the views over queue
    bytes alive at once are checked against :data:`VIEWS` on the way."""
    census = _Census(open_store(url))
    work(census)
    assert census.most_views <= VIEWS
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
def test_the_samplers_bytes_come_from_a_bounded_listing(n: int) -> None:
    """The bytes gauge lists the batch objects of the oldest ``BYTES_SPAN`` entries waiting,
    not of the whole backlog, and scales: the gauge stays near the backlog's bytes."""
    url = _queue(n)
    census = _Census(open_store(url))
    sampler = QueueSampler(census, manifest_path=MANIFEST, data_path_prefix=PREFIX)
    sampler.sample_once()
    gauges = sampler.gauges(None)
    assert gauges is not None
    assert census.most_listed <= min(n, BYTES_SPAN) + 1
    actual = sum(len(encode_batch([b"%d" % i])) for i in range(n))
    # Within a tenth: the oldest batches here hold shorter records (fewer digits) than the rest.
    assert abs(gauges.bytes - actual) <= actual // 10


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
