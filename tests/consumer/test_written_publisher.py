"""``WrittenPublisher``: the consumer service's written-through mark, written from a thread of
its own — coalesced under load, a heartbeat while idle, nothing before the start or after a
takeover, set-aside batches carried over to the next service."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

import pytest

from millpond.consumer.app._written import WrittenPublisher
from millpond.errors import StorageError
from millpond.queue import WrittenMark, read_written, written_path
from millpond.storage import ForwardingStore, ObjectStore, open_store
from tests.support import unique_root

QUEUE = "memory:///ingest/manifest"
PREFIX = "ingest"


class SlowStore(ForwardingStore):
    """Each PUT of the mark takes ``delay`` seconds (a store 50 ms away); records every mark
    written, and fails while ``failing``."""

    def __init__(self, inner: ObjectStore, delay: float = 0.0) -> None:
        super().__init__(inner)
        self.delay = delay
        self.failing = False
        self.lock = threading.Lock()
        self.marks: list[WrittenMark] = []
        self.failed = 0

    def put(self, path: str, data: bytes) -> str | None:
        self._note(path, data)
        return self.inner.put(path, data)

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        self._note(path, data)
        return self.inner.put_if_absent(path, data)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        self._note(path, data)
        return self.inner.put_if_match(path, data, etag)

    def _note(self, path: str, data: bytes) -> None:
        if path == written_path(PREFIX):
            time.sleep(self.delay)
            with self.lock:
                if self.failing:
                    self.failed += 1
                    raise StorageError("the store is down")
                self.marks.append(WrittenMark.from_json(data, name=path))


def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def store() -> SlowStore:
    # Named memory stores are shared within the process: a fresh name per test.
    return SlowStore(open_store(f"memory://{unique_root()}"))


def publisher(store: ObjectStore, **options: float) -> WrittenPublisher:
    return WrittenPublisher(store, data_path_prefix=PREFIX, queue=QUEUE, **options)


def test_nothing_is_written_before_the_start_nor_after_a_takeover(store: SlowStore) -> None:
    never = publisher(store)
    never.finish("stopped", "MillpondError: a sink of another queue")
    assert store.marks == []
    fenced = publisher(store, interval=60)
    fenced.start(epoch=3, written_through=9)
    until(lambda: len(store.marks) == 1, "the first mark")
    fenced.written(10)
    until(lambda: len(store.marks) == 2, "the second mark")
    fenced.finish("fenced", "FencedError: another consumer took over")
    assert [(m.epoch, m.written_through, m.state) for m in store.marks] == [
        (3, 9, "running"),
        (3, 10, "running"),
    ]


def test_commits_under_load_are_coalesced_into_a_few_writes(store: SlowStore) -> None:
    """500 commits while each PUT takes 50 ms: at most one write in flight and one every
    MIN_GAP (0.2 s), each carrying the latest sequence; the last one lands."""
    store.delay = 0.05
    service = publisher(store, interval=60)
    started = time.monotonic()
    service.start(epoch=1, written_through=None)
    for sequence in range(500):
        service.written(sequence)
        time.sleep(0.002)
    until(lambda: bool(store.marks) and store.marks[-1].written_through == 499, "sequence 499")
    elapsed = time.monotonic() - started
    assert len(store.marks) <= elapsed / 0.2 + 2
    through = [m.written_through for m in store.marks]
    assert through == sorted(through, key=lambda s: -1 if s is None else s)
    service.finish("stopped")
    final = read_written(store, PREFIX)
    assert final is not None
    assert (final.state, final.written_through) == ("stopped", 499)


def test_an_idle_service_writes_once_an_interval(store: SlowStore) -> None:
    service = publisher(store, interval=0.3)
    service.start(epoch=1, written_through=4)
    until(lambda: len(store.marks) >= 4, "four marks", timeout=20)
    service.finish("stopped")
    times = [m.updated_ms for m in store.marks]
    gaps = [(later - earlier) / 1000 for earlier, later in itertools.pairwise(times)]
    assert all(gap >= 0.29 for gap in gaps[:3]), gaps
    assert {m.written_through for m in store.marks} == {4}


def test_state_changes_are_written_and_a_stop_on_a_batch_stays(store: SlowStore) -> None:
    service = publisher(store, interval=60)
    service.start(epoch=2, written_through=6)
    service.state("retrying", error="could not write sequence 7 (retrying): database is locked")
    until(lambda: store.marks[-1].state == "retrying" if store.marks else False, "retrying")
    service.written(7)  # written after all: running again
    until(lambda: store.marks[-1].state == "running", "running again")
    service.state("stopped_on_batch", error="SinkError: refused", stopped_on=8)
    service.finish("stopped", "SinkError: refused")
    last = store.marks[-1]
    assert (last.state, last.stopped_on, last.error, last.written_through) == (
        "stopped_on_batch",
        8,
        "SinkError: refused",
        7,
    )


def test_set_aside_batches_are_listed_and_carried_over_to_the_next_service(
    store: SlowStore,
) -> None:
    first = publisher(store, interval=60)
    first.start(epoch=1, written_through=2)
    first.set_aside(3, "a string into an integer column")
    first.written(3)
    first.finish("stopped")
    second = publisher(store, interval=60)
    second.start(epoch=2, written_through=3)
    until(lambda: store.marks[-1].epoch == 2, "the second service's mark")
    second.finish("stopped")
    assert [(m.sequence, m.reason) for m in store.marks[-1].set_aside] == [
        (3, "a string into an integer column")
    ]


def test_a_store_that_fails_is_logged_once_and_written_again(
    store: SlowStore, caplog: pytest.LogCaptureFixture
) -> None:
    store.failing = True
    service = publisher(store, interval=60)
    with caplog.at_level(logging.INFO, logger="millpond.consumer.app._written"):
        service.start(epoch=1, written_through=0)
        service.written(1)
        until(lambda: store.failed >= 3, "three failed writes")
        store.failing = False
        until(lambda: bool(store.marks), "a mark written again")
        service.finish("stopped")
    assert store.marks[0].written_through == 1
    warnings = [r for r in caplog.records if "could not write the written-through" in r.message]
    assert len(warnings) == 1
    assert any("is written again" in r.message for r in caplog.records)


def test_a_fenced_services_late_mark_never_lands_over_its_successors(store: SlowStore) -> None:
    """The mark is written conditionally under the service's epoch: once the service that took
    over has written its mark, the older one's writes (a delivery it still counted, its last
    word) are refused and it writes no more. With a plain PUT its mark landed over the newer
    one's: epoch 3, written through 12, over epoch 4's 9."""
    older = publisher(store, interval=60)
    older.start(epoch=3, written_through=9)
    until(lambda: read_written(store, PREFIX) is not None, "the older service's mark")
    newer = publisher(store, interval=60)
    newer.start(epoch=4, written_through=9)
    until(lambda: read_written(store, PREFIX).epoch == 4, "the newer service's mark")  # type: ignore[union-attr]
    older.written(12)
    older.finish("stopped")
    mark = read_written(store, PREFIX)
    assert mark is not None
    assert (mark.epoch, mark.written_through) == (4, 9)
    newer.finish("stopped")
