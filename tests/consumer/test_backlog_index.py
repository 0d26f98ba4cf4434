"""The consumer's backlog index (``backlog_index=True``): moves, crashes, takeovers, readers."""

from __future__ import annotations

import time
from typing import Any

import pytest
from consumer_support import (
    FAST_RETRY,
    MANIFEST,
    PREFIX,
    QueueWriter,
    open_target,
    quiet_consumer,
)

from millpond.common.retry import RetryPolicy
from millpond.consumer import Consumer
from millpond.consumer.app._metrics import QueueSampler
from millpond.consumer.app.status import queue_status
from millpond.errors import FencedError, StorageError
from millpond.formats.manifest import Footer, Manifest, ManifestEntry
from millpond.queue import read_manifest
from millpond.queue.claim import internal_path
from millpond.queue.index import (
    BacklogIndex,
    IndexHead,
    Segment,
    head_path,
    queue_view,
    read_indexed,
)
from millpond.storage.store import ForwardingStore, ObjectStore


class _Crash(BaseException):
    """The process dies here."""


class _CrashAfterIndexWrite(ForwardingStore):
    """Dies at the first manifest write after the index head was written."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.head_written = False

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        self.head_written |= path == head_path(PREFIX)
        return self.inner.put_if_absent(path, data)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        if path == MANIFEST and self.head_written:
            raise _Crash(path)
        self.head_written |= path == head_path(PREFIX)
        return self.inner.put_if_match(path, data, etag)


@pytest.fixture
def store(store_target: Any) -> ObjectStore:
    return open_target(store_target)


def _fill(writer: QueueWriter, start: int, count: int) -> None:
    for i in range(start, start + count):
        writer.append([b"%d" % i])


def _queued(store: ObjectStore) -> list[int]:
    return [e.sequence for e in read_manifest(store, MANIFEST).manifest.entries]


def _indexed(store: ObjectStore) -> list[int]:
    return [e.sequence for e in read_indexed(store, PREFIX)[1]]


def _segments(store: ObjectStore) -> list[str]:
    return [i.path for i in store.list(internal_path(PREFIX, "index/segments"))]


def _drain(consumer: Consumer, until: int | None = None) -> list[tuple[int, bytes]]:
    out = []
    while (batch := consumer.next_batch()) is not None:
        out.append((batch.sequence, batch.entries[0]))
        consumer.ack(batch.sequence)
        if until is not None and batch.sequence >= until:
            break
    return out


def _expected(first: int, last: int) -> list[tuple[int, bytes]]:
    return [(i, b"%d" % i) for i in range(first, last + 1)]


def test_moves_the_backlog_out_of_the_manifest_and_drains_it_first(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    _fill(writer, 0, 12)
    consumer = quiet_consumer(
        store, backlog_index=True, backlog_index_threshold=5, ack_batch_size=2
    )
    consumer.initialize()
    assert _queued(store) == []  # every entry it read is in the index now
    assert _indexed(store) == list(range(12))
    _fill(writer, 12, 3)  # producers append to a short manifest
    assert _queued(store) == [12, 13, 14]
    status = queue_status(store, MANIFEST)
    assert (status.queue_length, status.indexed_entries, status.first_sequence) == (15, 12, 0)
    sampler = QueueSampler(store, manifest_path=MANIFEST, data_path_prefix=PREFIX)
    sampler.sample_once()
    gauges = sampler.gauges(acked=None)
    assert gauges is not None
    assert gauges.length == 15
    batches = [info for info in store.list(PREFIX, recursive=False) if info.path.endswith(".batch")]
    assert gauges.bytes == sum(info.size for info in batches)
    assert _drain(consumer, until=5) == _expected(0, 5)
    assert _indexed(store)[0] <= 6  # drained through an ack, never past it
    assert _queued(store) == [12, 13, 14]  # draining the index leaves the manifest alone
    assert _drain(consumer) == _expected(6, 14)
    consumer.close()
    assert _queued(store) == []
    assert _indexed(store) == []
    assert _segments(store) == []  # drained segments are deleted


def test_crash_between_index_write_and_manifest_write(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    _fill(writer, 0, 20)
    dying = quiet_consumer(
        _CrashAfterIndexWrite(store), backlog_index=True, backlog_index_threshold=5
    )
    with pytest.raises(_Crash):
        dying.initialize()
    # The entries are in both: every reader takes each once.
    assert _queued(store) == list(range(20))
    assert _indexed(store) == list(range(20))
    status = queue_status(store, MANIFEST)
    assert (status.queue_length, status.first_sequence, status.next_sequence) == (20, 0, 20)
    _fill(writer, 20, 3)
    # The next consumer (index switched off) finishes the move, then drains the index first.
    successor = quiet_consumer(store, backlog_index=False)
    successor.initialize()
    assert _queued(store) == [20, 21, 22]
    assert _drain(successor) == _expected(0, 22)
    successor.close()
    assert _queued(store) == []
    assert _indexed(store) == []
    assert _segments(store) == []


def test_takeover_drains_the_index_in_order_and_fences_the_old_consumer(
    store: ObjectStore,
) -> None:
    writer = QueueWriter(store)
    _fill(writer, 0, 30)
    old = quiet_consumer(store, backlog_index=True, backlog_index_threshold=5, ack_batch_size=2)
    old.initialize()
    _fill(writer, 30, 5)
    sink = _drain(old, until=9)
    assert sink == _expected(0, 9)
    assert _indexed(store)[0] >= 9  # its acks drained the index
    new = quiet_consumer(store, backlog_index=True, backlog_index_threshold=5)
    new.initialize(last_acked_sequence=sink[-1][0])  # where the sink is
    sink += _drain(new)
    assert sink == _expected(0, 34)
    with pytest.raises(FencedError):
        old.next_batch()
    # Even going straight to the index, the old epoch writes nothing there.
    head = store.get(head_path(PREFIX)).data
    stale = BacklogIndex(store, data_path_prefix=PREFIX, epoch=old.epoch or 0, retry=FAST_RETRY)
    with pytest.raises(FencedError):
        stale.claim()
    assert store.get(head_path(PREFIX)).data == head
    new.close()
    old.close()
    assert _queued(store) == []
    assert _indexed(store) == []


def test_a_stale_index_writer_cannot_write_after_a_claim(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    _fill(writer, 0, 8)
    old = quiet_consumer(store, backlog_index=True, backlog_index_threshold=5)
    old.initialize()
    assert _indexed(store) == list(range(8))
    index_a = BacklogIndex(store, data_path_prefix=PREFIX, epoch=old.epoch or 0, retry=FAST_RETRY)
    index_a.claim()
    new = quiet_consumer(store, backlog_index=False)
    new.initialize()  # bumps the epoch, then claims the head
    head = store.get(head_path(PREFIX)).data
    with pytest.raises(FencedError):
        index_a.drain(5)
    entries = read_manifest(store, MANIFEST).manifest.entries
    _fill(writer, 8, 2)
    more = [e for e in read_manifest(store, MANIFEST).manifest.entries if e.sequence >= 8]
    assert entries == ()
    with pytest.raises(FencedError):
        index_a.add(more, dequeued_through=-1)  # its segment is written, the head is not
    assert store.get(head_path(PREFIX)).data == head
    assert len(_segments(store)) == 2
    assert _drain(new) == _expected(0, 9)
    new.close()
    old.close()  # fenced: closes without a dequeue
    # The next consumer deletes the segment no head names.
    last = quiet_consumer(store, backlog_index=False)
    last.initialize()
    assert _segments(store) == []
    last.close()


class _ManifestWritesFail(ForwardingStore):
    """Manifest writes after the index head was written fail (the store is down for them)."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.armed = True
        self.head_written = False

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        self.head_written |= path == head_path(PREFIX)
        return self.inner.put_if_absent(path, data)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        if path == MANIFEST and self.head_written and self.armed:
            raise StorageError(f"{path}: injected: the store is down")
        self.head_written |= path == head_path(PREFIX)
        return self.inner.put_if_match(path, data, etag)


def test_a_move_whose_manifest_write_failed_is_finished_on_the_next_ack(
    store: ObjectStore,
) -> None:
    writer = QueueWriter(store)
    _fill(writer, 0, 10)
    failing = _ManifestWritesFail(store)
    consumer = quiet_consumer(
        failing,
        backlog_index=True,
        backlog_index_threshold=5,
        retry=RetryPolicy(max_attempts=2, base_delay=0.001, max_delay=0.002),
    )
    consumer.initialize()  # the move's manifest write fails: a warning, not an error
    assert _queued(store) == list(range(10))
    assert _indexed(store) == list(range(10))
    failing.armed = False
    batch = consumer.next_batch()
    assert batch is not None
    consumer.ack(batch.sequence)
    assert _queued(store) == []  # finished
    assert _drain(consumer) == _expected(1, 9)
    consumer.close()
    assert _indexed(store) == []


def test_queue_view_takes_each_sequence_once_and_reaches_past_an_older_manifest() -> None:
    def entry(sequence: int) -> ManifestEntry:
        return ManifestEntry(sequence, f"{PREFIX}/{sequence}.batch")

    def manifest(first: int, next_sequence: int) -> Manifest:
        entries = tuple(entry(s) for s in range(first, next_sequence))
        return Manifest(Footer(len(entries), next_sequence, 4), entries)

    segment = Segment("s", 3, 9)
    # A move that crashed before its manifest write: 3..9 in both.
    view = queue_view(
        manifest(3, 12), IndexHead(4, 2, (segment,)), [entry(s) for s in range(3, 10)]
    )
    assert [e.sequence for e in view.entries] == list(range(3, 12))
    assert (view.first_sequence, view.next_sequence) == (3, 12)
    # The manifest was read before the consumer moved 8..9 (appended after it was read).
    view = queue_view(manifest(3, 8), IndexHead(4, 2, (segment,)), [entry(s) for s in range(3, 10)])
    assert [e.sequence for e in view.entries] == list(range(3, 10))
    assert view.next_sequence == 10
    # Drained through 5: only what is past it.
    head = IndexHead(4, 5, (segment,))
    view = queue_view(manifest(10, 12), head, [entry(s) for s in range(6, 10)])
    assert [e.sequence for e in view.entries] == list(range(6, 12))


def test_the_backlog_moves_while_nothing_is_delivered(store: ObjectStore) -> None:
    """The sink is down: the service retries one write and asks for nothing; the backlog that
    piles up meanwhile still leaves the manifest."""
    writer = QueueWriter(store)
    consumer = quiet_consumer(
        store, backlog_index=True, backlog_index_threshold=5, backlog_index_interval=0.05
    )
    consumer.initialize()
    first = consumer.next_batch()
    assert first is None
    _fill(writer, 0, 12)
    try:
        deadline = time.monotonic() + 30
        while len(_queued(store)) >= 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        # Below the threshold what is left stays; what is moved is the oldest, in order.
        assert len(_queued(store)) < 5
        assert _indexed(store) + _queued(store) == list(range(12))
        assert _drain(consumer) == _expected(0, 11)
    finally:
        consumer.close()
    assert _indexed(store) == []


def test_an_object_whose_name_only_looks_like_a_segment_is_left_alone(
    store: ObjectStore,
) -> None:
    """``-e²`` passes ``str.isdigit`` but not ``int``: a consumer taking the index over raised
    ValueError while it looked for orphaned segments."""
    writer = QueueWriter(store)
    _fill(writer, 0, 12)
    first = quiet_consumer(store, backlog_index=True, backlog_index_threshold=5)
    first.initialize()
    assert _indexed(store) == list(range(12))
    stray = internal_path(PREFIX, "index/segments/not-a-segment-e\u00b2")
    store.put(stray, b"someone else's")
    successor = quiet_consumer(store, backlog_index=True, backlog_index_threshold=5)
    successor.initialize()  # takes the index over: looks for orphans
    assert _drain(successor) == _expected(0, 11)
    successor.close()
    first.close()  # fenced: closes without a dequeue
    assert _segments(store) == [stray]
