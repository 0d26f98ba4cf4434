"""Regression tests for issue 9's Spark cases, named after them (the rest are in
``tests/test_exactly_once_cases.py``).

5. a re-run streaming micro-batch whose entries were partly dequeued stops the stream:
   ``test_rerun_micro_batch_partly_dequeued_goes_on``
6. a failed or ambiguous Spark job commit duplicates on rerun:
   ``test_ambiguous_job_commit_rerun_with_write_id_does_not_duplicate`` (the commit protocol)
   and ``test_a_second_job_with_the_same_write_id_enqueues_nothing`` (a real Spark job)
8. timing assumptions nobody checks, the Spark part:
   ``test_timing_assumptions_old_uploads_are_copied_not_trusted``
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from typing import TYPE_CHECKING

import pytest

from millpond.common.clock import SystemClock
from millpond.common.retry import RetryPolicy
from millpond.errors import CommitStateUnknownError, StorageError
from millpond.producer.spark.commit import commit_job, commit_micro_batch, stream_state_path
from millpond.producer.spark.upload import TaskCommitMessage, UploadedBatch, UploadStats
from millpond.queue import read_manifest
from millpond.storage import ForwardingStore, GetResult, ObjectInfo, ObjectStore, open_store
from tests.spark.test_commit_protocol import (
    MANIFEST,
    PREFIX,
    CrashingStore,
    LaterClock,
    drain,
    locations,
    upload,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from millpond.localstack import S3Endpoint

FAST = RetryPolicy(max_attempts=3, max_elapsed=1.0, base_delay=0.001, max_delay=0.01)


def _fresh() -> CrashingStore:
    return CrashingStore(open_store(f"memory://{uuid.uuid4().hex}"))


def _dequeue_through(store: ObjectStore, through: int) -> None:
    from millpond.queue import QueueConsumer

    consumer = QueueConsumer(store, MANIFEST)
    consumer.initialize()
    consumer.dequeue(through)


# --- case 5 ----------------------------------------------------------------------------------


def test_rerun_micro_batch_partly_dequeued_goes_on() -> None:
    store = _fresh()
    entries = upload(store, 4)
    # The append lands; the driver dies before Spark records the batch (and, today, before
    # millpond marks its state committed).
    store.crash_path, store.crash_skip = stream_state_path(PREFIX, "q1"), 1
    with contextlib.suppress(SystemExit):  # on the commit before the fix nothing crashes here
        commit_micro_batch(
            store,
            entries,
            stream_id="q1",
            batch_id=0,
            manifest_path=MANIFEST,
            data_path_prefix=PREFIX,
            retry=FAST,
        )
    assert locations(store) == [e.location for e in entries]
    _dequeue_through(store, 1)  # the consumer took 2 of the 4
    outcome = commit_micro_batch(
        store,
        upload(store, 4),  # the re-run's own uploads
        stream_id="q1",
        batch_id=0,
        manifest_path=MANIFEST,
        data_path_prefix=PREFIX,
        retry=FAST,
    )
    assert outcome.status == "skipped"
    assert locations(store) == [e.location for e in entries[2:]]
    # The stream goes on.
    nxt = upload(store, 1)
    outcome = commit_micro_batch(
        store,
        nxt,
        stream_id="q1",
        batch_id=1,
        manifest_path=MANIFEST,
        data_path_prefix=PREFIX,
        retry=FAST,
    )
    assert outcome.status == "appended"
    assert locations(store) == [e.location for e in entries[2:] + nxt]


# --- case 6 ----------------------------------------------------------------------------------


class LandsThenFails(ForwardingStore):
    """The first manifest write lands and reports a timeout; from then on, until ``failing`` is
    cleared, the manifest cannot be read or written (the store went down right after)."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.failing = True
        self.down = False

    def _check(self, path: str) -> None:
        if path == MANIFEST and self.failing and self.down:
            raise StorageError(f"{path}: injected outage")

    def get(self, path: str) -> GetResult:
        self._check(path)
        return self.inner.get(path)

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        self._check(path)
        etag = self.inner.put_if_absent(path, data)
        return self._landed(path, etag)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        self._check(path)
        return self._landed(path, self.inner.put_if_match(path, data, etag))

    def _landed(self, path: str, etag: str | None) -> str | None:
        if path == MANIFEST and self.failing:
            self.down = True
            raise CommitStateUnknownError(f"{path}: injected timeout after the write landed")
        return etag


def _messages(store: ObjectStore, count: int) -> list[TaskCommitMessage]:
    return [
        TaskCommitMessage(
            partition,
            0,
            tuple(UploadedBatch(e.location, 1, 10, 1) for e in upload(store, 1)),
            UploadStats(rows=10, batches=1),
        )
        for partition in range(count)
    ]


def test_ambiguous_job_commit_rerun_with_write_id_does_not_duplicate() -> None:
    inner = open_store(f"memory://{uuid.uuid4().hex}")
    store = LandsThenFails(inner)
    first = _messages(inner, 3)
    with pytest.raises(StorageError, match=r"run it again to resolve it"):
        commit_job(
            store,
            first,
            job_id="run-1",
            manifest_path=MANIFEST,
            data_path_prefix=PREFIX,
            gc_grace_period=600,
            write_id="daily-2026-11-23",
            retry=FAST,
        )
    store.failing = False
    landed = [e.location for e in read_manifest(inner, MANIFEST).manifest.entries]
    assert landed == [m.uploads[0].location for m in first]
    # The job runs again: new task attempts, new uploads, the same write id.
    receipt = commit_job(
        store,
        _messages(inner, 3),
        job_id="run-2",
        manifest_path=MANIFEST,
        data_path_prefix=PREFIX,
        gc_grace_period=600,
        write_id="daily-2026-11-23",
        retry=FAST,
    )
    assert receipt.status == "skipped"
    assert [e.location for e in read_manifest(inner, MANIFEST).manifest.entries] == landed
    # And once more after the consumer took everything: still nothing twice.
    drain(inner)
    receipt = commit_job(
        store,
        _messages(inner, 3),
        job_id="run-3",
        manifest_path=MANIFEST,
        data_path_prefix=PREFIX,
        gc_grace_period=600,
        write_id="daily-2026-11-23",
        retry=FAST,
    )
    assert receipt.status == "skipped"
    assert read_manifest(inner, MANIFEST).manifest.entries == ()


def test_ambiguous_job_commit_without_write_id_says_it_does_not_know() -> None:
    inner = open_store(f"memory://{uuid.uuid4().hex}")
    with pytest.raises(CommitStateUnknownError, match="write_id"):
        commit_job(
            LandsThenFails(inner),
            _messages(inner, 2),
            job_id="j",
            manifest_path=MANIFEST,
            data_path_prefix=PREFIX,
            gc_grace_period=600,
            retry=FAST,
        )


@pytest.mark.slow
def test_a_second_job_with_the_same_write_id_enqueues_nothing(
    spark: SparkSession, moto_s3: S3Endpoint
) -> None:
    from tests.spark.spark_support import Queue

    queue = Queue(moto_s3)
    options = queue.options(write_id="load-42")
    df = spark.range(1000, numPartitions=3)
    df.write.format("millpond").options(**options).mode("append").save()
    first = queue.entries()
    assert len(first) >= 3
    df.write.format("millpond").options(**options).mode("append").save()
    assert queue.entries() == first
    other = queue.options(write_id="load-43")
    df.write.format("millpond").options(**other).mode("append").save()
    assert len(queue.entries()) == 2 * len(first)


# --- case 8 (Spark) ----------------------------------------------------------------------------


class CollectsOnFirstLook(ForwardingStore):
    """A collector deletes each batch object right after the committer first looks at it: the
    worst moment for a check-then-append."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.looked: set[str] = set()
        self._lock = threading.Lock()

    def _collect(self, path: str) -> None:
        with self._lock:
            first = path not in self.looked
            self.looked.add(path)
        if first:
            self.inner.delete_many([path])

    def head(self, path: str) -> ObjectInfo:
        info = self.inner.head(path)
        self._collect(path)
        return info

    def copy(self, source: str, target: str) -> None:
        self.inner.copy(source, target)
        self._collect(source)


def test_timing_assumptions_old_uploads_are_copied_not_trusted() -> None:
    inner = open_store(f"memory://{uuid.uuid4().hex}")
    messages = _messages(inner, 2)
    # The job ran for 400 s of a 600 s grace period: its uploads are old enough for GC.
    receipt = commit_job(
        CollectsOnFirstLook(inner),
        messages,
        job_id="long",
        manifest_path=MANIFEST,
        data_path_prefix=PREFIX,
        gc_grace_period=600,
        retry=FAST,
        clock=LaterClock(400),
    )
    assert receipt.first_sequence == 0
    for entry in read_manifest(inner, MANIFEST).manifest.entries:
        inner.head(entry.location)  # every appended location exists (raises NotFoundError)
    appended = {e.location for e in read_manifest(inner, MANIFEST).manifest.entries}
    assert appended.isdisjoint(m.uploads[0].location for m in messages)  # fresh copies


def test_timing_assumptions_fresh_uploads_are_appended_as_they_are() -> None:
    inner = open_store(f"memory://{uuid.uuid4().hex}")
    messages = _messages(inner, 2)
    commit_job(
        inner,
        messages,
        job_id="short",
        manifest_path=MANIFEST,
        data_path_prefix=PREFIX,
        gc_grace_period=600,
        retry=FAST,
        clock=SystemClock(),
    )
    assert [e.location for e in read_manifest(inner, MANIFEST).manifest.entries] == [
        m.uploads[0].location for m in messages
    ]


def test_stream_entries_are_held_until_committed() -> None:
    from millpond.queue.holds import held_locations

    store = _fresh()
    entries = upload(store, 2)
    store.crash_path = MANIFEST  # the driver dies after the pending state, before the append
    with pytest.raises(SystemExit):
        commit_micro_batch(
            store,
            entries,
            stream_id="q9",
            batch_id=0,
            manifest_path=MANIFEST,
            data_path_prefix=PREFIX,
            retry=FAST,
        )
    assert held_locations(store, PREFIX) == {e.location for e in entries}
    commit_micro_batch(
        store,
        upload(store, 2),
        stream_id="q9",
        batch_id=0,
        manifest_path=MANIFEST,
        data_path_prefix=PREFIX,
        retry=FAST,
    )
    assert held_locations(store, PREFIX) == set()
    assert locations(store) == [e.location for e in entries]
