"""What a producer sends the object store before its first batch, counted on a real SeaweedFS.

Counted twice: at the adapter boundary (a store wrapper that records every call with its
path, in order) and on the wire (the latency proxy, with no delay, counts the HTTP requests
that reach the server), so a request obstore retried or sent on its own would show too.

A producer opening an existing queue sends at most 7: the store check of
:func:`~millpond.storage.checks.preflight` (one probe object: create, refused second create,
update on its ETag, refused stale update, HEAD, delete; the update's stamp gives the store's
clock) and one read of the queue's claim. Every role of a Spark job opens a producer, so
these are paid per task.
"""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from millpond import Producer, ProducerConfig
from millpond.errors import ConfigError
from millpond.localstack import S3Endpoint
from millpond.localstack.latency_proxy import LatencyProxy, start_latency_proxy
from millpond.queue.claim import QueueClaim, claim_path, internal_path
from millpond.storage import (
    DeleteFailure,
    ForwardingStore,
    GetResult,
    ObjectInfo,
    ObjectStore,
    open_store,
)
from millpond.storage.checks import PROBE_PREFIX
from tests.support import ClockOff, unique_root

MAX_STARTUP_REQUESTS = 7
"""Requests a producer may send opening an existing queue, before its first batch."""
MANIFEST = "ingest/manifest"
PREFIX = "ingest"


class RecordingStore(ForwardingStore):
    """Records every call as ``(kind, path)``, in order (thread-safe)."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self.calls: builtins.list[tuple[str, str]] = []

    def _add(self, kind: str, path: str) -> None:
        with self._lock:
            self.calls.append((kind, path))

    def snapshot(self) -> builtins.list[tuple[str, str]]:
        with self._lock:
            return builtins.list(self.calls)

    def get(self, path: str) -> GetResult:
        self._add("GET", path)
        return self.inner.get(path)

    def get_if_changed(self, path: str, etag: str | None) -> GetResult | None:
        self._add("GET if-none-match" if etag is not None else "GET", path)
        return self.inner.get_if_changed(path, etag)

    def get_tail(self, path: str, length: int, etag: str | None = None) -> GetResult | None:
        self._add("GET range", path)
        return self.inner.get_tail(path, length, etag)

    def head(self, path: str) -> ObjectInfo:
        self._add("HEAD", path)
        return self.inner.head(path)

    def put(self, path: str, data: bytes) -> str | None:
        self._add("PUT", path)
        return self.inner.put(path, data)

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        self._add("PUT if-none-match", path)
        return self.inner.put_if_absent(path, data)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        self._add("PUT if-match", path)
        return self.inner.put_if_match(path, data, etag)

    def copy(self, source: str, target: str) -> None:
        self._add("COPY", target)
        self.inner.copy(source, target)

    def list(self, prefix: str = "", *, recursive: bool = True) -> builtins.list[ObjectInfo]:
        self._add("LIST", prefix)
        return self.inner.list(prefix, recursive=recursive)

    def delete_many(self, paths: Iterable[str]) -> builtins.list[DeleteFailure]:
        paths = builtins.list(paths)
        self._add("DELETE", ",".join(paths))
        return self.inner.delete_many(paths)


@pytest.fixture
def proxy(seaweedfs_s3: S3Endpoint) -> Iterator[LatencyProxy]:
    """A proxy that only counts (no delay) in front of the session SeaweedFS."""
    with start_latency_proxy(seaweedfs_s3, delay=0.0) as running:
        yield running


def _queue(proxy: LatencyProxy, *, claimed: bool) -> tuple[ObjectStore, RecordingStore]:
    """A fresh queue root through the proxy (raw store, recording store); ``claimed`` writes
    the queue's claim first, as the queue's first role did."""
    endpoint = proxy.endpoint
    inner = open_store(endpoint.url_for(unique_root()), endpoint.store_options())
    if claimed:
        inner.put_if_absent(claim_path(PREFIX), QueueClaim(manifest_path=MANIFEST).encode())
    return inner, RecordingStore(inner)


def _wire_requests(proxy: LatencyProxy, expected: int) -> int:
    """The proxy's count, once it has seen ``expected`` requests (it counts a request when
    its head arrives, which may be a moment after the client's call returned) or 2 s passed."""
    deadline = time.monotonic() + 2.0
    while proxy.stats().requests < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return proxy.stats().requests


def _start(store: ObjectStore, wal_dir: Path, **kw: object) -> Producer:
    return Producer(ProducerConfig(store=store, wal_dir=wal_dir, **kw))  # type: ignore[arg-type]


def test_a_producer_opening_an_existing_queue_sends_at_most_6_requests(
    proxy: LatencyProxy, tmp_path: Path
) -> None:
    inner, recorder = _queue(proxy, claimed=True)
    proxy.reset_stats()
    producer = _start(recorder, tmp_path / "wal")
    try:
        startup = recorder.snapshot()
        on_wire = _wire_requests(proxy, len(startup))
        producer.produce([b"first"]).wait(30)
    finally:
        producer.close()
    listing = "\n".join(f"  {kind} {path}" for kind, path in startup)
    assert len(startup) <= MAX_STARTUP_REQUESTS, f"{len(startup)} requests:\n{listing}"
    assert on_wire <= MAX_STARTUP_REQUESTS, f"{on_wire} on the wire:\n{listing}"
    # The claim is read once, and every check's object is gone again.
    assert startup.count(("GET", claim_path(PREFIX))) == 1, listing
    assert inner.list(PROBE_PREFIX) == []
    # Nothing of the start-up is put off until later: after the constructor, only the batch
    # and the manifest until the first batch is in.
    later = recorder.snapshot()[len(startup) :]
    assert later, "the first batch was never written"
    assert all(path.endswith(".batch") or path == MANIFEST for _, path in later), later


def test_a_second_producer_in_the_process_reads_the_claim_and_the_clock_only(
    proxy: LatencyProxy, tmp_path: Path
) -> None:
    _, recorder = _queue(proxy, claimed=True)
    with _start(recorder, tmp_path / "first") as producer:
        producer.produce([b"first"]).wait(30)
    before = len(recorder.snapshot())
    with _start(recorder, tmp_path / "second"):
        startup = recorder.snapshot()[before:]
    # The store check passed once in this process; the clock is probed on an object of its own.
    clock = internal_path(PREFIX, "clock")
    assert startup == [("GET", claim_path(PREFIX)), ("PUT", clock), ("HEAD", clock)], startup


def test_the_producer_that_creates_the_queue_does_not_read_its_own_claim_back(
    proxy: LatencyProxy, tmp_path: Path
) -> None:
    inner, recorder = _queue(proxy, claimed=False)
    with _start(recorder, tmp_path / "wal"):
        startup = recorder.snapshot()
    claim = claim_path(PREFIX)
    assert [call for call in startup if call[1] == claim] == [
        ("GET", claim),
        ("PUT if-none-match", claim),
    ], startup
    assert len(startup) <= MAX_STARTUP_REQUESTS + 1, startup
    assert QueueClaim.decode(inner.get(claim).data, name=claim).manifest_path == MANIFEST


@pytest.mark.parametrize("off", [-300.0, 300.0])
def test_the_clock_read_from_the_store_check_still_refuses_a_skewed_producer(
    proxy: LatencyProxy, tmp_path: Path, off: float
) -> None:
    _, recorder = _queue(proxy, claimed=True)
    with pytest.raises(ConfigError, match="clock") as refused:
        _start(recorder, tmp_path / "wal", clock=ClockOff(off))
    assert ("behind" if off < 0 else "ahead of") in str(refused.value)
    # Measured on the check's probe object: no clock probe of its own was sent.
    clock = internal_path(PREFIX, "clock")
    assert all(path != clock for _, path in recorder.snapshot()), recorder.snapshot()
    # Within the bound it starts (the store's whole-second stamps are allowed for).
    _, fresh = _queue(proxy, claimed=True)
    with _start(fresh, tmp_path / "ok", clock=ClockOff(20.0)) as producer:
        producer.produce([b"x"]).wait(30)
