"""Millpond's metrics in Prometheus' exposition format: the names, and the bridge.

Every metric any role exports is declared once, in :data:`CATALOG` (name, type, help, label
names); the docs' metrics table is generated from them. A role
describes what it has as :class:`Sample` values read from its own counters and histograms
(:mod:`millpond.common.metrics`), and :class:`MetricsCollector` turns them into metric families
each time a registry is scraped — nothing is exported or locked in the hot path.
:class:`MetricsServer` serves a registry on ``/metrics`` (``prometheus_client``'s own HTTP
server, on a daemon thread).

Names follow Prometheus' conventions: a ``millpond_`` prefix, the unit in the name
(``_seconds``, ``_bytes``), ``_total`` on counters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from millpond.common.metrics import HistogramSnapshot
from millpond.errors import ConfigError

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric as PrometheusMetric
    from prometheus_client.registry import CollectorRegistry

__all__ = [
    "CATALOG",
    "MetricKind",
    "MetricSpec",
    "MetricsCollector",
    "MetricsServer",
    "Sample",
    "flatten",
]

logger = logging.getLogger(__name__)


class MetricKind(StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric's declaration."""

    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()
    exported_by: str = ""
    """Which processes export it (``consume``, ``gc``, ``producer``), for the docs."""


def _spec(name: str, kind: MetricKind, help_: str, by: str, *labels: str) -> MetricSpec:
    return MetricSpec(name=name, kind=kind, help=help_, labels=labels, exported_by=by)


_C, _G, _H = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM

CATALOG: Mapping[str, MetricSpec] = {
    spec.name: spec
    for spec in (
        # The queue, as the consumer sees it (sampled from the manifest every few seconds).
        _spec(
            "millpond_queue_length",
            _G,
            "Entries in the queue manifest not yet consumed (acknowledged).",
            "consume",
        ),
        _spec(
            "millpond_queue_bytes",
            _G,
            "Bytes of the batch objects the unconsumed entries reference.",
            "consume",
        ),
        _spec(
            "millpond_consumer_lag_seconds",
            _G,
            "Age of the oldest unconsumed entry (now minus its earliest ingestion time); "
            "0 when the queue is drained.",
            "consume",
        ),
        _spec(
            "millpond_queue_sample_age_seconds",
            _G,
            "Seconds since the queue gauges were last read from the store.",
            "consume",
        ),
        _spec(
            "millpond_queue_sample_errors_total",
            _C,
            "Failed reads of the queue gauges (the last good values are kept).",
            "consume",
        ),
        # The consumer service.
        _spec("millpond_consumer_rows_total", _C, "Rows written into the database.", "consume"),
        _spec(
            "millpond_consumer_batches_total",
            _C,
            "Batches written into the database.",
            "consume",
        ),
        _spec(
            "millpond_consumer_batches_skipped_total",
            _C,
            "Batches skipped because the database already recorded their sequence or location.",
            "consume",
        ),
        _spec(
            "millpond_consumer_fetched_bytes_total",
            _C,
            "Bytes of batch objects read from the store.",
            "consume",
        ),
        _spec(
            "millpond_consumer_last_sequence",
            _G,
            "The last sequence acknowledged (-1 before the first).",
            "consume",
        ),
        _spec("millpond_consumer_epoch", _G, "The epoch this consumer holds.", "consume"),
        _spec(
            "millpond_consumer_fetch_duration_seconds",
            _H,
            "Reading and decoding one batch object.",
            "consume",
        ),
        _spec(
            "millpond_consumer_sink_commit_duration_seconds",
            _H,
            "One database transaction that wrote batches (one or a group) and their progress.",
            "consume",
        ),
        # The manifest, by role.
        _spec(
            "millpond_manifest_writes_total",
            _C,
            "Conditional writes of the queue manifest (attempts, conflicts included).",
            "consume, producer",
            "role",
        ),
        _spec(
            "millpond_manifest_conflicts_total",
            _C,
            "Manifest writes that lost the compare-and-swap to another writer.",
            "consume, producer",
            "role",
        ),
        # Garbage collection (the consumer's own collector, or millpond gc).
        _spec("millpond_gc_passes_total", _C, "Completed collection passes.", "consume, gc"),
        _spec("millpond_gc_deleted_total", _C, "Batch objects deleted.", "consume, gc"),
        _spec(
            "millpond_gc_failed_total",
            _C,
            "Deletes that failed (the objects are eligible again on the next pass).",
            "consume, gc",
        ),
        _spec(
            "millpond_gc_errors_total",
            _C,
            "Passes that stopped on an error (store, corrupt manifest); nothing was deleted.",
            "consume, gc",
        ),
        _spec("millpond_gc_duration_seconds", _H, "One collection pass.", "consume, gc"),
        # Producers (Producer.metrics(), Producer.register_metrics()).
        _spec(
            "millpond_producer_entries_total",
            _C,
            "Entries accepted by produce().",
            "producer",
        ),
        _spec(
            "millpond_producer_committed_entries_total",
            _C,
            "Entries whose batch is in the queue manifest.",
            "producer",
        ),
        _spec(
            "millpond_producer_batches_total",
            _C,
            "Batches whose location is in the queue manifest.",
            "producer",
        ),
        _spec(
            "millpond_producer_uploaded_bytes_total",
            _C,
            "Bytes of batch objects uploaded.",
            "producer",
        ),
        _spec(
            "millpond_producer_retries_total",
            _C,
            "Retried uploads and manifest appends.",
            "producer",
        ),
        _spec(
            "millpond_producer_dropped_entries_total",
            _C,
            "Entries dropped by the drop-oldest size cap.",
            "producer",
        ),
        _spec("millpond_producer_wal_bytes", _G, "Bytes held in the local WAL.", "producer"),
        _spec(
            "millpond_producer_pending_bytes",
            _G,
            "Staged bytes not yet sealed into a batch.",
            "producer",
        ),
        _spec(
            "millpond_producer_refreshing_batches",
            _G,
            "Batches being written again under their names (they waited longer than "
            "reupload_after for their append) until a HEAD after the delete window finds them.",
            "producer",
        ),
        _spec(
            "millpond_producer_wal_fsync_duration_seconds",
            _H,
            "One WAL fdatasync.",
            "producer",
        ),
        _spec(
            "millpond_manifest_append_duration_seconds",
            _H,
            "One append of a group of batch locations to the manifest, retries included.",
            "producer",
        ),
    )
}
"""Every metric millpond exports, by name."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One series' current value: a number, or a histogram for histogram metrics."""

    name: str
    value: float | HistogramSnapshot
    labels: tuple[tuple[str, str], ...] = ()


def flatten(samples: Iterable[Sample]) -> dict[str, Any]:
    """Samples as a plain dict keyed by metric name (labels dropped: one series per name).

    Histograms become ``{"count", "sum", "buckets"}``.
    """
    return {
        sample.name: (
            sample.value.to_dict() if isinstance(sample.value, HistogramSnapshot) else sample.value
        )
        for sample in samples
    }


class MetricsCollector:
    """A ``prometheus_client`` collector over a function that reads the current samples.

    Register it with ``registry.register(collector)``; every scrape calls ``read``, so values
    are as fresh as the counters they come from. The names it may return are declared up front
    (``describe``), so registering two collectors of the same names into one registry fails
    at once, as ``prometheus_client`` does for its own metrics.
    """

    def __init__(
        self,
        read: Callable[[], Iterable[Sample]],
        names: Iterable[str],
        *,
        const_labels: Mapping[str, str] | None = None,
    ) -> None:
        """Raises:
        ConfigError: a name that is not in :data:`CATALOG`.
        """
        self._read = read
        self._names = tuple(names)
        unknown = [name for name in self._names if name not in CATALOG]
        if unknown:
            raise ConfigError("metrics", f"expected names from CATALOG, found {unknown}")
        self._const = dict(const_labels or {})

    def describe(self) -> list[PrometheusMetric]:
        return [self._family(CATALOG[name], ()) for name in self._names]

    def collect(self) -> Iterator[PrometheusMetric]:
        by_name: dict[str, list[Sample]] = {}
        for sample in self._read():
            by_name.setdefault(sample.name, []).append(sample)
        for name in self._names:
            samples = by_name.get(name)
            if samples:
                yield self._family(CATALOG[name], samples)

    def _family(self, spec: MetricSpec, samples: Iterable[Sample]) -> PrometheusMetric:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        labels = [*self._const, *spec.labels]
        family: Any
        if spec.kind is MetricKind.COUNTER:
            family = CounterMetricFamily(spec.name, spec.help, labels=labels)
        elif spec.kind is MetricKind.GAUGE:
            family = GaugeMetricFamily(spec.name, spec.help, labels=labels)
        else:
            family = HistogramMetricFamily(spec.name, spec.help, labels=labels)
        for sample in samples:
            given = dict(sample.labels)
            values = [*self._const.values(), *(given.get(label, "") for label in spec.labels)]
            value = sample.value
            if isinstance(value, HistogramSnapshot):
                buckets = [(repr(float(bound)), float(n)) for bound, n in value.buckets]
                buckets.append(("+Inf", float(value.count)))
                family.add_metric(values, buckets, value.total)
            else:
                family.add_metric(values, float(value))
        result: PrometheusMetric = family
        return result


class MetricsServer:
    """``/metrics`` of one registry over HTTP, on a daemon thread, until :meth:`close`."""

    def __init__(self, registry: CollectorRegistry, *, port: int, address: str = "127.0.0.1"):
        """Bind ``address:port`` (port 0: any free port; :attr:`port` tells which).

        Raises:
            ConfigError: the port is out of range, or the address cannot be bound (in use,
                not an address of this machine).
        """
        from prometheus_client import start_http_server

        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError("metrics-port", f"expected a port 0..65535, found {port!r}")
        try:
            self._server, self._thread = start_http_server(port, address, registry)
        except OSError as err:
            raise ConfigError(
                "metrics-port", f"expected a free port on {address}, found {port}: {err}"
            ) from err
        self.address = address
        self.port: int = self._server.server_port
        logger.info("serving metrics on %s", self.url)

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port. Idempotent."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
