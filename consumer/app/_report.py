"""The consumer service's report: what it is doing, for ``millpond status`` in another process.

``millpond consume`` writes one small JSON object, ``{data_path_prefix}/_millpond/consumer.json``
(next to the queue's claim, in a nested prefix garbage collection never lists), every
``--report-interval`` seconds from a background thread, and at once when it stops: its state
(running, retrying, stopped on a batch, stopped, fenced), rows and batches since it started,
rows per second over the last interval, lag, the last sequence written, the last error, and
— when it is stopped on a batch it must not skip — that batch, why, and the
``millpond quarantine`` command that would set it aside.

With a :class:`~millpond.consumer.app._written.WrittenPublisher` (``millpond consume`` gives
it one), the reporter also keeps the small written-through mark producers wait on
(``written.json`` beside the report) in step with what it reports: the state, the batch it is
stopped on, and — through :meth:`ServiceReporter.written_through` after every commit of the
sink — the last sequence written.

The report is best effort: a failed write is logged and tried again at the next interval,
and never slows or stops consumption. ``millpond status`` reads it with one GET, so it answers
at once however busy the consumer is, and says when the report is older than its writer
promised (a consumer that died without a word).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from millpond.common.clock import Clock, SystemClock
from millpond.common.tasks import BackgroundTask
from millpond.consumer.app._written import WrittenPublisher
from millpond.errors import FormatError, MillpondError, NotFoundError
from millpond.queue import internal_path
from millpond.storage.store import ObjectStore

__all__ = [
    "REPORT_NAME",
    "REPORT_SLACK",
    "ServiceReport",
    "ServiceReporter",
    "ServiceState",
    "StoppedOn",
    "read_report",
    "report_path",
    "report_text",
    "status_section",
]

logger = logging.getLogger(__name__)

REPORT_NAME = "consumer.json"
_VERSION = 1
REPORT_SLACK = 1.0
"""Seconds a report's write may take before ``millpond status`` counts it missed."""


class ServiceState(StrEnum):
    RUNNING = "running"
    RETRYING = "retrying"
    """The store or the database fails for now; the same work is retried with backoff."""
    STOPPED_ON_BATCH = "stopped_on_batch"
    """A batch it cannot decode or the database refuses for good; nothing after it is written."""
    STOPPED = "stopped"
    FENCED = "fenced"


@dataclass(frozen=True, slots=True, kw_only=True)
class StoppedOn:
    """The batch a stopped consumer is stopped on."""

    sequence: int
    location: str
    error: str
    command: str
    """The ``millpond quarantine`` command that sets it aside (fill in the reason)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceReport:
    """One report of a consumer service."""

    state: ServiceState
    queue: str
    epoch: int | None = None
    host: str = ""
    pid: int = 0
    started_ms: int = 0
    updated_ms: int = 0
    interval: float = 0.0
    """Seconds between reports while running (0: only at start and stop)."""
    rows: int = 0
    batches: int = 0
    skipped: int = 0
    quarantined: int = 0
    rows_per_second: float = 0.0
    """Over the last interval."""
    last_sequence: int | None = None
    lag_seconds: float | None = None
    """Now minus the ingestion time of the oldest batch not yet written (0: caught up)."""
    last_error: str | None = None
    last_error_ms: int | None = None
    stopped_on: StoppedOn | None = None
    version: int = field(default=_VERSION)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, *, name: str) -> ServiceReport:
        """Raises:
        FormatError: not a report this version of millpond reads.
        """
        try:
            raw: dict[str, Any] = json.loads(data)
            if raw.get("version") != _VERSION:
                raise FormatError(
                    f"{name}: expected report version {_VERSION}, found {raw.get('version')!r}",
                    field="version",
                )
            stopped = raw.pop("stopped_on", None)
            return cls(
                **{**raw, "state": ServiceState(raw["state"])},
                stopped_on=StoppedOn(**stopped) if stopped else None,
            )
        except (ValueError, TypeError, KeyError) as err:
            raise FormatError(f"{name}: expected a consumer report, found {err}") from err

    def stale(self, now_ms: int) -> bool:
        """Whether a running consumer missed two reports in a row (it may have died): one
        late write is the store's, two the consumer's."""
        return self.missed(now_ms) >= 2

    def missed(self, now_ms: int) -> int:
        """How many reports a running consumer has missed since its last (0 when stopped, or
        when it promised none), allowing each write :data:`REPORT_SLACK` seconds."""
        if self.state not in (ServiceState.RUNNING, ServiceState.RETRYING) or self.interval <= 0:
            return 0
        age = (now_ms - self.updated_ms) / 1000
        return max(0, int((age - REPORT_SLACK) // self.interval))


def report_path(data_path_prefix: str) -> str:
    """Where the consumer of the queue whose batches live under ``data_path_prefix`` reports."""
    return internal_path(data_path_prefix, REPORT_NAME)


def read_report(store: ObjectStore, data_path_prefix: str) -> ServiceReport | None:
    """The last report, or ``None`` when no consumer service ever wrote one.

    Raises:
        FormatError: the object is not a report.
        StorageError: the store failed.
    """
    path = report_path(data_path_prefix)
    try:
        got = store.get(path)
    except NotFoundError:
        return None
    return ServiceReport.from_json(got.data, name=path)


class ServiceReporter:
    """Writes a consumer service's report now and then; thread-safe."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        data_path_prefix: str,
        queue: str,
        interval: float = 5.0,
        quarantine_command: Callable[[int], str] | None = None,
        clock: Clock | None = None,
        written: WrittenPublisher | None = None,
    ) -> None:
        """``written``: the written-through mark kept in step with the report, if any."""
        self._store = store
        self._written = written
        self._path = report_path(data_path_prefix)
        self._interval = max(0.0, interval)
        self._command = quarantine_command or (lambda sequence: "")
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._report = ServiceReport(
            state=ServiceState.RUNNING,
            queue=queue,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_ms=self._clock.now_ms(),
            interval=self._interval,
        )
        self._rate_at = (self._clock.monotonic(), 0)
        self._task = BackgroundTask("millpond-report", self._run)
        self._failing = False
        self._started = False

    @property
    def report(self) -> ServiceReport:
        with self._lock:
            return self._report

    def start(self, epoch: int | None, written_through: int | None = None) -> None:
        """Write the first report; then one every interval until :meth:`finish`.
        ``written_through``: the sink's last sequence at the takeover."""
        self._started = True
        self._update(epoch=epoch, state=ServiceState.RUNNING, stopped_on=None)
        self.write()
        if self._interval > 0:
            self._task.start()
        if self._written is not None:
            self._written.start(epoch, written_through)

    def written_through(self, sequence: int) -> None:
        """The sink committed everything through ``sequence`` (the written-through mark)."""
        if self._written is not None:
            self._written.written(sequence)

    def set_aside(self, sequence: int, reason: str) -> None:
        """``sequence`` was quarantined, not written (the written-through mark lists it)."""
        if self._written is not None:
            self._written.set_aside(sequence, reason)

    def progress(self, **counts: Any) -> None:
        """New totals (``rows``, ``batches``, ``skipped``, ``quarantined``, ``last_sequence``,
        ``lag_seconds``); a consumer that was retrying is running again."""
        with self._lock:
            state = self._report.state
            if state == ServiceState.RETRYING:
                state = ServiceState.RUNNING
            self._report = replace(self._report, state=state, **counts)

    def error(self, message: str, *, retrying: bool) -> None:
        """Note an error; ``retrying``: the service retries the same work with backoff."""
        with self._lock:
            self._report = replace(
                self._report,
                last_error=message,
                last_error_ms=self._clock.now_ms(),
                state=ServiceState.RETRYING if retrying else self._report.state,
            )
        if retrying and self._written is not None:
            self._written.state(ServiceState.RETRYING, error=message)

    def stopped_on(self, sequence: int, location: str, error: str) -> None:
        """The service stops on this batch (or sets it aside): written at once."""
        stopped = StoppedOn(
            sequence=sequence, location=location, error=error, command=self._command(sequence)
        )
        self._update(state=ServiceState.STOPPED_ON_BATCH, stopped_on=stopped)
        self.error(error, retrying=False)
        self.write()
        if self._written is not None:
            self._written.state(ServiceState.STOPPED_ON_BATCH, error=error, stopped_on=sequence)

    def moved_past(self, epoch: int | None) -> None:
        """The batch it was stopped on is set aside: running again (at ``epoch``)."""
        self._update(state=ServiceState.RUNNING, stopped_on=None, epoch=epoch)
        if self._written is not None:
            self._written.state(ServiceState.RUNNING, epoch=epoch, stopped_on=None)

    def finish(self, state: ServiceState, error: str | None = None) -> None:
        """Stop the background writes and write the last report (a stop on a batch stays).

        Nothing is written for a service that never started (:meth:`start`): a start that
        failed its checks leaves nothing behind — a report written into a bucket named by a
        typo would create it on a store that creates buckets on the first write.
        """
        self._task.stop(timeout=10)
        if self._written is not None:
            self._written.finish(state, error)
        if not self._started:
            return
        with self._lock:
            if self._report.state != ServiceState.STOPPED_ON_BATCH:
                self._report = replace(self._report, state=state)
        if error is not None:
            self.error(error, retrying=False)
        self.write()

    def write(self) -> None:
        """Write the report now; a failure is logged, never raised."""
        with self._write_lock:
            now = self._clock.monotonic()
            with self._lock:
                since, rows_then = self._rate_at
                rows = self._report.rows
                if now - since > 0:
                    rate = (rows - rows_then) / (now - since)
                    self._report = replace(self._report, rows_per_second=round(rate, 1))
                    self._rate_at = (now, rows)
                self._report = replace(self._report, updated_ms=self._clock.now_ms())
                report = self._report
            try:
                self._store.put(self._path, report.to_json())
            except MillpondError as err:
                if not self._failing:
                    logger.warning("could not write the consumer report %s: %s", self._path, err)
                self._failing = True
            else:
                if self._failing:
                    logger.info("the consumer report %s is written again", self._path)
                self._failing = False

    def _update(self, **changes: Any) -> None:
        with self._lock:
            self._report = replace(self._report, **changes)

    def _run(self) -> None:
        while not self._task.wait(self._interval):
            self.write()


def status_section(
    store: ObjectStore, data_path_prefix: str, *, now_ms: int, epoch: int
) -> tuple[list[str], dict[str, Any] | None]:
    """``millpond status``'s lines and JSON about the consumer service (one GET).

    Raises:
        StorageError: the store failed.
    """
    try:
        report = read_report(store, data_path_prefix)
    except FormatError as err:
        return [f"consumer         report unreadable: {err}"], None
    return report_text(report, now_ms=now_ms, epoch=epoch), (
        None if report is None else asdict(report)
    )


def report_text(report: ServiceReport | None, *, now_ms: int, epoch: int) -> list[str]:
    """``millpond status``'s lines about the consumer service (``epoch``: the manifest's)."""
    if report is None:
        return ["consumer         no report (no millpond consume has reported on this queue)"]
    age = max(0.0, (now_ms - report.updated_ms) / 1000)
    who = f"epoch {report.epoch}, {report.host} pid {report.pid}"
    lines: list[str] = []
    stopped = report.stopped_on
    if report.state == ServiceState.STOPPED_ON_BATCH and stopped is not None:
        lines += [
            f"consumer         STOPPED on sequence {stopped.sequence} ({stopped.location}), "
            f"{_ago(age)} ({who})",
            f"  why            {stopped.error}",
            f"  to set it aside {stopped.command}",
            "                 then start millpond consume again; `millpond replay ... "
            f"--sequence {stopped.sequence}` writes it once the cause is fixed",
        ]
    else:
        note = ""
        if report.stale(now_ms):
            note = (
                f"; NO REPORT FOR {age:.0f} s ({report.missed(now_ms)} missed, one every "
                f"{report.interval:g} s expected): is it alive?"
            )
        elif report.epoch is not None and report.epoch < epoch:
            note = f"; superseded: the queue is at epoch {epoch}"
        lines.append(f"consumer         {report.state} ({who}), reported {_ago(age)}{note}")
    lag = "-" if report.lag_seconds is None else f"{report.lag_seconds:.1f} s"
    last = "-" if report.last_sequence is None else str(report.last_sequence)
    lines += [
        f"  rows/s         {report.rows_per_second:,.0f} (over the last report interval)",
        f"  written        {report.rows:,} rows in {report.batches:,} batches since it started "
        f"({report.skipped} skipped as already written, {report.quarantined} quarantined)",
        f"  lag            {lag}; last sequence written {last}",
    ]
    if report.last_error is None:
        lines.append("  last error     none")
    else:
        at = (
            ""
            if report.last_error_ms is None
            else f"{_ago(max(0.0, (now_ms - report.last_error_ms) / 1000))}: "
        )
        lines.append(f"  last error     {at}{report.last_error}")
    return lines


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"
