"""One object only the holder of an epoch may change: every write the consumer's side makes to
the queue's shared objects goes through :class:`FencedObject` (the manifest's epoch bump and
dequeues, the backlog index's head, the epoch mark).

Each update is the same four steps (SlateDB's ``FenceableTransactionalObject``):

1. **refresh** — read the object (or start from the version this holder last read or wrote);
2. **epoch check** — a version read in this call is checked first: one a newer holder wrote
   raises :class:`~millpond.errors.FencedError`, and nothing is written;
3. **prepare** — the caller's pure function makes the new value from the current one
   (``None``: nothing to change);
4. **conditional update** — written only over the very version checked (``put_if_match`` on
   its ETag, ``put_if_absent`` when there was none). A lost race, an answer that may or may
   not have landed, or a failed request start over from step 1 with a fresh read.

So a write lands only on a version that carried the holder's epoch: a newer holder's takeover
changes the object (bumps the epoch in it) and every later write of the older one fails its
condition, then its check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from millpond.common.clock import Clock
from millpond.common.metrics import Counters
from millpond.common.retry import RetryPolicy
from millpond.errors import ConflictError, StorageError
from millpond.queue.cas import CasLoop
from millpond.storage.store import ObjectStore

__all__ = ["FencedObject", "Updated", "Version", "fenced_manifest", "raw_bytes"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Version(Generic[T]):
    """One state of the object: its value (``None``: there is no object) and ETag."""

    value: T | None
    etag: str | None


@dataclass(frozen=True, slots=True)
class Updated(Generic[T]):
    """What :meth:`FencedObject.update` left: the version the object holds as far as this
    holder knows, and whether this call's write landed it."""

    version: Version[T]
    wrote: bool


class FencedObject(Generic[T]):
    """Refresh, check, prepare, conditional update: one object under one holder's epoch."""

    def __init__(
        self,
        store: ObjectStore,
        path: str,
        *,
        decode: Callable[[bytes], T],
        encode: Callable[[T], bytes],
        check: Callable[[T], None],
        retry: RetryPolicy,
        clock: Clock,
        counters: Counters | None = None,
        kind: str = "object",
    ) -> None:
        """``check`` raises ``FencedError`` for a value a newer holder wrote; ``counters``, if
        given, counts ``{kind}_reads``, ``{kind}_writes``, ``cas_conflicts`` and
        ``cas_retries``."""
        self._cas = CasLoop(store, path, retry=retry, clock=clock, counters=counters, kind=kind)
        self._decode = decode
        self._encode = encode
        self._check = check

    def read(self) -> Version[T]:
        """The object as it is now, checked (steps 1 and 2).

        Raises:
            FencedError: a newer holder wrote it.
            FormatError: it is not what ``decode`` reads.
            StorageError: the store failed.
        """
        got = self._cas.read()
        if got is None:
            return Version(None, None)
        value = self._decode(got.data)
        self._check(value)
        return Version(value, got.etag)

    def update(
        self,
        prepare: Callable[[T | None], T | None],
        *,
        what: str,
        known: Version[T] | None = None,
        prove: bool = False,
        at_once: bool = False,
    ) -> Updated[T]:
        """Write ``prepare(current)`` over the current version, retried until it lands, the
        value needs no change, or the retry budget runs out.

        Args:
            prepare: the new value from the current one (``None`` when there is no object);
                ``None`` when nothing is to change. It may raise to refuse.
            what: the update, for messages (``dequeue``, ``index write``).
            known: a version this holder read or wrote and nothing newer was seen since: the
                first attempt starts from it instead of reading (its write fails if it is
                stale).
            prove: an answer of "nothing to change" must come from a version read in this
                call (the call then proves the holder still had the epoch).
            at_once: after a lost race, read again at once (bounded by time only) instead of
                backing off: a busy writer leaves the object alone only for a moment.

        Raises:
            FencedError: a newer holder wrote the object.
            FormatError: the object is not what ``decode`` reads.
            StorageError: the retry budget ran out.
            Whatever ``prepare`` raises.
        """
        cas = self._cas
        backoff = cas.retry.start(cas.clock)
        while True:
            fresh = known is None
            try:
                current = self.read() if known is None else known
            except (ConflictError, StorageError) as err:
                cas.backoff(backoff, what, err)
                continue
            known = None  # whatever becomes of this attempt, the next one reads
            new = prepare(current.value)
            if new is None:
                if fresh or not prove:
                    return Updated(current, wrote=False)
                continue  # an answer from an old version proves nothing: read
            try:
                etag = cas.write(None if current.value is None else current, self._encode(new))
            except (ConflictError, StorageError) as err:
                cas.backoff(backoff, what, err, at_once=at_once and isinstance(err, ConflictError))
                continue
            return Updated(Version(new, etag), wrote=True)


def raw_bytes(data: bytes) -> bytes:
    """``decode`` and ``encode`` of a :class:`FencedObject` kept as its bytes."""
    return data


def fenced_manifest(cas: CasLoop, check: Callable[[bytes], None]) -> FencedObject[bytes]:
    """The manifest ``cas`` writes as a :class:`FencedObject` of its bytes, with ``cas``'s
    policy and counters (``manifest_reads``, ``manifest_writes``)."""
    return FencedObject(
        cas.store,
        cas.path,
        decode=raw_bytes,
        encode=raw_bytes,
        check=check,
        retry=cas.retry,
        clock=cas.clock,
        counters=cas.counters,
        kind="manifest",
    )
