"""The consumer service's written-through mark: what its sink has committed, for producers.

``millpond consume`` keeps ``{data_path_prefix}/_millpond/written.json``
(:mod:`millpond.queue.written`) up to date from a background thread: after every commit of the
sink (the service calls :meth:`WrittenPublisher.written` with the last sequence of the group
it committed), when its state changes (stopped on a batch, retrying, stopped) and, while
nothing changes, every report interval, so a waiter can tell a live consumer from a dead one.
Waiters (``WriteHandle.wait_written``, Spark's ``await_sink``) read it.

Cost: one PUT per change, coalesced — one write in flight at a time, at most one every
:data:`MIN_GAP` seconds, each carrying the latest state — and one per report interval while
idle. The service never waits for it: the thread writes while the next group is written, and a
write that fails is logged once and tried again (backing off up to the report interval).
Nothing is written before :meth:`~WrittenPublisher.start` (a start that failed its checks
leaves nothing behind), and nothing after a takeover fenced the service (the newer consumer
writes the mark from then on).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import replace
from typing import Any

from millpond.common.clock import Clock, SystemClock
from millpond.common.tasks import BackgroundTask
from millpond.errors import FencedError, MillpondError
from millpond.queue import (
    Version,
    WrittenMark,
    read_written,
    same_queue,
    written_object,
    written_path,
)
from millpond.storage.store import ObjectStore

__all__ = ["MIN_GAP", "WrittenPublisher"]

logger = logging.getLogger(__name__)

MIN_GAP = 0.2
"""Seconds between two writes of the mark at least: at most five a second under load."""
_JOIN = 10.0


class WrittenPublisher:
    """Writes a consumer service's written-through mark; thread-safe."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        data_path_prefix: str,
        queue: str,
        interval: float = 5.0,
        min_gap: float = MIN_GAP,
        clock: Clock | None = None,
    ) -> None:
        self._store = store
        self._prefix = data_path_prefix
        self._path = written_path(data_path_prefix)
        self._interval = max(0.0, interval)
        self._min_gap = min_gap
        self._clock = clock or SystemClock()
        self._cond = threading.Condition()
        self._mark = WrittenMark(
            queue=queue,
            epoch=None,
            written_through=None,
            state="running",
            updated_ms=0,
            interval=self._interval,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        self._changes = 0  # bumped by every change of the mark
        self._published = 0  # the change the last write carried
        self._put_at: float | None = None  # monotonic time of the last write
        self._failing = False
        self._started = False
        self._fenced = False  # a newer consumer's mark is there: nothing more is written
        self._object = written_object(store, data_path_prefix, None, clock=self._clock)
        self._version: Version[WrittenMark] | None = None  # as last written
        self._task = BackgroundTask("millpond-written", self._run)

    @property
    def mark(self) -> WrittenMark:
        """The mark as it stands (``updated_ms`` is set when it is written)."""
        with self._cond:
            return self._mark

    def start(self, epoch: int | None, written_through: int | None) -> None:
        """The service took over at ``epoch``, its sink holding everything through
        ``written_through``: publish that (first carrying over the set-aside batches the last
        mark listed), then every change."""
        self._change(epoch=epoch, written_through=written_through, state="running", stopped_on=None)
        self._object = written_object(self._store, self._prefix, epoch, clock=self._clock)
        self._started = True
        self._task.start()

    def written(self, sequence: int) -> None:
        """The sink committed everything through ``sequence``; a consumer that was retrying
        is running again."""
        with self._cond:
            mark = self._mark
            through = mark.written_through
            if through is not None and sequence <= through and mark.state != "retrying":
                return
            state = "running" if mark.state == "retrying" else mark.state
            self._set(replace(mark, written_through=max(sequence, through or -1), state=state))

    def set_aside(self, sequence: int, reason: str) -> None:
        """``sequence`` is quarantined: a waiter for it fails naming it."""
        with self._cond:
            self._set(self._mark.with_set_aside(sequence, reason))

    def state(self, state: str, *, error: str | None = None, **changes: Any) -> None:
        """A new state (``retrying`` with the error it retries, ``stopped_on_batch`` with
        ``stopped_on``, ``running`` again); written at once unless it is the same."""
        with self._cond:
            mark = self._mark
            if mark.state == state and mark.error == error and not changes:
                return
            self._set(replace(mark, state=str(state), error=error, **changes))

    def finish(self, state: str, error: str | None = None) -> None:
        """Stop the thread and write the last mark (a stop on a batch stays; a fenced service
        writes nothing more: the mark is the newer consumer's)."""
        self._task.stop(join=False)
        with self._cond:
            self._cond.notify_all()
        self._task.join(_JOIN)
        if not self._started or state == "fenced" or self._fenced:
            return
        with self._cond:
            if self._mark.state != "stopped_on_batch":
                self._set(replace(self._mark, state=str(state), error=error))
        self._write()

    # -- the thread -----------------------------------------------------------------------

    def _change(self, **changes: Any) -> None:
        with self._cond:
            self._set(replace(self._mark, **changes))

    def _set(self, mark: WrittenMark) -> None:
        """Under the lock: the mark changed; wake the thread."""
        self._mark = mark
        self._changes += 1
        self._cond.notify_all()

    def _run(self) -> None:
        self._carry_over()
        retry = self._min_gap
        while self._next():
            if self._write():
                retry = self._min_gap
                continue
            if self._task.wait(retry):
                return
            retry = min(retry * 2, max(self._interval, 1.0))

    def _next(self) -> bool:
        """Wait for a change (at least :data:`MIN_GAP` after the last write) or for the
        heartbeat; ``False`` once stopping."""
        clock = self._clock
        with self._cond:
            while self._changes == self._published and not self._task.stopping:
                if self._interval > 0 and self._put_at is not None:
                    due = self._put_at + self._interval - clock.monotonic()
                    if due <= 0:
                        break
                    self._cond.wait(due)
                else:
                    self._cond.wait()
        if self._put_at is not None:
            gap = self._put_at + self._min_gap - clock.monotonic()
            if gap > 0 and self._task.wait(gap):
                return False
        return not self._task.stopping and not self._fenced

    def _write(self) -> bool:
        """Write the mark as it stands; whether it landed (a failure is logged once)."""
        with self._cond:
            mark = replace(self._mark, updated_ms=self._clock.now_ms())
            change = self._changes
        self._put_at = self._clock.monotonic()
        try:
            done = self._object.update(
                lambda _current: mark, what="written-through mark", known=self._version
            )
            self._version = done.version
        except FencedError as err:
            logger.info("a newer consumer writes %s now; writing no more: %s", self._path, err)
            self._fenced = True
            return True
        except MillpondError as err:
            self._version = None
            if not self._failing:
                logger.warning("could not write the written-through mark %s: %s", self._path, err)
            self._failing = True
            return False
        if self._failing:
            logger.info("the written-through mark %s is written again", self._path)
        self._failing = False
        with self._cond:
            self._published = max(self._published, change)
        return True

    def _carry_over(self) -> None:
        """Keep the set-aside batches the last mark listed, up to this service's start."""
        try:
            last = read_written(self._store, self._prefix)
        except MillpondError as err:
            logger.warning("could not read the last written-through mark %s: %s", self._path, err)
            return
        with self._cond:
            mark = self._mark
            through = mark.written_through
            if last is None or through is None or not same_queue(last.queue, mark.queue):
                return
            for old in last.set_aside:
                if old.sequence <= through:
                    mark = mark.with_set_aside(old.sequence, old.reason)
            if mark.set_aside != self._mark.set_aside:
                self._set(mark)
