"""The consumer's metrics: what ``millpond consume --metrics-port`` serves on ``/metrics``.

Three sources, none of which exports anything by itself:

* the :class:`~millpond.consumer.Consumer`'s own counters and histograms (batch object bytes
  and fetch times, manifest writes and conflicts, its collector's passes, deletes and times);
* :class:`TimedSink`, a pass-through around the sink that times each transaction and counts
  written and skipped batches;
* :class:`QueueSampler`, a daemon thread that looks at the queue every ``interval`` seconds
  (no fencing, nothing written) for its length, bytes and lag. Length and lag count the
  entries past the consumer's last ack at scrape time (the lag from the oldest entry the
  consumer has not acked, which it knows without IO), so they fall to 0 as soon as the queue
  is drained, not one interval later. An unchanged queue costs two 304s, and the pause between
  two looks grows with what one costs (at most a tenth of the time goes to them). Lengths are
  counted from sequences; bytes come from one listing of the data prefix from the oldest
  waiting entry's name on. Whatever the backlog, it holds one index segment and a few
  numbers, never the queue.

Names, types and help texts are the core's (:data:`millpond.common.exposition.CATALOG`).
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from millpond.cli.common import add_metrics_arguments
from millpond.common.clock import Clock, SystemClock
from millpond.common.exposition import MetricsCollector, Sample
from millpond.common.metrics import Counters, LatencySummary
from millpond.common.tasks import BackgroundTask
from millpond.errors import MillpondError, NotFoundError
from millpond.formats.manifest import ManifestEntry
from millpond.queue import (
    EntryReader,
    QueueLook,
    bytes_from,
    entry_time_ms,
    head_path,
    look_with_entry,
)
from millpond.storage.store import ObjectStore

if TYPE_CHECKING:
    from millpond.consumer._batch import ConsumedBatch
    from millpond.consumer._consumer import Consumer
    from millpond.consumer.sinks import Sink

__all__ = [
    "CONSUMER_METRICS",
    "ConsumerMetrics",
    "QueueSampler",
    "TimedSink",
    "add_arguments",
]

logger = logging.getLogger(__name__)

BYTES_SPAN = 10_000
"""Entries whose batch objects one sample lists for the bytes gauge; past them it scales."""

CONSUMER_METRICS = (
    "millpond_queue_length",
    "millpond_queue_bytes",
    "millpond_consumer_lag_seconds",
    "millpond_queue_sample_age_seconds",
    "millpond_queue_sample_errors_total",
    "millpond_consumer_rows_total",
    "millpond_consumer_batches_total",
    "millpond_consumer_batches_skipped_total",
    "millpond_consumer_fetched_bytes_total",
    "millpond_consumer_last_sequence",
    "millpond_consumer_epoch",
    "millpond_consumer_fetch_duration_seconds",
    "millpond_consumer_sink_commit_duration_seconds",
    "millpond_manifest_writes_total",
    "millpond_manifest_conflicts_total",
    "millpond_gc_passes_total",
    "millpond_gc_deleted_total",
    "millpond_gc_failed_total",
    "millpond_gc_errors_total",
    "millpond_gc_duration_seconds",
)
"""What a consumer process exports."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port``, ``--metrics-address`` and ``--metrics-interval`` for ``consume``."""
    add_metrics_arguments(parser)
    parser.add_argument(
        "--metrics-interval",
        type=_seconds,
        default=5.0,
        metavar="S",
        help="seconds between two reads of the manifest for the queue gauges (default 5)",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, found {text!r}")
    return value


class TimedSink:
    """A sink that times each write transaction and counts written and skipped batches.

    Everything else goes to the wrapped sink unchanged.
    """

    def __init__(self, inner: Sink) -> None:
        self.inner = inner
        self.commit_latency = LatencySummary()
        self.counters = Counters("batches", "skipped")

    def write(self, batch: ConsumedBatch) -> bool:
        """Raises: as the wrapped sink's."""
        with self.commit_latency.time():
            written = self.inner.write(batch)
        self._count([written])
        return written

    def write_many(self, batches: Sequence[ConsumedBatch]) -> list[bool]:
        """Raises: as the wrapped sink's."""
        with self.commit_latency.time():
            results = self.inner.write_many(batches)
        self._count(results)
        return results

    def __getattr__(self, name: str) -> Any:
        # Whatever else a sink offers (its progress, rows written, a probe) is the wrapped
        # sink's.
        return getattr(self.inner, name)

    def _count(self, results: Sequence[bool]) -> None:
        written = sum(1 for result in results if result)
        self.counters.add("batches", written)
        self.counters.add("skipped", len(results) - written)


@dataclass(frozen=True, slots=True)
class QueueGauges:
    """The queue gauges at scrape time, from the last sample."""

    length: int
    """Entries waiting past the ack given."""
    bytes: int
    """Bytes of their batch objects (scaled from the sample's to what still waits)."""
    age_seconds: float
    """Seconds since the sample."""
    oldest_ms: int | None
    """When the oldest entry waiting past the sample's ack was produced (``None``: none)."""


@dataclass(frozen=True, slots=True)
class _Sample:
    first: int
    next_sequence: int
    acked: int | None
    oldest_ms: int | None
    bytes: int
    at: float

    def waiting(self, acked: int | None) -> int:
        """Entries past ``acked`` as of the sample."""
        start = self.first if acked is None else max(self.first, acked + 1)
        return max(0, self.next_sequence - start)


class QueueSampler(BackgroundTask):
    """Looks at the queue every ``interval`` seconds on a daemon thread, for the gauges, from
    ``start()`` until ``stop()``.

    What it keeps between two looks is what the next needs, not the queue: the manifest's and
    the index head's ETags, the counts, one index segment (where the oldest waiting entry is),
    and two numbers (that entry's time, the bytes from it on)."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        manifest_path: str,
        data_path_prefix: str,
        interval: float = 5.0,
        clock: Clock | None = None,
        acked: Callable[[], int | None] | None = None,
    ) -> None:
        """``acked``: the consumer's last ack when sampling (what waits starts past it)."""
        super().__init__("millpond-metrics-queue", self._run)
        self._store = store
        self._manifest_path = manifest_path
        self._prefix = data_path_prefix
        self._interval = interval
        self._clock = clock or SystemClock()
        self._acked = acked or (lambda: None)
        self._lock = threading.Lock()
        self._sample: _Sample | None = None
        self._etags: tuple[str | None, str | None] | None = None
        self._reader = EntryReader(store)
        self._cost = 0.0  # seconds the last full sample took
        self.errors = 0

    def sample_once(self) -> None:
        """One look: conditional reads of the manifest and the index head; when either
        changed or the ack moved, the oldest waiting entry (one segment read, at most) and, for
        the bytes, one listing from its name to that of the entry :data:`BYTES_SPAN` later
        (one more segment read, at most).

        Raises:
            NotFoundError, FormatError, StorageError: the read failed; the last sample stays.
        """
        started = self._clock.monotonic()
        acked = self._acked()
        if self._unchanged(acked):
            with self._lock:
                assert self._sample is not None
                self._sample = replace(self._sample, at=self._clock.monotonic())
            return
        look, entry = look_with_entry(
            self._store, self._manifest_path, self._prefix, self._reader, acked
        )
        nbytes = self._bytes(look, entry, acked)
        now = self._clock.monotonic()
        with self._lock:
            self._sample = _Sample(
                first=look.first,
                next_sequence=look.next_sequence,
                acked=acked,
                oldest_ms=entry_time_ms(entry) if entry is not None else None,
                bytes=nbytes,
                at=now,
            )
            self._etags = (look.manifest_etag, look.head_etag)
            self._cost = now - started

    def _bytes(self, look: QueueLook, entry: ManifestEntry | None, acked: int | None) -> int:
        """Bytes of what waits past ``acked``: listed from the oldest waiting entry's name to
        the name :data:`BYTES_SPAN` entries later, scaled to all that waits (a million waiting
        are one listing of 10,000 names, not of a million)."""
        waiting = look.past(acked)
        if entry is None or waiting <= BYTES_SPAN:
            return bytes_from(self._store, self._prefix, entry)
        far = self._reader.entry(look, entry.sequence + BYTES_SPAN)
        listed = bytes_from(self._store, self._prefix, entry, until=far)
        return listed * waiting // BYTES_SPAN

    def _unchanged(self, acked: int | None) -> bool:
        """Whether the manifest and the index head are as last sampled (a 304 each) and the
        ack has not moved: nothing to look at again."""
        sample, etags = self._sample, self._etags
        if sample is None or etags is None or acked != sample.acked:
            return False
        manifest_etag, head_etag = etags
        if manifest_etag is None:
            return False
        if self._store.get_if_changed(self._manifest_path, manifest_etag) is not None:
            return False
        try:
            head = self._store.get_if_changed(head_path(self._prefix), head_etag)
        except NotFoundError:
            return head_etag is None
        return head_etag is not None and head is None

    def gauges(self, acked: int | None) -> QueueGauges | None:
        """What waits past ``acked``, its bytes, and the sample's age; ``None`` before the
        first sample."""
        with self._lock:
            sample = self._sample
        if sample is None:
            return None
        length, sampled = sample.waiting(acked), sample.waiting(sample.acked)
        nbytes = sample.bytes if length >= sampled else sample.bytes * length // max(1, sampled)
        return QueueGauges(
            length=length,
            bytes=nbytes if length else 0,
            age_seconds=self._clock.monotonic() - sample.at,
            oldest_ms=sample.oldest_ms,
        )

    def _run(self) -> None:
        while not self.stopping:
            try:
                self.sample_once()
            except MillpondError as err:
                # A gauge must never stop the consumer: keep the last sample, count, retry.
                self.errors += 1
                logger.warning("reading the queue for its gauges failed: %s", err)
            # A long queue is costly to look at: never spend more than a tenth of the time on it.
            self.wait(max(self._interval, 9 * self._cost))


class ConsumerMetrics:
    """The consumer process's samples, from the consumer, its sink and the queue sampler."""

    def __init__(self, consumer: Consumer, sink: TimedSink, *, interval: float = 5.0) -> None:
        self._consumer = consumer
        self._sink = sink
        config = consumer.config
        self.sampler = QueueSampler(
            consumer.store,
            manifest_path=config.manifest_path,
            data_path_prefix=config.data_path_prefix,
            interval=interval,
            clock=config.clock,
            acked=lambda: consumer.acked_sequence,
        )
        self._clock = config.clock or SystemClock()

    def collector(self) -> MetricsCollector:
        return MetricsCollector(self.samples, CONSUMER_METRICS)

    @contextmanager
    def sampling(self, *, enabled: bool = True) -> Iterator[None]:
        """Run the queue sampler while the block runs (when ``enabled``: no scrapes, no
        reads)."""
        if not enabled:
            yield
            return
        self.sampler.start()
        try:
            yield
        finally:
            self.sampler.stop()

    def samples(self) -> list[Sample]:
        consumer = self._consumer
        counters = consumer.counters.snapshot()
        gc = consumer.gc_counters.snapshot()
        sink = self._sink.counters.snapshot()
        role = (("role", "consumer"),)
        out = [
            Sample("millpond_consumer_rows_total", self._sink.rows_written),
            Sample("millpond_consumer_batches_total", sink.get("batches", 0)),
            Sample("millpond_consumer_batches_skipped_total", sink.get("skipped", 0)),
            Sample("millpond_consumer_fetched_bytes_total", counters.get("bytes", 0)),
            Sample("millpond_consumer_last_sequence", _or(consumer.acked_sequence, -1)),
            Sample("millpond_consumer_epoch", _or(consumer.epoch, 0)),
            Sample("millpond_consumer_fetch_duration_seconds", consumer.fetch_latency.histogram()),
            Sample(
                "millpond_consumer_sink_commit_duration_seconds",
                self._sink.commit_latency.histogram(),
            ),
            Sample("millpond_manifest_writes_total", counters.get("manifest_writes", 0), role),
            Sample("millpond_manifest_conflicts_total", counters.get("cas_conflicts", 0), role),
            Sample("millpond_gc_passes_total", gc.get("gc_passes", 0)),
            Sample("millpond_gc_deleted_total", gc.get("gc_deleted", 0)),
            Sample("millpond_gc_failed_total", gc.get("gc_failed_deletes", 0)),
            Sample("millpond_gc_errors_total", gc.get("gc_errors", 0)),
            Sample("millpond_gc_duration_seconds", consumer.gc_latency.histogram()),
            Sample("millpond_queue_sample_errors_total", self.sampler.errors),
        ]
        gauges = self.sampler.gauges(consumer.acked_sequence)
        if gauges is not None:
            # The consumer knows the oldest entry it has not acked (delivered or read ahead)
            # at this very moment; the sample, as of its own ack.
            oldest = consumer.oldest_unacked_ms() if gauges.length else None
            oldest = oldest if oldest is not None else gauges.oldest_ms
            lag = 0.0
            if gauges.length and oldest is not None:
                lag = max(0.0, (self._clock.now_ms() - oldest) / 1000)
            out += [
                Sample("millpond_queue_length", gauges.length),
                Sample("millpond_queue_bytes", gauges.bytes),
                Sample("millpond_consumer_lag_seconds", lag),
                Sample("millpond_queue_sample_age_seconds", gauges.age_seconds),
            ]
        return out


def _or(value: int | None, default: int) -> int:
    return default if value is None else value
