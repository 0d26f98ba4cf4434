"""Helpers for the producer tests: a store with switchable faults, and reading the queue back."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from millpond.common.retry import RetryPolicy
from millpond.errors import CommitStateUnknownError, NotFoundError, StorageError
from millpond.formats.batch import decode_batch
from millpond.formats.manifest import Metadata
from millpond.producer import Producer, ProducerConfig
from millpond.queue import queue_view, read_indexed, read_manifest
from millpond.storage import ForwardingStore, GetResult, ObjectStore, open_store

MANIFEST = "ingest/manifest"
PREFIX = "ingest"
# Short rounds so fault tests exercise the producer's own re-check and re-try loop quickly.
FAST_RETRY = RetryPolicy(max_attempts=5, max_elapsed=1.0, base_delay=0.001, max_delay=0.02)


def fresh_memory() -> ObjectStore:
    """An in-memory store no other test shares (``memory://`` names one store per process)."""
    return open_store(f"memory://producer-{uuid.uuid4().hex}")


def claim_queue(store: ObjectStore, *, grace: float = 60.0, delete_window: float = 0.2) -> Any:
    """Create the queue's claim with a short GC delete window, so a batch written again under
    its name is appended after ``delete_window`` seconds instead of the default 30."""
    from millpond.queue.claim import QueueClaim, open_claim

    claim = QueueClaim(
        manifest_path=MANIFEST, gc_grace_period=grace, gc_delete_window=delete_window
    )
    created = open_claim(store, data_path_prefix=PREFIX, manifest_path=MANIFEST, create=claim)
    assert created == claim, f"the queue was already claimed: {created}"
    return claim


def config(store: Any, wal_dir: Path, **kw: Any) -> ProducerConfig:
    """A config for tests: fast retries, short flush interval."""
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("flush_interval", 0.02)
    return ProducerConfig(store=store, wal_dir=wal_dir, **kw)


class ControlledStore(ForwardingStore):
    """Delegates to a real store; a test switches failures on and off.

    * ``fail_puts``: batch PUTs fail before writing (``StorageError``);
    * ``fail_manifest``: manifest writes fail before writing (``CommitStateUnknownError``);
    * ``land_then_fail``: that many manifest writes land, then report failure (the ambiguous
      case a timeout produces);
    * ``fail_reads``: manifest reads fail;
    * ``manifest_gate``: manifest writes wait until it is set.
    """

    def __init__(self, inner: ObjectStore, manifest_path: str = MANIFEST) -> None:
        super().__init__(inner)
        self.manifest_path = manifest_path
        self.fail_puts = False
        self.fail_manifest = False
        self.fail_reads = False
        self.land_then_fail = 0
        self.manifest_gate: threading.Event | None = None
        self.manifest_write_started = threading.Event()
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def get(self, path: str) -> GetResult:
        self.calls["get"] += 1
        if self.fail_reads and path == self.manifest_path:
            raise StorageError(f"{path}: injected read failure")
        return self.inner.get(path)

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        if path == self.manifest_path:
            return self._manifest_write(lambda: self.inner.put_if_absent(path, data))
        if not path.endswith(".batch"):  # millpond's own objects (the queue's claim)
            return self.inner.put_if_absent(path, data)
        self.calls["batch_put"] += 1
        if self.fail_puts:
            raise StorageError(f"{path}: injected PUT failure")
        return self.inner.put_if_absent(path, data)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        return self._manifest_write(lambda: self.inner.put_if_match(path, data, etag))

    def _manifest_write(self, write: Any) -> str | None:
        self.calls["manifest_write"] += 1
        self.manifest_write_started.set()
        if self.manifest_gate is not None:
            self.manifest_gate.wait()
        if self.fail_manifest:
            raise CommitStateUnknownError("manifest: injected failure before writing")
        result: str | None = write()
        with self._lock:
            ambiguous = self.land_then_fail > 0
            self.land_then_fail -= ambiguous
        if ambiguous:
            raise CommitStateUnknownError("manifest: injected failure after the write landed")
        return result


@dataclass(frozen=True, slots=True)
class Published:
    """One manifest entry with its batch read back."""

    sequence: int
    location: str
    metadata: tuple[Metadata, ...]
    entries: list[bytes]


def read_back(store: ObjectStore, manifest_path: str = MANIFEST) -> list[Published]:
    """Every entry in the queue, with its batch object decoded: the backlog index's segments,
    then the manifest past them (a consumer moves a backlog of 1,000 entries or more into the
    index by default; CI once lost the race below that and saw the moved entries as lost)."""
    head, indexed = read_indexed(store, PREFIX)  # before the manifest, as a consumer reads
    try:
        manifest = read_manifest(store, manifest_path).manifest
    except NotFoundError:
        return []
    return [
        Published(
            entry.sequence,
            entry.location,
            entry.metadata,
            decode_batch(store.get(entry.location).data, name=entry.location),
        )
        for entry in queue_view(manifest, head, indexed).entries
    ]


def all_entries(store: ObjectStore, manifest_path: str = MANIFEST) -> list[bytes]:
    return [entry for published in read_back(store, manifest_path) for entry in published.entries]


def wait_for(condition: Any, what: str, timeout: float = 120.0) -> None:
    """Poll ``condition`` until true; ``AssertionError`` naming ``what`` after ``timeout``."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def produce_until(producer: Producer, name: str, stop: threading.Event, out: list[bytes]) -> None:
    """Produce ``{name}-{n}`` records until ``stop``, recording each once it is staged."""
    n = 0
    while not stop.is_set():
        record = f"{name}-{n}".encode()
        producer.produce([record]).wait_staged(120.0)
        out.append(record)
        n += 1
        time.sleep(0.02)  # pacing the stream, not waiting for a condition


def drain(store: ObjectStore, manifest_path: str = MANIFEST) -> Counter[bytes]:
    """Every record a consumer reads from the queue, counted; asserts no location is in the
    manifest twice."""
    from millpond.consumer import Consumer, ConsumerConfig

    locations = [e.location for e in read_manifest(store, manifest_path).manifest.entries]
    assert len(locations) == len(set(locations)), "a location appended twice"
    consumer = Consumer(ConsumerConfig(store=store, manifest_path=manifest_path, gc_enabled=False))
    consumer.initialize()
    read: list[bytes] = []
    while (batch := consumer.next_batch()) is not None:
        read.extend(batch.entries)
        consumer.ack(batch.sequence)
    consumer.close()
    return Counter(read)
