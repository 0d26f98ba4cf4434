"""Driver side of a Spark write: turning successful task attempts into one queue append.

Batch jobs (``commit="job"``). Spark calls ``commit()`` on the driver with the messages of the
task attempts that succeeded, one per partition, only once every partition has one. Retried and
speculative attempts that failed or lost never reach it, so appending exactly these locations
in one CAS puts every row of the job in the queue exactly once. What the other attempts uploaded
is never referenced and GC removes it.

A job that fails and is run again is a new job: it uploads new objects. When the first run's
append landed (or may have) before the failure, the rerun would enqueue the same rows twice —
unless the job names itself with the ``write_id`` option: then the commit goes through a state
object (:mod:`millpond.producer.spark.commit_state`) and a second job with the same write id
enqueues nothing if the first one landed. One that commits while the first still does waits for
the first one's outcome (taking its state over only once it stayed unchanged for a lease, the
retry policy's ``max_elapsed``): the write id is appended once either way.

Streaming (:func:`commit_micro_batch`). A micro-batch is committed the same way, keyed by the
stream and the batch id: Spark runs the same batch id again after a driver restart (the sink
committed, then the driver died before Spark recorded the batch in its commit log), and the
state says whether, and where, it was enqueued.

Uploads older than half the queue's GC grace period are copied to fresh names before they are
appended or held (a server-side copy): an object that old could be collected between any check
and the append, a fresh copy cannot.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from millpond.common.clock import Clock, SystemClock
from millpond.common.metrics import Counters
from millpond.common.retry import RetryPolicy
from millpond.common.ulids import UlidMinter, batch_location, parse_batch_name, ulid_time_ms
from millpond.coordinator.client import CoordinatedAppender
from millpond.errors import (
    CommitStateUnknownError,
    ConflictError,
    MillpondError,
    NotFoundError,
    StorageError,
)
from millpond.formats.manifest import PendingEntry
from millpond.producer.spark.commit_state import (
    CommitOutcome,
    HoldTooLate,
    commit_with_state,
    state_path,
)
from millpond.producer.spark.summary import log_summary
from millpond.producer.spark.upload import TaskCommitMessage, UploadStats
from millpond.queue import Appender, QueueProducer, queue_identity
from millpond.storage.store import ObjectStore

__all__ = [
    "JobReceipt",
    "MicroBatchOutcome",
    "commit_job",
    "commit_micro_batch",
    "fresh_copies",
    "spark_payload",
    "stream_state_path",
    "sum_stats",
    "task_entries",
    "write_state_path",
]

logger = logging.getLogger(__name__)

_COPY_THREADS = 16
# Holds given up because the driver was held up past the uploads' deadline, before one attempt
# fails: each copies the uploads again first, so another needs another such pause.
_HOLD_RETRIES = 3

MicroBatchOutcome = CommitOutcome
"""How :func:`commit_micro_batch` resolved one micro-batch (see ``CommitOutcome``)."""


def spark_payload(**fields: object) -> bytes:
    """The metadata payload of a Spark-written entry: compact JSON under a ``spark`` key."""
    return json.dumps({"spark": fields}, separators=(",", ":"), sort_keys=True).encode()


def task_entries(messages: Sequence[TaskCommitMessage], **fields: object) -> list[PendingEntry]:
    """Every batch of ``messages``, in partition order, each with the Spark payload of
    ``fields`` and the task that uploaded it."""
    ordered = sorted(messages, key=lambda m: (m.partition_id, m.attempt))
    return [
        upload.pending_entry(spark_payload(partition=m.partition_id, attempt=m.attempt, **fields))
        for m in ordered
        for upload in m.uploads
    ]


def sum_stats(messages: Sequence[TaskCommitMessage]) -> UploadStats:
    """What the tasks of ``messages`` uploaded, summed."""
    return sum((m.stats for m in messages), UploadStats())


@dataclass(frozen=True, slots=True)
class JobReceipt:
    """What one committed Spark job put in the queue."""

    job_id: str
    """The id the driver minted for the write (in every entry's metadata payload)."""
    first_sequence: int | None
    """Sequence of the job's first entry, or ``None`` when it wrote no rows."""
    last_sequence: int | None
    """Sequence of the job's last entry."""
    tasks: int
    """Task commit messages (one per partition)."""
    stats: UploadStats
    """Rows, entries, batches, bytes and PUT requests of the winning attempts."""
    manifest: Mapping[str, int] = field(default_factory=dict)
    """Manifest requests of the commit: reads, writes, CAS conflicts, retries."""
    status: str = "appended"
    """``appended``, ``reappended`` or ``skipped`` (a write id already committed), ``empty``."""
    write_id: str | None = None
    """The ``write_id`` option, when given."""
    requests: Mapping[str, int] = field(default_factory=dict)
    """Object-store requests of the whole write by kind (``put``, ``get``), as counted by the
    tasks and the driver."""
    sequences: tuple[int, ...] = ()
    """Every sequence the job's entries are at (a ``skipped`` write id: where the first run
    put them), for ``await_sink``."""

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "first_sequence": self.first_sequence,
            "last_sequence": self.last_sequence,
            "tasks": self.tasks,
            "rows": self.stats.rows,
            "entries": self.stats.entries,
            "batches": self.stats.batches,
            "bytes": self.stats.bytes,
            "put_requests": self.stats.put_requests,
            "manifest": dict(self.manifest),
            "requests": dict(self.requests),
            "status": self.status,
            "write_id": self.write_id,
        }


def commit_job(
    store: ObjectStore,
    messages: Sequence[TaskCommitMessage | None],
    *,
    job_id: str,
    manifest_path: str,
    data_path_prefix: str = "ingest",
    gc_grace_period: float,
    write_id: str | None = None,
    extra_payload: Mapping[str, object] | None = None,
    retry: RetryPolicy | None = None,
    clock: Clock | None = None,
    coordinator: Sequence[str] = (),
) -> JobReceipt:
    """Append every batch of the job's successful task attempts in one CAS.

    With ``write_id``, at most once per write id however often the job runs (see the module
    docstring); without, a rerun of a job whose append landed enqueues its rows again.

    Raises:
        MillpondError: a message is missing (Spark should never commit then), or a write id
            whose earlier outcome cannot be told.
        NotFoundError: an uploaded object is gone (the job outlived the GC grace period).
        CommitStateUnknownError: the append gave up not knowing whether it landed; the
            message says so, and how to make a rerun safe.
        StorageError: the store failed before anything could have been enqueued.
    """
    if any(message is None for message in messages):
        raise MillpondError(f"job {job_id}: a task has no commit message; refusing to commit")
    tasks = [m for m in messages if m is not None]
    entries = task_entries(tasks, job=job_id, **(extra_payload or {}))
    job = _Job(job_id, write_id, len(tasks), entries, sum_stats(tasks))
    clock = clock or SystemClock()
    with _appender(
        store, manifest_path, retry=retry, clock=clock, coordinator=coordinator
    ) as queue:
        sequences, status = job.append(
            store,
            queue,
            limit=gc_grace_period / 2,
            data_path_prefix=data_path_prefix,
            retry=retry,
            clock=clock,
        )
        return job.receipt(sequences, status, queue.counters.snapshot())


@dataclass(frozen=True, slots=True)
class _Job:
    """A batch job's successful task attempts, as :func:`commit_job` appends them."""

    job_id: str
    write_id: str | None
    tasks: int
    """Task commit messages (one per partition)."""
    entries: list[PendingEntry]
    """Every batch of every task, in partition order, with the Spark payload."""
    stats: UploadStats

    def append(
        self,
        store: ObjectStore,
        queue: Appender,
        *,
        limit: float,
        data_path_prefix: str,
        retry: RetryPolicy | None,
        clock: Clock,
    ) -> tuple[tuple[int, ...], str]:
        """Append the job's entries: through its write id's state when it has one, else in
        one append of fresh copies (:func:`fresh_copies`, ``limit``).

        Returns:
            Where the entries went, and the receipt's status.

        Raises:
            As :func:`commit_job`.
        """
        if self.write_id is not None:
            outcome = _commit_keyed(
                store,
                queue,
                path=write_state_path(data_path_prefix, self.write_id),
                key=f"write:{self.write_id}",
                batch_id=0,
                entries=self.entries,
                limit=limit,
                data_path_prefix=data_path_prefix,
                retry=retry,
                clock=clock,
            )
            return outcome.sequences or (), outcome.status
        if not self.entries:
            return (), "empty"
        fresh = fresh_copies(
            store, self.entries, data_path_prefix=data_path_prefix, limit=limit, clock=clock
        )
        try:
            sequences = queue.append(
                fresh, deadline=append_deadline(fresh, limit=limit, clock=clock)
            )
        except CommitStateUnknownError as err:
            raise CommitStateUnknownError(
                f"job {self.job_id}: the append of {len(fresh)} batches may or may not have landed "
                f"({err}); rerunning the job may enqueue its rows twice. Give the job a "
                ".option('write_id', ...) to make reruns safe",
                sequences=err.sequences,
                maybe_landed_from=err.maybe_landed_from,
            ) from err
        return sequences, "appended"

    def receipt(
        self, sequences: tuple[int, ...], status: str, manifest: Mapping[str, int]
    ) -> JobReceipt:
        """Log the job's summary line; its receipt (``manifest``: the commit's counters)."""
        log_summary(
            f"job {self.job_id}",
            stats=self.stats,
            status=status,
            sequences=sequences,
            manifest=manifest,
        )
        return JobReceipt(
            self.job_id,
            sequences[0] if sequences else None,
            sequences[-1] if sequences else None,
            self.tasks,
            self.stats,
            manifest,
            status=status,
            write_id=self.write_id,
            sequences=sequences,
        )


def fresh_copies(
    store: ObjectStore,
    entries: Sequence[PendingEntry],
    *,
    data_path_prefix: str,
    limit: float,
    clock: Clock,
) -> tuple[PendingEntry, ...]:
    """The entries, with any upload older than ``limit`` seconds copied to a fresh name.

    A collector may delete an unreferenced object once its name and its last write are older
    than the grace period; checking that it still exists and then appending it leaves a window
    between the two. A server-side copy under a new ULID is as young as an upload, so it cannot
    be collected before the append. Only never-enqueued uploads may be renamed this way.

    Raises:
        NotFoundError: an upload is already gone (the job outlived the grace period).
        StorageError: a copy failed.
    """
    now_ms = clock.now_ms()
    old = [
        i
        for i, entry in enumerate(entries)
        if (age := _upload_age(entry, now_ms)) is None or age > limit
    ]
    if not old:
        return tuple(entries)
    logger.warning(
        "%s of %s uploads are older than half the GC grace period (%.0f s): copying them to "
        "fresh names before they are enqueued",
        len(old),
        len(entries),
        limit,
    )
    minter = UlidMinter(clock)
    copies = {i: batch_location(data_path_prefix, minter.mint()) for i in old}

    def copy(index: int) -> str | None:
        try:
            store.copy(entries[index].location, copies[index])
        except FileNotFoundError:
            return entries[index].location
        return None

    with ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="millpond-copy") as pool:
        gone = [loc for loc in pool.map(copy, old) if loc is not None]
    if gone:
        raise NotFoundError(
            f"{len(gone)} of {len(entries)} uploaded batch objects are gone (first: {gone[0]}): "
            f"the write took longer than the GC grace period of {2 * limit:.0f} s; raise "
            "gc_grace_period on the collector above the longest job, or write with "
            "commit='task'"
        )
    return tuple(
        PendingEntry(copies[i], entry.metadata) if i in copies else entry
        for i, entry in enumerate(entries)
    )


def append_deadline(entries: Sequence[PendingEntry], *, limit: float, clock: Clock) -> float:
    """When (on ``clock``'s monotonic time) the append of ``entries`` must have been sent: once
    the oldest is ``limit`` seconds old, as :func:`fresh_copies` judges it.

    Nothing but the append protects a job's uploads from the collector (no hold, unlike a
    keyed commit): a driver paused between the copies and the write must not send it then.
    """
    now_ms = clock.now_ms()
    ages = [age for entry in entries if (age := _upload_age(entry, now_ms)) is not None]
    return clock.monotonic() + limit - max([0.0, *ages])


def _upload_age(entry: PendingEntry, now_ms: int) -> float | None:
    """Seconds since the upload named by ``entry`` was minted (``None``: not a ULID name)."""
    ulid = parse_batch_name(entry.location.rsplit("/", 1)[-1])
    return None if ulid is None else (now_ms - ulid_time_ms(ulid)) / 1000


def stream_state_path(data_path_prefix: str, stream_id: str) -> str:
    """Where the commit state of a stream lives (a hold under the data prefix)."""
    return state_path(data_path_prefix, "stream", stream_id)


def write_state_path(data_path_prefix: str, write_id: str) -> str:
    """Where the commit state of a write id lives (a hold under the data prefix)."""
    return state_path(data_path_prefix, "write", write_id)


def commit_micro_batch(
    store: ObjectStore,
    entries: Sequence[PendingEntry],
    *,
    stream_id: str,
    batch_id: int,
    manifest_path: str,
    data_path_prefix: str,
    gc_grace_period: float = 600.0,
    retry: RetryPolicy | None = None,
    clock: Clock | None = None,
    counters: Counters | None = None,
    coordinator: Sequence[str] = (),
) -> CommitOutcome:
    """Enqueue one micro-batch at most once per (stream, batch id); see the module docstring.

    ``counters`` receives the commit's manifest reads, writes and CAS conflicts.

    Raises:
        MillpondError: an older batch id after a newer one, or an outcome that cannot be told.
        FormatError: the stream state or the manifest is corrupt.
        StorageError: the store failed past the retry budget.
    """
    clock = clock or SystemClock()
    with _appender(
        store, manifest_path, retry=retry, clock=clock, counters=counters, coordinator=coordinator
    ) as queue:
        return _commit_keyed(
            store,
            queue,
            path=stream_state_path(data_path_prefix, stream_id),
            key=f"stream:{stream_id}",
            batch_id=batch_id,
            entries=entries,
            limit=gc_grace_period / 2,
            data_path_prefix=data_path_prefix,
            retry=retry,
            clock=clock,
        )


def _appender(
    store: ObjectStore,
    manifest_path: str,
    *,
    retry: RetryPolicy | None,
    clock: Clock,
    counters: Counters | None = None,
    coordinator: Sequence[str] = (),
) -> AbstractContextManager[Appender]:
    """The driver's appender: through ``coordinator`` when given (appending directly whenever
    none answers, with the same contract; closed when the block ends), else straight to the
    manifest."""
    direct = QueueProducer(store, manifest_path, retry=retry, clock=clock, counters=counters)
    if not coordinator:
        return contextlib.nullcontext(direct)
    queue = queue_identity(store.url, manifest_path)
    return contextlib.closing(CoordinatedAppender(direct, coordinator, queue=queue, clock=clock))


def _commit_keyed(
    store: ObjectStore,
    queue: Appender,
    *,
    path: str,
    key: str,
    batch_id: int,
    entries: Sequence[PendingEntry],
    limit: float,
    data_path_prefix: str,
    retry: RetryPolicy | None,
    clock: Clock,
) -> CommitOutcome:
    """Commit through the state object, deciding again whenever it moved under us or a write
    of ours may or may not have landed (the state says what is known).

    Every decision first copies uploads older than ``limit`` to fresh names
    (:func:`fresh_copies`), and holds them before the oldest gets that old: a driver held up
    past that point copies them again rather than hold objects a collector may have taken.
    """
    retry = retry or RetryPolicy()
    again = _DecideAgain(retry, clock)
    fresh = tuple(entries)
    # This commit, in every attempt: it goes on with a pending state it claimed itself, and
    # waits for any other commit's (commit_state's docstring). Its lease: as long as one
    # append may retry.
    owner = uuid.uuid4().hex
    while True:
        fresh = fresh_copies(
            store, fresh, data_path_prefix=data_path_prefix, limit=limit, clock=clock
        )
        try:
            return commit_with_state(
                store,
                queue,
                path=path,
                key=key,
                batch_id=batch_id,
                fresh=fresh,
                hold_by=append_deadline(fresh, limit=limit, clock=clock),
                clock=clock,
                owner=owner,
                lease=retry.max_elapsed,
                on_wait=again.on_wait,
            )
        except HoldTooLate as err:
            # Not a failed attempt: the next decision holds fresh copies at once.
            if not again.hold_again():
                raise
            logger.warning("%s; copying them to fresh names", err)
        except (ConflictError, StorageError) as err:
            if not again.back_off():
                raise StorageError(
                    f"{path}: commit of {key} batch {batch_id} gave up after {again.attempt} "
                    f"attempts; run it again to resolve it: {err}"
                ) from err
            logger.info("%s batch %s: %s; deciding again", key, batch_id, err)


class _DecideAgain:
    """When :func:`_commit_keyed` decides again, and when it gives up."""

    def __init__(self, retry: RetryPolicy, clock: Clock) -> None:
        self._retry = retry
        self._clock = clock
        self._backoff = retry.start(clock)
        self._late = 0
        self._waited = False

    @property
    def attempt(self) -> int:
        """The attempt the backoff has come to, since the budget last started."""
        return self._backoff.attempt

    def on_wait(self) -> None:
        """The commit waits for another commit's outcome (``commit_with_state``'s ``on_wait``)."""
        self._waited = True

    def hold_again(self) -> bool:
        """Whether to decide again after a hold given up because the driver was held up past
        the uploads' deadline (at most ``_HOLD_RETRIES`` times)."""
        self._late += 1
        return self._late <= _HOLD_RETRIES

    def back_off(self) -> bool:
        """Wait before deciding again after a failed attempt; ``False`` once the retry budget
        is spent."""
        if self._waited:
            # Waiting for another commit's outcome is no failed attempt: the budget
            # starts again from here.
            self._waited = False
            self._backoff = self._retry.start(self._clock)
        return self._backoff.sleep()
