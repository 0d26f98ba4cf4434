"""A read sent alongside a contended write, so that a lost race costs one round trip, not two.

A writer that lost its compare-and-swap must read the manifest before it can write again: a
write, a read, a write — at 50 ms a request, two round trips per lost race, which caps a
contended manifest at about ten appends a second (issue 11). A writer that lost a race lately
(:meth:`~millpond.common.retry.Pacer.peek_lag`) therefore sends a read of the manifest a moment
after each write, on its own thread. When the write loses, the read, processed just after it by
the store, usually holds the state that beat it already, and the next write goes out at once.
When the write wins, the read is dropped: one request more per contended attempt, none at all
without contention. A read sent too soon is served before the store has applied the write
that beat ours and shows nothing new (SeaweedFS: one in five at 0.03 request times, 1-2 % at
0.1, the default); one sent later makes every hand-over wait longer. A store that applies
writes slowly may be given a second read a moment behind the first
(:meth:`~millpond.common.retry.Pacer.peek_again_lag`): whichever shows a new state tells.

Why such a read is as good as one sent after the write's answer (and only then used): a write
conditional on ETag ``E`` can land only while the manifest is at ``E``, and the manifest never
returns to a state it left (``next_sequence`` only grows; an ETag names one content). A read
showing a state other than ``E`` was therefore served after the manifest left ``E``: either
our write is what moved it, and the read shows our entries (or, later, their dequeue — the
landed-check's business), or the write can no longer land at all. A read that still shows
``E`` was served before anything happened and tells nothing; it is dropped and the loop reads
again. This relies only on the store's read-after-write consistency, as every read does.

The same argument means the write's own answer need not be waited for once the read shows a
state that is neither ``E`` nor the write's own bytes: the write can no longer land, so it has
lost (:meth:`Peek.outrun`). Some stores answer a losing conditional write slowly — SeaweedFS
held 1.5% of the contended writes of eight writers about 1 s (a few 2 s) before its
``412``, a second added to the append of whichever writer sent it — and a writer that knows
it lost goes on at once; the answer, when it comes, is dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from millpond.errors import ConflictError, StorageError
from millpond.queue.cas import Tagged

__all__ = ["Peek"]

logger = logging.getLogger(__name__)


_T = TypeVar("_T", bound=Tagged)
_R = TypeVar("_R")

_MIN_WAIT = 0.05  # seconds
_WAIT_SLOTS = 0.6  # how long a read due now is waited for, past its lag
_RECHECK_SLOTS = 2.0  # outrun's re-reads while a write's answer is late


class Peek(Generic[_T]):
    """One read of the manifest, sent ``lag`` seconds from now on a thread of its own (and a
    second ``again`` seconds from now, when given).

    ``slot`` is the seconds one store request takes, as measured (0 when not known): it
    bounds how long the read is waited for, and how often a late write is looked after.
    """

    def __init__(
        self,
        read: Callable[[], _T | None],
        lag: float,
        *,
        slot: float = 0.0,
        again: float | None = None,
    ) -> None:
        self._read = read
        lags = (lag,) if again is None else (lag, max(lag, again))
        self._wait = max(_MIN_WAIT, lags[-1] + _WAIT_SLOTS * slot)
        self._recheck = max(_MIN_WAIT, _RECHECK_SLOTS * slot)
        self._pending = len(lags)  # reads not back yet
        self._changed = threading.Condition()  # notified when a read or a raced write ends
        self._results: list[_T] = []  # in the order the reads came back
        for each in lags:
            threading.Thread(
                target=self._run, args=(each,), name="millpond-manifest-peek", daemon=True
            ).start()

    def _run(self, lag: float) -> None:
        result: _T | None = None
        try:
            # The lag is real time, not the queue's clock: it only orders two requests on the
            # wire (the write first), so the store serves the read after the write.
            time.sleep(lag)
            result = self._read()
        except StorageError as err:
            logger.debug("manifest read alongside a write failed: %s", err)
        except BaseException as err:
            # Nothing waits on this thread but ``moved_from``, which then reads again on the
            # writer's own thread, where whatever this was is raised to someone who can act.
            logger.debug("manifest read alongside a write ended: %r", err)
        finally:
            with self._changed:
                if result is not None:
                    self._results.append(result)
                self._pending -= 1
                self._changed.notify_all()

    def _told(self, etag: str) -> bool:
        """Whether the reads have said what they can: one found another state, or all are
        back. Called holding ``_changed``."""
        return self._pending == 0 or self._moved(etag) is not None

    def moved_from(self, etag: str) -> _T | None:
        """The state read, if it is not the one at ``etag``; else ``None`` (read again), as
        when the read failed or is not back soon."""
        # It left just after the write and takes as long, so it is due about now; a slow
        # answer is not waited for long, since reading again costs no more than that.
        with self._changed:
            self._changed.wait_for(lambda: self._told(etag), self._wait)
            return self._moved(etag)

    def outrun(self, write: Callable[[], _R], etag: str, landed: Callable[[_T], bool]) -> _R:
        """``write()``, conditional on ``etag``, run on a thread of its own: its answer, or
        ``ConflictError`` as soon as this read shows a state other than ``etag`` of which
        ``landed`` says it is not the write's own (module docstring). The write's answer is
        then dropped when it comes: it can only be a failure.

        Raises:
            ConflictError: the write lost, as answered or as the read showed.
            Whatever ``write`` raises.
        """
        answer: list[tuple[bool, object]] = []

        def run() -> None:
            try:
                answer.append((True, write()))
            except BaseException as err:  # handed to the caller, who may be gone
                answer.append((False, err))
            finally:
                with self._changed:
                    self._changed.notify_all()

        threading.Thread(target=run, name="millpond-manifest-write", daemon=True).start()
        with self._changed:
            self._changed.wait_for(lambda: bool(answer) or self._told(etag))
            state = self._moved(etag)
        # A read that found nothing new may have been served while the store held the write
        # back (behind another writer's): while the answer is late, look again now and then.
        while not answer:
            if state is not None:
                if not landed(state):
                    raise ConflictError(
                        "a read sent behind the write found the manifest at another state: "
                        "the write can no longer land"
                    )
                break  # the write landed: its answer is on its way
            with self._changed:
                if self._changed.wait_for(lambda: bool(answer), self._recheck):
                    break
            state = self._reread(etag)
        with self._changed:
            self._changed.wait_for(lambda: bool(answer))
        ok, value = answer[0]
        if not ok:
            assert isinstance(value, BaseException)
            raise value
        return value  # type: ignore[return-value]

    def _reread(self, etag: str) -> _T | None:
        try:
            result = self._read()
        except StorageError as err:
            logger.debug("manifest read behind a late write failed: %s", err)
            return None
        with self._changed:
            if result is not None:
                self._results.append(result)
            return self._moved(etag)

    def _moved(self, etag: str) -> _T | None:
        """The last state read that is not the one at ``etag``, if any."""
        for result in reversed(self._results):
            if result.etag is not None and result.etag != etag:
                return result
        return None
