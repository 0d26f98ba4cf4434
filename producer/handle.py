"""``WriteHandle``: what ``produce()`` returns, to wait for staging and for durability."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from millpond.common.forks import OwnProcess
from millpond.errors import InvalidInputError, SinkWaitTimeoutError
from millpond.queue import DEFAULT_POLL_INTERVAL

if TYPE_CHECKING:
    from millpond.queue import SinkWatch

__all__ = ["WriteHandle"]

_PENDING, _STAGED, _DURABLE, _FAILED = 0, 1, 2, 3


class WriteHandle:
    """Tracks one ``produce()`` call through the WAL, the batch upload and the manifest.

    Two milestones: *staged* (the entries are in the local WAL, fsynced when
    ``wal_sync="always"``) and *durable* (the batch holding them is written and its location
    is in the queue manifest — the RFC's ``await_durable``). A failure reaches the caller
    through the handle: ``wait()`` raises it and ``exception()`` returns it. A third,
    ``wait_written()``, is the consumer's: the rows are in its database.

    Handles are made on the ``produce()`` hot path, so a handle holds no lock or event of its
    own: the producer's handles share one lock, and an event is created only when a thread
    actually waits for a milestone that has not been reached.
    """

    __slots__ = (
        "_error",
        "_lock",
        "_process",
        "_progress",
        "_staged_ok",
        "_waiters",
        "_watch",
        "entry_count",
        "location",
        "sequence",
    )

    def __init__(
        self,
        entry_count: int,
        lock: threading.Lock | None = None,
        process: OwnProcess | None = None,
        watch: SinkWatch | None = None,
    ) -> None:
        self.entry_count = entry_count
        """How many entries this ``produce()`` call held."""
        self.location: str | None = None
        """The batch object holding the entries, once durable."""
        self.sequence: int | None = None
        """The manifest sequence of that batch, once durable."""
        self._lock = lock or threading.Lock()
        self._process = process  # the producer's: its threads settle the handle
        self._progress = _PENDING
        self._staged_ok = False
        self._error: BaseException | None = None
        self._waiters: list[tuple[int, threading.Event]] | None = None
        self._watch = watch  # the producer's: what the consumer says it has written

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the entries are in the local WAL (fsynced under ``wal_sync="always"``).

        Args:
            timeout: seconds to wait; ``None`` waits as long as it takes.

        Raises:
            TimeoutError: not staged within ``timeout``.
            MillpondError: the entries were never staged (the producer closed or failed
                first); the exception says why. ``ClosedError`` also when called in a process
                forked from the producer's.
        """
        if not self._reach(_STAGED, timeout):
            raise TimeoutError(f"entries not staged within {timeout} s")
        if not self._staged_ok and self._error is not None:
            raise self._error

    def wait(self, timeout: float | None = None) -> None:
        """Block until the batch is written and its location is in the manifest.

        Args:
            timeout: seconds to wait; ``None`` waits as long as it takes (through a store
                outage, too: staged data is retried until it lands).

        Raises:
            TimeoutError: not durable within ``timeout``; the entries stay staged and are
                still being published.
            BackpressureError: ``drop_oldest`` dropped these entries.
            ClosedError: the producer closed first; the entries remain in its WAL and the
                next producer on that directory publishes them. Also: called in a process
                forked from the producer's, where no thread settles the handle.
            StorageError: the producer's WAL failed (a full disk, an I/O error) and the
                producer stopped. Not "lost": what the WAL holds in full stays there, and a
                producer started again on the directory publishes it (once). Entries whose
                ``wait()`` raised this may still arrive.
            MillpondError: a permanent failure (corrupt manifest, bad configuration); as
                above, what was staged stays in the WAL for the next producer.
        """
        if not self._reach(_DURABLE, timeout):
            raise TimeoutError(f"entries not durable within {timeout} s")
        if self._error is not None:
            raise self._error

    def wait_written(
        self, timeout: float | None = None, *, poll_interval: float = DEFAULT_POLL_INTERVAL
    ) -> None:
        """Block until the consumer service (``millpond consume``) has written the entries
        into its database: :meth:`wait`, then until the written-through mark it publishes
        beside the queue reaches this batch's sequence. Wait on the last handle of a run:
        the consumer writes in sequence order, so the earlier ones are written too.

        Args:
            timeout: seconds for both steps; ``None`` waits as long as it takes.
            poll_interval: the longest pause between two reads of the mark (one conditional
                GET each; threads waiting on one producer's handles share them).

        Raises:
            SinkWaitTimeoutError: not written within ``timeout`` (a ``TimeoutError``); the
                message says what the consumer is doing: none has published a mark, it is
                not running, it is stopped on sequence S (and why), or it is behind by N.
                The entries stay in the queue and are written once it gets to them.
            SinkWaitError: the consumer set the batch aside (quarantined) instead of writing
                it; the message names it and the ``millpond replay`` that writes it.
            MillpondError: as :meth:`wait`, when the entries never reached the queue.
        """
        started = time.monotonic()
        if self._watch is None:
            raise InvalidInputError("wait_written(): this handle belongs to no producer")
        if not self._reach(_DURABLE, timeout):
            raise SinkWaitTimeoutError(
                f"{self.entry_count} entries: not in the queue after {timeout:.1f} s (still "
                "being published), so not in the database either",
                reason="not_durable",
                waiting_for=None,
            )
        if self._error is not None:
            raise self._error
        assert self.sequence is not None  # durable
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
        entries = f"{self.entry_count} entr{'y' if self.entry_count == 1 else 'ies'}"
        self._watch.wait(
            (self.sequence,),
            timeout=left,
            what=f"{entries} at sequence {self.sequence}",
            poll_interval=poll_interval,
            waited_before=time.monotonic() - started,
        )

    def done(self) -> bool:
        """Whether the call is settled: durable, or failed."""
        return self._progress >= _DURABLE

    def staged(self) -> bool:
        """Whether the entries reached the WAL (or the call failed before they could)."""
        return self._progress >= _STAGED

    def exception(self) -> BaseException | None:
        """The failure, if the call failed; ``None`` while pending or once durable."""
        return self._error if self._progress == _FAILED else None

    def __repr__(self) -> str:
        if self._progress == _FAILED:
            state = f"failed: {type(self._error).__name__}"
        elif self._progress == _DURABLE:
            state = f"durable at {self.location} (sequence {self.sequence})"
        elif self._progress == _STAGED:
            state = "staged"
        else:
            state = "pending"
        return f"WriteHandle({self.entry_count} entries, {state})"

    def _reach(self, milestone: int, timeout: float | None) -> bool:
        """Wait for ``milestone``; False on timeout. In a process forked from the producer's,
        where no thread settles the handle, ``ClosedError`` instead."""
        if self._process is not None:
            self._process.check()
        if self._progress >= milestone:
            return True
        with self._lock:
            if self._progress >= milestone:
                return True
            event = threading.Event()
            if self._waiters is None:
                self._waiters = []
            self._waiters.append((milestone, event))
        return event.wait(timeout)

    # -- called by the producer -----------------------------------------------------------

    def _advance(
        self,
        progress: int,
        *,
        error: BaseException | None = None,
        location: str | None = None,
        sequence: int | None = None,
    ) -> None:
        with self._lock:
            if self._progress >= _DURABLE or progress <= self._progress:
                return  # settled once, for good: the first outcome wins
            if progress == _FAILED:
                self._error = error
            elif progress == _DURABLE:
                self.location, self.sequence = location, sequence
            if progress in (_STAGED, _DURABLE):
                self._staged_ok = True
            self._progress = progress
            waiters = self._waiters
            if waiters is not None:
                self._waiters = [(m, e) for m, e in waiters if m > progress] or None
        if waiters is not None:
            for milestone, event in waiters:
                if milestone <= progress:
                    event.set()

    def _set_staged(self) -> None:
        self._advance(_STAGED)

    def _set_durable(self, location: str, sequence: int) -> None:
        self._advance(_DURABLE, location=location, sequence=sequence)

    def _set_failed(self, error: BaseException) -> None:
        self._advance(_FAILED, error=error)
