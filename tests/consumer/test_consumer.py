"""The consumer against every store backend: order, read-ahead, acks, resume, fencing, bad data."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest
from consumer_support import (
    MANIFEST,
    QueueWriter,
    RecordingStore,
    open_target,
    quiet_consumer,
)

from millpond.consumer import ConsumedBatch, Consumer, ConsumerConfig, Metadata
from millpond.errors import (
    ClosedError,
    ConfigError,
    FencedError,
    FormatError,
    InvalidInputError,
    MillpondError,
    NotFoundError,
)
from millpond.formats.arrow import encode_ipc
from millpond.formats.manifest import PendingEntry
from millpond.queue import read_manifest
from millpond.storage.store import ForwardingStore, GetResult, ObjectStore


@pytest.fixture
def store(store_target: Any) -> ObjectStore:
    return open_target(store_target)


def _drain(consumer: Consumer, *, ack: bool = True) -> list[ConsumedBatch]:
    out = []
    while (batch := consumer.next_batch()) is not None:
        out.append(batch)
        if ack:
            consumer.ack(batch.sequence)
    return out


def _queued(store: ObjectStore) -> list[int]:
    return [e.sequence for e in read_manifest(store, MANIFEST).manifest.entries]


def test_batches_come_in_sequence_order_with_their_metadata(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    expected = [
        writer.append([f"r{i}-{j}".encode() for j in range(i + 1)], payload=b"m%d" % i)
        for i in range(10)
    ]
    with quiet_consumer(store, read_ahead=3) as consumer:
        consumer.initialize()
        batches = _drain(consumer)
    assert [(b.sequence, b.location) for b in batches] == expected
    assert [len(b.entries) for b in batches] == list(range(1, 11))
    assert batches[4].entries[2] == b"r4-2"
    assert batches[4].metadata[0].payload == b"m4"
    assert batches[4].metadata_for(3) == batches[4].metadata[0]
    assert _queued(store) == []


def test_empty_queue_returns_none_then_sees_new_entries(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    with quiet_consumer(store) as consumer:
        consumer.initialize()
        assert consumer.next_batch() is None
        assert consumer.next_batch() is None
        seq, _ = writer.append([b"late"])
        batch = consumer.next_batch()
        assert batch is not None
        assert (batch.sequence, batch.entries) == (seq, (b"late",))
        consumer.ack(seq)
        assert consumer.next_batch() is None


def test_manifest_is_reread_only_when_the_cache_is_used_up(store_target: Any) -> None:
    inner = open_target(store_target)
    store = RecordingStore(inner)
    writer = QueueWriter(inner)
    for i in range(6):
        writer.append([b"x%d" % i])
    with quiet_consumer(store, read_ahead=2) as consumer:
        consumer.initialize()
        reads_after_init = store.calls.get("get_if_changed", 0)
        for _ in range(6):
            batch = consumer.next_batch()
            assert batch is not None
            consumer.ack(batch.sequence)
        # Six batches came out of the manifest read at initialize(): no re-read yet.
        assert store.calls.get("get_if_changed", 0) == reads_after_init
        assert consumer.next_batch() is None
        assert store.calls.get("get_if_changed", 0) == reads_after_init + 1


def test_read_ahead_fetches_concurrently_but_bounded(store_target: Any) -> None:
    inner = open_target(store_target)
    store = RecordingStore(inner, get_delay=0.05)
    writer = QueueWriter(inner)
    for i in range(12):
        writer.append([b"%d" % i])
    with quiet_consumer(store, read_ahead=4, read_ahead_max=4) as consumer:
        consumer.initialize()
        batches = _drain(consumer)
    assert [b.entries for b in batches] == [(b"%d" % i,) for i in range(12)]
    assert 2 <= store.max_active_gets <= 4


def test_read_ahead_grows_while_deliveries_wait_for_the_store(store_target: Any) -> None:
    inner = open_target(store_target)
    # Each GET takes far longer than the caller's work on a batch, even on a loaded machine:
    # with 50 ms a caller slowed by other processes kept up with the fetches, no delivery
    # waited, and the window stayed at 4 (a failure seen once beside a CI run).
    store = RecordingStore(inner, get_delay=0.2)
    writer = QueueWriter(inner)
    for i in range(40):
        writer.append([b"%d" % i])
    with quiet_consumer(store, read_ahead=2, read_ahead_max=8) as consumer:
        consumer.initialize()
        batches = _drain(consumer)
    assert [b.entries for b in batches] == [(b"%d" % i,) for i in range(40)]
    # The caller takes each batch at once: every delivery waits for the store, so the window
    # doubles past read_ahead, but never past read_ahead_max.
    assert 4 < store.max_active_gets <= 8


def test_read_ahead_grows_no_further_than_its_memory_budget(store_target: Any) -> None:
    inner = open_target(store_target)
    store = RecordingStore(inner, get_delay=0.05)
    writer = QueueWriter(inner)
    for _ in range(20):
        writer.append([b"x" * 1000])
    # 2.5 batches of 1,000 bytes fit in the budget: the window stays at read_ahead.
    with quiet_consumer(store, read_ahead=2, read_ahead_max=8, read_ahead_bytes=2500) as consumer:
        consumer.initialize()
        batches = _drain(consumer)
    assert len(batches) == 20
    assert store.max_active_gets == 2


def test_acks_must_be_in_order_and_delivered(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    for i in range(3):
        writer.append([b"%d" % i])
    with quiet_consumer(store) as consumer:
        consumer.initialize()
        first = consumer.next_batch()
        assert first is not None
        with pytest.raises(InvalidInputError, match=r"expected 0 \(acks are in order\), found 1"):
            consumer.ack(1)
        consumer.ack(0)
        with pytest.raises(InvalidInputError, match="expected 1"):
            consumer.ack(0)
        with pytest.raises(InvalidInputError, match="delivered"):
            consumer.ack(1)


def test_dequeue_every_n_acks_and_on_flush_and_close(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    for i in range(8):
        writer.append([b"%d" % i])
    consumer = quiet_consumer(store, ack_batch_size=3)
    consumer.initialize()
    for expected_queue in ([1, 2, 3, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7]):
        batch = consumer.next_batch()
        assert batch is not None
        consumer.ack(batch.sequence)
        if batch.sequence < 2:
            assert _queued(store) == list(range(8))
        else:
            assert _queued(store) == expected_queue
    batch = consumer.next_batch()
    assert batch is not None
    consumer.ack(batch.sequence)
    assert _queued(store) == [3, 4, 5, 6, 7]
    consumer.flush()
    assert _queued(store) == [4, 5, 6, 7]
    batch = consumer.next_batch()
    assert batch is not None
    consumer.ack(batch.sequence)
    consumer.close()
    assert _queued(store) == [5, 6, 7]
    consumer.close()  # idempotent
    with pytest.raises(ClosedError):
        consumer.next_batch()


def test_resume_after_last_acked_sequence(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    for i in range(6):
        writer.append([b"%d" % i])
    with quiet_consumer(store) as consumer:
        consumer.initialize(last_acked_sequence=2)
        # What the sink already holds is dequeued at once.
        assert _queued(store) == [3, 4, 5]
        assert [b.sequence for b in _drain(consumer)] == [3, 4, 5]
    with quiet_consumer(store) as consumer:
        consumer.initialize(last_acked_sequence=5)
        assert consumer.next_batch() is None


def test_resume_point_that_does_not_fit_the_queue_is_refused(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    for i in range(6):
        writer.append([b"%d" % i])
    with quiet_consumer(store) as consumer:
        consumer.initialize()
        for _ in range(4):
            batch = consumer.next_batch()
            assert batch is not None
            consumer.ack(batch.sequence)
    assert _queued(store) == [4, 5]
    with quiet_consumer(store) as consumer:
        with pytest.raises(InvalidInputError, match=r"entries 2\.\.3 were dequeued"):
            consumer.initialize(last_acked_sequence=1)
        with pytest.raises(InvalidInputError, match="sink is ahead"):
            consumer.initialize(last_acked_sequence=6)
        with pytest.raises(InvalidInputError, match="expected None or an integer"):
            consumer.initialize(last_acked_sequence=-1)


def test_a_manifest_created_again_is_refused_not_resumed_into(store: ObjectStore) -> None:
    """A manifest deleted and created again starts its sequences over at 0. Before the fix a
    consumer resuming after the sink's last sequence (5) took entries 0..5 of the new
    manifest, which the sink never saw, as written and dequeued them: six batches lost."""
    writer = QueueWriter(store)
    for i in range(6):
        writer.append([b"old%d" % i])
    with quiet_consumer(store) as consumer:
        consumer.initialize()
        assert [b.sequence for b in _drain(consumer)] == list(range(6))
    assert not store.delete_many([MANIFEST])
    again = QueueWriter(store)
    for i in range(10):
        again.append([b"new%d" % i])  # sequences 0..9: past the sink's 5
    refused = "epoch is 0, but a consumer of this queue held epoch 1"
    with quiet_consumer(store) as consumer, pytest.raises(InvalidInputError, match=refused):
        consumer.initialize(last_acked_sequence=5)
    # Nothing was written: every new entry is still queued and no epoch was bumped.
    snapshot = read_manifest(store, MANIFEST)
    assert [e.sequence for e in snapshot.manifest.entries] == list(range(10))
    assert snapshot.manifest.epoch == 0


def test_a_manifest_restored_from_an_older_copy_is_refused(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    writer.append([b"0"])
    older = store.get(MANIFEST).data  # epoch 0, entry 0
    with quiet_consumer(store) as first, quiet_consumer(store) as second:
        first.initialize()
        second.initialize()  # epoch 2 recorded
    writer.append([b"1"])
    store.put(MANIFEST, older)  # entry 1, appended since, is gone from it
    with quiet_consumer(store) as consumer, pytest.raises(InvalidInputError, match="epoch 2"):
        consumer.initialize(last_acked_sequence=None)


def test_a_manifest_replaced_under_a_running_consumer_stops_it(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    for i in range(3):
        writer.append([b"%d" % i])
    with quiet_consumer(store, read_ahead=1) as consumer:
        consumer.initialize()
        batch = consumer.next_batch()
        assert batch is not None
        consumer.ack(batch.sequence)
        assert not store.delete_many([MANIFEST])
        QueueWriter(store).append([b"new"])
        with pytest.raises(FencedError, match="epochs only grow, so the manifest was replaced"):
            consumer.flush()


class _TakeoverBetweenReads(ForwardingStore):
    """Runs ``takeover`` (another consumer's initialize) after this consumer's first read of
    the manifest and before its read of the epoch record answers: its record is then newer
    than the manifest this consumer read."""

    def __init__(self, inner: ObjectStore, takeover: Callable[[], None]) -> None:
        super().__init__(inner)
        self._takeover: Callable[[], None] | None = takeover
        self._manifest_read = threading.Event()

    def get(self, path: str) -> GetResult:
        if path.endswith("_millpond/epoch") and self._takeover is not None:
            assert self._manifest_read.wait(10), "the manifest was not read alongside"
            takeover, self._takeover = self._takeover, None
            takeover()
        got = self.inner.get(path)
        if path == MANIFEST:
            self._manifest_read.set()
        return got


def test_a_takeover_between_the_two_reads_is_not_taken_for_a_replaced_manifest(
    store: ObjectStore,
) -> None:
    writer = QueueWriter(store)
    writer.append([b"0"])
    with quiet_consumer(store) as first:
        first.initialize()  # epoch 1 recorded
    other = quiet_consumer(store)
    racing = _TakeoverBetweenReads(store, other.initialize)  # epoch 2, recorded
    with quiet_consumer(racing) as consumer:
        consumer.initialize()
        assert consumer.epoch == 3
        assert [b.entries for b in _drain(consumer)] == [(b"0",)]
    with pytest.raises(FencedError, match="another consumer took over"):
        other.next_batch()
    other.close()


def test_a_queue_started_over_on_purpose_is_consumed_once_the_record_is_removed(
    store: ObjectStore,
) -> None:
    writer = QueueWriter(store)
    writer.append([b"old"])
    with quiet_consumer(store) as consumer:
        consumer.initialize()
    assert not store.delete_many([MANIFEST])
    QueueWriter(store).append([b"new"])
    with quiet_consumer(store) as consumer, pytest.raises(InvalidInputError) as refused:
        consumer.initialize()
    record = str(refused.value).rsplit(" and ", 1)[1]
    assert record.endswith("_millpond/epoch")
    assert not store.delete_many([record])
    with quiet_consumer(store) as consumer:
        consumer.initialize()
        assert [b.entries for b in _drain(consumer)] == [(b"new",)]


def test_a_newer_consumer_fences_the_older(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    for i in range(3):
        writer.append([b"%d" % i])
    old = quiet_consumer(store)
    old.initialize()
    batch = old.next_batch()
    assert batch is not None
    old.ack(batch.sequence)
    new = quiet_consumer(store)
    new.initialize()
    assert new.epoch == (old.epoch or 0) + 1
    with pytest.raises(FencedError, match="another consumer took over"):
        old.flush()
    assert old.fenced
    with pytest.raises(FencedError):
        old.next_batch()
    old.close()  # a fenced consumer closes quietly, without writing
    assert [b.sequence for b in _drain(new)] == [0, 1, 2]
    new.close()
    assert _queued(store) == []


def test_fenced_consumer_notices_on_its_next_manifest_read(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    writer.append([b"a"])
    old = quiet_consumer(store)
    old.initialize()
    assert old.next_batch() is not None
    quiet_consumer(store).initialize()
    with pytest.raises(FencedError):
        old.next_batch()  # cache used up: the conditional re-read sees the new epoch
    old.close()


def test_missing_object_names_sequence_and_location(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    writer.append([b"ok"])
    seq, location = writer.append([b"gone"])
    writer.append([b"after"])
    data = store.get(location).data
    assert store.delete_many([location]) == []
    with quiet_consumer(store, read_ahead=3) as consumer:
        consumer.initialize()
        first = consumer.next_batch()
        assert first is not None
        assert first.entries == (b"ok",)
        consumer.ack(first.sequence)
        for _ in range(2):  # not skipped, not retried in a loop: the same error each call
            with pytest.raises(NotFoundError) as info:
                consumer.next_batch()
            assert f"sequence {seq}" in str(info.value)
            assert location in str(info.value)
        # Once the object is back, the consumer goes on from exactly that entry.
        store.put(location, data)
        assert [b.entries for b in _drain(consumer)] == [(b"gone",), (b"after",)]


@pytest.mark.parametrize(
    ("location", "problem"),
    [
        ("elsewhere/01ARZ3NDEKTSV4RRFFQ69G5FAV.batch", "outside the data prefix"),
        ("ingest/nested/01ARZ3NDEKTSV4RRFFQ69G5FAV.batch", "outside the data prefix"),
        ("01ARZ3NDEKTSV4RRFFQ69G5FAV.batch", "outside the data prefix"),
        ("ingest/not-a-ulid.batch", "not named"),
        ("ingest/01ARZ3NDEKTSV4RRFFQ69G5FAV.json", "not named"),
    ],
)
def test_location_outside_the_prefix_is_refused(
    store: ObjectStore, location: str, problem: str
) -> None:
    writer = QueueWriter(store)
    writer.append([b"ok"])
    store.put(location, b"")  # even if an object is there, it is never read
    seq = writer.enqueue(location)
    writer.append([b"after"])
    with quiet_consumer(store) as consumer:
        consumer.initialize()
        first = consumer.next_batch()
        assert first is not None
        assert first.entries == (b"ok",)
        consumer.ack(first.sequence)
        with pytest.raises(FormatError, match=problem) as info:
            consumer.next_batch()
        assert f"sequence {seq}" in str(info.value)
        assert repr(location) in str(info.value)


def test_corrupt_batch_names_its_location(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    location = writer.upload([b"fine"])
    store.put(location, b"\x00\x01garbage-bytes-with-a-bad-footer")
    seq = writer.enqueue(location)
    with quiet_consumer(store) as consumer:
        consumer.initialize()
        with pytest.raises(FormatError) as info:
            consumer.next_batch()
    assert location in str(info.value)
    assert f"sequence {seq}" in str(info.value)


def test_corrupt_manifest_is_a_format_error(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    writer.append([b"a"])
    raw = store.get(MANIFEST).data
    store.put(MANIFEST, raw[:3] + b"\xff" + raw[4:])  # entry_len of the first entry
    with quiet_consumer(store) as consumer, pytest.raises(FormatError, match=MANIFEST):
        consumer.initialize()


def test_to_arrow_unifies_drifted_schemas(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    old = pa.table({"n": pa.array([1, 2], pa.int32()), "s": ["a", "b"]})
    new = pa.table({"n": pa.array([3], pa.int64()), "extra": [True]})
    writer.append_arrow(old)
    writer.append([*encode_ipc(old), *encode_ipc(new)])
    with quiet_consumer(store) as consumer:
        consumer.initialize()
        one, two = _drain(consumer)
    assert one.to_arrow().equals(old)
    table = two.to_arrow()
    assert table.schema.field("n").type == pa.int64()
    assert table.column("n").to_pylist() == [1, 2, 3]
    assert table.column("s").to_pylist() == ["a", "b", None]
    assert table.column("extra").to_pylist() == [None, None, True]


def test_to_arrow_on_opaque_entries_is_a_format_error() -> None:
    batch = ConsumedBatch(entries=(b"plain",), sequence=4, location="ingest/X.batch")
    with pytest.raises(FormatError, match=r"ingest/X.batch \(sequence 4\) entry 0"):
        batch.to_arrow()


def test_backlog_reports_the_oldest_waiting_ingestion_time(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    writer.append([b"a"], ingestion_ms=1_000)
    writer.append([b"b"], ingestion_ms=2_000)
    with quiet_consumer(store) as consumer:
        consumer.initialize()
        assert consumer.backlog().entries == 2
        assert consumer.backlog().oldest_ingestion_ms == 1_000
        batch = consumer.next_batch()
        assert batch is not None
        assert consumer.backlog().oldest_ingestion_ms == 2_000


def test_large_queue_with_many_refreshes(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    with quiet_consumer(store, read_ahead=4, ack_batch_size=7) as consumer:
        consumer.initialize()
        seen: list[int] = []
        for round_ in range(5):
            for i in range(9):
                writer.append([b"%d-%d" % (round_, i)])
            seen.extend(b.sequence for b in _drain(consumer))
        assert seen == list(range(45))
    assert _queued(store) == []


def test_consumer_is_thread_safe_for_concurrent_callers(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    for i in range(30):
        writer.append([b"%d" % i])
    delivered: list[int] = []
    lock = threading.Lock()
    with quiet_consumer(store) as consumer:
        consumer.initialize()

        def worker() -> None:
            while True:
                with lock:  # acks must follow delivery order, so pair them under one lock
                    batch = consumer.next_batch()
                    if batch is None:
                        return
                    delivered.append(batch.sequence)
                    consumer.ack(batch.sequence)

        threads = [threading.Thread(target=worker) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert delivered == list(range(30))


def test_uninitialized_consumer_refuses_work(store: ObjectStore) -> None:
    consumer = quiet_consumer(store)
    with pytest.raises(MillpondError, match="initialize"):
        consumer.next_batch()
    consumer.close()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"ack_batch_size": 0}, "ack_batch_size"),
        ({"read_ahead": 0}, "read_ahead"),
        ({"read_ahead": 1000}, "read_ahead"),
        ({"gc_interval": 0}, "gc_interval"),
        ({"gc_grace_period": -1.0}, "gc_grace_period"),
        ({"gc_grace_period": float("nan")}, "gc_grace_period"),
        ({"manifest_path": ""}, "manifest_path"),
        ({"manifest_path": "ingest/"}, "manifest_path"),
        ({"store": ""}, "store"),
        ({"gc_enabled": "yes"}, "gc_enabled"),
    ],
)
def test_config_names_the_bad_key(overrides: dict[str, Any], key: str) -> None:
    options: dict[str, Any] = {"store": "memory://"}
    options.update(overrides)
    with pytest.raises(ConfigError) as info:
        ConsumerConfig(**options)
    assert info.value.key == key


def test_metadata_is_the_manifest_metadata() -> None:
    item = Metadata(start_index=0, ingestion_time_ms=5, payload=b"p")
    assert PendingEntry("ingest/x", (item,)).metadata[0] is item
