"""``Producer``: the RFC's producer, with a local write-ahead log as its durable staging tier.

``produce()`` validates the call, queues it for the WAL writer (blocking only for
backpressure) and returns a :class:`WriteHandle`. Background threads then stage it in the WAL
(``_stager``), and seal, upload and publish it (``_publisher``). On start the producer replays
what its WAL still holds and publishes it before anything new.

Memory: staged entries stay in memory up to ``max(4 * flush_size_bytes, 256 MiB)``; beyond
that (a backlog while the store is unreachable) they live only in the WAL and are read back
when their batch is encoded, so a WAL of gigabytes does not become gigabytes of heap.

Threads (named, daemon, all joined by ``close()``): ``millpond-wal-writer``,
``millpond-wal-syncer``, ``millpond-sealer``, ``millpond-upload-N``, ``millpond-committer`` and
``millpond-wal-releaser``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from millpond.common.exposition import MetricsCollector, flatten
from millpond.common.forks import OwnProcess
from millpond.common.metrics import Counters, LatencySummary
from millpond.common.tasks import BackgroundTask
from millpond.common.ulids import UlidMinter, parse_batch_name, ulid_time_ms
from millpond.coordinator.client import CoordinatedAppender
from millpond.coordinator.hosted import (
    HostCoordinatedAppender,
    HostCoordinator,
    shares_a_coordinator,
)
from millpond.errors import BackpressureError, ClosedError, InvalidInputError
from millpond.formats.batch import MAX_RECORD_BYTES
from millpond.formats.routing import with_table
from millpond.formats.wal import MAX_ENTRY_LEN, data_record_size
from millpond.producer._committer import Committer
from millpond.producer._metrics import producer_collector, producer_samples
from millpond.producer._publisher import Sealer, Uploader, fail_fatal
from millpond.producer._recovery import fold_records
from millpond.producer._releaser import Releaser
from millpond.producer._session import QueueSession
from millpond.producer._stager import WalWriter
from millpond.producer._state import (
    Batch,
    BatchState,
    CloseReport,
    Input,
    Staged,
    State,
    StopAwareClock,
)
from millpond.producer.config import ProducerConfig
from millpond.producer.handle import WriteHandle
from millpond.queue import Appender, QueueProducer, SinkWatch, queue_identity
from millpond.storage import open_store
from millpond.storage.checks import preflight
from millpond.wal import RecoveryReport, Wal, WalRecord

if TYPE_CHECKING:
    import pyarrow as pa
    from prometheus_client.registry import CollectorRegistry

__all__ = ["Producer"]

logger = logging.getLogger(__name__)

_MIN_MEMORY_BUDGET = 256 << 20  # staged bytes kept in memory before reading back from the WAL
_EVERYTHING = 1 << 62  # a flush target past any ordinal
_JOIN_GRACE = 30.0  # seconds a thread stuck in a network call gets after close()'s deadline


class Producer:
    """Stages entries in a local WAL and publishes them as batches to the queue manifest.

    Thread-safe. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, config: ProducerConfig) -> None:
        """Open the store and the WAL, replay the WAL, and start the background threads.

        When the store answers, the queue's claim and the store's clock are checked here; when
        it does not, before the first append (staging goes on meanwhile).

        Raises:
            ConfigError: a bad setting, ``wal_dir`` is held by another live producer, or the
                queue refuses this producer (another queue's data prefix, a ``reupload_after``
                its GC grace period cannot cover, a clock too far from the store's).
            StoreAccessError: the store refuses for good (credentials, bucket, permission,
                conditional writes); an unreachable store is waited out instead.
            FormatError: the WAL was written by another millpond version, or the queue's
                claim object is corrupt.
            StorageError: the WAL directory cannot be used.
        """
        if not isinstance(config, ProducerConfig):
            raise InvalidInputError(
                f"config: expected a ProducerConfig, found {type(config).__name__}"
            )
        self._config = config
        self._store = open_store(config.store, config.store_options)
        self._process = OwnProcess(
            f"producer on {self._store.url} (wal_dir {config.wal_dir})",
            "Open a Producer in this process after the fork, with a wal_dir of its own",
        )
        # Fail fast on what no retry fixes; the store's clock comes back from its probe write.
        store_time = preflight(self._store, write=True, lists=False, clock=config.clock)
        budget = max(4 * config.flush_size_bytes, _MIN_MEMORY_BUDGET)
        self._state = state = State(clock=config.clock, mem_budget=budget)
        self._clock = StopAwareClock(config.clock, state.stop)
        self._wal = Wal.open(
            config.wal_dir, rotate_bytes=config.rotate_bytes, fsync_latency=state.fsync_latency
        )
        self._close_report: CloseReport | None = None
        self._registered: tuple[CollectorRegistry, MetricsCollector] | None = None
        self._handle_lock = threading.Lock()  # shared by this producer's handles
        # What the consumer service says it has written (its handles' wait_written).
        self._sink_watch = SinkWatch(
            self._store,
            data_path_prefix=config.data_path_prefix,
            queue=queue_identity(self._store.url, config.manifest_path),
            clock=config.clock,
        )
        self._close_lock = threading.Lock()
        self._record_limit = min(MAX_ENTRY_LEN, config.wal_max_bytes // 4)
        self._session = QueueSession(self._store, config, self._clock)
        self._coordinated: CoordinatedAppender | HostCoordinatedAppender | None = None
        try:
            self._session.try_open(store_time)
            self._replay()
        except BaseException:
            self._wal.close()
            raise
        queue = self._appender()
        self._releaser = Releaser(state, self._wal)
        self._start_threads(queue)

    def _appender(self) -> Appender:
        """The committer's appender: through the coordinators the config names, or the one the
        producers of this queue on this machine share, else straight to the manifest (a
        coordinated one is kept in ``_coordinated``, closed with the producer)."""
        config = self._config
        direct = QueueProducer(
            self._store,
            config.manifest_path,
            retry=config.retry,
            clock=self._clock,
            counters=self._state.counters,
        )
        identity = queue_identity(self._store.url, config.manifest_path)
        if config.coordinator:
            self._coordinated = CoordinatedAppender(
                direct, config.coordinator, queue=identity, clock=self._clock
            )
        elif shares_a_coordinator(config.host_coordinator, self._store):
            host = HostCoordinator(
                self._store,
                config.manifest_path,
                data_path_prefix=config.data_path_prefix,
                queue=identity,
                clock=config.clock,
            )
            self._coordinated = HostCoordinatedAppender(
                direct, host, queue=identity, clock=self._clock
            )
        return direct if self._coordinated is None else self._coordinated

    def _start_threads(self, queue: Appender) -> None:
        """Start the background threads (module docstring); the committer appends through
        ``queue``."""
        config, state, wal = self._config, self._state, self._wal
        writer = WalWriter(state, wal, config)
        committer = Committer(state, wal, config, self._store, queue, self._session, self._clock)
        bodies: list[tuple[str, Any, str | None]] = [
            # The WAL writer and syncer fail the calls they hold themselves (_stager).
            ("millpond-wal-writer", writer.run, None),
            ("millpond-wal-syncer", writer.run_syncer, None),
            ("millpond-sealer", Sealer(state, wal, config, UlidMinter(config.clock)).run, "sealer"),
            ("millpond-committer", committer.run, "committer"),
            ("millpond-wal-releaser", self._releaser.run, "WAL releaser"),
        ]
        for i in range(config.upload_concurrency):
            uploader = Uploader(state, wal, config, self._store, self._clock, self._session)
            bodies.append((f"millpond-upload-{i}", uploader.run, "uploader"))
        # One stop for all: _stop_threads sets it under state.cond and wakes every body.
        self._tasks = [
            BackgroundTask(
                name, run, stop=state.stop, on_error=fail_fatal(state, who) if who else None
            ).start()
            for name, run, who in bodies
        ]

    # -- replay ---------------------------------------------------------------------------

    def _replay(self) -> None:
        wal = self._wal
        report = wal.report
        if not report.clean:
            logger.warning("%s", report.summary())
        elif report.records_replayed or report.torn_tail_bytes:
            logger.info("%s", report.summary())
        folded = fold_records(wal.records)
        state = self._state
        now = state.clock.monotonic()

        def staged(record: WalRecord) -> Staged:
            state.next_ordinal += 1
            return Staged(
                ordinal=state.next_ordinal - 1,
                seq=record.seq,
                ref=record.ref,
                ingestion_time_ms=record.ingestion_time_ms,
                metadata=record.metadata,
                entry_count=record.entry_count,
                nbytes=record.entry_bytes,
                entries=None,
                handle=None,
                staged_at=now,
            )

        with state.cond:
            for bound in folded.batches:
                ulid = parse_batch_name(bound.location.rsplit("/", 1)[-1])
                state.batches.append(
                    Batch(
                        [staged(r) for r in bound.records],
                        location=bound.location,
                        minted_ms=ulid_time_ms(ulid) if ulid else 0,
                        state=BatchState.UNCERTAIN,
                        prior_locations=list(bound.prior_locations),
                        complete=bound.complete,
                        recovered=True,
                    )
                )
            for record in folded.unbound:
                item = staged(record)
                state.pending.append(item)
                state.pending_bytes += item.nbytes
            replayed = state.staged_only()
        records = len(replayed)
        entries = sum(r.entry_count for r in replayed)
        state.counters.add("records_recovered", records)
        state.counters.add("entries_recovered", entries)
        if records:
            logger.info(
                "replaying %s produce() calls (%s entries, %s already bound to batches) from %s",
                records,
                entries,
                len(folded.batches),
                wal.directory,
            )

    # -- public API -----------------------------------------------------------------------

    @property
    def config(self) -> ProducerConfig:
        return self._config

    @property
    def recovery_report(self) -> RecoveryReport:
        """What replaying the WAL found on start, losses included."""
        return self._wal.report

    @property
    def counters(self) -> Counters:
        """Live counters (see :meth:`metrics` for a snapshot with gauges)."""
        return self._state.counters

    @property
    def fsync_latency(self) -> LatencySummary:
        """Seconds per WAL ``fdatasync`` (count, mean, p50, p99, max)."""
        return self._state.fsync_latency

    def produce(
        self,
        entries: Iterable[bytes | bytearray | memoryview],
        metadata: bytes | bytearray | memoryview = b"",
        timeout: float | None = None,
        *,
        table: str | None = None,
    ) -> WriteHandle:
        """Stage ``entries`` (one metadata item in the manifest) and publish them.

        Blocks only while ``max_buffered_inputs`` calls wait for the WAL writer (which itself
        waits while the WAL is full under ``size_cap_policy="backpressure"``).

        Args:
            entries: opaque byte strings, at least one, each at most 2**32 - 1 bytes.
            metadata: opaque bytes stored with this call's metadata item in the manifest.
            timeout: seconds to wait for buffer room; ``None`` waits as long as it takes.
            table: the consumer's table for the entries (``None``: its own), carried as a
                ``millpond.table=`` line in front of ``metadata`` (``formats.routing``).

        Returns:
            A handle: ``wait_staged()`` for the WAL, ``wait()`` for the manifest,
            ``wait_written()`` for the consumer's database.

        Raises:
            InvalidInputError: no entries, an entry that is not bytes-like or over the u32
                limit, a bad ``table``; the call is rejected before anything is staged.
            BackpressureError: no buffer room within ``timeout``.
            ClosedError: the producer is closed or stopped after a permanent failure.
        """
        # Before any lock: one of the parent's threads may have held it at the fork, and
        # nothing in this process would ever release it.
        self._process.check()
        items, meta, nbytes, record_size = self._validate(entries, metadata, table)
        state = self._state
        handle = WriteHandle(len(items), self._handle_lock, self._process, self._sink_watch)
        ingestion_time_ms = state.clock.now_ms()
        limit = self._config.max_buffered_inputs
        deadline = None if timeout is None else state.clock.monotonic() + timeout
        with state.cond:
            self._check_usable()
            if len(state.inbox) >= limit:
                state.counters.add("backpressure_waits")
            while len(state.inbox) >= limit:
                remaining = None if deadline is None else deadline - state.clock.monotonic()
                if remaining is not None and remaining <= 0:
                    raise BackpressureError(
                        f"produce(): {limit} calls (max_buffered_inputs) still waiting for the "
                        f"WAL after {timeout} s; the WAL is full or the disk is slow"
                    )
                state.room.wait(remaining)
                self._check_usable()
            ordinal = state.next_ordinal
            state.next_ordinal += 1
            state.inbox.append(
                Input(ordinal, items, meta, ingestion_time_ms, nbytes, record_size, handle)
            )
            state.writer_wake.notify()
        self._count_call(len(items), nbytes)
        return handle

    def _count_call(self, entries: int, nbytes: int) -> None:
        counters = self._state.counters
        counters.add("produce_calls")
        counters.add("entries_produced", entries)
        counters.add("bytes_produced", nbytes)

    def produce_arrow(
        self,
        data: pa.RecordBatch | pa.Table,
        metadata: bytes | bytearray | memoryview = b"",
        timeout: float | None = None,
        *,
        table: str | None = None,
    ) -> WriteHandle:
        """Produce one entry per non-empty record batch of ``data``, as Arrow IPC streams.

        ``table``: the table ``millpond consume`` writes the rows into, as :meth:`produce`
        takes it (``produce_arrow(orders, table="orders")``).

        Raises:
            InvalidInputError: not a record batch or table, or no rows at all; a bad
                ``table`` (see :meth:`produce`).
            BackpressureError, ClosedError: as :meth:`produce`.
        """
        from millpond.formats.arrow import encode_ipc

        entries = encode_ipc(data)
        if not entries:
            raise InvalidInputError("data: expected at least one row, found none")
        return self.produce(entries, metadata, timeout, table=table)

    def flush(self, timeout: float | None = None) -> None:
        """Publish everything produced so far now, and wait until it is in the manifest.

        Raises:
            TimeoutError: not everything was published within ``timeout``.
            ClosedError: the producer is closed or stopped after a permanent failure.
        """
        self._process.check()  # before the lock, as in produce()
        state = self._state
        deadline = None if timeout is None else state.clock.monotonic() + timeout
        with state.cond:
            self._check_usable()
            target = state.next_ordinal - 1
            state.flush_target = max(state.flush_target, target)
            state.sealer_wake.notify_all()
            while state.resolved_through < target:
                remaining = None if deadline is None else deadline - state.clock.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"flush(): not everything was published within {timeout} s; still "
                        f"waiting for: {state.waiting_for()}"
                    )
                state.wait(state.cond, remaining)
                self._check_usable()

    def close(self, timeout: float | None = None) -> CloseReport:
        """Publish everything, stop the threads, close the WAL. Idempotent.

        Args:
            timeout: seconds to keep publishing; ``None`` waits until everything is in the
                manifest (through a store outage, too). When it runs out, an error is logged
                saying what publishing still waited for (uploads, appends, batches written
                again waiting out the delete window until when, ...).

        Returns:
            What is left: calls still only staged in the WAL (published by the next producer
            on ``wal_dir``; their handles fail with ``ClosedError``) and calls that never
            reached it, and ``waiting_for``, what the timeout ran out on. ``report.complete``
            is true when nothing is left.

        Raises:
            MillpondError: the permanent failure that stopped the producer, if any (after
                cleaning up; staged data stays in the WAL).
        """
        self._process.check()
        with self._close_lock:  # a second close() waits for the first and gets its report
            return self._close(timeout)

    def _close(self, timeout: float | None) -> CloseReport:
        state = self._state
        with state.cond:
            if self._close_report is not None:
                return self._close_report
            state.closing = True
            state.flush_target = _EVERYTHING
            state.wake_all()
            waiting_for = self._publish_all(timeout)
        self._stop_threads()
        self._releaser.finish()
        if self._coordinated is not None:
            self._coordinated.close()
        report = dataclasses.replace(self._settle_leftovers(), waiting_for=waiting_for)
        self._wal.close()
        self._close_report = report
        if self._registered is not None:
            registry, collector = self._registered
            registry.unregister(collector)
            self._registered = None
        if not report.complete:
            logger.warning(
                "producer closed with %s produce() calls (%s entries) still only staged in %s "
                "and %s never staged",
                report.staged_records,
                report.staged_entries,
                report.wal_dir,
                report.unstaged_records,
            )
        if state.fatal is not None:
            raise state.fatal
        return report

    def _publish_all(self, timeout: float | None) -> str:
        """Wait (holding ``state.cond``) until everything is published, the producer failed,
        or ``timeout`` ran out; then what it was still waiting for, logged as an error
        (``""`` when nothing was left)."""
        state = self._state
        deadline = None if timeout is None else state.clock.monotonic() + timeout
        target = state.next_ordinal - 1
        while state.resolved_through < target and state.fatal is None:
            remaining = None if deadline is None else deadline - state.clock.monotonic()
            if remaining is not None and remaining <= 0:
                waiting_for = state.waiting_for()
                logger.error(
                    "close(): its timeout (%s s) ran out while waiting for: %s; what is not "
                    "published stays in %s for the next producer",
                    timeout,
                    waiting_for,
                    self._wal.directory,
                )
                return waiting_for
            state.wait(state.cond, remaining)
        return ""

    def metrics(self) -> dict[str, Any]:
        """Counters, gauges and the fsync latency summary, as a plain dict.

        Also every metric :meth:`register_metrics` exports, under its Prometheus name
        (``millpond_manifest_writes_total``, ...; histograms as ``{"count", "sum",
        "buckets"}``).

        Raises:
            ClosedError: called in a process forked from the producer's (its figures stopped
                at the fork).
        """
        self._process.check()  # before the lock, as in produce()
        state = self._state
        values: dict[str, Any] = dict(state.counters.snapshot())
        values.update(flatten(producer_samples(state, self._wal)))
        with state.cond:
            values["buffered_inputs"] = len(state.inbox)
            values["pending_records"] = len(state.pending)
            values["pending_bytes"] = state.pending_bytes
            values["batches_in_flight"] = len(state.batches)
            values["unsettled_batches"] = len(state.unsettled)
            values["batches_awaiting_refresh"] = state.awaiting_refresh()
            values["memory_bytes"] = state.mem_bytes
        if not self._wal.closed:
            values["wal_bytes"] = self._wal.bytes_used
            values["wal_files"] = self._wal.file_count
        values["fsync_latency"] = state.fsync_latency.snapshot()
        values["recovery"] = {
            "records_replayed": self._wal.report.records_replayed,
            "torn_tail_bytes": self._wal.report.torn_tail_bytes,
            "lost_bytes": self._wal.report.lost_bytes,
            "quarantined": len(self._wal.report.quarantined),
        }
        return values

    def register_metrics(
        self,
        registry: CollectorRegistry | None = None,
        *,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        """Export this producer's metrics (see the docs' metrics page) through ``registry``.

        Each scrape of the registry reads the producer's counters; :meth:`close` unregisters
        them. One registry takes one producer (``prometheus_client`` refuses a name twice):
        give each producer in a process its own registry.

        Args:
            registry: a ``prometheus_client`` registry; default its global ``REGISTRY``.
            labels: constant labels added to every series (``{"app": "ingest"}``).

        Raises:
            ValueError: this producer's metrics are already registered, or the registry
                already holds these names (``prometheus_client``'s refusal).
        """
        from prometheus_client import REGISTRY

        target = registry if registry is not None else REGISTRY
        if self._registered is not None:
            raise ValueError("producer metrics: already registered; call close() first")
        collector = producer_collector(self._state, self._wal, self._process, dict(labels or {}))
        target.register(collector)
        self._registered = (target, collector)

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self._close_report is None else "closed"
        return f"Producer({self._store.url!r}, wal_dir={str(self._wal.directory)!r}, {state})"

    # -- internals ------------------------------------------------------------------------

    def _check_usable(self) -> None:
        self._process.check()
        state = self._state
        if state.fatal is not None:
            raise ClosedError(f"producer stopped after a failure: {state.fatal}") from state.fatal
        if state.closing:
            raise ClosedError("producer is closed")

    def _validate(
        self,
        entries: Iterable[bytes | bytearray | memoryview],
        metadata: bytes | bytearray | memoryview,
        table: str | None = None,
    ) -> tuple[list[bytes], bytes, int, int]:
        if isinstance(entries, (bytes, bytearray, memoryview, str)):
            raise InvalidInputError(
                f"entries: expected a list of byte strings, found a single {type(entries).__name__}"
            )
        try:
            items = list(entries)
        except TypeError as err:
            raise InvalidInputError(
                f"entries: expected a list of byte strings, found {type(entries).__name__}"
            ) from err
        if not items:
            raise InvalidInputError("entries: expected at least one entry, found none")
        if len(items) > MAX_RECORD_BYTES:
            raise InvalidInputError(
                f"entries: expected at most {MAX_RECORD_BYTES} entries, found {len(items)}"
            )
        # Sizes first, copies after: an oversized entry is rejected without touching its bytes.
        sizes: list[int] | None = None
        if all(type(item) is bytes for item in items):  # the common case, checked in C
            sizes = list(map(len, items))
        if sizes is None or max(sizes) > MAX_RECORD_BYTES:
            sizes = [_byte_size(f"entries[{i}]", item) for i, item in enumerate(items)]
        meta_size = _byte_size("metadata", metadata)
        if table is not None:  # a millpond.table line in front of the application's metadata
            metadata = with_table(bytes(metadata), table)
            meta_size = len(metadata)
        record_size = data_record_size(meta_size, sizes)
        if record_size > self._record_limit:
            raise InvalidInputError(
                f"entries: one produce() call must fit in the WAL (at most {self._record_limit} "
                f"bytes with framing: wal_max_bytes // 4 and the u32 record limit), found "
                f"{record_size}"
            )
        copied = [item if type(item) is bytes else bytes(item) for item in items]
        meta = metadata if type(metadata) is bytes else bytes(metadata)
        return copied, meta, sum(sizes), record_size

    def _stop_threads(self) -> None:
        state = self._state
        with state.cond:
            state.stop.set()
            state.wake_all()
        deadline = time.monotonic() + _JOIN_GRACE
        for task in self._tasks:
            if not task.join(max(0.0, deadline - time.monotonic())):
                # Only a store call that hangs gets here; the thread is a daemon, and whatever
                # it was publishing stays in the WAL for the next producer.
                logger.warning("%s did not stop within %s s", task.name, _JOIN_GRACE)

    def _settle_leftovers(self) -> CloseReport:
        state = self._state
        wal_dir = str(self._wal.directory)
        with state.cond:
            left = state.staged_only()
            unstaged = list(state.inbox)
            report = CloseReport(
                wal_dir=wal_dir,
                staged_records=len(left),
                staged_entries=sum(r.entry_count for r in left),
                staged_bytes=sum(r.nbytes for r in left),
                unstaged_records=len(unstaged),
                unstaged_entries=sum(len(i.entries) for i in unstaged),
            )
            if state.unsettled:
                logger.warning(
                    "%s dropped batches were never settled: whether their ambiguous manifest "
                    "appends landed is unknown",
                    len(state.unsettled),
                )
            if state.fatal is None:
                state.fail_unsettled(
                    ClosedError(
                        f"producer closed before these entries were published; they remain "
                        f"staged in {wal_dir} and the next producer on it publishes them"
                    )
                )
        return report


def _byte_size(what: str, value: object) -> int:
    if isinstance(value, memoryview):
        if not value.c_contiguous:
            raise InvalidInputError(f"{what}: expected a contiguous memoryview")
        size = value.nbytes
    elif isinstance(value, (bytes, bytearray)):
        size = len(value)
    else:
        raise InvalidInputError(
            f"{what}: expected bytes, bytearray or memoryview, found {type(value).__name__}"
        )
    if size > MAX_RECORD_BYTES:
        raise InvalidInputError(f"{what}: expected at most {MAX_RECORD_BYTES} bytes, found {size}")
    return size
