"""Shared helpers for the core tests: a fake clock, a fault-injecting store, entry factories."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from millpond.common.retry import RetryPolicy
from millpond.common.ulids import UlidMinter, batch_location
from millpond.errors import CommitStateUnknownError, ConflictError
from millpond.formats.manifest import Metadata, PendingEntry
from millpond.storage import ForwardingStore, GetResult, ObjectStore, open_store
from tests.support import StoreTarget

MANIFEST = "ingest/manifest"

# Retries in tests back off on a fake clock: no test waits for real time to pass.
FAST_RETRY = RetryPolicy(max_attempts=1000, max_elapsed=3600.0, base_delay=0.001, max_delay=0.01)

_minter = UlidMinter()


def open_target(target: StoreTarget) -> ObjectStore:
    """The store a ``StoreTarget`` names."""
    return open_store(target.url, target.options)


def pending(
    n: int, *, tag: str = "p", now_ms: int = 1_700_000_000_000, minter: UlidMinter | None = None
) -> list[PendingEntry]:
    """``n`` entries at fresh ULID batch locations (minted by ``minter``, default on the real
    clock), each with one metadata item naming it."""
    out = []
    for i in range(n):
        location = batch_location("ingest", (minter or _minter).mint())
        out.append(PendingEntry(location, (Metadata(0, now_ms + i, f"{tag}-{i}".encode()),)))
    return out


class FakeClock:
    """Monotonic time that only moves when someone sleeps; sleeping returns at once."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._lock = threading.Lock()
        self._now = 0.0
        self._start_ms = start_ms
        self.slept: list[float] = []
        self.on_sleep: Callable[[float], object] | None = None
        """Run after each sleep, with its seconds (another actor's move while this one waits)."""

    def now_ms(self) -> int:
        with self._lock:
            return self._start_ms + int(self._now * 1000)

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.slept.append(seconds)
            self._now += max(0.0, seconds)
        if self.on_sleep is not None:
            self.on_sleep(seconds)


Fault = Callable[[], object] | None


class FaultyStore(ForwardingStore):
    """Delegates to a real store; conditional writes can be made to land and then fail.

    ``faults`` is a queue of plans consumed one per conditional write (``put_if_absent`` or
    ``put_if_match``). Each plan is ``(land, error, before, hook)``: whether the write is sent
    to the real store, the exception raised afterwards (``None`` for success), and optional
    hooks run just before sending and after it (to interleave another actor's writes). A
    write that is sent can still lose its real compare-and-swap; that ``ConflictError`` then
    propagates as it would from the real store.
    """

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.faults: list[tuple[bool, type[Exception] | None, Fault, Fault]] = []
        self.conditional_writes = 0
        self.landed_writes = 0

    def fail_next(
        self,
        *,
        land: bool,
        error: type[Exception] | None,
        hook: Fault = None,
        before: Fault = None,
        times: int = 1,
    ) -> None:
        self.faults.extend([(land, error, before, hook)] * times)

    def _conditional(self, write: Callable[[], str | None], path: str) -> str | None:
        self.conditional_writes += 1
        land, error, before, hook = self.faults.pop(0) if self.faults else (True, None, None, None)
        if before is not None:
            before()
        etag = write() if land else None
        if land:
            self.landed_writes += 1
        if hook is not None:
            hook()
        if error is ConflictError:
            raise ConflictError(f"{path}: injected precondition failure")
        if error is CommitStateUnknownError:
            raise CommitStateUnknownError(f"{path}: injected timeout")
        if error is not None:
            raise error(f"{path}: injected")
        return etag

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        return self._conditional(lambda: self.inner.put_if_absent(path, data), path)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        return self._conditional(lambda: self.inner.put_if_match(path, data, etag), path)


class SlowStore(ForwardingStore):
    """Every read and every conditional write takes ``delay`` seconds of real time, as each
    request does at a real store."""

    def __init__(self, inner: ObjectStore, delay: float) -> None:
        super().__init__(inner)
        self.delay = delay

    def get(self, path: str) -> GetResult:
        time.sleep(self.delay)
        return self.inner.get(path)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        time.sleep(self.delay)
        return self.inner.put_if_match(path, data, etag)
