"""``GarbageCollector``: the RFC's collector as a library object and a scheduled job.

Each pass is :func:`millpond.queue.gc_rules.collect_once` (the same pass the consumer runs in
its own process): list the batch objects directly under the data prefix, read the manifest
without fencing, delete what is unreferenced, older than the queue's oldest entry and older than
the grace period. Failed deletes are logged and simply eligible again on the next pass.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

from millpond.common.clock import Clock, SystemClock
from millpond.common.durations import check_duration
from millpond.common.metrics import Counters, LatencySummary
from millpond.common.tasks import BackgroundTask
from millpond.errors import ClosedError, ConfigError, MillpondError
from millpond.queue import GcReport, Queue, QueueLocation
from millpond.storage import ObjectStore

__all__ = ["GarbageCollector", "GarbageCollectorConfig"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class GarbageCollectorConfig(QueueLocation):
    """Configuration of a :class:`GarbageCollector` (RFC ``GarbageCollectorConfig``)."""

    gc_interval: float = 300.0
    """Seconds between two passes of :meth:`GarbageCollector.run_forever`. Default 300."""
    gc_grace_period: float = 600.0
    """Seconds a batch object's ULID time must lie in the past before it may be deleted.
    Default 600."""
    dry_run: bool = False
    """Report what would be deleted, delete nothing. Default ``False``."""
    clock: Clock | None = None
    """Wall clock for the grace period; injectable for tests. Default the system's."""

    def __post_init__(self) -> None:
        QueueLocation.__post_init__(self)
        check_duration("gc_interval", self.gc_interval, allow_zero=False)
        check_duration("gc_grace_period", self.gc_grace_period, allow_zero=True)
        if not isinstance(self.dry_run, bool):
            raise ConfigError("dry_run", f"expected True or False, found {self.dry_run!r}")


class GarbageCollector:
    """Deletes batch objects that nothing references any more.

    ``run_once()`` does one pass; ``run_forever(stop)`` repeats every ``gc_interval`` until the
    event is set; ``start()`` does that on a daemon thread that ``close()`` stops and joins.
    """

    def __init__(self, config: GarbageCollectorConfig) -> None:
        """Open the store; nothing is read until the first pass.

        Raises:
            ConfigError: the store URL or options are invalid.
        """
        self._config = config
        self._queue = Queue.open(config)
        self._store = self._queue.store
        self._clock = config.clock or SystemClock()
        self._stop = threading.Event()
        self._task = BackgroundTask("millpond-gc", self.run_forever, stop=self._stop)
        self._closed = False
        self.counters = Counters("passes", "deleted", "failed_deletes", "errors")
        self.latency = LatencySummary()
        """Seconds per completed pass."""
        self.last_report: GcReport | None = None

    @property
    def config(self) -> GarbageCollectorConfig:
        return self._config

    @property
    def store(self) -> ObjectStore:
        return self._store

    def run_once(self) -> GcReport:
        """One collection pass.

        Returns:
            What was listed, deleted (or, with ``dry_run``, would be), kept and why, and the
            deletes that failed.

        Raises:
            ConfigError: the queue's claim names another manifest (two queues on one data
                prefix) or a longer grace period (nothing deleted).
            FormatError: the manifest is corrupt (nothing deleted).
            StorageError: listing or reading the manifest failed (nothing deleted).
        """
        config = self._config
        try:
            with self.latency.time():
                report = self._queue.collect(
                    grace_period=config.gc_grace_period, clock=self._clock, dry_run=config.dry_run
                )
        except MillpondError:
            self.counters.add("errors")
            raise
        self.counters.add("passes")
        self.counters.add("deleted", 0 if report.dry_run else len(report.deleted))
        self.counters.add("failed_deletes", len(report.failures))
        self.last_report = report
        logger.info(
            "gc %s: listed %s, %s %s, kept %s, %s deletes failed",
            config.data_path_prefix,
            report.listed,
            "would delete" if report.dry_run else "deleted",
            len(report.deleted),
            dict(report.kept),
            len(report.failures),
        )
        return report

    def run_forever(
        self,
        stop: threading.Event | None = None,
        on_report: Callable[[GcReport], None] | None = None,
    ) -> None:
        """Run a pass now and then every ``gc_interval`` seconds until ``stop`` is set.

        A pass that failed on the store or the data is logged and retried at the next
        interval; a configuration the queue refuses (``ConfigError``) is permanent and ends the
        loop by raising.

        Args:
            stop: ends the loop when set (default: the collector's own, set by ``close()``).
            on_report: called with each pass's report.

        Raises:
            ConfigError: the queue refuses this collector (see :meth:`run_once`).
        """
        stop = stop or self._stop
        while not stop.is_set() and not self._stop.is_set():
            try:
                report = self.run_once()
            except ConfigError:
                raise
            except MillpondError as err:
                logger.warning(
                    "gc pass failed, retrying in %.0f s: %s", self._config.gc_interval, err
                )
            else:
                if on_report is not None:
                    on_report(report)
            if stop.wait(self._config.gc_interval):
                return

    def start(self) -> None:
        """Run :meth:`run_forever` on a daemon thread.

        Raises:
            ClosedError: the collector was closed.
        """
        if self._closed:
            raise ClosedError("garbage collector is closed")
        self._task.start()

    def close(self) -> None:
        """Stop the background thread (waiting for a running pass). Idempotent."""
        self._closed = True
        self._task.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
