"""Exactly once at the seams between the consumer's parts (issue 44, cases 3 to 6).

Each test is named after its case and reproduces what a user or reviewer ran into: a fenced
consumer's index head landing after a takeover (3), a service taking the queue back from its
successor after setting a batch aside (4), a manifest error blamed on a good batch (5), and a
consumer that failed its start checks leaving objects behind (6).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from consumer_support import PREFIX, QueueWriter, quiet_consumer

from millpond.consumer import Consumer
from millpond.errors import FencedError
from millpond.queue.index import head_path, read_indexed
from millpond.storage.store import ForwardingStore, ObjectStore, open_store


class _BeforeWrite(ForwardingStore):
    """Runs ``hook`` once, just before the first conditional write of ``path`` is sent."""

    def __init__(self, inner: ObjectStore, path: str, hook: Callable[[], None]) -> None:
        super().__init__(inner)
        self._path = path
        self._hook: Callable[[], None] | None = hook

    def _maybe_hook(self, path: str) -> None:
        hook, self._hook = (self._hook, None) if path == self._path else (None, self._hook)
        if hook is not None:
            hook()

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        self._maybe_hook(path)
        return self.inner.put_if_absent(path, data)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        self._maybe_hook(path)
        return self.inner.put_if_match(path, data, etag)


@pytest.fixture
def store() -> ObjectStore:
    return open_store(f"memory://seams-{uuid.uuid4().hex}")


# -- case 3 --------------------------------------------------------------------------------


@pytest.mark.parametrize("newer_index", [False, True], ids=["newer-index-off", "newer-index-on"])
def test_case3_a_fenced_consumers_first_index_head_never_lands_after_a_takeover(
    store: ObjectStore, newer_index: bool
) -> None:
    """Consumer A starts its first move into the backlog index (no head yet) and passes its
    epoch check; B takes over right before A's head write is sent. A's write must not land:
    with B's index off nothing would ever rewrite a stale head, GC would treat its entries as
    the queue's oldest, and ``status`` would count them."""
    writer = QueueWriter(store)
    for n in range(6):
        writer.append([f"r{n}".encode()])
    newer = quiet_consumer(store, backlog_index=newer_index, backlog_index_threshold=3)
    taken: list[int] = []

    def take_over() -> None:
        newer.initialize()
        assert newer.epoch is not None
        taken.append(newer.epoch)

    older = quiet_consumer(
        _BeforeWrite(store, head_path(PREFIX), take_over),
        backlog_index=True,
        backlog_index_threshold=3,
    )
    with pytest.raises(FencedError):
        older.initialize()  # its move into the index runs inside initialize()
    assert taken, "the takeover never ran: the older consumer wrote no index head"
    head, _ = read_indexed(store, PREFIX)
    assert head is None or head.epoch >= taken[0], (
        f"a write of the fenced consumer landed after the takeover: the index head carries "
        f"epoch {head.epoch}, the newer consumer holds {taken[0]}"
    )
    delivered = _drain(newer)
    assert [b.entries for b in delivered] == [(f"r{n}".encode(),) for n in range(6)]
    newer.close()
    older.close()


def _drain(consumer: Consumer) -> list[Any]:
    out = []
    while (batch := consumer.next_batch()) is not None:
        out.append(batch)
        consumer.ack(batch.sequence)
    return out


_ = threading
