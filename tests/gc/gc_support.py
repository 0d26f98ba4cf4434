"""Helpers for the GC tests: batch objects at chosen ULID times, a hand-moved clock."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from ulid import ULID

from millpond.common.retry import RetryPolicy
from millpond.formats.batch import encode_batch
from millpond.formats.manifest import Metadata, PendingEntry
from millpond.queue import QueueConsumer, QueueProducer
from millpond.storage import DeleteFailure, ForwardingStore, ObjectStore, open_store

MANIFEST = "ingest/manifest"
PREFIX = "ingest"
T0 = 1_700_000_000_000
FAST_RETRY = RetryPolicy(max_attempts=1000, max_elapsed=120.0, base_delay=0.001, max_delay=0.05)


def open_target(target: Any) -> ObjectStore:
    return open_store(target.url, dict(target.options or {}))


def ulid_at(ms: int) -> str:
    """A fresh ULID whose time is ``ms``."""
    return str(ULID.from_int((ms << 80) | int.from_bytes(os.urandom(10), "big")))


def put_batch(store: ObjectStore, ms: int, prefix: str = PREFIX) -> str:
    """A batch object named with a ULID of time ``ms``; returns its path."""
    location = f"{prefix}/{ulid_at(ms)}.batch"
    store.put(location, encode_batch([b"x"]))
    return location


def enqueue(store: ObjectStore, *locations: str) -> tuple[int, ...]:
    return QueueProducer(store, MANIFEST, retry=FAST_RETRY).append(
        [PendingEntry(loc, (Metadata(0, T0, b""),)) for loc in locations]
    )


def dequeue(store: ObjectStore, through: int) -> None:
    consumer = QueueConsumer(store, MANIFEST, retry=FAST_RETRY)
    consumer.initialize()
    consumer.dequeue(through)


def paths(store: ObjectStore) -> set[str]:
    """Every object, but millpond's own bookkeeping (``_millpond/``: claim, clock probe)."""
    return {info.path for info in store.list("", recursive=True) if "_millpond/" not in info.path}


class FailingDeletes(ForwardingStore):
    """Delegates to a real store; deletes of paths in ``failing`` fail."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.failing: set[str] = set()
        self.deleted: list[str] = []

    def delete_many(self, paths: Iterable[str]) -> list[DeleteFailure]:
        wanted = list(paths)
        ok = [p for p in wanted if p not in self.failing]
        failures = self.inner.delete_many(ok)
        self.deleted.extend(p for p in ok if p not in {f.path for f in failures})
        return failures + [
            DeleteFailure(p, "injected failure") for p in wanted if p in self.failing
        ]


class OffsetClock:
    """Real wall-clock time plus an offset the test can move forward."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offset_ms = 0

    def now_ms(self) -> int:
        with self._lock:
            return time.time_ns() // 1_000_000 + self._offset_ms

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._offset_ms += round(seconds * 1000)

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)
