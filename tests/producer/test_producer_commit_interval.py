"""Group commit: batches uploaded close together share one manifest append; ``commit_interval``
spaces appends further apart, trading latency for fewer manifest writes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import millpond.wal
from millpond.producer import Producer
from millpond.storage.store import ForwardingStore, ObjectStore
from tests.producer.producer_support import MANIFEST, config, fresh_memory, read_back


def _publish(tmp_path: Path, commit_interval: float) -> tuple[int, int, list[bytes]]:
    """Produce 60 calls that seal ~60 small batches; returns (batches, appends, entries)."""
    store = fresh_memory()
    cfg = config(
        store,
        tmp_path / f"wal-{commit_interval}",
        flush_size_bytes=64,
        commit_interval=commit_interval,
    )
    with Producer(cfg) as producer:
        handles = [producer.produce([f"{i:04d}".encode() * 20]) for i in range(60)]
        for handle in handles:
            handle.wait(timeout=30)
        appends = producer.counters.get("manifest_appends")
    published = read_back(store)
    return len(published), appends, [e for p in published for e in p.entries]


def test_commit_interval_groups_batches_into_fewer_appends(tmp_path: Path) -> None:
    expected = [f"{i:04d}".encode() * 20 for i in range(60)]
    batches, appends, entries = _publish(tmp_path, commit_interval=0.2)
    assert entries == expected  # nothing lost, nothing doubled, order kept
    assert batches >= 30  # each call over flush_size_bytes: about a batch per call
    assert appends <= batches / 3, f"{appends} appends for {batches} batches"


def test_flush_does_not_wait_for_the_commit_interval(tmp_path: Path) -> None:
    store = fresh_memory()
    cfg = config(store, tmp_path / "wal", commit_interval=30.0)
    with Producer(cfg) as producer:
        producer.produce([b"first"]).wait(timeout=30)  # the first append starts the interval
        handle = producer.produce([b"second"])
        started = time.monotonic()
        producer.flush(timeout=10)
        assert handle.done()
        assert time.monotonic() - started < 10
    assert [e for p in read_back(store) for e in p.entries] == [b"first", b"second"]


class _GatedUploads(ForwardingStore):
    """Holds every batch PUT until the test releases its path; counts manifest writes."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.cond = threading.Condition()
        self.waiting: list[str] = []
        self.released: set[str] = set()
        self.all_released = False
        self.landed: set[str] = set()
        self.manifest_written = threading.Event()

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        if path == MANIFEST:
            self.manifest_written.set()
        if not path.endswith(".batch"):
            return self.inner.put_if_absent(path, data)
        with self.cond:
            self.waiting.append(path)
            self.cond.notify_all()
            if not self.cond.wait_for(
                lambda: self.all_released or path in self.released, timeout=60
            ):
                raise AssertionError(f"{path} was never released")
        etag = self.inner.put_if_absent(path, data)
        with self.cond:
            self.landed.add(path)
            self.cond.notify_all()
        return etag

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        self.manifest_written.set()
        return self.inner.put_if_match(path, data, etag)

    def release(self, paths: list[str]) -> None:
        with self.cond:
            self.released.update(paths)
            self.cond.notify_all()

    def release_all(self) -> None:
        with self.cond:
            self.all_released = True
            self.cond.notify_all()

    def wait_for(self, what: str, predicate: Callable[[], bool]) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, timeout=30), f"timed out waiting for {what}"


def test_uploads_in_flight_share_the_head_batchs_append(tmp_path: Path) -> None:
    """The head batch's upload lands while three more are still uploading: it waits for them
    (flush_interval is long here) and the four go into the manifest in one CAS, in order."""
    inner = fresh_memory()
    store = _GatedUploads(inner)
    cfg = config(store, tmp_path / "wal", flush_size_bytes=64, flush_interval=30.0)
    payloads = [f"{i:04d}".encode() * 20 for i in range(4)]  # each over flush_size: a batch
    with Producer(cfg) as producer:
        handles = [producer.produce([payload]) for payload in payloads]
        store.wait_for("four uploads in flight", lambda: len(store.waiting) == 4)
        head, *rest = sorted(store.waiting)  # ULIDs sort in publish order
        try:
            store.release([head])
            store.wait_for("the head batch's upload", lambda: head in store.landed)
            # Without group commit the committer appends the head at once, alone.
            assert not store.manifest_written.wait(0.5), "the head was appended alone"
        finally:
            store.release(rest)
        for handle in handles:
            handle.wait(timeout=30)
        appends = producer.counters.get("manifest_appends")
    published = read_back(inner)
    assert [p.location for p in published] == [head, *rest]
    assert [e for p in published for e in p.entries] == payloads
    assert appends == 1, f"{appends} appends for 4 batches"


def test_no_batch_is_sealed_by_age_while_every_uploader_is_busy(tmp_path: Path) -> None:
    """With its only uploader busy, calls past flush_interval keep filling one batch instead
    of each becoming a small object queued behind the upload."""
    inner = fresh_memory()
    store = _GatedUploads(inner)
    cfg = config(store, tmp_path / "wal", upload_concurrency=1)  # flush_interval 0.02 s
    with Producer(cfg) as producer:
        first = producer.produce([b"first"])
        store.wait_for("the first upload", lambda: len(store.waiting) == 1)
        try:
            later = [producer.produce([f"later-{i}".encode()]) for i in range(3)]
            for handle in later:
                handle.wait_staged(timeout=30)
            # Without the rule each call is sealed alone once it is 0.02 s old.
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                assert producer.counters.get("batches_sealed") == 1, "sealed behind a busy upload"
                time.sleep(0.01)
        finally:
            store.release_all()
        for handle in [first, *later]:
            handle.wait(timeout=30)
    published = read_back(inner)
    assert [p.entries for p in published] == [[b"first"], [b"later-0", b"later-1", b"later-2"]]


def test_flush_of_more_than_the_wal_holds_appends_as_it_goes(tmp_path: Path) -> None:
    """flush() groups its batches into few appends, but not by waiting for calls that only an
    append can make room for in a full WAL (that would hold them half of
    reupload_after)."""
    store = fresh_memory()
    cfg = config(store, tmp_path / "wal", wal_max_bytes=64 << 10, flush_size_bytes=4096)
    payloads = [b"%06d" % i + b"." * 1018 for i in range(400)]  # 400 KiB through a 64 KiB WAL
    with Producer(cfg) as producer:
        handles = [producer.produce([payload]) for payload in payloads]
        producer.flush(timeout=20)
        assert all(handle.done() for handle in handles)
        assert producer.metrics()["backpressure_waits"] > 0  # the WAL did fill up
    assert [e for p in read_back(store) for e in p.entries] == payloads


def test_an_age_seal_waits_for_accepted_calls_that_fill_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch due by age keeps filling while calls already accepted, held up on their way into
    the WAL (a slow fdatasync here), would fill it: one full batch, not a small one first."""
    armed, entered, gate = threading.Event(), threading.Event(), threading.Event()
    real = millpond.wal._fdatasync

    def stalled(fd: int) -> None:
        if armed.is_set():
            entered.set()
            gate.wait()
        real(fd)

    monkeypatch.setattr(millpond.wal, "_fdatasync", stalled)
    store = fresh_memory()
    cfg = config(store, tmp_path / "wal", flush_size_bytes=4096, flush_interval=0.3)
    with Producer(cfg) as producer:
        first = producer.produce([b"first"])
        first.wait_staged(timeout=30)
        armed.set()
        try:
            rest = [producer.produce([b"%04d" % i + b"." * 1020]) for i in range(8)]
            assert entered.wait(10)
            # Without the rule "first" is sealed alone once it is 0.3 s old.
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                assert producer.counters.get("batches_sealed") == 0, "sealed a small batch"
                time.sleep(0.01)
        finally:
            armed.clear()
            gate.set()
        for handle in [first, *rest]:
            handle.wait(timeout=30)
    published = read_back(store)
    assert published[0].entries[0] == b"first"
    assert len(published[0].entries) > 1  # "first" went out with the calls behind it
    assert [e for p in published for e in p.entries] == [b"first"] + [
        b"%04d" % i + b"." * 1020 for i in range(8)
    ]
