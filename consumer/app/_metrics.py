"""The consumer's metrics: what ``millpond consume --metrics-port`` serves on ``/metrics``.

Three sources, none of which exports anything by itself:

* the :class:`~millpond.consumer.Consumer`'s own counters and histograms (batch object bytes
  and fetch times, manifest writes and conflicts, its collector's passes, deletes and times);
* :class:`TimedSink`, a pass-through around the sink that times each transaction and counts
  written and skipped batches;
* :class:`QueueSampler`, a daemon thread that reads the manifest every ``interval`` seconds
  (no fencing, nothing written) for the queue's length, bytes and lag. Length and lag count
  the entries past the consumer's last ack at scrape time, so they fall to 0 as soon as the
  queue is drained, not one interval later. An unchanged manifest costs a 304, and the pause
  between two reads grows with what one costs (at most a tenth of the time goes to them).
  Bytes come from one listing of the data prefix, made only when the manifest references an
  object whose size is not known yet.

Names, types and help texts are the core's (:data:`millpond.common.exposition.CATALOG`).
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from millpond.cli.common import add_metrics_arguments
from millpond.common.clock import Clock, SystemClock
from millpond.common.exposition import MetricsCollector, Sample
from millpond.common.metrics import Counters, LatencySummary
from millpond.common.tasks import BackgroundTask
from millpond.errors import MillpondError, NotFoundError
from millpond.formats.manifest import ManifestEntry, decode_manifest
from millpond.queue import (
    IndexHead,
    Waiting,
    decode_head,
    head_path,
    list_sizes,
    queue_view,
    waiting_after,
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

    @property
    def rows_written(self) -> int:
        return self.inner.rows_written

    def last_sequence(self, queue: str) -> int | None:
        """Raises: as the wrapped sink's."""
        return self.inner.last_sequence(queue)

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

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # Whatever else a sink offers (a probe, its table) is the wrapped sink's.
        return getattr(self.inner, name)

    def _count(self, results: Sequence[bool]) -> None:
        written = sum(1 for result in results if result)
        self.counters.add("batches", written)
        self.counters.add("skipped", len(results) - written)


class QueueSampler(BackgroundTask):
    """Reads the manifest every ``interval`` seconds on a daemon thread, for the gauges, from
    ``start()`` until ``stop()``."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        manifest_path: str,
        data_path_prefix: str,
        interval: float = 5.0,
        clock: Clock | None = None,
    ) -> None:
        super().__init__("millpond-metrics-queue", self._run)
        self._store = store
        self._manifest_path = manifest_path
        self._prefix = data_path_prefix
        self._interval = interval
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._waiting: Waiting | None = None
        self._sizes: dict[str, int] = {}
        self._sampled_at: float | None = None
        self._etag: str | None = None
        self._head: IndexHead | None = None
        self._head_etag: str | None = None
        self._segments: dict[str, tuple[ManifestEntry, ...]] = {}
        self._cost = 0.0  # seconds the last full sample took
        self.errors = 0

    def sample_once(self) -> None:
        """One conditional read of the manifest (and, for unknown sizes, one listing of the
        data prefix).

        Raises:
            NotFoundError, FormatError, StorageError: the read failed; the last sample stays.
        """
        started = self._clock.monotonic()
        got = self._store.get_if_changed(self._manifest_path, self._etag)
        if got is None:  # unchanged since the last sample: a 304, nothing to decode
            # The backlog index cannot have changed but by drains, which only remove what
            # gauges() filters out past the ack anyway: a move rewrites the manifest too.
            with self._lock:
                self._sampled_at = self._clock.monotonic()
            return
        # After the manifest, as every reader of the backlog index does (one more conditional
        # GET; segments never change, so each is read once).
        self._read_index()
        manifest = decode_manifest(got.data, name=self._manifest_path)
        indexed = [
            entry
            for segment in (self._head.segments if self._head is not None else ())
            for entry in self._segments[segment.path]
            if self._head is not None and entry.sequence > self._head.dequeued_through
        ]
        waiting = waiting_after(queue_view(manifest, self._head, indexed))
        referenced = {entry.location for entry in waiting.entries}
        with self._lock:
            known = self._sizes
        if referenced - known.keys():
            # Batch objects never change once written, so a size, once listed, holds.
            known = {**known, **list_sizes(self._store, self._prefix)}
        sizes = {location: known[location] for location in referenced if location in known}
        with self._lock:
            self._waiting = waiting
            self._sizes = sizes
            self._etag = got.etag
            self._sampled_at = self._clock.monotonic()
            self._cost = self._sampled_at - started

    def _read_index(self) -> None:
        """Refresh the backlog index head and its segments."""
        path = head_path(self._prefix)
        try:
            got = self._store.get_if_changed(path, self._head_etag)
        except NotFoundError:
            self._head, self._head_etag, self._segments = None, None, {}
            return
        if got is None:
            return
        head = decode_head(got.data, name=path)
        segments = {}
        for segment in head.segments:
            entries = self._segments.get(segment.path)
            if entries is None:
                data = self._store.get(segment.path).data
                entries = decode_manifest(data, name=segment.path).entries
            segments[segment.path] = entries
        self._head, self._head_etag, self._segments = head, got.etag, segments

    def gauges(self, acked: int | None) -> tuple[Waiting, int, float] | None:
        """What waits past ``acked``, its bytes, and the sample's age; ``None`` before the
        first sample."""
        with self._lock:
            if self._waiting is None or self._sampled_at is None:
                return None
            waiting = self._waiting.after(acked)
            age = self._clock.monotonic() - self._sampled_at
            return waiting, waiting.bytes_from(self._sizes), age

    def _run(self) -> None:
        while not self.stopping:
            try:
                self.sample_once()
            except MillpondError as err:
                # A gauge must never stop the consumer: keep the last sample, count, retry.
                self.errors += 1
                logger.warning("reading the queue for its gauges failed: %s", err)
            # A long manifest is costly to read: never spend more than a tenth of the time on it.
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
            waiting, nbytes, age = gauges
            out += [
                Sample("millpond_queue_length", waiting.length),
                Sample("millpond_queue_bytes", nbytes),
                Sample("millpond_consumer_lag_seconds", waiting.lag_seconds(self._clock.now_ms())),
                Sample("millpond_queue_sample_age_seconds", age),
            ]
        return out


def _or(value: int | None, default: int) -> int:
    return default if value is None else value
