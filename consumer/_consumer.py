"""The consumer (RFC, "Consumer"): reads the queue in order, reads ahead, acks in order.

Positions. ``_next`` is the next sequence ``next_batch()`` delivers; ``_acked`` the last
acknowledged sequence; ``_dequeued`` the last sequence removed from the manifest. They only
grow, and ``_dequeued <= _acked < _next``. Entries are dequeued every ``ack_batch_size`` acks
and on ``flush()``/``close()``, never before their ack: the manifest keeps every batch that is
not yet safely in the database, which is also what keeps GC away from it.

Reading. The manifest is read once at ``initialize()`` and again only when every cached entry
has been delivered, with a conditional GET (an unchanged manifest costs a 304). Up to
``read_ahead`` batch objects are fetched and decoded on a thread pool while batches are handed
out strictly in sequence order.

Fencing. Every ``next_batch()``/``next_batches()`` and every ``ack()``/``ack_through()``
first checks that the manifest still carries this consumer's epoch: a conditional GET of its
22-byte footer, a 304 when nothing changed. Once a newer consumer's ``initialize()`` has
returned, this one delivers and acks nothing more: its next call raises ``FencedError``. A
caller that takes several fetched batches at once, and acks them at once, pays one check for
each.

Bad entries. An entry whose location is not ``{data_path_prefix}/{ULID}.batch``, whose object
is missing, or whose bytes are corrupt raises an error naming the sequence and location. The
consumer does not skip it and does not retry by itself: the next ``next_batch()`` call tries the
same entry again.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Self, TypeVar

from millpond.common.clock import Clock, SystemClock
from millpond.common.metrics import Counters, LatencySummary
from millpond.common.ulids import parse_batch_name
from millpond.consumer._background_gc import BackgroundCollector
from millpond.consumer._batch import ConsumedBatch
from millpond.consumer._config import ConsumerConfig
from millpond.errors import (
    ClosedError,
    FencedError,
    FormatError,
    InvalidInputError,
    MillpondError,
    NotFoundError,
)
from millpond.formats.batch import decode_batch
from millpond.formats.manifest import Manifest, ManifestEntry
from millpond.queue import QueueConsumer, read_manifest
from millpond.queue.claim import QueueClaim, open_claim, queue_identity
from millpond.storage.checks import preflight
from millpond.storage.store import ObjectStore, open_store

__all__ = ["Backlog", "Consumer"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


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
    :meth:`close`, which dequeues what was acked.
    """

    def __init__(self, config: ConsumerConfig) -> None:
        """Open the store; nothing is read or written until :meth:`initialize`.

        Raises:
            ConfigError: the store URL or options are invalid.
        """
        self._config = config
        self._clock: Clock = config.clock or SystemClock()
        self._store: ObjectStore = open_store(config.store, config.store_options)
        self._prefix = config.data_path_prefix.strip("/")
        self.counters = Counters(
            "batches", "entries", "bytes", "acks", "dequeues", "manifest_refreshes"
        )
        self.fetch_latency = LatencySummary()
        """Seconds to read and decode one batch object."""
        # Kept across initialize() calls, which start a new collector each.
        self.gc_counters = Counters("gc_passes", "gc_deleted", "gc_failed_deletes", "gc_errors")
        self.gc_latency = LatencySummary()
        self._queue = QueueConsumer(
            self._store,
            config.manifest_path,
            retry=config.retry,
            clock=self._clock,
            counters=self.counters,  # manifest reads, writes and conflicts count here too
        )
        self._lock = threading.RLock()
        self._pool: ThreadPoolExecutor | None = None
        self._gc: BackgroundCollector | None = None
        # Entries read from the manifest, not yet submitted for fetching.
        self._cache: deque[ManifestEntry] = deque()
        # Submitted fetches, in sequence order; the head is delivered next.
        self._inflight: deque[tuple[ManifestEntry, Future[ConsumedBatch]]] = deque()
        self._next = 0
        self._acked = -1
        self._dequeued = -1
        self._known = -1  # the highest sequence ever put in the cache
        self._initialized = False
        self._closed = False
        self._fenced: FencedError | None = None

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
        return queue_identity(self._store.url, self._config.manifest_path)

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

        Args:
            last_acked_sequence: ``None`` starts at the earliest entry in the queue; a
                sequence resumes right after it (what a sink stored with its last batch).
                Entries up to it still in the manifest are dequeued at once.

        Nothing is written, and no other consumer is fenced, when the queue refuses this one:
        its claim names another manifest (two queues on one data prefix), its GC grace period
        is shorter than the queue's, or ``last_acked_sequence`` is not below the queue's
        ``next_sequence``.

        Raises:
            ConfigError: the queue refuses this consumer (see above), naming the setting.
            InvalidInputError: ``last_acked_sequence`` is negative, not below the manifest's
                ``next_sequence`` (the sink is ahead of this queue), or below the queue's
                first entry minus one (entries it never saw were dequeued).
            FencedError: yet another consumer initialized meanwhile.
            FormatError: the manifest is corrupt.
            StorageError: the store failed past the retry budget.
            StoreAccessError: the store refuses for good (credentials, bucket, permission,
                conditional writes).
            ClosedError: the consumer was closed.
        """
        if last_acked_sequence is not None and (
            isinstance(last_acked_sequence, bool)
            or not isinstance(last_acked_sequence, int)
            or last_acked_sequence < 0
        ):
            raise InvalidInputError(
                f"last_acked_sequence: expected None or an integer >= 0, "
                f"found {last_acked_sequence!r}"
            )
        with self._lock:
            self._check_open()
            preflight(self._store, write=True)  # fail fast on what no retry fixes
            self._reset()
            self._open_claim()
            # Refuse a sink that is ahead of the queue before taking over: an operator's
            # mistake must not fence the consumer that is right.
            self._check_ahead(last_acked_sequence, self._peek_next_sequence())
            self._queue.initialize()
            snapshot = self._guard(self._queue.read)
            manifest = snapshot.manifest
            first = self._first_available(manifest)
            if last_acked_sequence is None:
                acked = first - 1
            else:
                acked = last_acked_sequence
                self._check_ahead(acked, manifest.next_sequence)
                if acked < first - 1:
                    raise InvalidInputError(
                        f"last_acked_sequence: expected >= {first - 1} (the queue starts at "
                        f"{first}), found {acked}: entries {acked + 1}..{first - 1} were "
                        "dequeued without this consumer's sink seeing them"
                    )
            self._acked = acked
            self._dequeued = first - 1
            self._next = acked + 1
            self._cache_new(manifest, after=acked)
            self._pool = ThreadPoolExecutor(
                self._config.read_ahead, thread_name_prefix="millpond-read"
            )
            self._initialized = True
            if self._acked > self._dequeued:
                self._dequeue()
            if self._config.gc_enabled:
                epoch = self._queue.epoch
                assert epoch is not None
                self._gc = BackgroundCollector(
                    self._store,
                    manifest_path=self._config.manifest_path,
                    data_path_prefix=self._prefix,
                    interval=self._config.gc_interval,
                    grace_period=self._config.gc_grace_period,
                    clock=self._clock,
                    epoch=epoch,
                    counters=self.gc_counters,
                    latency=self.gc_latency,
                )
                self._gc.start()
            logger.info(
                "consumer at epoch %s starts after sequence %s (%s entries queued)",
                self._queue.epoch,
                acked,
                len(self._cache),
            )

    def next_batch(self) -> ConsumedBatch | None:
        """The next batch in sequence order, or ``None`` when the queue holds nothing new.

        Raises:
            FormatError: the next entry's location is not ``{prefix}/{ULID}.batch``, its
                object is corrupt, or the manifest is; names the sequence and location.
            NotFoundError: the next entry's batch object is missing; names both.
            FencedError: another consumer took over.
            StorageError: the store failed; the same entry is tried again on the next call.
            ClosedError: the consumer was closed.
        """
        batches = self.next_batches(1)
        return batches[0] if batches else None

    def next_batches(self, limit: int) -> list[ConsumedBatch]:
        """The next batch, and up to ``limit - 1`` more that the read-ahead has already
        fetched, in sequence order; ``[]`` when the queue holds nothing new.

        One fencing check covers them all: a caller with a backlog (the consumer service
        writing several batches in one transaction) pays one conditional GET per group.

        Raises:
            FormatError, NotFoundError, FencedError, StorageError, ClosedError: as
                :meth:`next_batch`.
        """
        with self._lock:
            self._check_ready()
            if not self._cache and not self._inflight:
                self._refresh()  # checks the epoch too
            else:
                self._guard(self._queue.check_fence)
            self._top_up()
            batches: list[ConsumedBatch] = []
            while self._inflight and len(batches) < max(1, limit):
                entry, future = self._inflight[0]
                if batches and not _ready(future):
                    break
                try:
                    batch = future.result()
                except MillpondError:
                    if batches:
                        break  # the ones before it are delivered; it fails on the next call
                    self._rewind()
                    raise
                self._inflight.popleft()
                self._next = entry.sequence + 1
                self.counters.add("batches")
                self.counters.add("entries", len(batch.entries))
                self._top_up()
                batches.append(batch)
            return batches

    def has_ready_batch(self) -> bool:
        """Whether :meth:`next_batch` would return a batch at once, without any IO.

        ``True`` when the next batch object is already fetched and decoded by the read-ahead;
        a caller with a backlog uses it to gather several batches into one database
        transaction without waiting for more.
        """
        with self._lock:
            if self._closed or self._fenced is not None or not self._inflight:
                return False
            future = self._inflight[0][1]
            return future.done() and not future.cancelled() and future.exception() is None

    def ack(self, sequence: int) -> None:
        """Confirm that the batch ``sequence`` is processed. Acks must come in order.

        Every ``ack_batch_size`` acks the acknowledged entries are dequeued.

        Raises:
            InvalidInputError: ``sequence`` is not the one after the last acked, or was not
                delivered yet.
            FencedError: another consumer took over.
            StorageError: the fencing check failed (the ack is not recorded:
                ``acked_sequence`` tells), or the dequeue ran out of retries (the ack is kept;
                the next ack, ``flush()`` or ``close()`` dequeues again).
            ClosedError: the consumer was closed.
        """
        with self._lock:
            self._check_ready()
            expected = self._acked + 1
            if isinstance(sequence, bool) or sequence != expected:
                raise InvalidInputError(
                    f"sequence: expected {expected} (acks are in order), found {sequence!r}"
                )
            self._ack_through_locked(sequence)

    def ack_through(self, sequence: int) -> None:
        """Confirm every delivered batch up to ``sequence`` (one fencing check for them all).

        Raises:
            InvalidInputError: ``sequence`` is not past the last acked, or was not delivered.
            FencedError, StorageError, ClosedError: as :meth:`ack`.
        """
        with self._lock:
            self._check_ready()
            if isinstance(sequence, bool) or sequence <= self._acked:
                raise InvalidInputError(
                    f"sequence: expected more than the last acked {self._acked}, found {sequence!r}"
                )
            self._ack_through_locked(sequence)

    def _ack_through_locked(self, sequence: int) -> None:
        if sequence >= self._next:
            raise InvalidInputError(
                f"sequence: expected a delivered sequence (below {self._next}), found {sequence}"
            )
        self._guard(self._queue.check_fence)
        self.counters.add("acks", sequence - self._acked)
        self._acked = sequence
        if self._acked - self._dequeued >= self._config.ack_batch_size:
            self._dequeue()

    def flush(self) -> None:
        """Dequeue every acknowledged entry now.

        Raises:
            FencedError: another consumer took over.
            StorageError: the dequeue ran out of retries.
            ClosedError: the consumer was closed.
        """
        with self._lock:
            self._check_ready()
            if self._acked > self._dequeued:
                self._dequeue()

    def close(self) -> None:
        """Dequeue what was acked, stop the collector and the fetch threads. Idempotent.

        A consumer that already knows it is fenced skips the dequeue and does not raise.

        Raises:
            FencedError: the final dequeue found another consumer in charge.
            StorageError: the final dequeue ran out of retries.
        """
        with self._lock:
            if self._closed:
                return
            try:
                if self._initialized and self._fenced is None and self._acked > self._dequeued:
                    self._dequeue()
            finally:
                self._closed = True
                self._shutdown()

    def backlog(self) -> Backlog:
        """Undelivered entries as of the last manifest read (for lag reporting)."""
        with self._lock:
            head: ManifestEntry | None = None
            if self._inflight:
                head = self._inflight[0][0]
            elif self._cache:
                head = self._cache[0]
            oldest = (
                min(item.ingestion_time_ms for item in head.metadata)
                if head is not None and head.metadata
                else None
            )
            return Backlog(
                entries=len(self._inflight) + len(self._cache), oldest_ingestion_ms=oldest
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        # Already failing: clean up, but let the original error be the one that surfaces.
        try:
            self.close()
        except MillpondError as err:
            logger.warning("close after %s failed: %s", type(exc).__name__, err)

    # -- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("consumer is closed")

    def _check_ready(self) -> None:
        self._check_open()
        if self._fenced is not None:
            err = self._fenced
            raise FencedError(
                str(err), expected_epoch=err.expected_epoch, found_epoch=err.found_epoch
            )
        if not self._initialized:
            raise MillpondError("consumer is not initialized: call initialize() first")

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

    def _open_claim(self) -> None:
        """Read the queue's claim (a consumer that collects makes it, with its grace period)
        and check this consumer against it."""
        config = self._config
        grace = config.gc_grace_period
        create = None
        if config.gc_enabled:
            create = QueueClaim(
                manifest_path=config.manifest_path,
                gc_grace_period=grace,
                created_ms=self._clock.now_ms(),
            )
        claim = open_claim(
            self._store,
            data_path_prefix=self._prefix,
            manifest_path=config.manifest_path,
            create=create,
        )
        if claim is not None and config.gc_enabled:
            claim.check_gc_grace(grace, store_url=self._store.url)

    def _peek_next_sequence(self) -> int:
        try:
            return read_manifest(self._store, self._config.manifest_path).manifest.next_sequence
        except NotFoundError:
            return 0

    def _check_ahead(self, acked: int | None, next_sequence: int) -> None:
        if acked is not None and acked >= next_sequence:
            raise InvalidInputError(
                f"last_acked_sequence: expected < next_sequence {next_sequence} of "
                f"{self.queue}, found {acked}: the sink is ahead of this queue (a manifest "
                "that was recreated, or a sink restored from another queue)"
            )

    def _first_available(self, manifest: Manifest) -> int:
        first = manifest.first_sequence
        return first if first is not None else manifest.next_sequence

    def _refresh(self) -> None:
        snapshot = self._guard(self._queue.read_if_changed)
        self.counters.add("manifest_refreshes")
        if snapshot is None:
            return
        manifest = snapshot.manifest
        first = self._first_available(manifest)
        if first > self._next:
            # Only this consumer dequeues, and never past what it delivered.
            raise MillpondError(
                f"{self._config.manifest_path}: entries {self._next}..{first - 1} were removed "
                f"before this consumer (epoch {self._queue.epoch}) read them"
            )
        self._cache_new(manifest, after=max(self._known, self._next - 1))

    def _cache_new(self, manifest: Manifest, *, after: int) -> None:
        """Cache the manifest's entries past ``after`` that were never cached before."""
        fresh = [e for e in manifest.entries if e.sequence > after]
        self._cache.extend(fresh)
        if fresh:
            self._known = fresh[-1].sequence

    def _top_up(self) -> None:
        pool = self._pool
        assert pool is not None
        while self._cache and len(self._inflight) < self._config.read_ahead:
            entry = self._cache.popleft()
            problem = self._location_problem(entry.location)
            if problem is None:
                future = pool.submit(self._fetch, entry)
            else:
                future = Future()
                future.set_exception(
                    FormatError(
                        f"{self._config.manifest_path}: sequence {entry.sequence}: location "
                        f"{entry.location!r} {problem}",
                        field="location",
                    )
                )
            self._inflight.append((entry, future))

    def _rewind(self) -> None:
        """Put every submitted entry back in front of the cache, to be fetched again."""
        for entry, future in reversed(self._inflight):
            future.cancel()
            self._cache.appendleft(entry)
        self._inflight.clear()

    def _location_problem(self, location: str) -> str | None:
        parent, _, name = location.rpartition("/")
        if parent != self._prefix:
            return f"is outside the data prefix {self._prefix!r}"
        if parse_batch_name(name) is None:
            return "is not named {ULID}.batch"
        return None

    def _fetch(self, entry: ManifestEntry) -> ConsumedBatch:
        with self.fetch_latency.time():
            return self._fetch_untimed(entry)

    def _fetch_untimed(self, entry: ManifestEntry) -> ConsumedBatch:
        location = entry.location
        try:
            got = self._store.get(location)
        except NotFoundError as err:
            raise NotFoundError(
                f"{self._config.manifest_path}: sequence {entry.sequence}: batch object "
                f"{location} is missing"
            ) from err
        try:
            records = decode_batch(got.data, name=location)
        except FormatError as err:
            raise FormatError(
                f"sequence {entry.sequence}: {err}", field=err.field, offset=err.offset
            ) from err
        self.counters.add("bytes", len(got.data))
        return ConsumedBatch(
            entries=tuple(records),
            sequence=entry.sequence,
            location=location,
            metadata=entry.metadata,
            queue=self.queue,
        )

    def _dequeue(self) -> None:
        through = self._acked
        self._guard(lambda: self._queue.dequeue(through))
        self._dequeued = through
        self.counters.add("dequeues")

    def _reset(self) -> None:
        self._shutdown()
        self._cache.clear()
        self._known = -1
        self._initialized = False
        self._fenced = None

    def _shutdown(self) -> None:
        if self._gc is not None:
            self._gc.stop()
            self._gc = None
        for _entry, future in self._inflight:
            future.cancel()
        self._inflight.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _ready(future: Future[ConsumedBatch]) -> bool:
    """Whether a fetch finished (successfully or not) without waiting for it."""
    return future.done() and not future.cancelled()
