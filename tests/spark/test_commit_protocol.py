"""The driver-side commit protocols, without Spark: every way a restarted driver can find a
micro-batch, and the job commit's checks. Crashes are injected by a store that fails one write.
"""

from __future__ import annotations

import uuid

import pytest

from millpond.common.clock import SystemClock
from millpond.common.retry import RetryPolicy
from millpond.common.ulids import UlidMinter, batch_location
from millpond.errors import MillpondError, NotFoundError, StorageError
from millpond.formats.batch import encode_batch
from millpond.formats.manifest import Metadata, PendingEntry
from millpond.gc import GarbageCollector, GarbageCollectorConfig
from millpond.producer.spark.commit import (
    commit_job,
    commit_micro_batch,
    spark_payload,
    stream_state_path,
)
from millpond.producer.spark.upload import TaskCommitMessage, UploadedBatch, UploadStats
from millpond.queue import QueueConsumer, read_manifest
from millpond.storage import ForwardingStore, GetResult, ObjectStore, open_store
from tests.support import TestClockStore

MANIFEST = "ingest/manifest"
PREFIX = "ingest"
FAST = RetryPolicy(max_attempts=3, max_elapsed=1.0, base_delay=0.001, max_delay=0.01)


class CrashingStore(ForwardingStore):
    """Delegates to a store; a write to ``crash_path`` raises instead (a dead driver), after
    ``crash_skip`` writes to it went through."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.crash_path: str | None = None
        self.crash_skip = 0

    def _maybe_crash(self, path: str) -> None:
        if path == self.crash_path:
            if self.crash_skip:
                self.crash_skip -= 1
                return
            self.crash_path = None
            raise SystemExit(f"driver killed before writing {path}")

    def put(self, path: str, data: bytes) -> str | None:
        self._maybe_crash(path)
        return self.inner.put(path, data)

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        self._maybe_crash(path)
        return self.inner.put_if_absent(path, data)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        self._maybe_crash(path)
        return self.inner.put_if_match(path, data, etag)


@pytest.fixture
def store() -> CrashingStore:
    return CrashingStore(open_store(f"memory://{uuid.uuid4().hex}"))


_minter = UlidMinter()


def upload(store: ObjectStore, count: int = 2) -> tuple[PendingEntry, ...]:
    """``count`` real batch objects, as the tasks of one micro-batch would upload them."""
    entries = []
    for _ in range(count):
        location = batch_location(PREFIX, _minter.mint())
        store.put_if_absent(location, encode_batch([b"row"]))
        entries.append(PendingEntry(location, (Metadata(0, 1, b"p"),)))
    return tuple(entries)


def commit(store: ObjectStore, entries: tuple[PendingEntry, ...], batch_id: int) -> str:
    outcome = commit_micro_batch(
        store,
        entries,
        stream_id="q1",
        batch_id=batch_id,
        manifest_path=MANIFEST,
        data_path_prefix=PREFIX,
        retry=FAST,
    )
    return outcome.status


def locations(store: ObjectStore) -> list[str]:
    return [e.location for e in read_manifest(store, MANIFEST).manifest.entries]


def drain(store: ObjectStore) -> None:
    """What a consumer does: dequeue everything."""
    consumer = QueueConsumer(store, MANIFEST)
    consumer.initialize()
    manifest = consumer.read().manifest
    consumer.dequeue(manifest.next_sequence - 1)


def test_each_batch_is_appended_once_and_a_rerun_is_skipped(store: CrashingStore) -> None:
    first = upload(store)
    assert commit(store, first, 0) == "appended"
    second = upload(store)
    assert commit(store, second, 1) == "appended"
    # The driver died after the sink commit, before Spark's commit log: batch 1 runs again,
    # its tasks upload fresh objects.
    assert commit(store, upload(store), 1) == "skipped"
    assert locations(store) == [e.location for e in first + second]


def test_a_crash_between_state_and_append_appends_the_remembered_batch(
    store: CrashingStore,
) -> None:
    original = upload(store)
    store.crash_path = MANIFEST
    with pytest.raises(SystemExit):
        commit(store, original, 0)
    assert store.inner.get(stream_state_path(PREFIX, "q1")).data  # the state landed
    assert commit(store, upload(store), 0) == "appended"
    assert locations(store) == [e.location for e in original]


def test_a_committed_batch_run_again_is_skipped_without_looking(store: CrashingStore) -> None:
    original = upload(store)
    assert commit(store, original, 0) == "appended"
    drain(store)  # consumed and dequeued: nothing in the manifest tells any more
    assert commit(store, upload(store), 0) == "skipped"
    assert locations(store) == []


def test_a_consumed_batch_is_appended_again_with_the_same_locations(
    store: CrashingStore,
) -> None:
    # The append landed, the driver died before it marked the state committed, then the
    # consumer wrote and dequeued the batch before the driver restarted.
    original = upload(store)
    store.crash_path, store.crash_skip = stream_state_path(PREFIX, "q1"), 1
    with pytest.raises(SystemExit):
        commit(store, original, 0)
    drain(store)
    assert commit(store, upload(store), 0) == "reappended"
    # The same locations: a sink that records locations skips them, so no row doubles.
    assert locations(store) == [e.location for e in original]


def test_held_objects_gone_and_consumed_is_refused_with_a_clear_error(
    store: CrashingStore,
) -> None:
    original = upload(store)
    store.crash_path, store.crash_skip = stream_state_path(PREFIX, "q1"), 1
    with pytest.raises(SystemExit):
        commit(store, original, 0)
    drain(store)
    # Something that does not read holds (an RFC peer's collector) took the held objects.
    store.delete_many([e.location for e in original])
    with pytest.raises(MillpondError, match=r"stream:q1 batch 0: cannot tell") as info:
        commit(store, upload(store), 0)
    message = str(info.value)
    assert original[0].location in message or original[1].location in message
    assert '"status": "committed"' in message  # how to settle it by hand, without a duplicate


def test_a_never_appended_batch_whose_orphans_were_collected_uses_the_rerun(
    store: CrashingStore,
) -> None:
    original = upload(store)
    store.crash_path = MANIFEST
    with pytest.raises(SystemExit):
        commit(store, original, 0)
    store.delete_many([e.location for e in original])  # orphans, past the grace period
    rerun = upload(store)
    assert commit(store, rerun, 0) == "appended"
    assert locations(store) == [e.location for e in rerun]


def test_an_older_batch_after_a_newer_one_is_refused(store: CrashingStore) -> None:
    assert commit(store, upload(store), 5) == "appended"
    with pytest.raises(MillpondError, match="checkpoint was reset"):
        commit(store, upload(store), 2)


def test_an_empty_micro_batch_writes_nothing(store: CrashingStore) -> None:
    assert commit(store, (), 0) == "empty"
    with pytest.raises(NotFoundError):
        store.get(MANIFEST)


def test_stream_ids_that_are_not_path_safe_are_hashed() -> None:
    assert stream_state_path("ingest", "q-1") == "ingest/_millpond/holds/spark-stream-q-1.json"
    hashed = stream_state_path("", "s3://bucket/ckpt dir")
    assert hashed.startswith("_millpond/holds/spark-stream-")
    assert "/" not in hashed.removeprefix("_millpond/holds/")


def _message(store: ObjectStore, partition: int, attempt: int = 0) -> TaskCommitMessage:
    entries = upload(store, 1)
    uploads = tuple(UploadedBatch(e.location, 1, 10, 1) for e in entries)
    return TaskCommitMessage(partition, attempt, uploads, UploadStats(rows=10, batches=1))


def test_a_job_is_one_append_in_partition_order(store: CrashingStore) -> None:
    messages = [_message(store, 1, attempt=1), _message(store, 0)]
    receipt = commit_job(store, messages, job_id="j1", manifest_path=MANIFEST, gc_grace_period=600)
    assert (receipt.first_sequence, receipt.last_sequence, receipt.stats.rows) == (0, 1, 20)
    assert receipt.manifest["manifest_writes"] == 1
    entries = read_manifest(store, MANIFEST).manifest.entries
    assert [e.location for e in entries] == [
        messages[1].uploads[0].location,
        messages[0].uploads[0].location,
    ]
    assert entries[1].metadata[0].payload == spark_payload(job="j1", partition=1, attempt=1)


def test_a_job_without_a_message_for_every_task_is_refused(store: CrashingStore) -> None:
    with pytest.raises(MillpondError, match="no commit message"):
        commit_job(
            store,
            [_message(store, 0), None],
            job_id="j",
            manifest_path=MANIFEST,
            gc_grace_period=600,
        )
    with pytest.raises(NotFoundError):
        store.get(MANIFEST)


class LaterClock(SystemClock):
    def __init__(self, ahead_s: float) -> None:
        self.ahead_ms = int(ahead_s * 1000)

    def now_ms(self) -> int:
        return super().now_ms() + self.ahead_ms


def test_a_job_older_than_the_grace_period_checks_its_uploads(store: CrashingStore) -> None:
    message = _message(store, 0)
    store.delete_many([message.uploads[0].location])  # GC took it during a long job
    with pytest.raises(NotFoundError, match="longer than the GC grace period"):
        commit_job(
            store,
            [message],
            job_id="j",
            manifest_path=MANIFEST,
            gc_grace_period=600,
            clock=LaterClock(400),
        )
    with pytest.raises(NotFoundError):
        store.get(MANIFEST)


class PausedDriverClock(SystemClock):
    """The system's clock, moved forward by a test: wall and monotonic time jump together, as
    they do for a driver the machine paused."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now_ms(self) -> int:
        return super().now_ms() + round(self.offset * 1000)

    def monotonic(self) -> float:
        return super().monotonic() + self.offset


class _PausingStore(ForwardingStore):
    """The driver pauses for ``seconds`` while it reads the manifest the first time, after it
    judged its uploads fresh and before it holds them; ``during`` runs in the pause."""

    def __init__(self, inner: ObjectStore, clock: PausedDriverClock, seconds: float) -> None:
        super().__init__(inner)
        self.clock, self.seconds = clock, seconds
        self.during = lambda: None
        self.uploads: tuple[str, ...] = ()

    def get(self, path: str) -> GetResult:
        if path == MANIFEST and self.seconds:
            self.clock.offset += self.seconds
            self.seconds = 0
            self.during()
        return super().get(path)


def test_a_job_commit_paused_past_half_the_grace_period_sends_no_append(
    store: CrashingStore,
) -> None:
    """A driver paused between checking its uploads' age and the write (here: while it reads
    the manifest) must not append them then: the collector may have taken them meanwhile."""
    clock = PausedDriverClock()
    paused = _PausingStore(store.inner, clock, seconds=301)  # half the grace period, and a second
    with pytest.raises(StorageError, match="deadline passed before the write"):
        commit_job(
            paused,
            [_message(store, 0)],
            job_id="j",
            manifest_path=MANIFEST,
            gc_grace_period=600,
            retry=FAST,
            clock=clock,
        )
    with pytest.raises(NotFoundError):
        store.get(MANIFEST)


def test_a_failed_append_enqueues_nothing_and_says_so(store: CrashingStore) -> None:
    class Unreachable(CrashingStore):
        def put_if_absent(self, path: str, data: bytes) -> str | None:
            if path == MANIFEST:
                raise StorageError("connection refused")
            return super().put_if_absent(path, data)

    broken = Unreachable(store.inner)
    with pytest.raises(StorageError, match="gave up"):
        commit_job(
            broken,
            [_message(store, 0)],
            job_id="j",
            manifest_path=MANIFEST,
            gc_grace_period=600,
            retry=FAST,
        )
    with pytest.raises(NotFoundError):
        store.get(MANIFEST)


def _keyed_commit(kind: str, store: ObjectStore, clock: SystemClock) -> tuple[str, ...]:
    """A stream's micro-batch or a job with a ``write_id``, of two fresh uploads; returns the
    locations uploaded and commits them (grace period 600 s)."""
    if kind == "stream":
        entries = upload(store)
        commit_micro_batch(
            store,
            entries,
            stream_id="q1",
            batch_id=0,
            manifest_path=MANIFEST,
            data_path_prefix=PREFIX,
            gc_grace_period=600,
            retry=FAST,
            clock=clock,
        )
        return tuple(e.location for e in entries)
    messages = [_message(store, 0), _message(store, 1)]
    commit_job(
        store,
        messages,
        job_id="j",
        manifest_path=MANIFEST,
        gc_grace_period=600,
        write_id="w1",
        retry=FAST,
        clock=clock,
    )
    return tuple(u.location for m in messages for u in m.uploads)


@pytest.mark.parametrize("kind", ["stream", "write_id"])
def test_a_keyed_commit_paused_while_a_collector_runs_holds_no_collected_upload(
    kind: str,
) -> None:
    """A keyed commit protects its uploads with a hold, but only once the hold is written. A
    driver paused past the grace period before that, while a collector ran, must not hold and
    append the uploads the collector took: the commit fails naming them, and nothing is
    enqueued (before the fix the manifest named objects that no longer existed)."""
    clock = PausedDriverClock()
    memory = open_store(f"memory://{uuid.uuid4().hex}")
    QueueConsumer(memory, MANIFEST).initialize()  # a queue in use: the collector runs
    paused = _PausingStore(memory, clock, seconds=601)
    collector = GarbageCollector(
        GarbageCollectorConfig(
            store=TestClockStore(memory, clock), clock=clock, gc_grace_period=600
        )
    )
    paused.during = lambda: collector.run_once()
    with pytest.raises(NotFoundError, match="longer than the GC grace period"):
        _keyed_commit(kind, paused, clock)
    assert locations(memory) == []


@pytest.mark.parametrize("kind", ["stream", "write_id"])
def test_a_keyed_commit_paused_past_half_the_grace_period_holds_fresh_copies(kind: str) -> None:
    """Paused past half the grace period before its hold is written (no collector ran yet),
    the commit copies its uploads to fresh names and holds and appends the copies, as it does
    for uploads already that old when the commit starts."""
    clock = PausedDriverClock()
    memory = open_store(f"memory://{uuid.uuid4().hex}")
    uploaded = _keyed_commit(kind, _PausingStore(memory, clock, seconds=301), clock)
    named = locations(memory)
    assert len(named) == len(uploaded)
    assert not set(named) & set(uploaded)  # copies, not the uploads the pause made old
    for location in named:
        memory.head(location)  # every appended copy is there
