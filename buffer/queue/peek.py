"""A read sent alongside a contended write, so that a lost race costs one round trip, not two.

A writer that lost its compare-and-swap must read the manifest before it can write again: a
write, a read, a write — at 50 ms a request, two round trips per lost race, which caps a
contended manifest at about ten appends a second (issue 11). A writer that lost a race lately
(:meth:`~millpond.common.retry.Pacer.peek_lag`) therefore sends a read of the manifest a moment
after each write, on its own thread. When the write loses, the read, processed just after it by
the store, usually holds the state that beat it already, and the next write goes out at once.
When the write wins, the read is dropped: one request more per contended attempt, none at all
without contention.

Why such a read is as good as one sent after the write's answer (and only then used): a write
conditional on ETag ``E`` can land only while the manifest is at ``E``, and the manifest never
returns to a state it left (``next_sequence`` only grows; an ETag names one content). A read
showing a state other than ``E`` was therefore served after the manifest left ``E``: either
our write is what moved it, and the read shows our entries (or, later, their dequeue — the
landed-check's business), or the write can no longer land at all. A read that still shows
``E`` was served before anything happened and tells nothing; it is dropped and the loop reads
again. This relies only on the store's read-after-write consistency, as every read does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from millpond.errors import StorageError

__all__ = ["Peek"]

logger = logging.getLogger(__name__)


class _Tagged(Protocol):
    @property
    def etag(self) -> str | None: ...


_T = TypeVar("_T", bound=_Tagged)

_MIN_WAIT = 0.05  # seconds
_WAIT_LAGS = 20  # lags (two slots at the aging pacer's lag of 0.1 slot)


class Peek(Generic[_T]):
    """One read of the manifest, sent ``lag`` seconds from now on a thread of its own."""

    def __init__(self, read: Callable[[], _T | None], lag: float) -> None:
        self._read = read
        self._lag = lag
        self._done = threading.Event()
        self._result: _T | None = None
        threading.Thread(target=self._run, name="millpond-manifest-peek", daemon=True).start()

    def _run(self) -> None:
        try:
            # The lag is real time, not the queue's clock: it only orders two requests on the
            # wire (the write first), so the store serves the read after the write.
            time.sleep(self._lag)
            self._result = self._read()
        except StorageError as err:
            logger.debug("manifest read alongside a write failed: %s", err)
        except BaseException as err:
            # Nothing waits on this thread but ``moved_from``, which then reads again on the
            # writer's own thread, where whatever this was is raised to someone who can act.
            logger.debug("manifest read alongside a write ended: %r", err)
        finally:
            self._done.set()

    def moved_from(self, etag: str) -> _T | None:
        """The state read, if it is not the one at ``etag``; else ``None`` (read again), as
        when the read failed or is not back soon."""
        # It left just after the write and takes as long, so it is due about now; a slow
        # answer is not waited for long, since reading again costs no more than that.
        if not self._done.wait(max(_MIN_WAIT, _WAIT_LAGS * self._lag)):
            return None
        result = self._result
        if result is None or result.etag is None or result.etag == etag:
            return None
        return result
