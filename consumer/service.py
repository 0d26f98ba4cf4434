"""``millpond consume STORE_URL --sink URL``: the long-running consumer service.

It resumes after the sequence the sink recorded last, writes every batch into the database in
one transaction with its sequence and location, acks it, and goes on until SIGTERM or SIGINT;
then it dequeues what was acked and exits 0. It stops, naming the batch, on data it must not
skip (a corrupt batch or manifest, a missing object, a location outside the data prefix) and
writes nothing after it. When another consumer takes over it exits with code 3.

Throughput: when the read-ahead has several batches fetched (a backlog), they are written in
one transaction (``--max-group``), each with its own progress row, so a backlog costs one
commit per few batches instead of one per batch.

Retries: an idle queue is polled with backoff (``--poll-interval`` caps the pause); a store
or database that is down is retried with capped backoff for as long as it takes — reads,
writes, acks and their dequeues alike — because a batch is only acked after its transaction
committed and a retried transaction either commits once or finds its sequence already
recorded. ``--exit-when-idle`` drains the queue and exits,
for a consumer run as a scheduled job.
"""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import TypeVar

from millpond.cli.common import (
    add_store_arguments,
    parse_options,
    require_queue_unless_create,
    serving_metrics,
)
from millpond.common.clock import Clock, SystemClock
from millpond.consumer import _metrics
from millpond.consumer._batch import ConsumedBatch
from millpond.consumer._config import ConsumerConfig
from millpond.consumer._consumer import Consumer
from millpond.consumer.sinks import Sink, SinkError, open_sink
from millpond.errors import ConfigError, FencedError, FormatError, MillpondError, StorageError

__all__ = ["ConsumerService", "ServiceStats", "add_arguments", "run"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


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
    """The last sequence acked."""


class ConsumerService:
    """The consume loop: next batch, write it into the sink, ack; repeat until stopped."""

    def __init__(
        self,
        consumer: Consumer,
        sink: Sink,
        *,
        poll_min: float = 0.05,
        poll_max: float = 1.0,
        max_group: int = 16,
        retry_initial_delay: float = 0.5,
        retry_max_delay: float = 30.0,
        progress_interval: float = 10.0,
        clock: Clock | None = None,
    ) -> None:
        self._consumer = consumer
        self._sink = sink
        self._poll_min = poll_min
        self._poll_max = max(poll_min, poll_max)
        self._max_group = max(1, max_group)
        self._retry_initial = retry_initial_delay
        self._retry_max = max(retry_initial_delay, retry_max_delay)
        self._progress_interval = progress_interval
        self._clock = clock or SystemClock()
        self.stats = ServiceStats()
        self._window = ServiceStats()
        self._started = self._window_start = self._clock.monotonic()

    def run(self, stop: threading.Event, *, until_idle: bool = False) -> ServiceStats:
        """Consume until ``stop`` is set (or, with ``until_idle``, the queue is drained); then
        flush the acks.

        Raises:
            FencedError: another consumer took over.
            FormatError: a corrupt batch object or manifest, or a location outside the data
                prefix; nothing after it was written.
            NotFoundError: a manifest entry's object is missing; nothing after it was written.
            SinkError: the database refused a batch for good.
            InvalidInputError: the sink's last sequence does not fit this queue.
        """
        consumer = self._consumer
        self._started = self._clock.monotonic()
        try:
            # The sink refuses here, before this consumer takes over or dequeues anything, if it
            # holds another queue's progress.
            start = self._with_retry(
                stop,
                "read the sink's last sequence",
                functools.partial(self._sink.last_sequence, consumer.queue),
            )
            if stop.is_set():
                return self.stats
            # A store that is down at start-up is waited out like one that fails later.
            self._with_retry(
                stop,
                "take over the queue",
                functools.partial(consumer.initialize, last_acked_sequence=start),
            )
            if stop.is_set():
                return self.stats
            logger.info(
                "consuming %s from after sequence %s (epoch %s)",
                consumer.config.manifest_path,
                start,
                consumer.epoch,
            )
            self._window_start = self._clock.monotonic()
            self._loop(stop, until_idle=until_idle)
            # A store that is down when the work is done is waited out like one that fails
            # mid-run: a clean exit leaves nothing written in the queue.
            if not stop.is_set():
                self._with_retry(stop, "dequeue what was written", consumer.flush)
        except FencedError:
            self._close_quietly("fenced")
            raise
        except BaseException as err:
            if isinstance(err, MillpondError):
                logger.error(  # noqa: TRY400 - the message is the point; the CLI prints it too
                    "stopping after sequence %s; nothing after it is written: %s",
                    self.stats.last_sequence,
                    err,
                )
            # Dequeue what was written and acked, even when stopping on bad data; a failure
            # there must not hide why the service stopped.
            self._close_quietly(type(err).__name__)
            raise
        self._close_quietly(None)
        self._log_progress(final=True)
        return self.stats

    def _close_quietly(self, stopping_on: str | None) -> None:
        """Close the consumer (its final dequeue); log, never raise, what that hits.

        Nothing is lost when the final dequeue fails: every acked batch is in the sink, and
        the next consumer resumes after the sink's last sequence and dequeues what is left.
        """
        try:
            self._consumer.close()
        except MillpondError as err:
            logger.warning(
                "final dequeue failed%s; the next consumer dequeues what this one wrote: %s",
                f" while stopping on {stopping_on}" if stopping_on else "",
                err,
            )

    def _loop(self, stop: threading.Event, *, until_idle: bool) -> None:
        consumer = self._consumer
        idle_delay = self._poll_min
        while not stop.is_set():
            try:
                # With a backlog, batches the read-ahead already fetched share one transaction
                # (fewer commits, the same exactly-once guarantee per batch) and one fencing
                # check.
                group = consumer.next_batches(self._max_group)
            except StorageError as err:
                logger.warning("reading the queue failed, retrying in %.2f s: %s", idle_delay, err)
                stop.wait(idle_delay)
                idle_delay = min(idle_delay * 2, self._poll_max)
                continue
            if not group:
                if until_idle:
                    return
                stop.wait(idle_delay)
                idle_delay = min(idle_delay * 2, self._poll_max)
                self._maybe_log_progress()
                continue
            idle_delay = self._poll_min
            if not self._write_and_ack(group, stop):
                return  # stopped while the database was unavailable; nothing more is acked
            self._maybe_log_progress()

    def _write_and_ack(self, group: list[ConsumedBatch], stop: threading.Event) -> bool:
        """Write the group and ack it; ``False`` when stopped before it was written."""
        if len(group) > 1:
            rows_before = self._sink.rows_written
            try:
                results = self._with_retry(
                    stop,
                    f"write sequences {group[0].sequence}..{group[-1].sequence}",
                    functools.partial(self._sink.write_many, group),
                )
            except (FormatError, SinkError) as err:
                # Something in the group cannot be written: write one by one, so every batch
                # before the bad one still lands and the error names the bad one.
                logger.warning(
                    "sequences %s..%s cannot be written together (%s); writing one by one",
                    group[0].sequence,
                    group[-1].sequence,
                    err,
                )
            else:
                if results is None:
                    return False
                if not self._ack(group[-1], stop):
                    return False
                for batch, written in zip(group, results, strict=True):
                    self._count(batch, written, 0)
                self._count_rows(self._sink.rows_written - rows_before)
                return True
        for batch in group:
            rows_before = self._sink.rows_written
            one = self._with_retry(
                stop,
                f"write sequence {batch.sequence}",
                functools.partial(self._sink.write, batch),
            )
            if one is None:
                return False
            if not self._ack(batch, stop):
                return False
            self._count(batch, one, self._sink.rows_written - rows_before)
        return True

    def _ack(self, batch: ConsumedBatch, stop: threading.Event) -> bool:
        """Ack a written batch and every delivered one before it (one fencing check), retrying
        for as long as the store is down; ``False`` when stopped first (the batches are in the
        sink, so nothing is lost).

        An ack that was recorded but whose dequeue failed is not repeated: the next ack (or the
        final ``close()``) dequeues it with the rest.
        """

        def ack() -> bool:
            acked = self._consumer.acked_sequence
            if acked is None or acked < batch.sequence:
                self._consumer.ack_through(batch.sequence)
            return True

        return self._with_retry(stop, f"ack sequence {batch.sequence}", ack) is not None

    def _count(self, batch: ConsumedBatch, written: bool, rows: int) -> None:
        for stats in (self.stats, self._window):
            stats.last_sequence = batch.sequence
            stats.rows += rows
            if written:
                stats.batches += 1
            else:
                stats.skipped += 1

    def _count_rows(self, rows: int) -> None:
        self.stats.rows += rows
        self._window.rows += rows

    def _with_retry(self, stop: threading.Event, what: str, call: Callable[[], _T]) -> _T | None:
        delay = self._retry_initial
        while True:
            try:
                return call()
            except SinkError as err:
                if not err.transient:
                    raise
                logger.warning("could not %s, retrying in %.1f s: %s", what, delay, err)
            except StorageError as err:
                logger.warning("could not %s, retrying in %.1f s: %s", what, delay, err)
            if stop.wait(delay):
                return None
            delay = min(delay * 2, self._retry_max)

    def _maybe_log_progress(self) -> None:
        if self._clock.monotonic() - self._window_start >= self._progress_interval:
            self._log_progress(final=False)

    def _log_progress(self, *, final: bool) -> None:
        now = self._clock.monotonic()
        stats = self.stats if final else self._window
        elapsed = max(now - (self._started if final else self._window_start), 1e-9)
        backlog = self._consumer.backlog()
        lag = (
            max(0.0, (self._clock.now_ms() - backlog.oldest_ingestion_ms) / 1000)
            if backlog.oldest_ingestion_ms is not None
            else 0.0
        )
        logger.info(
            "%s%s batches (%.1f/s), %s rows (%.0f/s), %s skipped, last sequence %s, "
            "lag %.1f s, %s entries waiting",
            f"stopped after {elapsed:.1f} s: " if final else "",
            stats.batches,
            stats.batches / elapsed,
            stats.rows,
            stats.rows / elapsed,
            stats.skipped,
            self.stats.last_sequence,
            lag,
            backlog.entries,
        )
        if not final:
            self._window_start = now
            self._window = ServiceStats()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser, output=False)
    parser.add_argument(
        "--create",
        action="store_true",
        help="start an empty queue when there is none at STORE_URL (else refuse: a typo)",
    )
    parser.add_argument(
        "--sink", required=True, metavar="URL", help="sqlite:///path.db or postgresql://..."
    )
    parser.add_argument("--table", default="millpond_rows", help="target table [schema.]name")
    parser.add_argument(
        "--entry-format",
        choices=("auto", "arrow", "opaque"),
        default="auto",
        help="Arrow IPC entries become rows with their columns; opaque entries one row each",
    )
    parser.add_argument(
        "--sequence-column",
        default="_millpond_sequence",
        help="column holding each Arrow row's batch sequence ('' for none)",
    )
    parser.add_argument("--progress-table", default="millpond_progress")
    parser.add_argument("--ack-batch-size", type=int, default=100, help="acks per dequeue")
    parser.add_argument("--read-ahead", type=int, default=4, help="batch objects fetched ahead")
    parser.add_argument(
        "--max-group",
        type=int,
        default=16,
        help="most batches written in one transaction when there is a backlog (default 16)",
    )
    parser.add_argument(
        "--poll-interval", type=float, default=1.0, help="longest pause between idle polls (s)"
    )
    parser.add_argument(
        "--progress-interval", type=float, default=10.0, help="seconds between progress lines"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--exit-when-idle",
        action="store_true",
        help="stop once the queue is drained (for a scheduled job) instead of polling",
    )
    parser.add_argument(
        "--gc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the garbage collector in this process (default on)",
    )
    parser.add_argument("--gc-interval", type=float, default=300.0, help="seconds (default 300)")
    parser.add_argument(
        "--gc-grace-period", type=float, default=600.0, help="seconds (default 600)"
    )
    _metrics.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the service until SIGTERM or SIGINT.

    Raises:
        FencedError: another consumer took over (the CLI exits 3).
        MillpondError: bad data, a bad configuration or a refusing database (exit 1).
    """
    if not args.quiet:
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
    config = ConsumerConfig(
        store=args.store,
        store_options=parse_options(args.store_option),
        manifest_path=args.manifest_path,
        data_path_prefix=args.data_prefix,
        ack_batch_size=args.ack_batch_size,
        read_ahead=args.read_ahead,
        gc_enabled=args.gc,
        gc_interval=args.gc_interval,
        gc_grace_period=args.gc_grace_period,
    )
    if args.poll_interval <= 0:
        raise ConfigError("poll-interval", f"expected > 0 seconds, found {args.poll_interval}")
    stop = threading.Event()
    with (
        _stop_on_signals(stop),
        open_sink(
            args.sink,
            table=args.table,
            entry_format=args.entry_format,
            sequence_column=args.sequence_column or None,
            progress_table=args.progress_table,
        ) as sink,
    ):
        require_queue_unless_create(args)  # every option is checked first: a typo is usage
        consumer = Consumer(config)
        timed = _metrics.TimedSink(sink)
        metrics = _metrics.ConsumerMetrics(consumer, timed, interval=args.metrics_interval)
        service = ConsumerService(
            consumer,
            timed,
            poll_max=args.poll_interval,
            max_group=args.max_group,
            progress_interval=args.progress_interval,
        )
        with (
            serving_metrics(args, [metrics.collector()]) as server,
            metrics.sampling(enabled=server is not None),
        ):
            service.run(stop, until_idle=args.exit_when_idle)
    return 0


@contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set ``stop``: the loop finishes its batch, flushes and returns."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        logger.info("received %s; finishing the current batch", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
