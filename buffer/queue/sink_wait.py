"""Waiting until a queue's consumer service has written given sequences into its database.

:class:`SinkWatch` reads the consumer's written-through mark (:mod:`~millpond.queue.written`)
with a conditional GET (a 304 while it is unchanged), polling from 50 ms and backing off to a
poll interval, until the mark reaches the highest sequence waited for. Threads waiting on one
watch share its reads: a thread that wakes after another one's read takes that read instead of
sending its own. It keeps the highest ``written_through`` it has read (a late write of an older
consumer cannot take it back) and, for its words about the consumer, the newest mark (highest
epoch, then latest).

When the mark reaches the sequences, the wait returns, unless the consumer set one of them
aside (quarantined: its rows are not in the table): then :class:`SinkWaitError` names it.
When the time runs out, :class:`SinkWaitTimeoutError` says what the consumer is doing: none
ever published a mark, it is not running (stopped, or silent past its promise), it is stopped
on a batch (which, and why), or it is running and behind by N entries.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass, field

from millpond.common.clock import Clock, SystemClock
from millpond.errors import (
    FormatError,
    InvalidInputError,
    MillpondError,
    NotFoundError,
    SinkWaitError,
    SinkWaitTimeoutError,
)
from millpond.queue.claim import same_queue
from millpond.queue.written import WrittenMark, written_path
from millpond.storage.store import ObjectStore

__all__ = ["DEFAULT_POLL_INTERVAL", "SinkLook", "SinkWatch", "describe_consumer"]

DEFAULT_POLL_INTERVAL = 0.25
"""Longest pause between two reads of the mark while waiting (seconds)."""
_FIRST_POLL = 0.05
_ENDED = {
    "stopped": "stopped",
    "fenced": "was fenced by a newer consumer, which has published nothing since,",
}


@dataclass(frozen=True, slots=True)
class SinkLook:
    """What a watch knows after its latest read."""

    reads: int
    """Reads made so far (a waiter that has seen this many needs a newer one)."""
    written_through: int | None
    """The highest ``written_through`` read."""
    mark: WrittenMark | None
    """The newest mark read (highest epoch, then latest)."""
    set_aside: dict[int, str] = field(default_factory=dict)
    """Every set-aside sequence any mark read listed, with its reason."""
    trouble: str | None = None
    """Why the latest read failed, if it did."""


class SinkWatch:
    """Watches one queue's written-through mark; thread-safe, shared by many waiters."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        data_path_prefix: str,
        queue: str,
        clock: Clock | None = None,
    ) -> None:
        self._store = store
        self._path = written_path(data_path_prefix)
        self._queue = queue
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()  # one read at a time
        self._etag: str | None = None
        self._look = SinkLook(0, None, None)

    @property
    def path(self) -> str:
        return self._path

    def look(self, after: int = 0) -> SinkLook:
        """A read newer than the ``after``-th: another thread's when it made one meanwhile,
        else one conditional GET. Never raises: a failed read is ``trouble``."""
        with self._lock:
            if self._look.reads > after:
                return self._look
            look = self._look
            mark, trouble = None, None
            try:
                got = self._store.get_if_changed(self._path, self._etag)
                if got is not None:
                    found = WrittenMark.from_json(got.data, name=self._path)
                    if not same_queue(found.queue, self._queue):
                        raise FormatError(f"{self._path}: a mark of queue {found.queue}")
                    mark, self._etag = found, got.etag
            except NotFoundError:
                self._etag = None
            except MillpondError as err:
                trouble = str(err)
            self._look = _merged(look, mark, trouble)
            return self._look

    def wait(
        self,
        sequences: Collection[int],
        *,
        timeout: float | None,
        what: str | None = None,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        waited_before: float = 0.0,
    ) -> WrittenMark | None:
        """Wait until the consumer has written ``sequences`` (all of them: through the
        highest) into its database.

        Args:
            sequences: manifest sequences of the batches waited for.
            timeout: seconds; ``None`` waits as long as it takes.
            what: how messages name what was waited for (default: the sequences).
            poll_interval: the longest pause between two reads.
            waited_before: seconds the caller waited already (for the message).

        Returns:
            The mark that showed them written (``None`` when ``sequences`` is empty).

        Raises:
            SinkWaitError: the consumer set one of them aside instead of writing it.
            SinkWaitTimeoutError: not written within ``timeout``; names the consumer's state.
            InvalidInputError: a negative timeout or poll interval.
        """
        if (timeout is not None and timeout < 0) or not poll_interval > 0:
            raise InvalidInputError(
                f"timeout, poll_interval: expected >= 0 and > 0, found {timeout}, {poll_interval}"
            )
        if not sequences:
            return None
        wanted = set(sequences)
        through = max(wanted)
        named = what or _sequences_text(wanted)
        clock = self._clock
        started = clock.monotonic() - waited_before
        deadline = None if timeout is None else clock.monotonic() + timeout
        delay, seen = _FIRST_POLL, 0
        while True:
            look = self.look(seen)
            seen = look.reads
            if look.written_through is not None and look.written_through >= through:
                _refuse_set_aside(look, wanted, through, named)
                return look.mark
            remaining = None if deadline is None else deadline - clock.monotonic()
            if remaining is not None and remaining <= 0:
                waited = clock.monotonic() - started
                raise _timed_out(look, through, named, waited, clock.now_ms(), self._path)
            clock.sleep(delay if remaining is None else min(delay, remaining))
            delay = min(delay * 2, poll_interval)


def _merged(look: SinkLook, mark: WrittenMark | None, trouble: str | None) -> SinkLook:
    """``look`` after a read that found ``mark`` (``None``: unchanged or none) or failed."""
    best, newest, set_aside = look.written_through, look.mark, dict(look.set_aside)
    if mark is not None:
        if mark.written_through is not None and (best is None or mark.written_through > best):
            best = mark.written_through
        if newest is None or _newer(mark, newest):
            newest = mark
        set_aside.update((m.sequence, m.reason) for m in mark.set_aside)
    return SinkLook(look.reads + 1, best, newest, set_aside, trouble)


def _newer(mark: WrittenMark, than: WrittenMark) -> bool:
    epoch = -1 if mark.epoch is None else mark.epoch
    other = -1 if than.epoch is None else than.epoch
    return (epoch, mark.updated_ms) >= (other, than.updated_ms)


def _refuse_set_aside(look: SinkLook, wanted: set[int], through: int, named: str) -> None:
    """Raises:
    SinkWaitError: the consumer set aside some of ``wanted``.
    """
    hit = sorted(wanted & look.set_aside.keys())
    if not hit:
        return
    first = hit[0]
    raise SinkWaitError(
        f"{named}: the consumer moved past {_sequences_text(set(hit))} without writing the "
        f"rows: set aside (quarantined; sequence {first}: {look.set_aside[first]}). The other "
        "rows are in the database; these stay in the dead-letter prefix until `millpond replay "
        f"... --sequence {first}` writes them (this wait does not see a replay)",
        reason="set_aside",
        waiting_for=through,
        written_through=look.written_through,
        set_aside=tuple(hit),
    )


def _timed_out(
    look: SinkLook, through: int, named: str, waited: float, now_ms: int, path: str
) -> SinkWaitTimeoutError:
    reason, state = describe_consumer(look, through, now_ms, path=path)
    trouble = f"; the last read of {path} failed: {look.trouble}" if look.trouble else ""
    mark = look.mark
    return SinkWaitTimeoutError(
        f"{named}: not in the database after {waited:.1f} s: {state}{trouble}. The entries are "
        "in the queue and are written once the consumer gets to them (enqueuing them again "
        "would double them)",
        reason=reason,
        waiting_for=through,
        written_through=look.written_through,
        stopped_on=mark.stopped_on if mark is not None else None,
    )


def describe_consumer(look: SinkLook, through: int, now_ms: int, *, path: str) -> tuple[str, str]:
    """Why the consumer has not written ``through`` yet, as a reason (``no_consumer``,
    ``not_running``, ``stopped_on_batch``, ``behind``) and a sentence."""
    mark = look.mark
    if mark is None:
        return "no_consumer", (
            f"no consumer has said what it wrote on this queue: no {path} (is `millpond "
            "consume` running?)"
        )
    written = look.written_through
    behind = through - (-1 if written is None else written)
    progress = f"written through {_or_none(written)}, behind by {behind}"
    age = max(0.0, (now_ms - mark.updated_ms) / 1000)
    who = f"epoch {mark.epoch}, {mark.host} pid {mark.pid}"
    why = f": {mark.error}" if mark.error else ""
    if mark.state == "stopped_on_batch":
        return "stopped_on_batch", (
            f"the consumer is stopped on sequence {mark.stopped_on}{why} ({who}, {age:.0f} s "
            f"ago); {progress}. Fix the cause and restart it, or set the batch aside "
            "(`millpond status` names the command)"
        )
    if mark.state not in ("running", "retrying"):
        ended = _ENDED.get(mark.state, f"stopped ({mark.state})")
        return "not_running", (
            f"the consumer is not running: it {ended} {age:.0f} s ago{why} ({who}); {progress}"
        )
    if mark.stale(now_ms):
        return "not_running", (
            f"the consumer is not running: no word from it for {age:.0f} s (it promised one "
            f"every {mark.interval:g} s; {who}); {progress}"
        )
    retrying = f", retrying{why}" if mark.state == "retrying" else ""
    return "behind", (
        f"the consumer is behind by {behind} entries: written through {_or_none(written)}, "
        f"waiting for {through} ({who}{retrying}; last word {age:.1f} s ago)"
    )


def _or_none(sequence: int | None) -> str:
    return "nothing yet" if sequence is None else str(sequence)


def _sequences_text(sequences: set[int]) -> str:
    ordered = sorted(sequences)
    if len(ordered) == 1:
        return f"sequence {ordered[0]}"
    if ordered[-1] - ordered[0] + 1 == len(ordered):
        return f"sequences {ordered[0]}..{ordered[-1]}"
    shown = ", ".join(str(s) for s in ordered[:5])
    return f"sequences {shown}{', ...' if len(ordered) > 5 else ''} ({len(ordered)})"
