"""A producer's metrics under the names the whole system exports (the core's ``CATALOG``).

:meth:`Producer.metrics` adds them to its dict under those names; :meth:`Producer.register_metrics`
registers a collector that reads them on every scrape of the caller's ``CollectorRegistry``.
"""

from __future__ import annotations

from millpond.common.exposition import MetricsCollector, Sample
from millpond.common.forks import OwnProcess
from millpond.producer._state import State
from millpond.wal import Wal

__all__ = ["PRODUCER_METRICS", "producer_collector", "producer_samples"]

PRODUCER_METRICS = (
    "millpond_producer_entries_total",
    "millpond_producer_committed_entries_total",
    "millpond_producer_batches_total",
    "millpond_producer_uploaded_bytes_total",
    "millpond_producer_retries_total",
    "millpond_producer_dropped_entries_total",
    "millpond_producer_wal_bytes",
    "millpond_producer_pending_bytes",
    "millpond_producer_refreshing_batches",
    "millpond_producer_wal_fsync_duration_seconds",
    "millpond_manifest_append_duration_seconds",
    "millpond_manifest_writes_total",
    "millpond_manifest_conflicts_total",
)
"""What a producer exports."""


def producer_samples(state: State, wal: Wal) -> list[Sample]:
    """The producer's current values (reads its counters; holds its lock only for a moment)."""
    counters = state.counters.snapshot()
    with state.cond:
        pending = state.pending_bytes
        refreshing = state.awaiting_refresh()
    role = (("role", "producer"),)
    return [
        Sample("millpond_producer_entries_total", counters.get("entries_produced", 0)),
        Sample("millpond_producer_committed_entries_total", counters.get("entries_committed", 0)),
        Sample("millpond_producer_batches_total", counters.get("batches_committed", 0)),
        Sample("millpond_producer_uploaded_bytes_total", counters.get("bytes_uploaded", 0)),
        Sample(
            "millpond_producer_retries_total",
            counters.get("put_retries", 0) + counters.get("cas_retries", 0),
        ),
        Sample("millpond_producer_dropped_entries_total", counters.get("entries_dropped", 0)),
        Sample("millpond_producer_wal_bytes", 0 if wal.closed else wal.bytes_used),
        Sample("millpond_producer_pending_bytes", pending),
        Sample("millpond_producer_refreshing_batches", refreshing),
        Sample("millpond_producer_wal_fsync_duration_seconds", state.fsync_latency.histogram()),
        Sample("millpond_manifest_append_duration_seconds", state.append_latency.histogram()),
        Sample("millpond_manifest_writes_total", counters.get("manifest_writes", 0), role),
        Sample("millpond_manifest_conflicts_total", counters.get("cas_conflicts", 0), role),
    ]


def producer_collector(
    state: State, wal: Wal, process: OwnProcess, const_labels: dict[str, str] | None = None
) -> MetricsCollector:
    """A ``prometheus_client`` collector over :func:`producer_samples`.

    In a process forked from the producer's it yields nothing: the figures stopped at the
    fork, and the lock they are read under may have been held by a thread the child lacks.
    """
    return MetricsCollector(
        lambda: producer_samples(state, wal) if process.is_current() else [],
        PRODUCER_METRICS,
        const_labels=const_labels,
    )
