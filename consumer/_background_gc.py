"""The garbage collector the consumer runs in its own process (RFC, "Garbage Collection").

The rules and the pass itself are the core's (:func:`millpond.queue.gc_rules.collect_once`), shared
with ``millpond.gc``; this module only schedules passes on a daemon thread and ties them to
the consumer's epoch: a pass whose manifest snapshot carries another epoch deletes nothing and
ends the thread, so a fenced consumer's collector stops even before the consumer notices.
"""

from __future__ import annotations

import logging

from millpond.common.clock import Clock
from millpond.common.metrics import Counters, LatencySummary
from millpond.common.tasks import BackgroundTask
from millpond.errors import ConfigError, MillpondError
from millpond.formats.manifest import Footer
from millpond.queue import collect_once
from millpond.storage.store import ObjectStore

__all__ = ["BackgroundCollector"]

logger = logging.getLogger(__name__)


class _EpochMovedError(Exception):
    """The manifest's epoch is no longer the consumer's."""


class BackgroundCollector(BackgroundTask):
    """Runs a collection pass every ``interval`` seconds until stopped or fenced; ``stop()``
    waits for a running pass to finish unless told not to (``join=False``)."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        manifest_path: str,
        data_path_prefix: str,
        interval: float,
        grace_period: float,
        clock: Clock,
        epoch: int,
        counters: Counters,
        latency: LatencySummary,
    ) -> None:
        """``counters``: ``gc_passes``, ``gc_deleted``, ``gc_failed_deletes``, ``gc_errors``;
        ``latency``: seconds per completed pass (the consumer's, kept across its collectors)."""
        super().__init__(f"millpond-consumer-gc-{epoch}", self._run)
        self._store = store
        self._manifest_path = manifest_path
        self._prefix = data_path_prefix
        self._interval = interval
        self._grace = grace_period
        self._clock = clock
        self._epoch = epoch
        self.counters = counters
        self.latency = latency

    def _check_epoch(self, footer: Footer) -> None:
        if footer.epoch != self._epoch:
            raise _EpochMovedError(footer.epoch)

    def _run(self) -> None:
        # The first pass runs at once: a consumer restarted more often than gc_interval
        # would otherwise never collect.
        while not self.stopping:
            try:
                with self.latency.time():
                    report = collect_once(
                        self._store,
                        manifest_path=self._manifest_path,
                        data_path_prefix=self._prefix,
                        clock=self._clock,
                        grace_period=self._grace,
                        check_manifest=self._check_epoch,
                    )
            except _EpochMovedError as moved:
                logger.info(
                    "gc: manifest epoch is %s, this consumer held %s; GC stops",
                    moved.args[0],
                    self._epoch,
                )
                return
            except ConfigError as err:
                # Permanent: the consumer checked the claim at start, so only a claim changed
                # since gets here. Retrying would fail the same way forever.
                self.counters.add("gc_errors")
                logger.error("gc stops: %s", err)  # noqa: TRY400 - the message is the point
                return
            except MillpondError as err:
                self.counters.add("gc_errors")
                logger.warning("gc pass failed, retrying in %.0f s: %s", self._interval, err)
            else:
                self.counters.add("gc_passes")
                self.counters.add("gc_deleted", len(report.deleted))
                self.counters.add("gc_failed_deletes", len(report.failures))
                if report.deleted or report.failures:
                    logger.info(
                        "gc: deleted %s of %s objects, %s deletes failed",
                        len(report.deleted),
                        report.listed,
                        len(report.failures),
                    )
            if self.wait(self._interval):
                return
