"""The producer's shared state: what each ``produce()`` call is doing, under one lock.

A call moves through: the *inbox* (accepted, waiting for the WAL writer; bounded by
``max_buffered_inputs``) → *written* (in the WAL, waiting for its fdatasync) → *pending*
(staged, not yet in a batch) → a *batch* (bound to a location in the WAL, uploaded, appended
to the manifest) → settled (durable or failed). Batches are published strictly in the order
they were sealed, so the manifest holds one producer's entries in ``produce()`` order.

Every field here is guarded by ``State.lock`` (``with state.cond:``); each thread waits on its
own condition of that lock. IO is never done while holding it.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import UTC, datetime

from millpond.common.clock import Clock, SystemClock
from millpond.common.metrics import Counters, LatencySummary
from millpond.errors import BackpressureError
from millpond.formats.manifest import Metadata, PendingEntry
from millpond.producer.handle import WriteHandle
from millpond.wal import WalRef

__all__ = [
    "COUNTER_NAMES",
    "Batch",
    "BatchState",
    "CloseReport",
    "Input",
    "Staged",
    "State",
    "Written",
]

COUNTER_NAMES = (
    "produce_calls",
    "entries_produced",
    "bytes_produced",
    "records_staged",
    "bytes_staged",
    "wal_syncs",
    "batches_sealed",
    "uploads",
    "bytes_uploaded",
    "put_retries",
    "manifest_appends",
    "manifest_reads",
    "manifest_writes",
    "cas_retries",
    "cas_conflicts",
    "batches_committed",
    "entries_committed",
    "batches_refreshed",
    "batches_dropped",
    "entries_dropped",
    "records_dropped",
    "records_recovered",
    "entries_recovered",
    "backpressure_waits",
    "coordinator_appends",
    "coordinator_refused",
    "coordinator_unknown",
    "coordinator_lost",
    "coordinator_chained",
    "direct_appends",
)

_INJECTED_CLOCK_TICK = 0.01
"""Real seconds a timed wait lasts at most under an injected clock, which may run ahead."""


class Interrupted(Exception):
    """Raised inside a retry sleep once the producer is shutting down."""


class StopAwareClock:
    """The configured clock, with a ``sleep`` that ends early and raises on shutdown.

    The queue's CAS loop sleeps through this clock, so ``close()`` never waits out a backoff.
    """

    def __init__(self, clock: Clock, stop: threading.Event) -> None:
        self._clock = clock
        self._stop = stop
        self._real = isinstance(clock, SystemClock)

    def now_ms(self) -> int:
        return int(self._clock.now_ms())

    def monotonic(self) -> float:
        return float(self._clock.monotonic())

    def sleep(self, seconds: float) -> None:
        if self._real:
            if self._stop.wait(max(seconds, 0.0)):
                raise Interrupted
            return
        if self._stop.is_set():
            raise Interrupted
        self._clock.sleep(seconds)


@dataclass(slots=True, eq=False)
class Input:
    """A ``produce()`` call accepted but not yet in the WAL."""

    ordinal: int
    entries: list[bytes]
    metadata: bytes
    ingestion_time_ms: int
    nbytes: int
    record_size: int
    handle: WriteHandle


Written = tuple[list[Input], list[tuple[int, WalRef]], int]
"""A group in the WAL awaiting its sync: the calls, their (seq, ref), and the group's floor."""


@dataclass(slots=True, eq=False)
class Staged:
    """A ``produce()`` call (or a replayed one) staged in the WAL."""

    ordinal: int
    seq: int
    ref: WalRef
    ingestion_time_ms: int
    metadata: bytes
    entry_count: int
    nbytes: int
    entries: list[bytes] | None
    """Kept in memory within the budget; ``None`` means read it back from the WAL."""
    handle: WriteHandle | None
    staged_at: float = 0.0


class BatchState(enum.Enum):
    BINDING = "binding"
    """Records chosen; the BIND record is being written."""
    SEALED = "sealed"
    """Bound in the WAL, waiting for an upload slot."""
    UPLOADING = "uploading"
    UPLOADED = "uploaded"
    """The object is written; waiting to be appended to the manifest."""
    APPENDING = "appending"
    """Inside a manifest append."""
    UNCERTAIN = "uncertain"
    """An append failed ambiguously (or the batch was replayed): look in the manifest first."""


@dataclass(slots=True, eq=False)
class Batch:
    """A group of staged records published as one object and one manifest entry.

    A batch keeps its location for good once it is bound: the sink recognises a batch it has
    already written by its location, so a recovery path that gave the same records a new one
    could write them twice. An object that may be old enough for GC is written again under
    the same name instead (``overwrite``).
    """

    records: list[Staged]
    location: str = ""
    minted_ms: int = 0
    """Wall-clock milliseconds in the location's ULID: when the batch was named."""
    state: BatchState = BatchState.BINDING
    prior_locations: list[str] = field(default_factory=list)
    """Locations of earlier bindings of the same records (WALs of older versions re-minted)."""
    uploaded_at: float | None = None
    """Monotonic seconds; no later than the object's last write landed (its last-modified
    time). ``None`` until this process has written it (or found it written)."""
    ready_at: float | None = None
    """Monotonic seconds when its last upload landed: how long it has waited for an append."""
    overwrite: bool = False
    """The next upload writes the object again, unconditionally, to refresh its last-modified
    time (same name, same records)."""
    settle_until: float | None = None
    """After an overwrite: not appended before this monotonic time (the collectors' delete
    window), and only once a HEAD has found the object."""
    complete: bool = True
    """Whether every record its BIND counted survived (a replayed batch may have lost some to
    WAL corruption: then an existing object, which holds them all, is kept as it is)."""
    dropped: bool = False
    payload: bytes | None = None
    """The encoded batch, from sealing until it is uploaded."""
    recovered: bool = False
    """Replayed from the WAL on start."""
    append_group: list[Batch] | None = None
    """The batches of the last (ambiguous) manifest append this batch was part of, in order:
    resolved together (:mod:`millpond.queue.landed`)."""
    append_from: int = 0
    """The lowest sequence that ambiguous append could have landed at (0: unknown)."""

    @property
    def first_seq(self) -> int:
        return self.records[0].seq

    @property
    def last_seq(self) -> int:
        return self.records[-1].seq

    @property
    def entry_count(self) -> int:
        return sum(r.entry_count for r in self.records)

    @property
    def locations(self) -> list[str]:
        return [*self.prior_locations, self.location]

    def pending_entry(self) -> PendingEntry:
        """The manifest entry: one metadata item per ``produce()`` call."""
        items = []
        start = 0
        for record in self.records:
            items.append(Metadata(start, record.ingestion_time_ms, record.metadata))
            start += record.entry_count
        return PendingEntry(self.location, tuple(items))


@dataclass(frozen=True, slots=True)
class CloseReport:
    """What ``Producer.close()`` left behind; ``complete`` when everything is published."""

    wal_dir: str
    staged_records: int = 0
    """``produce()`` calls (replayed ones included) still only in the WAL; the next producer
    on ``wal_dir`` publishes them."""
    staged_entries: int = 0
    staged_bytes: int = 0
    unstaged_records: int = 0
    """Calls that never reached the WAL (close timed out while it was full); their handles
    failed with ``ClosedError``."""
    unstaged_entries: int = 0
    waiting_for: str = ""
    """What ``close()`` was still waiting for when its timeout ran out (``""``: nothing)."""

    @property
    def complete(self) -> bool:
        return self.staged_records == 0 and self.unstaged_records == 0


class State:
    """Everything the producer's threads share, guarded by ``cond``."""

    def __init__(self, *, clock: Clock, mem_budget: int) -> None:
        # One lock, several conditions: each thread waits on its own, and a change wakes only
        # the threads it concerns (a notify_all to every thread per produce() call costs more
        # than the call itself).
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        """Held to read or change anything here; waited on by flush() and close()."""
        self.room = threading.Condition(self.lock)
        """produce() waits here for inbox room."""
        self.writer_wake = threading.Condition(self.lock)
        self.syncer_wake = threading.Condition(self.lock)
        self.sealer_wake = threading.Condition(self.lock)
        self.upload_wake = threading.Condition(self.lock)
        self.committer_wake = threading.Condition(self.lock)
        self.space = threading.Condition(self.lock)
        """The WAL writer waits here for released WAL space."""
        self.release_wake = threading.Condition(self.lock)
        self.release_owed = False
        """An append settled batches since the WAL releaser last ran."""
        self.stop = threading.Event()
        self.clock = clock
        self._real_clock = isinstance(clock, SystemClock)
        self.counters = Counters(*COUNTER_NAMES)
        self.fsync_latency = LatencySummary()
        self.append_latency = LatencySummary()
        """Seconds per successful manifest append (a group of batches), retries included."""
        self.inbox: deque[Input] = deque()
        self.pending: deque[Staged] = deque()
        self.pending_bytes = 0
        self.batches: deque[Batch] = deque()
        """Sealed batches not yet settled, in seal (= publish) order."""
        self.upload_queue: deque[Batch] = deque()
        self.unsettled: list[Batch] = []
        """Dropped while their manifest append was ambiguous: settled by a later look."""
        self.written: deque[Written] = deque()
        """Groups in the WAL but not yet synced and staged (the syncer takes them)."""
        self.writer_done = False
        self.writer_waiting_for_space = False
        """The WAL writer waits for a release (``wal_max_bytes``): the sealer must not wait for
        more staged data to fill a batch."""
        self.staging_bytes = 0
        """Bytes of the calls the WAL writer took from the inbox and has not staged yet."""
        self.unstaged_floors: list[int] = []
        """For each group taken from the inbox and not yet staged, the lowest sequence its
        records can have: a release must not pass them before they are in ``pending``."""
        self.next_ordinal = 0
        self.resolved_through = -1
        self._resolved_ahead: set[int] = set()
        self.flush_target = -1
        self.closing = False
        self.fatal: BaseException | None = None
        self.mem_budget = mem_budget
        self.mem_bytes = 0

    def wait(self, condition: threading.Condition, seconds: float | None = None) -> None:
        """Wait on ``condition`` (the lock held) until notified, or until ``seconds`` have
        passed on the producer's clock (``None``: until notified).

        Threads wait in real time. An injected clock (a test's, the whole-system checker's)
        may run ahead of it, so under one a timed wait ends at least every 10 ms and the
        caller reads the clock again.
        """
        if seconds is not None and not self._real_clock:
            seconds = min(seconds, _INJECTED_CLOCK_TICK)
        condition.wait(seconds)

    def wake_all(self) -> None:
        """Wake every waiting thread (closing, stopping, failing)."""
        for condition in (
            self.cond,
            self.room,
            self.writer_wake,
            self.syncer_wake,
            self.sealer_wake,
            self.upload_wake,
            self.committer_wake,
            self.space,
            self.release_wake,
        ):
            condition.notify_all()

    # -- settling -------------------------------------------------------------------------

    def resolve(self, ordinal: int) -> None:
        """Mark one call settled; ``resolved_through`` advances over a contiguous run."""
        if ordinal == self.resolved_through + 1:
            self.resolved_through = ordinal
            while self.resolved_through + 1 in self._resolved_ahead:
                self._resolved_ahead.remove(self.resolved_through + 1)
                self.resolved_through += 1
        elif ordinal > self.resolved_through:
            self._resolved_ahead.add(ordinal)
        self.cond.notify_all()

    def settle_durable(self, batch: Batch, sequence: int) -> None:
        for record in batch.records:
            if record.handle is not None:
                record.handle._set_durable(batch.location, sequence)
            self.release_memory(record)
            self.resolve(record.ordinal)

    def settle_failed(self, records: list[Staged], error: BaseException) -> None:
        for record in records:
            if record.handle is not None:
                record.handle._set_failed(error)
            self.release_memory(record)
            self.resolve(record.ordinal)

    def fail_dropped(self, records: list[Staged], *, batches: int) -> None:
        """Count calls ``drop_oldest`` dropped (in ``batches`` batches) and fail them."""
        self.counters.add("batches_dropped", batches)
        self.counters.add("records_dropped", len(records))
        self.counters.add("entries_dropped", sum(r.entry_count for r in records))
        self.settle_failed(
            records,
            BackpressureError(
                "dropped by size_cap_policy='drop_oldest': the WAL reached wal_max_bytes "
                "before these entries were published"
            ),
        )

    def release_memory(self, record: Staged) -> None:
        if record.entries is not None:
            record.entries = None
            self.mem_bytes -= record.nbytes

    def unstaged_through(self, ordinal: int) -> bool:
        """Whether some call at or before ``ordinal`` is not yet staged (inbox or WAL write)."""
        return bool(
            self.written
            or self.unstaged_floors
            or (self.inbox and self.inbox[0].ordinal <= ordinal)
        )

    def watermark(self, wal_next_seq: int) -> int:
        """The lowest sequence still needed: everything below it can be released."""
        candidates = [wal_next_seq]
        if self.batches:
            candidates.append(self.batches[0].first_seq)
        if self.pending:
            candidates.append(self.pending[0].seq)
        if self.unstaged_floors:
            candidates.append(min(self.unstaged_floors))
        return min(candidates)

    def set_fatal(self, error: BaseException) -> None:
        """Stop on a permanent failure: every unsettled call fails with ``error``.

        Staged data stays in the WAL (nothing is released), so a producer started again on
        the same directory after the cause is fixed publishes it.
        """
        if self.fatal is not None:
            return
        self.fatal = error
        self.fail_unsettled(error)

    def fail_unsettled(self, error: BaseException) -> None:
        """Fail the handles of every call not yet settled (the data stays where it is)."""
        for item in [*self.inbox, *(i for group, _, _ in self.written for i in group)]:
            item.handle._set_failed(error)
            self.resolve(item.ordinal)
        self.inbox.clear()
        self.settle_failed(self.staged_only(), error)
        for batch in self.unsettled:
            self.settle_failed(batch.records, error)
        self.wake_all()

    # -- views ----------------------------------------------------------------------------

    def staged_only(self) -> list[Staged]:
        records = [r for b in self.batches for r in b.records]
        records.extend(self.pending)
        return records

    def awaiting_refresh(self) -> int:
        """Batches being written again under their names, or waiting out the delete window
        after it before a HEAD confirms them (they waited longer than ``reupload_after``)."""
        return sum(1 for b in self.batches if b.overwrite or b.settle_until is not None)

    def waiting_for(self) -> str:
        """What publishing everything still waits for, in words (``""``: nothing)."""
        counts = Counter(_waiting_on(batch) for batch in self.batches)
        parts = [f"{_count(n, 'batch', 'es')} {self._spell(what)}" for what, n in counts.items()]
        if self.pending:
            calls = _count(len(self.pending), "produce() call", "s")
            parts.append(f"{calls} staged but not yet in a batch")
        unstaged = len(self.inbox) + sum(len(group) for group, _, _ in self.written)
        if unstaged:
            parts.append(f"{_count(unstaged, 'produce() call', 's')} not yet in the WAL")
        return "; ".join(parts)

    def _spell(self, what: str) -> str:
        if what != _WINDOW:
            return what
        last = max(b.settle_until for b in self.batches if b.settle_until is not None)
        ms = self.clock.now_ms() + (last - self.clock.monotonic()) * 1000
        until = datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%H:%M:%S UTC")
        return f"{_WINDOW} until {until} (refresh of stale batches)"


_WINDOW = "waiting for the delete window"


def _waiting_on(batch: Batch) -> str:
    """What one batch of the line waits for, in words."""
    if batch.settle_until is not None:
        return _WINDOW
    if batch.overwrite and batch.state in (BatchState.SEALED, BatchState.UPLOADING):
        return "being written again under their names (they waited longer than reupload_after)"
    if batch.state is BatchState.UNCERTAIN:
        return "being looked for in the manifest (replayed, or an append in doubt)"
    if batch.state in (BatchState.UPLOADED, BatchState.APPENDING):
        return "waiting for their manifest append"
    return "being uploaded"


def _count(n: int, noun: str, plural: str) -> str:
    return f"{n} {noun}{plural if n != 1 else ''}"
