"""A producer paused with an append under way: the append is not sent as it was.

Garbage collection may delete an unreferenced batch object once it is older than the grace
period. A producer writes a batch again under its name (``reupload_after``, half the grace
period) before appending it when it waited that long — but it used to decide that only when
the append started. A producer paused (a stopped VM, a long GC pause, a coordinator that never
answered) between that decision and the write then appended a location whose object the
collector had taken meanwhile, and every consumer stopped on the missing object for good. The
whole-system checker found it (seeds 10064, 11588 and 11801 of a 2,000-schedule soak).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from millpond.errors import NotFoundError, StorageError
from millpond.formats.manifest import decode_manifest
from millpond.producer import Producer
from millpond.storage.store import ForwardingStore, GetResult, ObjectStore
from tests.producer.producer_support import MANIFEST, claim_queue, config, fresh_memory, read_back

GRACE = 60.0  # reupload_after is half of it


class _PausedClock:
    """This machine's monotonic clock, moved ahead by :meth:`pause`: time a paused process
    did not see pass. The wall clock is left alone (only the monotonic clock ages a batch)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offset = 0.0

    def pause(self, seconds: float) -> None:
        with self._lock:
            self._offset += seconds

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        with self._lock:
            return time.monotonic() + self._offset

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            threading.Event().wait(seconds)


class _Store(ForwardingStore):
    """Fails the next manifest write before it is sent, then holds the manifest read that
    follows until released; records batch PUTs and manifest writes in order."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.fail_next_write = False
        self.read_held = threading.Event()
        self.release_read = threading.Event()
        self.release_read.set()
        self.log: list[tuple[str, tuple[str, ...]]] = []

    def _manifest_write(self, data: bytes) -> None:
        if self.fail_next_write:
            self.fail_next_write = False
            self.release_read.clear()  # the read after this failure waits for the test
            raise StorageError(f"{MANIFEST}: injected failure before the write")
        locations = tuple(e.location for e in decode_manifest(data).entries)
        self.log.append(("manifest", locations))

    def get(self, path: str) -> GetResult:
        if path == MANIFEST and not self.release_read.is_set():
            self.read_held.set()
            assert self.release_read.wait(timeout=60)
        return self.inner.get(path)

    def _writing(self, path: str, data: bytes) -> None:
        if path == MANIFEST:
            self._manifest_write(data)
        elif path.endswith(".batch"):
            self.log.append(("put", (path,)))

    def put(self, path: str, data: bytes) -> str | None:
        self._writing(path, data)
        return self.inner.put(path, data)

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        self._writing(path, data)
        return self.inner.put_if_absent(path, data)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        if path == MANIFEST:
            self._manifest_write(data)
        return self.inner.put_if_match(path, data, etag)


def test_an_append_paused_past_reupload_after_writes_the_batch_again_first(
    tmp_path: Path,
) -> None:
    store = _Store(fresh_memory())
    claim_queue(store, grace=GRACE, delete_window=0.2)
    clock = _PausedClock()
    with Producer(config(store, tmp_path / "wal", clock=clock)) as producer:
        producer.produce([b"first"]).wait(timeout=30)
        store.fail_next_write = True
        handle = producer.produce([b"second"])
        # The append failed before its write was sent, and its next read of the manifest is
        # held: the producer pauses here for longer than reupload_after.
        assert store.read_held.wait(timeout=30)
        clock.pause(GRACE / 2 + 1)
        store.release_read.set()
        handle.wait(timeout=30)
        assert producer.metrics()["batches_refreshed"] == 1
    published = read_back(store)
    assert [e for p in published for e in p.entries] == [b"first", b"second"]
    location = published[1].location
    # No manifest names the batch before its object was written again after the pause.
    puts = [i for i, (kind, paths) in enumerate(store.log) if kind == "put" and location in paths]
    named = [
        i for i, (kind, paths) in enumerate(store.log) if kind == "manifest" and location in paths
    ]
    assert len(puts) == 2, store.log
    assert named, store.log
    assert named[0] > puts[1], store.log


class _LateStore(_Store):
    """The next manifest write is sent in time but lands late: while it is in flight the
    producer's clock moves past the grace period and a collector deletes every batch object no
    manifest names yet (as it may: they are unreferenced and old)."""

    def __init__(self, inner: ObjectStore, clock: _PausedClock) -> None:
        super().__init__(inner)
        self.clock = clock
        self.late_next_write = False
        self.collected: list[str] = []

    def _manifest_write(self, data: bytes) -> None:
        if self.late_next_write:
            self.late_next_write = False
            self.clock.pause(GRACE + 1)
            try:
                named = {e.location for e in decode_manifest(self.inner.get(MANIFEST).data).entries}
            except NotFoundError:
                named = set()
            orphans = [
                info.path
                for info in self.inner.list("ingest/")
                if info.path.endswith(".batch") and info.path not in named
            ]
            self.inner.delete_many(orphans)
            self.collected.extend(orphans)
        super()._manifest_write(data)

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        if path == MANIFEST:
            self._manifest_write(data)
            return self.inner.put_if_absent(path, data)
        return super().put_if_absent(path, data)


def test_an_append_that_lands_after_its_deadline_writes_back_what_a_collector_took(
    tmp_path: Path,
) -> None:
    """An append checked against its deadline and sent in time can still land late (a request
    held in the network, a process paused just after the check). If a collector took the batch
    meanwhile, the entry names nothing, and the rows are gone once the WAL lets them go. The
    producer sees that the append returned after its deadline, and writes back, under the same
    name, every object of it that is gone, before it releases the WAL."""
    clock = _PausedClock()
    store = _LateStore(fresh_memory(), clock)
    claim_queue(store, grace=GRACE, delete_window=0.2)
    with Producer(config(store, tmp_path / "wal", clock=clock)) as producer:
        producer.produce([b"first"]).wait(timeout=30)
        store.late_next_write = True
        producer.produce([b"second"]).wait(timeout=30)
    assert len(store.collected) == 1  # the second batch, taken while its append was in flight
    published = read_back(store)  # every entry's object is there
    assert [e for p in published for e in p.entries] == [b"first", b"second"]
    assert published[1].location == store.collected[0]
