"""The long-running consumer service behind ``millpond consume`` (its command line:
:mod:`millpond.consumer.app.command`).

It resumes after the sequence the sink recorded last, writes every batch into the database in
one transaction with its sequence and location, acks it, and goes on until SIGTERM or SIGINT;
then it dequeues what was acked and exits 0. It stops, naming the batch, on data it must not
skip (a corrupt batch or manifest, a missing object, a location outside the data prefix) and
writes nothing after it. When another consumer takes over it exits with code 3.

Throughput: when the read-ahead has several batches fetched (a backlog), they are written in
one transaction (``--max-group``, 64 by default; the read-ahead's own bounds, 64 batches and
``read_ahead_bytes`` of decoded rows, bound it too), each with its own progress row, so a
backlog costs one commit per many batches instead of one per batch. A queue feeding several
tables writes each table's share of a group with one COPY: the bigger the group, the more
rows each COPY carries (issue 46: ten tables at 0.75-0.85 of one table with groups of 16
batches, 0.91 with 64).

Retries: an idle queue is polled with backoff (``--poll-interval`` caps the pause); a store
or database that is down is retried with capped backoff for as long as it takes — reads,
writes, acks and their dequeues alike — because a batch is only acked after its transaction
committed and a retried transaction either commits once or finds its sequence already
recorded. ``--exit-when-idle`` drains the queue and exits,
for a consumer run as a scheduled job.

Bad batches: by default the service stops on a batch it cannot decode or the database refuses
for good, naming it, and says how to set it aside (``millpond quarantine``, see
:mod:`millpond.consumer.app.quarantine`). ``--on-bad-batch quarantine`` sets such batches aside by
itself, counting each, and stops after ``--quarantine-limit`` in a row (then the cause is the
database or the configuration, not the data). Only an error of a batch's own object (missing,
corrupt: a :class:`~millpond.errors.BadBatchError`) or rows the database refuses make a bad
batch; a manifest that answers 404 or bytes that do not decode is retried a few times
(:data:`MANIFEST_ATTEMPTS`), then stops the service naming the manifest, setting nothing
aside. Moving past a batch is an ack (with its fencing check), never a new takeover: a service
that has lost the queue stops with ``FencedError``.

Report: every ``--report-interval`` seconds, and when it stops, the service writes what it is
doing where ``millpond status`` reads it from any other process
(:mod:`millpond.consumer.app._report`).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import TypeVar

from millpond.common.clock import Clock, SystemClock
from millpond.common.durations import check_count, check_duration
from millpond.consumer._batch import ConsumedBatch
from millpond.consumer._consumer import Backlog, Consumer
from millpond.consumer.app._report import ServiceReporter, ServiceState
from millpond.consumer.app.quarantine import (
    dead_letter_prefix_for,
    set_aside,
)
from millpond.consumer.sinks import QuarantineLedger, Sink, SinkError
from millpond.consumer.takeover import take_over
from millpond.errors import (
    BadBatchError,
    ConfigError,
    FencedError,
    FormatError,
    MillpondError,
    NotFoundError,
    StorageError,
)
from millpond.formats.manifest import ManifestEntry

__all__ = [
    "MANIFEST_ATTEMPTS",
    "BadBatchPolicy",
    "ConsumerService",
    "ServiceStats",
    "StartTimeoutError",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

MANIFEST_ATTEMPTS = 6
"""Reads of the manifest that may fail in a row (404, bytes that do not decode) before the
service stops naming it: about 15 s at the default retry delays (0.5 s doubling)."""


class StartTimeoutError(MillpondError):
    """The database or the store did not answer within the service's start timeout."""


class BadBatchPolicy(StrEnum):
    """What the service does with a batch it cannot decode or the database refuses for good."""

    STOP = "stop"
    """Stop, naming it (the default): an operator decides (``millpond quarantine``)."""
    QUARANTINE = "quarantine"
    """Copy it to the dead-letter prefix, record it quarantined, count it, go on."""


@dataclass(slots=True)
class ServiceStats:
    """What a service run did."""

    batches: int = 0
    """Batches written (skipped ones not counted)."""
    skipped: int = 0
    """Batches skipped because their sequence or location was already recorded."""
    rows: int = 0
    """Rows written."""
    last_sequence: int | None = None
    """The last sequence written into the sink (or skipped, or set aside); acked with the next
    delivery, and at the latest when the service stops."""
    quarantined: int = 0
    """Batches set aside by ``--on-bad-batch quarantine``."""


def _check_settings(
    max_group: int, quarantine_limit: int, progress_interval: float, **durations: float
) -> None:
    """Raises:
    ConfigError: ``max_group`` or ``quarantine_limit`` is not an integer >= 1; a duration is
        not a finite number of seconds > 0 (``progress_interval`` >= 0).
    """
    check_count("max_group", max_group)
    check_count("quarantine_limit", quarantine_limit)
    for key, seconds in durations.items():
        check_duration(key, seconds, allow_zero=False)
    # 0: a progress line after every group.
    check_duration("progress_interval", progress_interval, allow_zero=True)


def _bad_batch_handling(
    on_bad_batch: BadBatchPolicy | str, sink: Sink, ledger: QuarantineLedger | None
) -> tuple[BadBatchPolicy, QuarantineLedger | None]:
    """The bad-batch policy and the ledger that records quarantines (``sink`` itself when
    none is given and it can).

    Raises:
        ConfigError: ``on_bad_batch`` is not ``stop`` or ``quarantine``, or ``quarantine``
            with a sink that cannot record quarantines.
    """
    try:
        policy = BadBatchPolicy(on_bad_batch)
    except ValueError:
        raise ConfigError(
            "on_bad_batch", f"expected 'stop' or 'quarantine', found {on_bad_batch!r}"
        ) from None
    if ledger is None and isinstance(sink, QuarantineLedger):
        ledger = sink
    if policy is BadBatchPolicy.QUARANTINE and ledger is None:
        raise ConfigError(
            "on_bad_batch",
            f"expected a sink that records quarantines (SQLite, PostgreSQL), found {sink!r}",
        )
    return policy, ledger


class ConsumerService:
    """The consume loop: next batch, write it into the sink, ack; repeat until stopped."""

    def __init__(
        self,
        consumer: Consumer,
        sink: Sink,
        *,
        poll_min: float = 0.05,
        poll_max: float = 1.0,
        max_group: int = 64,
        retry_initial_delay: float = 0.5,
        retry_max_delay: float = 30.0,
        progress_interval: float = 10.0,
        clock: Clock | None = None,
        on_bad_batch: BadBatchPolicy | str = BadBatchPolicy.STOP,
        dead_letter_prefix: str | None = None,
        quarantine_limit: int = 10,
        reporter: ServiceReporter | None = None,
        ledger: QuarantineLedger | None = None,
        start_timeout: float | None = None,
    ) -> None:
        """``ledger`` records quarantines (default ``sink`` itself, when it can: pass it when
        ``sink`` wraps the database's sink, as the metrics' timing wrapper does).
        ``start_timeout``: how long the start (reading the sink's progress, taking the queue
        over) waits out a database or a store that does not answer before :meth:`run` gives up
        naming it; ``None`` waits as long as it takes, as the rest of the run does.

        Raises:
        ConfigError: ``on_bad_batch`` is not ``stop`` or ``quarantine``, or ``quarantine``
            with a sink that cannot record quarantines; ``max_group`` or
            ``quarantine_limit`` is not an integer >= 1; a duration is not a finite number
            of seconds > 0 (``progress_interval`` >= 0).
        """
        _check_settings(
            max_group,
            quarantine_limit,
            progress_interval,
            poll_min=poll_min,
            poll_max=poll_max,
            retry_initial_delay=retry_initial_delay,
            retry_max_delay=retry_max_delay,
        )
        self._on_bad_batch, self._ledger = _bad_batch_handling(on_bad_batch, sink, ledger)
        self._dead_letter = dead_letter_prefix_for(consumer.config, dead_letter_prefix)
        self._quarantine_limit = quarantine_limit
        self._bad_in_a_row = 0
        self._reporter = reporter
        self._consumer = consumer
        self._sink = sink
        self._poll_min = poll_min
        self._poll_max = max(poll_min, poll_max)
        self._max_group = max_group
        self._retry_initial = retry_initial_delay
        self._retry_max = max(retry_initial_delay, retry_max_delay)
        self._progress_interval = progress_interval
        self._clock = clock or SystemClock()
        self._start_timeout = start_timeout
        self._init_run_state()

    def _init_run_state(self) -> None:
        """What a run counts and carries from one group to the next."""
        self.stats = ServiceStats()
        # The totals at the last progress line: the next one tells what was done since.
        self._logged = ServiceStats()
        # The next group, being delivered while the current one is written.
        self._ahead: Future[list[ConsumedBatch]] | None = None
        # The last sequence written into the sink (acked with the next delivery).
        self._written_through: int | None = None
        self._manifest_failures = 0  # reads of the manifest that failed in a row
        self._started = self._window_start = self._clock.monotonic()

    def run(self, stop: threading.Event, *, until_idle: bool = False) -> ServiceStats:
        """Consume until ``stop`` is set (or, with ``until_idle``, the queue is drained); then
        flush the acks.

        Raises:
            FencedError: another consumer took over.
            FormatError: a corrupt batch object (``CorruptBatchError``) or a location outside
                the data prefix; nothing after it was written. Or a manifest that did not
                decode :data:`MANIFEST_ATTEMPTS` times in a row.
            NotFoundError: a manifest entry's object is missing (``BatchNotFoundError``);
                nothing after it was written. Or a manifest missing that many times in a row.
            SinkError: the database refused a batch for good.
            InvalidInputError: the sink's last sequence does not fit this queue.
        """
        self._started = self._clock.monotonic()
        try:
            if not self._take_over(stop):
                return self.stats
            self._window_start = self._clock.monotonic()
            self._loop(stop, until_idle=until_idle)
            self._dequeue_written(stop)
        except FencedError as err:
            self._close_quietly("fenced")
            self._finish_report(ServiceState.FENCED, err)
            raise
        except BaseException as err:
            self._stopped_by(err)
            raise
        self._close_quietly(None)
        self._log_progress(final=True)
        self._finish_report(ServiceState.STOPPED, None)
        return self.stats

    def _take_over(self, stop: threading.Event) -> bool:
        """Take the queue over from after the sink's last sequence, waiting out a store or a
        database that is down; ``False`` when stopped first."""
        consumer = self._consumer
        timeout = self._start_timeout
        deadline = None if timeout is None else self._clock.monotonic() + timeout
        progress = functools.partial(self._sink.last_sequence, consumer.queue)
        # The sink refuses here, before this consumer takes over or dequeues anything, if it
        # holds another queue's progress.
        start = self._with_retry(stop, "read the sink's last sequence", progress, deadline=deadline)
        if stop.is_set():
            return False
        # A store that is down at start-up is waited out like one that fails later. An
        # older consumer still running may have written and dequeued past ``start``
        # meanwhile: the sink is read again once it is fenced (take_over).
        start = self._with_retry(
            stop,
            "take over the queue",
            functools.partial(take_over, consumer, progress, read=start),
            deadline=deadline,
        )
        if stop.is_set():
            return False
        logger.info(
            "consuming %s from after sequence %s (epoch %s)",
            consumer.config.manifest_path,
            start,
            consumer.epoch,
        )
        if self._reporter is not None:
            self._reporter.start(consumer.epoch, written_through=start)
        return True

    def _dequeue_written(self, stop: threading.Event) -> None:
        """After the loop: dequeue what was written, or, when stopped, ack what was written and
        not acked yet (the last group), retrying while the store is down and ``stop`` is not
        set."""
        # A store that is down when the work is done is waited out like one that fails
        # mid-run: a clean exit leaves nothing written in the queue. The last group
        # written is acked with the dequeue (no delivery follows to carry it).
        if not stop.is_set():
            self._with_retry(
                stop,
                "dequeue what was written",
                lambda: self._consumer.flush(ack_through=self._to_ack()),
                reads_manifest=True,
            )
        elif (sequence := self._to_ack()) is not None:
            self._ack(sequence, stop)

    def _stopped_by(self, err: BaseException) -> None:
        """The run stops on ``err`` (not a fencing): log why, dequeue what was written, and
        report the stop."""
        if isinstance(err, MillpondError):
            # Why is the error itself, which the caller gets (the command prints it once).
            last = self.stats.last_sequence
            logger.error(
                "stopping before writing anything"
                if last is None
                else f"stopping after sequence {last}; nothing after it is written"
            )
        # Dequeue what was written and acked, even when stopping on bad data; a failure
        # there must not hide why the service stopped.
        self._close_quietly(type(err).__name__)
        self._finish_report(ServiceState.STOPPED, err)

    def _finish_report(self, state: ServiceState, err: BaseException | None) -> None:
        if self._reporter is None:
            return
        self._report_progress()
        error = None if err is None else f"{type(err).__name__}: {err}"
        self._reporter.finish(state, error)

    def _close_quietly(self, stopping_on: str | None) -> None:
        """Close the consumer (its final dequeue); log, never raise, what that hits.

        Nothing is lost when the final dequeue fails: every acked batch is in the sink, and
        the next consumer resumes after the sink's last sequence and dequeues what is left.
        """
        sequence = self._to_ack()
        if sequence is not None and not self._consumer.fenced:
            # The last group written waits for an ack that no delivery will carry now.
            try:
                self._consumer.ack_through(sequence)
            except MillpondError as err:
                logger.warning(
                    "acking sequence %s failed; the next consumer dequeues what this one wrote: %s",
                    sequence,
                    err,
                )
        try:
            self._consumer.close()
        except MillpondError as err:
            logger.warning(
                "final dequeue failed%s; the next consumer dequeues what this one wrote: %s",
                f" while stopping on {stopping_on}" if stopping_on else "",
                err,
            )

    def _loop(self, stop: threading.Event, *, until_idle: bool) -> None:
        # One thread delivers the next group (acking the one written before it, under one
        # fencing check) while this one writes the current group into the database: the
        # store's round trips hide behind the database's work. This thread uses the consumer
        # only while no delivery is under way, so the two never interleave their calls.
        with ThreadPoolExecutor(1, thread_name_prefix="millpond-deliver") as courier:
            try:
                self._loop_with(courier, stop, until_idle=until_idle)
            finally:
                self._ahead_done()

    def _loop_with(
        self, courier: ThreadPoolExecutor, stop: threading.Event, *, until_idle: bool
    ) -> None:
        consumer = self._consumer
        idle_delay = self._poll_min
        while not stop.is_set():
            group = self._take_ahead(until_idle=until_idle)
            if group is None:
                try:
                    # Acks what was written before and delivers the next group (the
                    # read-ahead's fetched batches, several when there is a backlog) under
                    # one fencing check.
                    group = consumer.next_batches(self._max_group, ack_through=self._to_ack())
                except StorageError as err:
                    logger.warning(
                        "reading the queue failed, retrying in %.2f s: %s", idle_delay, err
                    )
                    if self._reporter is not None:
                        self._reporter.error(f"reading the queue failed: {err}", retrying=True)
                    stop.wait(idle_delay)
                    idle_delay = min(idle_delay * 2, self._poll_max)
                    continue
                except BadBatchError as err:
                    # A batch object that cannot be read. Everything written before it is
                    # acked by now.
                    if not self._bad_batch(None, err, stop):
                        return
                    continue
                except (FormatError, NotFoundError) as err:
                    # The manifest itself (the fencing check, a refresh): no batch is at
                    # fault, none is set aside.
                    if not self._manifest_trouble(err, stop):
                        return
                    continue
                self._manifest_failures = 0
            if not group:
                self._report_progress()
                if until_idle:
                    return
                stop.wait(idle_delay)
                idle_delay = min(idle_delay * 2, self._poll_max)
                self._maybe_log_progress()
                continue
            idle_delay = self._poll_min
            self._report_progress()  # the consumer is not busy: backlog() does not wait
            self._maybe_log_progress()
            # The group written last is acked with the next delivery, which starts now.
            self._ahead = courier.submit(
                consumer.next_batches, self._max_group, ack_through=self._to_ack()
            )
            if not self._write_group(group, stop):
                return  # stopped while the database was unavailable; nothing more is acked

    def _manifest_trouble(self, err: FormatError | NotFoundError, stop: threading.Event) -> bool:
        """The manifest answered 404 or bytes that do not decode: retried with backoff while
        it may be passing (a store answering 404 for a moment, a read cut short), then a stop
        naming the manifest. ``False`` when stopped meanwhile.

        Raises:
            FormatError, NotFoundError: the same error, :data:`MANIFEST_ATTEMPTS` times in a
                row, with the manifest named.
        """
        self._manifest_failures += 1
        manifest = f"{self._consumer.store.url}/{self._consumer.config.manifest_path}"
        if self._manifest_failures >= MANIFEST_ATTEMPTS:
            raise type(err)(
                f"the queue manifest {manifest} could not be read {self._manifest_failures} "
                f"times in a row (no batch is at fault; none was set aside): {err}"
            ) from err
        delay = min(self._retry_initial * 2 ** (self._manifest_failures - 1), self._retry_max)
        logger.warning(
            "reading the queue manifest %s failed (%s of %s), retrying in %.1f s: %s",
            manifest,
            self._manifest_failures,
            MANIFEST_ATTEMPTS,
            delay,
            err,
        )
        self._note_retry("read the queue manifest", err)
        return not stop.wait(delay)

    def _take_ahead(self, *, until_idle: bool) -> list[ConsumedBatch] | None:
        """The group delivered while the last one was written; ``None`` when there is none,
        or when its delivery failed (the caller asks again, which meets the same error and
        handles it, or succeeds), or when it came back empty with a write still to ack and
        the service goes on (the ack goes with the next call; a service that stops when
        idle acks it with its final dequeue).

        Raises:
            FencedError: another consumer took over (this one stops).
        """
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        try:
            group = ahead.result()
        except FencedError:
            raise
        except MillpondError as err:
            logger.debug("delivering ahead failed, asking again: %s", err)
            return None
        if not group and not until_idle and self._to_ack() is not None:
            return None
        return group

    def _ahead_done(self) -> None:
        """Wait until the delivery under way (if any) has finished; its outcome is kept for
        :meth:`_take_ahead`."""
        if self._ahead is not None:
            wait([self._ahead])

    def _to_ack(self) -> int | None:
        """The last sequence written into the sink when the consumer has not acked it yet."""
        written = self._written_through
        acked = self._consumer.acked_sequence
        if written is None or (acked is not None and acked >= written):
            return None
        return written

    def _write_group(self, group: list[ConsumedBatch], stop: threading.Event) -> bool:
        """Write the group in one transaction; it is acked with the next delivery. ``False``
        when stopped before it was written.

        A group that cannot be written together is written one by one, each batch acked on
        its own, so every batch before a bad one still lands and the error names the bad one.
        """
        rows_before = self._sink.rows_written
        try:
            results = self._write(group, stop)
        except (FormatError, SinkError) as err:  # permanent: transient ones are retried
            # What follows acks on its own and may set batches aside: the delivery under
            # way finishes first (its group is kept and written next).
            self._ahead_done()
            if len(group) == 1:
                return self._bad_batch(group[0], err, stop)
            # Not the error's text: writing one by one names the batch it is about, once.
            logger.warning(
                "sequences %s..%s cannot be written together (%s); writing one by one",
                group[0].sequence,
                group[-1].sequence,
                type(err).__name__,
            )
            return self._write_one_by_one(group, stop)
        if results is None:
            return False
        self._written_through = group[-1].sequence
        for batch, written in zip(group, results, strict=True):
            self._count(batch, written, 0)
        self.stats.rows += self._sink.rows_written - rows_before
        return True

    def _write(self, group: list[ConsumedBatch], stop: threading.Event) -> list[bool] | None:
        """Write the group in one transaction (``write`` for one batch, ``write_many`` for
        more), retried while the database is down; what each batch's write returned, or
        ``None`` when stopped first.

        Raises:
            FormatError, SinkError: a permanent failure (transient ones are retried).
        """
        if len(group) > 1:
            return self._with_retry(
                stop,
                f"write sequences {group[0].sequence}..{group[-1].sequence}",
                functools.partial(self._sink.write_many, group),
            )
        one = self._with_retry(
            stop,
            f"write sequence {group[0].sequence}",
            functools.partial(self._sink.write, group[0]),
        )
        return None if one is None else [one]

    def _write_one_by_one(self, group: list[ConsumedBatch], stop: threading.Event) -> bool:
        for batch in group:
            rows_before = self._sink.rows_written
            try:
                results = self._write([batch], stop)
            except (FormatError, SinkError) as err:  # permanent: transient ones are retried
                if not self._bad_batch(batch, err, stop):
                    return False
                continue
            if results is None:
                return False
            if not self._ack(batch.sequence, stop):
                return False
            self._count(batch, results[0], self._sink.rows_written - rows_before)
        return True

    def _ack(self, sequence: int, stop: threading.Event) -> bool:
        """Ack the written ``sequence`` and every delivered one before it (one fencing check),
        retrying for as long as the store is down; ``False`` when stopped first (the batches are
        in the sink, so nothing is lost).

        An ack that was recorded but whose dequeue failed is not repeated: the next ack (or the
        final ``close()``) dequeues it with the rest.
        """

        def ack() -> bool:
            acked = self._consumer.acked_sequence
            if acked is None or acked < sequence:
                self._consumer.ack_through(sequence)
            return True

        acked = self._with_retry(stop, f"ack sequence {sequence}", ack, reads_manifest=True)
        return acked is not None

    def _count(self, batch: ConsumedBatch, written: bool, rows: int) -> None:
        stats = self.stats
        stats.last_sequence = batch.sequence
        stats.rows += rows
        if written:
            stats.batches += 1
            self._bad_in_a_row = 0
        else:
            stats.skipped += 1
        if self._reporter is not None:  # committed in the sink: producers may be waiting
            self._reporter.written_through(batch.sequence)

    # -- bad batches -----------------------------------------------------------------------

    def _bad_batch(
        self, batch: ConsumedBatch | None, err: MillpondError, stop: threading.Event
    ) -> bool:
        """A batch that cannot be written: stop on it (raise ``err``) or set it aside.

        ``batch`` is ``None`` when it could not even be fetched or decoded (``err`` is then
        the :class:`BadBatchError` naming it). ``False`` when stopped meanwhile.

        Raises:
            MillpondError: ``err`` itself when stopping on it (the default), or when
                ``quarantine_limit`` batches in a row were set aside; what setting it aside
                ran into (a missing object, a sink of another queue).
        """
        entry = self._bad_entry(batch, err)
        sequence, location = entry.sequence, entry.location
        why = f"{type(err).__name__}: {err}"
        if batch is None and isinstance(err, NotFoundError):
            recorded = self._with_retry(
                stop,
                f"look up sequence {sequence}'s location in the sink",
                functools.partial(self._skip_recorded, location, sequence),
            )
            if recorded is None:
                return False
            if recorded[0] is not None:
                logger.warning(
                    "sequence %s (%s) is a duplicate of sequence %s, recorded before; its "
                    "object is gone (collected after that one was consumed): moving past it",
                    sequence,
                    location,
                    recorded[0],
                )
                return self._moved_past(None, sequence, stop, skipped=True)
        looked = self._with_retry(
            stop,
            f"look up sequence {sequence}'s location in the quarantine",
            functools.partial(self._set_aside_earlier, location, sequence),
        )
        if looked is None:
            return False
        earlier = looked[0]
        if earlier is not None:
            # The same location appended again (a producer that recovered after its first
            # append was dequeued), set aside under an earlier sequence: not a new bad batch to
            # stop on but a duplicate, recorded as one like any location written twice.
            why = f"a duplicate of sequence {earlier}, set aside before ({why})"
        else:
            self._stop_on_bad_batch(sequence, location, why, err)
        return self._set_aside(batch, entry, why, stop, duplicate=earlier is not None)

    def _bad_entry(self, batch: ConsumedBatch | None, err: MillpondError) -> ManifestEntry:
        """The entry of the bad batch: ``batch``'s, or, when it could not be fetched, the one
        the consumer delivers next.

        Raises:
            MillpondError: ``err`` itself when it does not name the entry the consumer
                delivers next (nothing to set aside).
        """
        if batch is not None:
            return ManifestEntry(batch.sequence, batch.location, batch.metadata)
        entry = self._consumer.next_entry()
        if (
            not isinstance(err, BadBatchError)
            or entry is None
            or (entry.sequence, entry.location) != (err.sequence, err.location)
        ):
            raise err  # not the batch the consumer would deliver next: nothing to set aside
        return entry

    def _set_aside(
        self,
        batch: ConsumedBatch | None,
        entry: ManifestEntry,
        why: str,
        stop: threading.Event,
        *,
        duplicate: bool,
    ) -> bool:
        """Copy the bad batch to the dead-letter prefix, record it quarantined (a
        ``duplicate`` of one set aside before: recorded as such, not counted as bad), and
        move past it; ``False`` when stopped meanwhile."""
        sequence, location = entry.sequence, entry.location
        sink = self._ledger
        assert sink is not None  # checked in __init__
        consumer = self._consumer
        reason = why if duplicate else f"--on-bad-batch quarantine: {why}"
        outcome = self._with_retry(
            stop,
            f"set aside sequence {sequence}",
            functools.partial(
                set_aside,
                consumer.store,
                sink,
                queue=consumer.queue,
                sequence=sequence,
                location=location,
                metadata=entry.metadata,
                reason=reason,
                dead_letter_prefix=self._dead_letter,
                clock=self._clock,
            ),
        )
        if outcome is None:
            return False
        if self._reporter is not None:  # its rows are not in the table: waiters must know
            self._reporter.set_aside(sequence, reason)
        if not duplicate:
            self._bad_in_a_row += 1
        logger.warning(
            "set aside sequence %s (%s), %s this run: %s",
            sequence,
            location,
            self.stats.quarantined + (not duplicate),
            why,
        )
        return self._moved_past(batch, sequence, stop, skipped=duplicate)

    def _moved_past(
        self, batch: ConsumedBatch | None, sequence: int, stop: threading.Event, *, skipped: bool
    ) -> bool:
        """Count ``sequence`` as skipped or quarantined and go on after it; ``False`` when
        stopped meanwhile."""
        consumer = self._consumer
        stats = self.stats
        stats.last_sequence = sequence
        if skipped:
            stats.skipped += 1
        else:
            stats.quarantined += 1
        if batch is not None:
            if not self._ack(batch.sequence, stop):
                return False
        else:
            # Never delivered: the consumer would fetch it again. Acknowledged without being
            # delivered, under a fencing check like any ack; never a new takeover, which
            # would fence a consumer that took the queue over meanwhile.
            def move_past() -> bool:
                consumer.pass_over(sequence)
                return True

            moved = self._with_retry(
                stop, f"move past sequence {sequence}", move_past, reads_manifest=True
            )
            if moved is None:
                return False
        if self._reporter is not None:
            self._reporter.moved_past(consumer.epoch)
            self._reporter.written_through(sequence)
        self._report_progress()
        return True

    def _skip_recorded(self, location: str, sequence: int) -> tuple[int | None]:
        """The earlier sequence ``location`` is recorded under in the sink, after recording
        ``sequence`` as its duplicate (``None``: it is not, or no ledger can tell), in a
        tuple."""
        if self._ledger is None:
            return (None,)
        return (
            self._ledger.skip_recorded(self._consumer.queue, sequence=sequence, location=location),
        )

    def _set_aside_earlier(self, location: str, sequence: int) -> tuple[int | None]:
        """The earlier sequence ``location`` was set aside under (``None``: it was not, or
        no ledger can tell), in a tuple."""
        if self._ledger is None:
            return (None,)
        rows = self._ledger.quarantined(self._consumer.queue)
        earlier = [row.sequence for row in rows if row.location == location]
        return (min((n for n in earlier if n < sequence), default=None),)

    def _stop_on_bad_batch(
        self, sequence: int, location: str, why: str, err: MillpondError
    ) -> None:
        """Raise ``err`` under the stop policy, or when ``quarantine_limit`` batches in a row
        were set aside; report the stop."""
        if self._reporter is not None:
            self._reporter.stopped_on(sequence, location, why)
        if self._on_bad_batch is BadBatchPolicy.STOP:
            stopped = self._reporter.report.stopped_on if self._reporter is not None else None
            if stopped is not None:
                logger.error(
                    "stopped on sequence %s; to set it aside: %s", sequence, stopped.command
                )
            raise err
        if self._bad_in_a_row >= self._quarantine_limit:
            raise MillpondError(
                f"{self._bad_in_a_row} batches in a row were set aside; stopping on sequence "
                f"{sequence} ({location}) instead: that many look like a problem of the "
                f"database or the configuration, not of the data. {why}"
            ) from err

    def _report_progress(self) -> None:
        if self._reporter is not None:  # the report's totals are the run's, by the same names
            lag = round(self._lag(self._consumer.backlog()), 3)
            self._reporter.progress(**asdict(self.stats), lag_seconds=lag)

    def _lag(self, backlog: Backlog) -> float:
        """Seconds since the oldest record of the next undelivered entry (0: none known)."""
        oldest = backlog.oldest_ingestion_ms
        return 0.0 if oldest is None else max(0.0, (self._clock.now_ms() - oldest) / 1000)

    def _with_retry(
        self,
        stop: threading.Event,
        what: str,
        call: Callable[[], _T],
        *,
        reads_manifest: bool = False,
        deadline: float | None = None,
    ) -> _T | None:
        """``call()``, retried with capped backoff while the store or the database is down;
        ``None`` when stopped first. Past ``deadline`` (the start timeout, on the service's
        clock) a failure is raised, naming what could not be done and why.

        ``reads_manifest``: ``call`` is a consumer call that checks the epoch (an ack, a move
        past a batch, the final dequeue) and delivers nothing, so a ``FormatError`` or
        ``NotFoundError`` from it is the manifest's: retried as :meth:`_manifest_trouble`
        says, never taken for a bad batch.
        """
        delay = self._retry_initial
        while True:
            try:
                result = call()
            except (FormatError, NotFoundError) as err:
                if not reads_manifest or isinstance(err, BadBatchError):
                    raise
                if not self._manifest_trouble(err, stop):
                    return None
                continue
            except (SinkError, StorageError) as err:
                if isinstance(err, SinkError) and not err.transient:
                    raise
                left = None if deadline is None else deadline - self._clock.monotonic()
                if left is not None and left <= 0:
                    raise StartTimeoutError(
                        f"could not {what} within {self._start_timeout:g} s of starting, giving "
                        f"up (--start-timeout): {err}"
                    ) from err
                logger.warning("could not %s, retrying in %.1f s: %s", what, delay, err)
                self._note_retry(what, err)
            else:
                if reads_manifest:
                    self._manifest_failures = 0
                return result
            if stop.wait(delay if left is None else min(delay, left)):
                return None
            delay = min(delay * 2, self._retry_max)

    def _note_retry(self, what: str, err: MillpondError) -> None:
        if self._reporter is not None:
            self._reporter.error(f"could not {what} (retrying): {err}", retrying=True)

    def _maybe_log_progress(self) -> None:
        if self._clock.monotonic() - self._window_start >= self._progress_interval:
            self._log_progress(final=False)

    def _log_progress(self, *, final: bool) -> None:
        now = self._clock.monotonic()
        stats = self.stats
        since = ServiceStats() if final else self._logged
        elapsed = max(now - (self._started if final else self._window_start), 1e-9)
        batches, rows = stats.batches - since.batches, stats.rows - since.rows
        backlog = self._consumer.backlog()
        logger.info(
            "%s%s batches (%.1f/s), %s rows (%.0f/s), %s skipped, last sequence %s, "
            "lag %.1f s, %s entries waiting",
            f"stopped after {elapsed:.1f} s: " if final else "",
            batches,
            batches / elapsed,
            rows,
            rows / elapsed,
            stats.skipped - since.skipped,
            stats.last_sequence,
            self._lag(backlog),
            backlog.entries,
        )
        if not final:
            self._window_start = now
            self._logged = replace(stats)
