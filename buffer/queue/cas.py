"""Compare-and-swap on the queue manifest: what the RFC's queue producer and consumer share.

Every write is a compare-and-swap: the first a create-if-absent, every later one a put
conditional on the ETag that was read. A lost race re-reads and retries with capped, jittered
exponential backoff (``RetryPolicy``). Producers (:mod:`millpond.queue.append`) append a group
of entries in one CAS and carry the epoch forward unchanged; the consumer
(:mod:`millpond.queue.dequeue`) bumps the epoch in ``initialize()`` and checks it on every read
and dequeue, so an older consumer gets ``FencedError``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from millpond.common.clock import Clock, SystemClock
from millpond.common.metrics import Counters
from millpond.common.retry import Backoff, RetryPolicy
from millpond.errors import (
    ConflictError,
    StorageError,
)
from millpond.formats.manifest import (
    Manifest,
    PendingEntry,
    decode_manifest,
)
from millpond.queue.landed import Landings
from millpond.storage.store import ObjectStore, get_or_none

__all__ = ["Appender", "CasLoop", "ManifestSnapshot", "RawManifest", "Tagged", "read_manifest"]

logger = logging.getLogger(__name__)


class Appender(Protocol):
    """What appends to a queue, and says where appends in doubt landed (``landings``):
    :class:`QueueProducer`, or a coordinator client, which keeps its contract."""

    @property
    def counters(self) -> Counters: ...

    @property
    def seen_next_sequence(self) -> int: ...

    def landings(self, *, recovered: bool = False) -> Landings: ...

    def append(
        self,
        entries: Sequence[PendingEntry],
        *,
        more: Callable[[], Sequence[PendingEntry]] | None = None,
        deadline: float | None = None,
        in_doubt_from: int | None = None,
    ) -> tuple[int, ...]: ...


class Tagged(Protocol):
    """A version of an object, as far as a conditional write over it needs."""

    @property
    def etag(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class ManifestSnapshot:
    """A decoded manifest with the ETag and size it was read at."""

    manifest: Manifest
    etag: str | None
    size: int


@dataclass(slots=True)
class RawManifest:
    """The manifest's bytes as read or written, with the ETag they were read or written at."""

    data: bytes
    etag: str | None


def read_manifest(store: ObjectStore, path: str) -> ManifestSnapshot:
    """Read and decode the manifest without any epoch check (for GC, status, inspect).

    Raises:
        NotFoundError: no manifest yet.
        FormatError: the manifest is corrupt.
        StorageError: the store failed.
    """
    got = store.get(path)
    return ManifestSnapshot(decode_manifest(got.data, name=path), got.etag, len(got.data))


class CasLoop:
    """Shared machinery: read, conditional write, back off on a lost race — of the manifest,
    or of any one object (``kind`` names its counters: ``{kind}_reads``, ``{kind}_writes``)."""

    def __init__(
        self,
        store: ObjectStore,
        manifest_path: str,
        *,
        retry: RetryPolicy | None,
        clock: Clock | None,
        counters: Counters | None,
        kind: str = "manifest",
    ) -> None:
        self.store = store
        self.path = manifest_path
        self.retry = retry or RetryPolicy()
        self.clock = clock or SystemClock()
        self.counters = counters or Counters(
            f"{kind}_reads", f"{kind}_writes", "cas_conflicts", "cas_retries", "fence_checks"
        )
        self._kind = kind

    def read(self) -> RawManifest | None:
        self.counters.add(f"{self._kind}_reads")
        got = get_or_none(self.store, self.path)
        return None if got is None else RawManifest(got.data, got.etag)

    def write(self, current: Tagged | None, data: bytes) -> str | None:
        """One CAS attempt over ``current`` (``None``: there is no object). Raises
        ConflictError, CommitStateUnknownError, StorageError."""
        self.counters.add(f"{self._kind}_writes")
        if current is None:
            return self.store.put_if_absent(self.path, data)
        if current.etag is None:
            raise StorageError(f"{self.path}: the store returned no ETag; cannot compare-and-swap")
        return self.store.put_if_match(self.path, data, current.etag)

    def backoff(
        self, backoff: Backoff, what: str, err: Exception, *, at_once: bool = False
    ) -> None:
        """Count the failed attempt and wait before the next, or raise when the budget is spent.

        ``at_once``: a lost race retried without waiting (:meth:`Backoff.again`, bounded by
        time only), for a loop that must be reading when a busy writer pauses for a moment.
        """
        conflict = isinstance(err, ConflictError)
        if conflict:
            self.counters.add("cas_conflicts")
        self.counters.add("cas_retries")
        if not (backoff.again() if at_once else backoff.sleep(conflict=conflict)):
            raise StorageError(
                f"{self.path}: {what} gave up after {backoff.attempt} attempts: {err}"
            ) from err
        logger.debug("%s on %s: attempt %s after %s", what, self.path, backoff.attempt, err)
