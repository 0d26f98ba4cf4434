"""Driver side of a Spark write: turning successful task attempts into one queue append.

Batch jobs (``commit="job"``). Spark calls ``commit()`` on the driver with the messages of the
task attempts that succeeded, one per partition, only once every partition has one. Retried and
speculative attempts that failed or lost never reach it, so appending exactly these locations
in one CAS puts every row of the job in the queue exactly once. What the other attempts uploaded
is never referenced and GC removes it.

Streaming (:func:`commit_micro_batch`). A micro-batch is committed with one append as well, and
Spark may run the same batch id again after a driver restart (the sink committed, then the
driver died before Spark recorded the batch in its commit log). A small state object per
stream, ``{data_path_prefix}/_spark/streams/{stream_id}.json``, written with compare-and-swap
*before* the append, remembers the batch id, the entries and the manifest's ``next_sequence``
when the append began. A batch id that comes back finds its own state and is resolved by
looking, never by guessing:

1. the remembered locations are in the manifest: already enqueued, skip;
2. they are not, and nothing at or after the remembered ``next_sequence`` has been dequeued:
   the append never happened; append (the re-run's fresh uploads, if GC took the old ones);
3. they are not, something was dequeued since, and the old objects still exist: the append may
   have landed and been consumed. Append the *same* locations again: a sink that records batch
   locations (millpond's do) skips a location it has already written, so no row doubles;
4. they are not, something was dequeued, and GC removed the old objects: cannot tell. This is
   the one window left (a driver down for longer than the GC grace period right after the state
   write); the commit fails with a message naming the stream, the batch and the locations to
   look for in the sink, instead of risking a loss or a duplicate.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any

from millpond.common.clock import Clock, SystemClock
from millpond.common.retry import RetryPolicy
from millpond.common.ulids import parse_batch_name, ulid_time_ms
from millpond.errors import (
    CommitStateUnknownError,
    ConflictError,
    FormatError,
    MillpondError,
    NotFoundError,
    StorageError,
)
from millpond.formats.manifest import (
    Footer,
    Metadata,
    PendingEntry,
    decode_footer,
    decode_manifest,
    empty_manifest,
    find_locations,
)
from millpond.producer.spark.upload import TaskCommitMessage, UploadStats
from millpond.queue import QueueProducer
from millpond.storage.store import ObjectStore

__all__ = [
    "JobReceipt",
    "MicroBatchOutcome",
    "check_uploads_present",
    "commit_job",
    "commit_micro_batch",
    "spark_payload",
    "stream_state_path",
]

logger = logging.getLogger(__name__)

_STATE_VERSION = 1
_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_HEAD_THREADS = 16


def spark_payload(**fields: object) -> bytes:
    """The metadata payload of a Spark-written entry: compact JSON under a ``spark`` key."""
    return json.dumps({"spark": fields}, separators=(",", ":"), sort_keys=True).encode()


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
    requests: Mapping[str, int] = field(default_factory=dict)
    """Object-store requests of the whole write by kind (``put``, ``get``), as counted by the
    tasks and the driver."""

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
        }


def commit_job(
    store: ObjectStore,
    messages: Sequence[TaskCommitMessage | None],
    *,
    job_id: str,
    manifest_path: str,
    gc_grace_period: float,
    extra_payload: Mapping[str, object] | None = None,
    retry: RetryPolicy | None = None,
    clock: Clock | None = None,
) -> JobReceipt:
    """Append every batch of the job's successful task attempts in one CAS.

    Raises:
        MillpondError: a message is missing (Spark should never commit then).
        NotFoundError: an uploaded object is gone (the job outlived the GC grace period).
        StorageError: the append's retry budget ran out; whether it landed is unknown.
    """
    clock = clock or SystemClock()
    if any(message is None for message in messages):
        raise MillpondError(f"job {job_id}: a task has no commit message; refusing to commit")
    ordered = sorted(
        (m for m in messages if m is not None), key=lambda m: (m.partition_id, m.attempt)
    )
    entries: list[PendingEntry] = []
    stats = UploadStats()
    for message in ordered:
        stats += message.stats
        payload = spark_payload(
            job=job_id,
            partition=message.partition_id,
            attempt=message.attempt,
            **(extra_payload or {}),
        )
        entries.extend(upload.pending_entry(payload) for upload in message.uploads)
    if not entries:
        logger.info("job %s wrote no rows; nothing to append", job_id)
        return JobReceipt(job_id, None, None, len(ordered), stats)
    check_uploads_present(
        store, [e.location for e in entries], gc_grace_period=gc_grace_period, clock=clock
    )
    queue = QueueProducer(store, manifest_path, retry=retry, clock=clock)
    sequences = queue.append(entries)
    logger.info(
        "job %s: %s batches, %s rows enqueued at sequences %s..%s",
        job_id,
        len(entries),
        stats.rows,
        sequences[0],
        sequences[-1],
    )
    return JobReceipt(
        job_id,
        sequences[0],
        sequences[-1],
        len(ordered),
        stats,
        queue.counters.snapshot(),
    )


def check_uploads_present(
    store: ObjectStore, locations: Sequence[str], *, gc_grace_period: float, clock: Clock
) -> None:
    """Refuse to enqueue objects GC may already have removed.

    GC deletes an unreferenced batch once its ULID is older than both the grace period and the
    oldest queue entry. Uploads younger than half the grace period are safe without a look;
    for older ones (a long job) every object is checked with a HEAD, so a job that outlived the
    grace period fails clearly instead of enqueuing locations the consumer cannot read.

    Raises:
        NotFoundError: naming how many objects are gone and the first one.
        StorageError: a HEAD failed.
    """
    now_ms = clock.now_ms()
    oldest_ms = min(
        (
            ulid_time_ms(ulid)
            for loc in locations
            if (ulid := parse_batch_name(loc.rsplit("/", 1)[-1]))
        ),
        default=now_ms,
    )
    age = (now_ms - oldest_ms) / 1000
    if age < gc_grace_period / 2:
        return
    logger.warning(
        "uploads are %.0f s old (GC grace period %.0f s): checking %s objects still exist",
        age,
        gc_grace_period,
        len(locations),
    )

    def missing(location: str) -> str | None:
        try:
            store.head(location)
        except NotFoundError:
            return location
        return None

    with ThreadPoolExecutor(_HEAD_THREADS, thread_name_prefix="millpond-head") as pool:
        gone = [loc for loc in pool.map(missing, locations) if loc is not None]
    if gone:
        raise NotFoundError(
            f"{len(gone)} of {len(locations)} uploaded batch objects are gone (first: {gone[0]}):"
            f" the write took {age:.0f} s, longer than the GC grace period of "
            f"{gc_grace_period:.0f} s; raise gc_grace_period on the collector above the longest "
            "job, or write with commit='task'"
        )


@dataclass(frozen=True, slots=True)
class MicroBatchOutcome:
    """How :func:`commit_micro_batch` resolved one micro-batch."""

    status: str
    """``appended``, ``reappended`` (case 3), ``skipped`` (already enqueued) or ``empty``."""
    sequences: tuple[int, ...] | None = None
    """Where the entries went, when known."""


@dataclass(frozen=True, slots=True)
class _StreamState:
    batch_id: int
    next_sequence: int
    entries: tuple[PendingEntry, ...]

    def encode(self, stream_id: str) -> bytes:
        record = {
            "version": _STATE_VERSION,
            "stream": stream_id,
            "batch_id": self.batch_id,
            "next_sequence": self.next_sequence,
            "entries": [
                {
                    "location": e.location,
                    "metadata": [
                        [m.start_index, m.ingestion_time_ms, base64.b64encode(m.payload).decode()]
                        for m in e.metadata
                    ],
                }
                for e in self.entries
            ],
        }
        return json.dumps(record, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, *, name: str) -> _StreamState:
        try:
            record = json.loads(data)
            if record.get("version") != _STATE_VERSION:
                raise FormatError(
                    f"{name}: version: expected {_STATE_VERSION}, found {record.get('version')!r}",
                    field="version",
                )
            entries = tuple(
                PendingEntry(
                    e["location"],
                    tuple(
                        Metadata(int(s), int(t), base64.b64decode(p)) for s, t, p in e["metadata"]
                    ),
                )
                for e in record["entries"]
            )
            return cls(int(record["batch_id"]), int(record["next_sequence"]), entries)
        except (ValueError, KeyError, TypeError) as err:
            raise FormatError(f"{name}: not a millpond stream state: {err}") from err


def stream_state_path(data_path_prefix: str, stream_id: str) -> str:
    """Where the state object of a stream lives; ids that are not path-safe are hashed."""
    safe = stream_id if _SAFE_ID.match(stream_id) else sha256(stream_id.encode()).hexdigest()[:32]
    prefix = data_path_prefix.strip("/")
    name = f"_spark/streams/{safe}.json"
    return f"{prefix}/{name}" if prefix else name


def commit_micro_batch(
    store: ObjectStore,
    entries: Sequence[PendingEntry],
    *,
    stream_id: str,
    batch_id: int,
    manifest_path: str,
    data_path_prefix: str,
    retry: RetryPolicy | None = None,
    clock: Clock | None = None,
) -> MicroBatchOutcome:
    """Enqueue one micro-batch at most once per (stream, batch id); see the module docstring.

    Raises:
        MillpondError: case 4 of the module docstring (cannot tell whether the batch landed).
        FormatError: the stream state or the manifest is corrupt.
        StorageError: the store failed past the retry budget.
    """
    retry = retry or RetryPolicy()
    clock = clock or SystemClock()
    state_path = stream_state_path(data_path_prefix, stream_id)
    fresh = tuple(entries)
    queue = QueueProducer(store, manifest_path, retry=retry, clock=clock)
    backoff = retry.start(clock)
    while True:
        try:
            return _commit_once(store, queue, state_path, stream_id, batch_id, fresh, manifest_path)
        except (ConflictError, CommitStateUnknownError) as err:
            # The state object moved under us, or our write of it may have landed: decide
            # again from what is stored now.
            if not backoff.sleep():
                raise StorageError(
                    f"{state_path}: stream commit gave up after {backoff.attempt} attempts: {err}"
                ) from err
            logger.info("stream %s batch %s: %s; deciding again", stream_id, batch_id, err)


def _commit_once(
    store: ObjectStore,
    queue: QueueProducer,
    state_path: str,
    stream_id: str,
    batch_id: int,
    fresh: tuple[PendingEntry, ...],
    manifest_path: str,
) -> MicroBatchOutcome:
    state, etag = _read_state(store, state_path)
    if state is not None and state.batch_id > batch_id:
        # Spark only ever re-runs its latest batch: an older id means the checkpoint was reset
        # or two queries share one stream id. Skipping would lose data, appending may double it.
        raise MillpondError(
            f"stream {stream_id}: batch {batch_id} arrived after batch {state.batch_id} was "
            f"committed ({state_path}): the checkpoint was reset or another query uses the same "
            "stream id; give this query its own query_id option"
        )
    manifest = _read_manifest_bytes(store, manifest_path)
    footer = decode_footer(manifest, name=manifest_path)
    if state is not None and state.batch_id == batch_id:
        return _recover(store, queue, state_path, etag, stream_id, state, fresh, manifest, footer)
    if not fresh:
        return MicroBatchOutcome("empty")
    _write_state(
        store, state_path, etag, _StreamState(batch_id, footer.next_sequence, fresh), stream_id
    )
    sequences = queue.append(fresh)
    return MicroBatchOutcome("appended", sequences)


def _recover(
    store: ObjectStore,
    queue: QueueProducer,
    state_path: str,
    etag: str | None,
    stream_id: str,
    state: _StreamState,
    fresh: tuple[PendingEntry, ...],
    manifest: bytes,
    footer: Footer,
) -> MicroBatchOutcome:
    where = f"stream {stream_id} batch {state.batch_id}"
    locations = {e.location for e in state.entries}
    found = find_locations(manifest, locations, from_sequence=state.next_sequence)
    if found:
        if len(found) != len(locations):
            raise MillpondError(
                f"{where}: only {len(found)} of its {len(locations)} locations are in the "
                "manifest; it was written by something else"
            )
        first = min(found.values())
        # Worth a line at WARNING: the driver died between our append and Spark's commit log.
        logger.warning("%s: already enqueued at sequence %s; skipping the re-run", where, first)
        return MicroBatchOutcome("skipped", tuple(range(first, first + len(found))))
    dequeued_since = _dequeued_through(manifest, footer, name=state_path) >= state.next_sequence
    gone = [loc for loc in sorted(locations) if not _exists(store, loc)]
    if not gone:
        if dequeued_since:
            logger.warning(
                "%s: not in the manifest, which was dequeued past sequence %s since; appending "
                "the same %s locations again (the sink skips locations it has written)",
                where,
                state.next_sequence,
                len(locations),
            )
        sequences = queue.append(state.entries)
        return MicroBatchOutcome("reappended" if dequeued_since else "appended", sequences)
    if dequeued_since:
        raise MillpondError(
            f"{where}: cannot tell whether it was enqueued: its locations are not in the "
            f"manifest, entries from sequence {state.next_sequence} on were dequeued since, and "
            f"GC removed {len(gone)} of its batch objects (first: {gone[0]}). Look for these "
            f"locations in the sink; if they are absent, delete {state_path} and restart the "
            "query"
        )
    # Never appended, and GC removed the orphans: the re-run's own uploads take their place.
    if not fresh:
        return MicroBatchOutcome("empty")
    _write_state(
        store,
        state_path,
        etag,
        _StreamState(state.batch_id, footer.next_sequence, fresh),
        stream_id,
    )
    return MicroBatchOutcome("appended", queue.append(fresh))


def _read_state(store: ObjectStore, path: str) -> tuple[_StreamState | None, str | None]:
    try:
        got = store.get(path)
    except NotFoundError:
        return None, None
    return _StreamState.decode(got.data, name=path), got.etag


def _write_state(
    store: ObjectStore, path: str, etag: str | None, state: _StreamState, stream_id: str
) -> None:
    data = state.encode(stream_id)
    if etag is None:
        store.put_if_absent(path, data)
    else:
        store.put_if_match(path, data, etag)


def _read_manifest_bytes(store: ObjectStore, path: str) -> bytes:
    try:
        return store.get(path).data
    except NotFoundError:
        return empty_manifest()


def _dequeued_through(manifest: bytes, footer: Footer, *, name: str) -> int:
    """The highest sequence that has left the queue (-1 when none has)."""
    if footer.entry_count == 0:
        return footer.next_sequence - 1
    first = decode_manifest(manifest, name=name).first_sequence
    return footer.next_sequence - 1 if first is None else first - 1


def _exists(store: ObjectStore, location: str) -> bool:
    try:
        store.head(location)
    except NotFoundError:
        return False
    return True
