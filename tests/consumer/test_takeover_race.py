"""A service that takes over while the older consumer is still running, on real servers.

The service reads the sink's last sequence before its takeover (so that a sink of another
queue is refused before anyone is fenced). Between that read and the epoch bump, the older
consumer may write more groups into the same database and dequeue them. The takeover must
then start where the sink really is — not refuse with "entries were dequeued without this
consumer's sink seeing them" (which it did: the race showed up about once in twenty runs of
``test_fence_pipeline.py``) — and every row must end up in PostgreSQL exactly once.

Stores: SeaweedFS (an S3 server on loopback); the sink: the session PostgreSQL.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
from consumer_support import FAST_RETRY, Database, ForwardingSink, QueueWriter, numbered

from millpond.consumer import Consumer, ConsumerConfig
from millpond.consumer.app.service import ConsumerService
from millpond.consumer.takeover import take_over
from millpond.errors import FencedError, ProgressBehindError
from millpond.storage import open_store
from tests.support import unique_root

BATCHES = 10
ROWS = 3


class OlderRunsOnAfterTheRead(ForwardingSink):
    """The newer side's sink: right after its first progress read, the older consumer writes
    and dequeues ``more`` batches more."""

    def __init__(self, inner: Any, older: Consumer, older_sink: Any, more: int) -> None:
        super().__init__(inner)
        self._older, self._older_sink, self._more = older, older_sink, more
        self.reads = 0

    def last_sequence(self, queue: str) -> int | None:
        found = self.inner.last_sequence(queue)
        self.reads += 1
        if self.reads == 1:
            _write_and_dequeue(self._older, self._older_sink, self._more)
        return found  # type: ignore[no-any-return]


def _write_and_dequeue(consumer: Consumer, sink: Any, count: int) -> None:
    """What a running service does with ``count`` batches: write, ack, dequeue."""
    batches: list[Any] = []
    while len(batches) < count:  # a call hands out what the read-ahead has fetched
        batches += consumer.next_batches(count - len(batches))
    sink.write_many(batches)
    consumer.flush(ack_through=batches[-1].sequence)


def _older(s3: Any, database: Database) -> tuple[Consumer, Any]:
    store = open_store(s3.url_for(unique_root()), s3.store_options())
    QueueWriter(store).append_arrow_all([numbered(b * ROWS, ROWS) for b in range(BATCHES)])
    older = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=FAST_RETRY))
    sink = database.sink()
    older.initialize(last_acked_sequence=sink.last_sequence(older.queue))
    _write_and_dequeue(older, sink, 3)  # sequences 0..2 written and dequeued
    return older, sink


def _rows(database: Database) -> list[int]:
    return [row[0] for row in database.query(f'SELECT n FROM "{database.table}" ORDER BY n')]


def test_a_service_taking_over_from_a_consumer_still_writing_starts_where_the_sink_is(
    seaweedfs_s3: Any, postgres_server: Any
) -> None:
    database = Database("postgres", postgres_server.url)
    older, older_sink = _older(seaweedfs_s3, database)
    newer = Consumer(ConsumerConfig(store=older.config.store, gc_enabled=False, retry=FAST_RETRY))
    with contextlib.closing(database.sink()) as inner:
        sink = OlderRunsOnAfterTheRead(inner, older, older_sink, more=3)  # 3..5 meanwhile
        stats = ConsumerService(newer, sink, poll_min=0.001, poll_max=0.01).run(
            threading.Event(), until_idle=True
        )
    assert sink.reads == 2  # read again once the older one was fenced
    assert stats.batches == BATCHES - 6  # 6..9: nothing the older one wrote again
    assert _rows(database) == list(range(BATCHES * ROWS))
    with pytest.raises(FencedError):
        older.next_batches(1)
    older.close()
    older_sink.close()


def test_progress_that_still_trails_after_the_takeover_is_refused(
    seaweedfs_s3: Any, postgres_server: Any
) -> None:
    """Entries dequeued that the sink never recorded: read again after the takeover, the
    progress is the same, and the takeover says so instead of skipping them silently."""
    database = Database("postgres", postgres_server.url)
    older, older_sink = _older(seaweedfs_s3, database)
    batches = older.next_batches(2)
    while len(batches) < 2:
        batches += older.next_batches(2 - len(batches))
    older.flush(ack_through=batches[-1].sequence)  # 3..4 dequeued, never written
    older.close()
    newer = Consumer(ConsumerConfig(store=older.config.store, gc_enabled=False, retry=FAST_RETRY))
    with pytest.raises(ProgressBehindError, match=r"expected >= 4 .* found 2: entries 3\.\.4"):
        take_over(newer, lambda: older_sink.last_sequence(newer.queue))
    newer.close()
    older_sink.close()
