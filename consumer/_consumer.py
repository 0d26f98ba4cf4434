"""The consumer (RFC, "Consumer"): reads the queue in order, reads ahead, acks in order.

Positions. ``_next`` is the next sequence ``next_batch()`` delivers; ``_acked`` the last
acknowledged sequence; ``_dequeued`` the last sequence removed from the manifest. They only
grow, and ``_dequeued <= _acked < _next``. Entries are dequeued on ``flush()``/``close()`` and
once the acked ones number ``ack_batch_size`` and ``dequeue_fraction`` of the entries still
queued behind them, or have waited ``dequeue_max_delay``; never before their ack: the manifest
keeps every batch that is not yet safely in the database, which is also what keeps GC away
from it. Each dequeue rewrites what is left of the manifest, so dequeuing in proportion to the
backlog keeps draining N entries at O(N) bytes written (a fixed step would be O(N^2)).

Reading. The manifest is read once at ``initialize()`` and again only when every entry known
has been delivered, with a conditional GET (an unchanged manifest costs a 304). The entries
are read a few at a time, in order (:class:`~millpond.queue.QueueCursor`): from the backlog
index one segment at a time, then from the manifest's bytes, each decoded when it is next,
so a day-long backlog costs what its next few entries cost. Batch objects are fetched and
decoded on a thread pool, starting in ``initialize()``, while batches are handed out strictly
in sequence order; how many are fetched ahead grows with the store's latency, within a memory
budget (:mod:`millpond.consumer._read_ahead`).

Fencing. Every ``next_batch()``/``next_batches()`` and every ``ack()``/``ack_through()``
checks, inside the call and before it delivers or records anything, that the manifest still
carries this consumer's epoch: a conditional GET of its 22-byte footer (a 304 when nothing
changed), or the conditional read of the whole manifest when the call reads it anyway. Once a
newer consumer's ``initialize()`` has returned, this one delivers and acks nothing more: its
next call raises ``FencedError``. A check made by an earlier call never stands in for one: a
newer ``initialize()`` may have returned since. A caller that takes several fetched batches at
once pays one check for them; ``next_batches(limit, ack_through=n)`` acks and delivers under
one check (the consumer service's loop: ack the group it wrote, take the next). The check of a
call runs while the batch objects it delivers are still being fetched.

Bad entries. An entry whose location is not ``{data_path_prefix}/{ULID}.batch``, whose object
is missing, or whose bytes are corrupt raises an error naming the sequence and location. The
consumer does not skip it and does not retry by itself: the next ``next_batch()`` call tries the
same entry again.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import NoReturn, Self, TypeVar

from millpond.common.clock import Clock, SystemClock
from millpond.common.forks import OwnProcess
from millpond.common.metrics import Counters, LatencySummary
from millpond.common.tasks import BackgroundTask
from millpond.consumer._background_gc import BackgroundCollector
from millpond.consumer._batch import ConsumedBatch
from millpond.consumer._config import ConsumerConfig
from millpond.consumer._index_mover import IndexMover
from millpond.consumer._read_ahead import ReadAhead
from millpond.coordinator.client import CoordinatedDequeue
from millpond.coordinator.wire import token_from_env
from millpond.errors import (
    ClosedError,
    FencedError,
    InvalidInputError,
    MillpondError,
    StorageError,
)
from millpond.formats.manifest import ManifestEntry
from millpond.queue import BacklogIndex, Queue, Takeover, batch_time_ms
from millpond.storage import ObjectStore
from millpond.storage.checks import preflight

__all__ = ["Backlog", "Consumer"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_COUNTERS = (
    "batches",
    "entries",
    "bytes",
    "acks",
    "dequeues",
    "manifest_refreshes",
    "index_moves",
    "coordinator_dequeues",
    "coordinator_dequeue_fallbacks",
)
"""What a consumer counts (``Consumer.counters``; manifest reads, writes and conflicts too)."""


@dataclass(frozen=True, slots=True)
class Backlog:
    """What the consumer knows is waiting, as of its last manifest read."""

    entries: int
    """Entries read from the manifest but not yet delivered."""
    oldest_ingestion_ms: int | None
    """Earliest ingestion time among the metadata of the next undelivered entry."""


class Consumer:
    """Reads batches from the queue in sequence order under epoch fencing.

    Thread-safe; every public method takes one lock. Use as a context manager, or call
    :meth:`close`, which dequeues what was acked. In a process forked from the one that
    opened it, every method raises ``ClosedError`` at once (its threads did not survive the
    fork).
    """

    def __init__(self, config: ConsumerConfig) -> None:
        """Open the store; nothing is read or written until :meth:`initialize`.

        Raises:
            ConfigError: the store URL or options are invalid.
        """
        self._config = config
        self._clock: Clock = config.clock or SystemClock()
        self._opened = Queue.open(config)
        self._store: ObjectStore = self._opened.store
        self.counters = Counters(*_COUNTERS)
        self.fetch_latency = LatencySummary()
        """Seconds to read and decode one batch object."""
        # Kept across initialize() calls, which start a new collector each.
        self.gc_counters = Counters("gc_passes", "gc_deleted", "gc_failed_deletes", "gc_errors")
        self.gc_latency = LatencySummary()
        # Manifest reads, writes and conflicts count with the consumer's own.
        self._queue = self._opened.reader(
            retry=config.retry, clock=self._clock, counters=self.counters
        )
        self._coordinator = (
            CoordinatedDequeue(
                config.coordinator, self.queue, self.counters, self._clock, token=token_from_env()
            )
            if config.coordinator is not None
            else None
        )
        self._lock = threading.RLock()
        self._process = OwnProcess(
            f"consumer of {self.queue}",
            "Open a Consumer in this process after the fork (its initialize() fences the parent's)",
        )
        self._gc: BackgroundCollector | None = None
        # The queue from the next entry on, read a little at a time and fetched ahead.
        self._ahead = ReadAhead(
            self._store,
            config,
            queue=self.queue,
            counters=self.counters,
            fetch_latency=self.fetch_latency,
        )
        self._next = 0
        self._acked = -1
        self._dequeued = -1
        # Delivered and not acknowledged yet: (sequence, when its oldest record was produced).
        # The caller holds these batches; their times tell the lag without any IO.
        self._delivered: deque[tuple[int, int | None]] = deque()
        # Monotonic time of the first ack not yet dequeued (None when none is waiting).
        self._ack_waiting_since: float | None = None
        self._initialized = False
        self._closed = False
        self._fenced: FencedError | None = None
        self._index: BacklogIndex | None = None
        self._mover = IndexMover(
            self._queue, config, self.counters, guard=self._guard, dequeued=self._dequeued_through
        )
        self._mover.moved = self._ahead.cursor.index_changed
        self._mover_task: BackgroundTask | None = None

    # -- properties ------------------------------------------------------------------------

    @property
    def store(self) -> ObjectStore:
        """The object store the consumer reads."""
        return self._store

    @property
    def config(self) -> ConsumerConfig:
        return self._config

    @property
    def queue(self) -> str:
        """This queue's identity (store URL and manifest path): what sinks key progress by."""
        return self._opened.identity

    @property
    def epoch(self) -> int | None:
        """The epoch this consumer holds, or ``None`` before :meth:`initialize`."""
        return self._queue.epoch

    @property
    def acked_sequence(self) -> int | None:
        """The last acknowledged sequence, or ``None`` when nothing was ever acked."""
        return self._acked if self._acked >= 0 else None

    @property
    def fenced(self) -> bool:
        """Whether this consumer has seen another take over."""
        return self._fenced is not None

    @property
    def collector(self) -> BackgroundCollector | None:
        """The in-process garbage collector, when enabled and started."""
        return self._gc

    # -- RFC API -----------------------------------------------------------------------------

    def initialize(self, last_acked_sequence: int | None = None) -> None:
        """Bump the manifest epoch (fencing any older consumer) and position the reader.

        The steps and their order: :mod:`millpond.queue.takeover`. Nothing is written, and
        no other consumer is fenced, when the queue refuses this one. A consumer that lost the
        queue to a newer one raises ``FencedError`` and never takes it back.

        Args:
            last_acked_sequence: ``None`` starts at the earliest entry in the queue; a
                sequence resumes right after it (what a sink stored with its last batch).
                Entries up to it still in the manifest are dequeued at once.

        Raises:
            ConfigError: the queue's claim refuses this consumer (another manifest on the
                data prefix, a longer grace period), naming the setting.
            ProgressBehindError: ``last_acked_sequence`` is below the queue's first entry
                minus one, read again (an older consumer may have written meanwhile).
            InvalidInputError: ``last_acked_sequence`` is negative or not below the
                manifest's ``next_sequence``; or the manifest was replaced.
            FencedError: another consumer initialized meanwhile, or took over from this one.
            FormatError, StorageError, StoreAccessError, ClosedError: a corrupt manifest;
                the store failing past the retry budget, or refusing for good; closed.
        """
        _check_resume_point(last_acked_sequence)
        with self._locked():
            self._check_open()
            if self._fenced is not None:
                # A consumer that lost the queue never takes it back (it would fence the one
                # that took over); a new Consumer may.
                self._raise_fenced()
            preflight(self._store, write=True)  # fail fast on what no retry fixes
            self._reset()
            if self._coordinator is not None:
                # Its rounds would keep the epoch bump out: the read and the bump on what it
                # read both go in the pause asked for here.
                self._coordinator.make_way()
            self._start_after(self._guard(lambda: self._take_over(last_acked_sequence)))

    def _take_over(self, last_acked: int | None) -> Takeover:
        config = self._config
        return self._opened.take_over(
            self._queue,
            last_acked=last_acked,
            gc_grace_period=config.gc_grace_period if config.gc_enabled else None,
            retry=config.retry,
            clock=self._clock,
        )

    def _start_after(self, taken: Takeover) -> None:
        """Position the reader after a takeover, finish what an earlier consumer left half
        done, and start the threads: read-ahead, collector, backlog mover."""
        self._index = taken.index
        self._acked = taken.acked
        self._dequeued = taken.first - 1
        self._next = taken.acked + 1
        cursor = self._ahead.cursor
        cursor.reset(taken.acked)
        cursor.index_changed(taken.index.head)
        cursor.manifest_read(taken.manifest)
        self._ahead.start()
        self._initialized = True
        if taken.unfinished_move:
            # A move that stopped before its manifest write: finish it.
            self._guard(lambda: self._queue.dequeue(taken.index.end))
        if self._acked > self._dequeued:
            self._dequeue()
        self._maybe_move()
        config = self._config
        if config.gc_enabled:
            self._gc = BackgroundCollector(
                self._store,
                manifest_path=config.manifest_path,
                data_path_prefix=config.data_path_prefix.strip("/"),
                interval=config.gc_interval,
                grace_period=config.gc_grace_period,
                clock=self._clock,
                epoch=taken.epoch,
                counters=self.gc_counters,
                latency=self.gc_latency,
            ).start()
        if config.backlog_index:
            self._start_mover()
        # Fetching is not delivering: the first objects are on their way before the first
        # next_batches() call, which checks the epoch while they arrive.
        self._ahead.top_up()
        logger.info(
            "consumer at epoch %s starts after sequence %s (%s entries queued)",
            taken.epoch,
            taken.acked,
            self._ahead.waiting,
        )

    def next_batch(self) -> ConsumedBatch | None:
        """The next batch in sequence order, or ``None`` when the queue holds nothing new.

        Raises:
            CorruptBatchError: the next entry's location is not ``{prefix}/{ULID}.batch``, or
                its object is corrupt; names the sequence and location (a ``FormatError``
                and a ``BadBatchError``).
            BatchNotFoundError: the next entry's batch object is missing; names both (a
                ``NotFoundError`` and a ``BadBatchError``).
            FormatError, NotFoundError: the manifest itself is corrupt or missing (never a
                ``BadBatchError``: no batch is at fault).
            FencedError: another consumer took over.
            StorageError: the store failed; the same entry is tried again on the next call.
            ClosedError: the consumer was closed.
        """
        batches = self.next_batches(1)
        return batches[0] if batches else None

    def next_batches(self, limit: int, *, ack_through: int | None = None) -> list[ConsumedBatch]:
        """The next batch, and up to ``limit - 1`` more that the read-ahead has already
        fetched, in sequence order; ``[]`` when the queue holds nothing new.

        One fencing check covers them all: a caller with a backlog (the consumer service
        writing several batches in one transaction) pays one conditional GET per group.

        Args:
            limit: most batches to return (at least one is waited for when any is queued).
            ack_through: also acknowledge every delivered batch up to this sequence, as
                :meth:`ack_through` does, before delivering: one check covers the ack and the
                delivery. ``None`` acknowledges nothing.

        Raises:
            InvalidInputError: ``ack_through`` is not past the last acked, or was not
                delivered (nothing acked, nothing delivered).
            FencedError: another consumer took over (nothing acked, nothing delivered).
            StorageError: the fencing check failed (nothing acked, nothing delivered), or the
                dequeue due after the ack ran out of retries (the ack is kept: see
                ``acked_sequence``; nothing delivered).
            FormatError, NotFoundError: as :meth:`next_batch`; the ack is kept.
            ClosedError: the consumer was closed.
        """
        with self._locked():
            self._check_ready()
            if ack_through is not None:
                self._check_ack_through(ack_through)
            ahead = self._ahead
            idle = ahead.empty
            self._read_and_check(idle)
            if ack_through is not None:
                self._record_ack(ack_through)
            if idle:
                if not ahead.waiting and self._dequeue_overdue():
                    self._dequeue()  # idle: acked entries do not wait for more acks
                self._maybe_move()
            # What was read before the check, and no request more: a newer consumer that
            # takes over from here on finds this call's check made and nothing delivered yet
            # that it could not have delivered itself.
            ahead.submit()
            batches = ahead.deliver(limit)
            if batches:
                self._next = batches[-1].sequence + 1
                self._delivered.extend(
                    (batch.sequence, batch_time_ms(batch.metadata, batch.location))
                    for batch in batches
                )
            return batches

    def _read_and_check(self, idle: bool) -> None:
        """Read the next entries of the queue (an index segment when they are there) and
        check the epoch after every read: nothing this call delivers is read after its check.

        Idle, the conditional read of the manifest is the check, and what it found is read
        after it (from its bytes: no request, unless a move put it in the index, when the
        epoch is checked again); else the entries are read first, then the epoch is checked
        while the fetches go on."""
        ahead = self._ahead
        if self._index is not None:
            self._index.delete_drained()  # segments earlier acks drained (before the check)
        if idle:
            self._refresh()  # the conditional read checks the epoch
            reads = ahead.cursor.reads
            ahead.top_up()
            if ahead.cursor.reads == reads:
                return
        else:
            ahead.top_up()
        self._guard(self._queue.check_fence)

    def pass_over(self, sequence: int) -> None:
        """Acknowledge the next entry, ``sequence``, without delivering it: its batch could
        not be read (``next_batch()`` raised a :class:`~millpond.errors.BadBatchError` for it)
        and the caller's sink has recorded it another way (set aside, or a duplicate of a
        location it holds). Every batch before it must be acknowledged already.

        One fencing check, as for an ack; the epoch is never bumped (a consumer that lost
        the queue meanwhile raises ``FencedError`` and writes nothing).

        Raises:
            InvalidInputError: ``sequence`` is not the next entry, or a delivered batch before
                it is not acknowledged.
            FencedError, StorageError, ClosedError: as :meth:`ack`.
        """
        with self._locked():
            self._check_ready()
            head = self._ahead.head()
            if head is None or head.sequence != sequence or sequence != self._next:
                raise InvalidInputError(
                    f"sequence: expected the next entry {self._next}, not delivered, found "
                    f"{sequence!r}"
                )
            if self._acked != sequence - 1:
                raise InvalidInputError(
                    f"sequence: expected every batch before {sequence} acknowledged, found the "
                    f"last acknowledged {self._acked}"
                )
            self._guard(self._queue.check_fence)
            self._ahead.skip_head()
            self._next = sequence + 1
            self._record_ack(sequence)

    def has_ready_batch(self) -> bool:
        """Whether :meth:`next_batch` would return a batch at once, without any IO.

        ``True`` when the next batch object is already fetched and decoded by the read-ahead;
        a caller with a backlog uses it to gather several batches into one database
        transaction without waiting for more.
        """
        with self._locked():
            if self._closed or self._fenced is not None:
                return False
            return self._ahead.has_ready()

    def ack(self, sequence: int) -> None:
        """Confirm that the batch ``sequence`` is processed. Acks must come in order.

        The acknowledged entries are dequeued once they number ``ack_batch_size`` and
        ``dequeue_fraction`` of what is still queued behind them, or have waited
        ``dequeue_max_delay`` seconds.

        Raises:
            InvalidInputError: ``sequence`` is not the one after the last acked, or was not
                delivered yet.
            FencedError: another consumer took over.
            StorageError: the fencing check failed (the ack is not recorded:
                ``acked_sequence`` tells), or the dequeue ran out of retries (the ack is kept;
                the next ack, ``flush()`` or ``close()`` dequeues again).
            ClosedError: the consumer was closed.
        """
        with self._locked():
            self._check_ready()
            expected = self._acked + 1
            if isinstance(sequence, bool) or sequence != expected:
                raise InvalidInputError(
                    f"sequence: expected {expected} (acks are in order), found {sequence!r}"
                )
            self._check_delivered(sequence)
            self._guard(self._queue.check_fence)
            self._record_ack(sequence)

    def ack_through(self, sequence: int) -> None:
        """Confirm every delivered batch up to ``sequence`` (one fencing check for them all).

        Raises:
            InvalidInputError: ``sequence`` is not past the last acked, or was not delivered.
            FencedError, StorageError, ClosedError: as :meth:`ack`.
        """
        with self._locked():
            self._check_ready()
            self._check_ack_through(sequence)
            self._guard(self._queue.check_fence)
            self._record_ack(sequence)

    def _check_ack_through(self, sequence: int) -> None:
        if isinstance(sequence, bool) or not isinstance(sequence, int) or sequence <= self._acked:
            raise InvalidInputError(
                f"sequence: expected more than the last acked {self._acked}, found {sequence!r}"
            )
        self._check_delivered(sequence)

    def _check_delivered(self, sequence: int) -> None:
        if sequence >= self._next:
            raise InvalidInputError(
                f"sequence: expected a delivered sequence (below {self._next}), found {sequence}"
            )

    def _record_ack(self, sequence: int) -> None:
        """Record an ack whose fencing check passed in this call; dequeue when due."""
        self._note_ack(sequence)
        if self._dequeue_due():
            self._dequeue()
        if self._mover.unfinished:
            self._maybe_move()  # producers are paying for those entries in the manifest

    def _note_ack(self, sequence: int) -> None:
        if sequence <= self._acked:
            return
        self.counters.add("acks", sequence - self._acked)
        self._acked = sequence
        delivered = self._delivered
        while delivered and delivered[0][0] <= sequence:
            delivered.popleft()
        if self._ack_waiting_since is None:
            self._ack_waiting_since = self._clock.monotonic()

    def _dequeue_due(self) -> bool:
        """Whether the acked entries should leave the manifest now (see the module doc)."""
        waiting = self._acked - self._dequeued
        if waiting <= 0:
            return False
        behind = self._ahead.known - self._acked  # queued after them, as last read
        return waiting >= self._config.dequeue_step(behind) or self._dequeue_overdue()

    def _dequeue_overdue(self) -> bool:
        since = self._ack_waiting_since
        return (
            self._acked > self._dequeued
            and since is not None
            and self._clock.monotonic() - since >= self._config.dequeue_max_delay
        )

    def flush(self, *, ack_through: int | None = None) -> None:
        """Dequeue every acknowledged entry now.

        Args:
            ack_through: first acknowledge every delivered batch up to this sequence, as
                :meth:`ack_through` does; the dequeue's own read or conditional write, made in
                this call, is its fencing check (no separate request). ``None`` acknowledges
                nothing.

        Raises:
            InvalidInputError: ``ack_through`` is not past the last acked, or was not
                delivered.
            FencedError: another consumer took over (nothing acked).
            StorageError: the dequeue ran out of retries (the ack is kept when a read in this
                call found this consumer's epoch: ``acked_sequence`` tells).
            ClosedError: the consumer was closed.
        """
        with self._locked():
            self._check_ready()
            if ack_through is not None:
                self._check_ack_through(ack_through)
                index = self._index
                if index is not None and (index.live or ack_through <= index.end):
                    # The manifest may not be written: check the epoch on its own.
                    self._guard(self._queue.check_fence)
                else:
                    # Returns only after a read in this call found this consumer's epoch, or
                    # after a write conditional on bytes that carried it landed.
                    confirmed = self._queue.confirmations
                    try:
                        self._dequeue(ack_through)
                    except StorageError:
                        if self._queue.confirmations != confirmed:
                            # Checked in this call, then the writes ran out of retries: the
                            # ack stands, as ack()'s does; the next flush dequeues again.
                            self._note_ack(ack_through)
                        raise
                self._record_ack(ack_through)
            if self._acked > self._dequeued:
                self._dequeue()

    def close(self) -> None:
        """Dequeue what was acked, stop the collector and the fetch threads. Idempotent.

        A consumer that already knows it is fenced skips the dequeue and does not raise.

        Raises:
            FencedError: the final dequeue found another consumer in charge.
            StorageError: the final dequeue ran out of retries.
        """
        with self._locked():
            if self._closed:
                return
            try:
                if self._initialized and self._fenced is None and self._acked > self._dequeued:
                    self._dequeue()
                if self._index is not None and self._fenced is None:
                    self._index.delete_drained()
            finally:
                self._closed = True
                self._shutdown()

    def next_entry(self) -> ManifestEntry | None:
        """The entry :meth:`next_batch` delivers next (the one it failed on, after a failure),
        or ``None`` when none is read yet; from the manifest or the backlog index."""
        with self._locked():
            return self._ahead.head()

    def backlog(self) -> Backlog:
        """Undelivered entries as of the last manifest read (for lag reporting)."""
        with self._locked():
            head = self._ahead.head()
            oldest = (
                min(item.ingestion_time_ms for item in head.metadata)
                if head is not None and head.metadata
                else None
            )
            return Backlog(entries=len(self._ahead), oldest_ingestion_ms=oldest)

    def oldest_unacked_ms(self) -> int | None:
        """When the oldest record of the first entry not acknowledged yet was produced (a
        batch delivered and not acked, else the next one read ahead), or ``None`` when none is
        known. Takes no lock and does no IO: a metrics scrape calls it while the consumer
        works."""
        try:
            return self._delivered[0][1]
        except IndexError:
            pass
        try:
            head = self._ahead.head()
        except IndexError:  # emptied while looked at
            return None
        return batch_time_ms(head.metadata, head.location) if head is not None else None

    def held_entries(self) -> int:
        """Entries this consumer holds decoded or noted: read ahead (in flight, or read from
        the queue and not yet submitted) and delivered without an ack. Bounded by the
        read-ahead window and what the caller has not acked, whatever the backlog."""
        with self._lock:
            return self._ahead.held() + len(self._delivered)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except MillpondError as err:
            if exc is None:
                raise
            # Already failing: clean up, but let the original error be the one that surfaces.
            logger.warning("close after %s failed: %s", type(exc).__name__, err)

    # -- internals -------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The consumer's lock, taken after the process check: in a child forked while one of
        the parent's threads (the backlog mover) held it, nothing releases it."""
        self._process.check()
        with self._lock:
            yield

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("consumer is closed")

    def _check_ready(self) -> None:
        self._check_open()
        if self._fenced is not None:
            self._raise_fenced()
        if not self._initialized:
            raise MillpondError("consumer is not initialized: call initialize() first")

    def _raise_fenced(self) -> NoReturn:
        err = self._fenced
        assert err is not None
        raise FencedError(str(err), expected_epoch=err.expected_epoch, found_epoch=err.found_epoch)

    def _guard(self, call: Callable[[], _T]) -> _T:
        """Run a queue operation; remember fencing and stop the collector on it."""
        try:
            return call()
        except FencedError as err:
            self._fenced = err
            if self._gc is not None:
                self._gc.stop(join=False)
            logger.warning("consumer fenced: %s", err)
            raise

    def _refresh(self) -> None:
        manifest = self._guard(self._queue.read_view_if_changed)
        self.counters.add("manifest_refreshes")
        if manifest is None:
            return
        first = manifest.first_sequence
        first = first if first is not None else manifest.next_sequence
        moved = self._index.end if self._index is not None else -1
        if first > max(self._next, moved + 1):
            # Only this consumer dequeues (or moves entries into its index), and never past
            # what it delivered (or read).
            raise MillpondError(
                f"{self._config.manifest_path}: entries {self._next}..{first - 1} were removed "
                f"before this consumer (epoch {self._queue.epoch}) read them"
            )
        # Entries past what it knew are new; it reads them from these bytes as it goes.
        self._ahead.cursor.manifest_read(manifest)

    def _dequeue(self, through: int | None = None) -> None:
        """Remove the acked entries (through ``through``, default the last acked): through the
        coordinator when one is configured and answers ``dequeued``, else directly.

        Either way, returning proves this consumer held the epoch during the call: the
        coordinator answers ``dequeued`` only after a write conditional on bytes that carried
        the consumer's epoch landed, or after a read in this call found it with nothing left
        to remove (:mod:`millpond.queue.coordinator_dequeue`)."""
        if through is None:
            through = self._acked
        index = self._index
        # The index first: together with the manifest it stays contiguous (module doc of
        # millpond.queue.index); an index being drained leaves the manifest alone.
        if index is not None and index.live:
            self._guard(lambda: index.drain(through))
        in_manifest = index is None or through > index.end
        if in_manifest and not self._through_coordinator(through):
            self._guard(lambda: self._queue.dequeue(through))
        self._dequeued_through(through)
        self.counters.add("dequeues")

    def _through_coordinator(self, through: int) -> bool:
        coordinator, epoch = self._coordinator, self._queue.epoch
        return coordinator is not None and epoch is not None and coordinator.dequeue(epoch, through)

    def _maybe_move(self) -> None:
        """Move what the manifest holds into the backlog index once it holds too much."""
        if self._index is not None:
            self._mover.maybe_move(
                self._index, acked=self._acked, dequeued=self._dequeued, known=self._ahead.known
            )

    def _dequeued_through(self, sequence: int) -> None:
        """The acked entries through ``sequence`` left the manifest (or went with a move)."""
        self._dequeued = sequence
        self._ack_waiting_since = None

    def _reset(self) -> None:
        self._shutdown()
        self._ahead.reset()
        self._delivered.clear()
        self._ack_waiting_since = None
        self._mover.unfinished = False
        self._initialized = False

    def _start_mover(self) -> None:
        """A thread that keeps moving the backlog into the index while nothing is delivered
        (the sink is down, the service retrying one write): that is when the backlog grows."""
        task: BackgroundTask = BackgroundTask(
            "millpond-backlog-index", lambda: self._move_periodically(task)
        )
        self._mover_task = task.start()

    def _move_periodically(self, task: BackgroundTask) -> None:
        while not task.wait(self._config.backlog_index_interval):
            with self._lock:
                # Each initialize() starts a task of its own: an earlier one never runs on.
                if task.stopping or self._closed or self._fenced is not None:
                    return
                try:
                    self._refresh()  # only new entries are cached; a 304 when nothing changed
                    self._maybe_move()
                except FencedError:
                    return
                except MillpondError as err:
                    logger.warning("backlog index: reading the manifest failed: %s", err)

    def _shutdown(self) -> None:
        # Not joined: it may be waiting for the lock this runs under; it sees its stop asked.
        if self._mover_task is not None:
            self._mover_task.stop(join=False)
        if self._gc is not None:
            self._gc.stop()
            self._gc = None
        self._ahead.close()


def _check_resume_point(last_acked_sequence: object) -> None:
    """``initialize``'s argument: ``None`` or an integer >= 0 (never a bool)."""
    if last_acked_sequence is not None and (
        isinstance(last_acked_sequence, bool)
        or not isinstance(last_acked_sequence, int)
        or last_acked_sequence < 0
    ):
        raise InvalidInputError(
            f"last_acked_sequence: expected None or an integer >= 0, found {last_acked_sequence!r}"
        )
