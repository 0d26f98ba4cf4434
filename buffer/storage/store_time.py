"""The object store's clock, read by writing a tiny object and looking at its last-modified time.

obstore does not hand out a response's ``Date`` header, but every store stamps a write with its
own time. :func:`probe_store_time` writes ``path`` (one small object, overwritten by every
probe) and reads the stamp back with a HEAD: 2 requests. Stores keep whole seconds (S3), so the
true store time of the write lies in ``[stamp, stamp + 1 s)``; the result carries that
uncertainty plus half the round trip.

Used where a rule compares against times the store wrote (garbage collection's last-modified
rule) and to measure the skew of a producer's clock against the store's. A caller that writes
an object anyway (the start-up check of conditional writes) reads the store's clock from that
write with :meth:`StoreTime.from_write` instead of sending a probe of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from millpond.common.clock import Clock
from millpond.errors import StorageError
from millpond.storage.store import ObjectStore

__all__ = ["StoreTime", "probe_store_time", "to_ms"]

_PROBE = b"millpond clock probe\n"
_STAMP_RESOLUTION_MS = 1000


@dataclass(frozen=True, slots=True)
class StoreTime:
    """What one probe learned."""

    stamp_ms: int
    """The last-modified time the store gave the probe object: a lower bound of its clock at
    the moment the probe returned."""
    offset_ms: float
    """Store clock minus local clock, in milliseconds (positive: the store is ahead)."""
    uncertainty_ms: float
    """How far ``offset_ms`` may be off either way."""

    @classmethod
    def from_write(cls, stamp: datetime, before_ms: float, after_ms: float) -> StoreTime:
        """What a write learned: the store stamped it ``stamp``, and it was sent at local time
        ``before_ms`` (or later) and answered by ``after_ms``.

        The true store time of the write lies in ``[stamp, stamp + 1 s)`` (stores keep whole
        seconds) and, locally, in ``[before_ms, after_ms]``: the result carries both
        uncertainties.
        """
        stamp_ms = to_ms(stamp)
        local_mid = (before_ms + after_ms) / 2
        store_mid = stamp_ms + _STAMP_RESOLUTION_MS / 2
        return cls(
            stamp_ms=stamp_ms,
            offset_ms=store_mid - local_mid,
            uncertainty_ms=(after_ms - before_ms) / 2 + _STAMP_RESOLUTION_MS / 2,
        )

    @property
    def skew_seconds(self) -> float:
        """The clock skew that is certain: ``|offset|`` less the uncertainty, at least 0."""
        return max(0.0, abs(self.offset_ms) - self.uncertainty_ms) / 1000


def to_ms(moment: datetime) -> int:
    """Milliseconds since the Unix epoch of an aware (or UTC-naive) datetime."""
    return int(moment.timestamp() * 1000)


def probe_store_time(store: ObjectStore, path: str, clock: Clock) -> StoreTime:
    """Write ``path`` and read back the time the store stamped on it.

    Raises:
        StorageError: the store failed, or it keeps no last-modified time.
    """
    before = clock.now_ms()
    store.put(path, _PROBE)
    info = store.head(path)
    after = clock.now_ms()
    if info.last_modified is None:
        raise StorageError(f"{store.url}/{path}: the store keeps no last-modified time")
    return StoreTime.from_write(info.last_modified, before, after)
