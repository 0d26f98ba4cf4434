"""Regression tests for the exactly-once holes of issue 9, one per case, named after it.

Each reproduces a way the first version lost, doubled or silently skipped data, using real
stores, real WAL directories and real SQLite sinks; the store wrappers only hold back, fail or
reorder requests the way a network and a store can.

1. re-mint after dequeue duplicates rows: ``test_remint_after_dequeue_does_not_duplicate_rows``
2. a fenced consumer goes on delivering: ``test_fenced_consumer_stops_delivering_at_once``
3. ``_landed`` accepts a partial group: ``test_landed_does_not_accept_a_partial_group`` and
   ``test_producer_does_not_take_a_partial_group_as_landed``
4. a sink holding another queue's progress skips entries:
   ``test_sink_holding_another_queues_progress_is_refused``
7. two queues sharing one data prefix: ``test_two_queues_sharing_a_data_prefix_are_refused``
8. timing assumptions nobody checks: ``test_timing_assumptions_*``
9. the service dies when the store is down during a dequeue:
   ``test_service_survives_the_store_down_during_a_dequeue``

Cases 5 and 6 (Spark commits) are in ``tests/spark/test_exactly_once_spark.py``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from millpond.common.retry import RetryPolicy
from millpond.common.ulids import UlidMinter, batch_location
from millpond.consumer import Consumer, ConsumerConfig
from millpond.consumer.app.service import ConsumerService
from millpond.consumer.sinks import SinkError, open_sink
from millpond.errors import (
    CommitStateUnknownError,
    ConfigError,
    FencedError,
    FormatError,
    StorageError,
)
from millpond.formats.batch import encode_batch
from millpond.formats.manifest import Metadata, PendingEntry
from millpond.formats.wal import BindBody
from millpond.gc import GarbageCollector, GarbageCollectorConfig
from millpond.localstack import S3Endpoint
from millpond.localstack._process import wait_for
from millpond.producer import Producer
from millpond.queue import QueueProducer, read_manifest
from millpond.storage import ForwardingStore, GetResult, ObjectStore, open_store
from millpond.wal import Wal
from tests.producer.producer_support import (
    MANIFEST,
    all_entries,
    config,
    fresh_memory,
    read_back,
)
from tests.support import ClockOff, unique_root

_ONE_ATTEMPT = RetryPolicy(max_attempts=1, max_elapsed=5.0, base_delay=0.001, max_delay=0.001)
_FAST = RetryPolicy(max_attempts=1000, max_elapsed=60.0, base_delay=0.001, max_delay=0.05)


class HeldBackStore(ForwardingStore):
    """Holds back chosen manifest writes, as a network can, and lets them land later.

    ``hold_next()`` makes the next manifest write fail towards the caller (``CommitStateUnknown``,
    as after a timeout) without reaching the store; the request is kept and lands, with its
    original precondition, just before the manifest write that follows — the delayed request
    arriving while the caller is already retrying.
    """

    def __init__(self, inner: ObjectStore, manifest_path: str = MANIFEST) -> None:
        super().__init__(inner)
        self.manifest_path = manifest_path
        self._hold = 0
        self._held: list[Callable[[], object]] = []
        self._lock = threading.Lock()
        self.released = 0
        self.held = threading.Event()
        self.read_gate: threading.Event | None = None
        """When set to an event, manifest reads wait for it."""
        self.gate_reads_after_hold: threading.Event | None = None
        """Becomes ``read_gate`` once a write is held back (so the holder's own check waits)."""
        self.batch_puts = 0

    def hold_next(self, times: int = 1) -> None:
        with self._lock:
            self._hold += times

    def get(self, path: str) -> GetResult:
        if path == self.manifest_path and self.read_gate is not None:
            self.read_gate.wait()
        return self.inner.get(path)

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        if path != self.manifest_path:
            etag = self.inner.put_if_absent(path, data)
            with self._lock:
                self.batch_puts += 1
            return etag
        return self._manifest(lambda: self.inner.put_if_absent(path, data))

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        return self._manifest(lambda: self.inner.put_if_match(path, data, etag))

    def _manifest(self, write: Callable[[], str | None]) -> str | None:
        with self._lock:
            held, self._held = self._held, []
            hold = self._hold > 0
            self._hold -= hold
        for request in held:
            try:
                request()
                self.released += 1
            except Exception:  # a held request that lost its race never lands
                pass
        if hold:
            with self._lock:
                self._held.append(write)
            self.read_gate = self.gate_reads_after_hold
            self.held.set()
            raise CommitStateUnknownError(f"{self.manifest_path}: injected timeout (held back)")
        return write()


def _entries(n: int) -> list[PendingEntry]:
    minter = UlidMinter()
    return [
        PendingEntry(batch_location("ingest", minter.mint()), (Metadata(0, i, b"%d" % i),))
        for i in range(n)
    ]


def _queued(store: ObjectStore) -> list[str]:
    return [e.location for e in read_manifest(store, MANIFEST).manifest.entries]


# --- case 3 ----------------------------------------------------------------------------------


def test_landed_does_not_accept_a_partial_group() -> None:
    store = HeldBackStore(fresh_memory())
    queue = QueueProducer(store, MANIFEST, retry=_ONE_ATTEMPT)
    a, b, c = _entries(3)
    store.hold_next()
    try:
        queue.append([a, b])  # times out; the request is still on its way
    except StorageError:
        pass
    else:  # pragma: no cover - the held request must make this append fail
        raise AssertionError("expected the held-back append to fail")
    # The retry appends [A, B, C]; the delayed [A, B] lands first, so this attempt loses
    # its race and looks: A and B are there, C is not.
    queue = QueueProducer(store, MANIFEST, retry=RetryPolicy(max_attempts=10, base_delay=0.001))
    sequences = queue.append([a, b, c])
    assert store.released == 1
    assert _queued(store) == [a.location, b.location, c.location]
    assert list(sequences) == [0, 1, 2]


def test_producer_does_not_take_a_partial_group_as_landed(tmp_path: Path) -> None:
    store = HeldBackStore(fresh_memory())
    # One attempt per round: an ambiguous append goes straight to the committer's own check.
    with Producer(config(store, tmp_path / "wal", retry=_ONE_ATTEMPT)) as producer:
        store.hold_next()
        # The committer's check after the held-back append waits for the second batch.
        store.gate_reads_after_hold = gate = threading.Event()
        first = producer.produce([b"first"])
        wait_for(lambda: store.held.is_set() or None, timeout=30, what="the held-back append")
        second = producer.produce([b"second"])
        wait_for(lambda: store.batch_puts >= 2 or None, timeout=30, what="the second upload")
        # The check finds nothing (the request is still held), so [first, second] is appended
        # in one group; the delayed [first] lands just before it, and that attempt fails.
        gate.set()
        first.wait(timeout=30)
        second.wait(timeout=30)
        producer.flush(timeout=30)
    assert store.released == 1
    assert sorted(all_entries(store)) == [b"first", b"second"]


# --- case 1 ----------------------------------------------------------------------------------


class _HourAgo:
    """The wall clock an hour back: a batch named by it looks an hour old."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000 - 3_600_000

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def _claim_with_short_window(store: ObjectStore) -> None:
    """The queue's claim, written as raw bytes: a 60 s GC grace period, a 0.2 s delete window
    (so a batch written again under its name is appended 0.2 s later, not 30 s)."""
    claim = {
        "version": 1,
        "manifest_path": MANIFEST,
        "gc_grace_period_s": 60.0,
        "gc_delete_window_s": 0.2,
        "created_ms": 0,
    }
    store.put("ingest/_millpond/queue.json", json.dumps(claim).encode())


def _consume_all(store: ObjectStore, sink_url: str) -> None:
    consumer = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=_FAST))
    with open_sink(sink_url, entry_format="opaque") as sink:
        ConsumerService(consumer, sink, poll_min=0.01).run(threading.Event(), until_idle=True)


def _sink_payloads(sink_url: str) -> list[bytes]:
    path = sink_url.removeprefix("sqlite://")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return [bytes(row[0]) for row in conn.execute("SELECT payload FROM millpond_rows")]


def test_remint_after_dequeue_does_not_duplicate_rows(tmp_path: Path) -> None:
    store = fresh_memory()
    _claim_with_short_window(store)
    wal_dir = tmp_path / "wal"
    sink_url = f"sqlite://{tmp_path / 'sink.db'}"
    entries = [b"row-a", b"row-b", b"row-c"]
    # A producer named a batch an hour ago, uploaded it, appended it — and died before it
    # released its WAL: the WAL still holds the records and their binding.
    location = batch_location("ingest", UlidMinter(_HourAgo()).mint())
    with Wal.open(wal_dir) as wal:
        wal.append_data([(1_700_000_000_000, b"m", entries)])
        wal.append_bind(BindBody(0, 0, 1, location))
        wal.sync()
    store.put_if_absent(location, encode_batch(entries))
    QueueProducer(store, MANIFEST).append([PendingEntry(location, (Metadata(0, 1, b"m"),))])
    # The consumer writes it and dequeues it while the producer is down.
    _consume_all(store, sink_url)
    assert _queued(store) == []
    assert sorted(_sink_payloads(sink_url)) == sorted(entries)
    # The producer comes back (the batch is older than any re-upload threshold) and publishes
    # what its WAL holds: it cannot see the dequeued entry, so it appends the batch again.
    with Producer(config(store, wal_dir)) as producer:
        producer.flush(timeout=30)
    _consume_all(store, sink_url)
    assert sorted(_sink_payloads(sink_url)) == sorted(entries)


# --- case 2 ----------------------------------------------------------------------------------


def _enqueue(store: ObjectStore, count: int) -> list[str]:
    locations = []
    queue = QueueProducer(store, MANIFEST, retry=_FAST)
    for i in range(count):
        location = batch_location("ingest", UlidMinter().mint())
        store.put_if_absent(location, encode_batch([b"entry-%d" % i]))
        queue.append([PendingEntry(location, (Metadata(0, i, b""),))])
        locations.append(location)
    return locations


def test_fenced_consumer_stops_delivering_at_once() -> None:
    store = fresh_memory()
    _enqueue(store, 50)
    older = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=_FAST))
    older.initialize()
    first = older.next_batch()  # 50 entries cached, a few fetched ahead
    assert first is not None
    newer = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=_FAST))
    newer.initialize()
    # From the moment the newer initialize() returned, the older delivers and acks nothing.
    with pytest.raises(FencedError):
        older.ack(first.sequence)
    with pytest.raises(FencedError):
        older.next_batch()
    older.close()
    delivered = []
    while (batch := newer.next_batch()) is not None:
        delivered.append(batch.sequence)
        newer.ack(batch.sequence)
    newer.close()
    assert delivered == list(range(50))


def test_fenced_consumer_stops_before_its_next_delivery() -> None:
    store = fresh_memory()
    _enqueue(store, 5)
    older = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=_FAST))
    older.initialize()
    batch = older.next_batch()
    assert batch is not None
    older.ack(batch.sequence)
    Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=_FAST)).initialize()
    with pytest.raises(FencedError):
        older.next_batch()


# --- case 9 ----------------------------------------------------------------------------------


class DownAfterTakeover(ForwardingStore):
    """Once ``armed``, the store goes down for manifest writes right after the next one (the
    consumer's epoch bump) lands, until ``down`` is cleared."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.armed = False
        self.down = False
        self.refused = 0

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        if path != MANIFEST:
            return self.inner.put_if_match(path, data, etag)
        if self.down:
            self.refused += 1
            raise StorageError(f"{path}: injected outage")
        result = self.inner.put_if_match(path, data, etag)
        if self.armed:
            self.armed, self.down = False, True
        return result


def test_service_survives_the_store_down_during_a_dequeue(tmp_path: Path) -> None:
    store = DownAfterTakeover(fresh_memory())
    _enqueue(store, 6)
    sink_url = f"sqlite://{tmp_path / 'sink.db'}"
    # A dequeue gives up after 0.2 s here (60 s by default): then the store stays down longer.
    short = RetryPolicy(max_attempts=1000, max_elapsed=0.2, base_delay=0.001, max_delay=0.01)
    consumer = Consumer(
        ConsumerConfig(store=store, gc_enabled=False, retry=short, ack_batch_size=2)
    )
    errors: list[BaseException] = []
    stop = threading.Event()
    store.armed = True

    def run() -> None:
        try:
            with open_sink(sink_url, entry_format="opaque") as sink:
                service = ConsumerService(
                    consumer, sink, poll_min=0.01, retry_initial_delay=0.01, retry_max_delay=0.05
                )
                service.run(stop, until_idle=True)
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        # Every batch is written while the store is down; then several dequeue rounds run out of
        # retries (0.2 s each) and the service, with nothing left to write, still waits.
        # (Watched through the consumer: reading the SQLite file from this process while the
        # sink's own SQLite library writes it would break SQLite's locking.)
        wait_for(lambda: consumer.acked_sequence == 5 or None, timeout=30, what="all written")
        written_at = store.refused
        wait_for(
            lambda: not thread.is_alive() or store.refused >= written_at + 150 or None,
            timeout=30,
            what="refused dequeues after the last write",
        )
        assert thread.is_alive()
        assert not errors
        store.down = False
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert errors == []
        assert sorted(_sink_payloads(sink_url)) == sorted(b"entry-%d" % i for i in range(6))
        assert _queued(store) == []
    finally:
        stop.set()  # a failed check must not leave the service retrying
        thread.join(timeout=10)


class CorruptBatch(DownAfterTakeover):
    """Serves garbage for one batch object."""

    def __init__(self, inner: ObjectStore, corrupt: str) -> None:
        super().__init__(inner)
        self.corrupt = corrupt

    def get(self, path: str) -> GetResult:
        if path == self.corrupt:
            return GetResult(b"not a batch", None)
        return self.inner.get(path)


def test_service_close_does_not_hide_why_it_stopped(tmp_path: Path) -> None:
    inner = fresh_memory()
    locations = _enqueue(inner, 3)
    store = CorruptBatch(inner, corrupt=locations[1])
    short = RetryPolicy(max_attempts=1000, max_elapsed=0.2, base_delay=0.001, max_delay=0.01)
    consumer = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=short))
    store.armed = True  # the final dequeue of the acked first batch fails too
    with (
        open_sink(f"sqlite://{tmp_path / 'sink.db'}", entry_format="opaque") as sink,
        pytest.raises(FormatError, match=locations[1]),
    ):
        ConsumerService(consumer, sink, poll_min=0.01, retry_initial_delay=0.01).run(
            threading.Event(), until_idle=True
        )


# --- case 4 ----------------------------------------------------------------------------------


def _epoch(store: ObjectStore) -> int:
    return read_manifest(store, MANIFEST).manifest.epoch


def test_sink_holding_another_queues_progress_is_refused(tmp_path: Path) -> None:
    q = fresh_memory()
    _enqueue(q, 10)
    x_db = tmp_path / "x.db"
    _consume_all(q, f"sqlite://{x_db}")
    assert len(_sink_payloads(f"sqlite://{x_db}")) == 10  # sequences 0..9 recorded
    # Another queue, pointed at a copy of that database.
    q4 = fresh_memory()
    _enqueue(q4, 10)
    copy = tmp_path / "copy.db"
    shutil.copyfile(x_db, copy)
    epoch = _epoch(q4)
    with pytest.raises(SinkError, match="holds the rows and progress of queue") as refused:
        _consume_all(q4, f"sqlite://{copy}")
    message = str(refused.value)
    assert q.url in message
    assert q4.url in message
    # Refused before anything happened to q4: nothing dequeued, no consumer fenced.
    assert len(_queued(q4)) == 10
    assert _epoch(q4) == epoch
    # Side by side: q4 into its own table of the same database.
    consumer = Consumer(ConsumerConfig(store=q4, gc_enabled=False, retry=_FAST))
    with open_sink(f"sqlite://{copy}", entry_format="opaque", table="q4_rows") as sink:
        ConsumerService(consumer, sink, poll_min=0.01).run(threading.Event(), until_idle=True)
    with contextlib.closing(sqlite3.connect(copy)) as conn:
        theirs = sorted(bytes(r[0]) for r in conn.execute("SELECT payload FROM q4_rows"))
        ours = sorted(bytes(r[0]) for r in conn.execute("SELECT payload FROM millpond_rows"))
    assert theirs == sorted(b"entry-%d" % i for i in range(10))
    assert ours == theirs  # q's rows, untouched (the same payloads, another queue)
    assert _queued(q4) == []


@pytest.mark.parametrize(
    "spelling",
    [
        pytest.param("{bucket}/x/../{root}", id="dot-dot"),
        pytest.param("{bucket}/./{root}/", id="dot"),
        pytest.param("{bucket}/{escaped}", id="percent-escapes"),
    ],
)
def test_another_spelling_of_the_same_queue_is_not_another_queue(
    seaweedfs_s3: S3Endpoint, tmp_path: Path, spelling: str
) -> None:
    """The store resolves ``..`` and ``.`` segments and percent escapes in a URL's path, so
    ``s3://b/x/../root`` opens the very objects of ``s3://b/root``. Before the fix the queue's
    identity kept the spelling, and the sink that holds the queue's progress refused the
    consumer as one of another queue."""
    root = unique_root()
    plain = seaweedfs_s3.url_for(root)
    bucket = plain.removesuffix("/" + root)
    other = "s3://" + spelling.format(
        bucket=bucket.removeprefix("s3://"),
        root=root,
        escaped="".join(f"%{b:02X}" for b in root.encode()),
    )
    options = seaweedfs_s3.store_options()
    sink = f"sqlite://{tmp_path / 'sink.db'}"
    _enqueue(open_store(plain, options), 3)
    _consume_all(open_store(plain, options), sink)
    spelled = open_store(other, options)
    assert read_manifest(spelled, MANIFEST).manifest.next_sequence == 3  # the same objects
    _enqueue(spelled, 2)
    _consume_all(spelled, sink)  # before the fix: SinkError, "holds the rows ... of queue"
    assert sorted(_sink_payloads(sink)) == sorted(b"entry-%d" % i for i in (0, 1, 2, 0, 1))
    assert len(_queued(open_store(plain, options))) == 0


def test_an_owner_recorded_under_an_old_spelling_is_still_the_queue(tmp_path: Path) -> None:
    """A sink whose owner record an earlier version wrote through ``…/x/../q`` (it kept the
    spelling) is the same queue's for a consumer of ``…/q``: before the fix it was refused."""
    url = (tmp_path / "q").as_uri()
    store = open_store(url)
    sink = f"sqlite://{tmp_path / 'sink.db'}"
    _enqueue(store, 2)
    _consume_all(store, sink)
    old = url.removesuffix("/q") + "/x/../q/ingest/manifest"
    with contextlib.closing(sqlite3.connect(tmp_path / "sink.db")) as conn, conn:
        assert conn.execute("UPDATE millpond_owners SET queue = ?", (old,)).rowcount == 1
    _enqueue(store, 1)
    _consume_all(store, sink)
    assert sorted(_sink_payloads(sink)) == [b"entry-0", b"entry-0", b"entry-1"]
    assert _queued(store) == []


# --- case 7 ----------------------------------------------------------------------------------


def test_two_queues_sharing_a_data_prefix_are_refused(tmp_path: Path) -> None:
    store = fresh_memory()
    with Producer(config(store, tmp_path / "a")) as producer:  # queue A claims "ingest"
        producer.produce([b"a"]).wait(timeout=30)
    other = "other/manifest"  # queue B: its own manifest, but the same data prefix
    with pytest.raises(ConfigError, match="data_path_prefix") as by_producer:
        Producer(config(store, tmp_path / "b", manifest_path=other))
    with pytest.raises(ConfigError, match="data_path_prefix") as by_consumer:
        Consumer(
            ConsumerConfig(store=store, manifest_path=other, gc_enabled=False, retry=_FAST)
        ).initialize()
    collector = GarbageCollector(
        GarbageCollectorConfig(store=store, manifest_path=other, gc_grace_period=0.0)
    )
    with pytest.raises(ConfigError, match="data_path_prefix") as by_collector:
        collector.run_once()
    for refused in (by_producer, by_consumer, by_collector):
        assert MANIFEST in str(refused.value)
        assert other in str(refused.value)
    assert [p.entries for p in read_back(store)] == [[b"a"]]


# --- case 8 ----------------------------------------------------------------------------------


def _claim(store: ObjectStore, grace: float, window: float | None = None) -> None:
    record = {
        "version": 1,
        "manifest_path": MANIFEST,
        "gc_grace_period_s": grace,
        "gc_delete_window_s": window if window is not None else min(30.0, grace / 4),
        "created_ms": 0,
    }
    store.put("ingest/_millpond/queue.json", json.dumps(record).encode())


def test_timing_assumptions_reupload_after_is_tied_to_the_grace_period(tmp_path: Path) -> None:
    store = fresh_memory()
    _claim(store, grace=60.0)
    # More than half the queue's grace period: a batch could wait for its append past the
    # point where GC may take it.
    with pytest.raises(ConfigError, match="reupload_after") as refused:
        Producer(config(store, tmp_path / "a", reupload_after=40.0))
    assert "60" in str(refused.value)
    # Unset, it follows the queue: half its grace period.
    with Producer(config(store, tmp_path / "b")) as producer:
        producer.produce([b"x"]).wait(timeout=30)
        assert producer._session.reupload_after == 30.0


def test_timing_assumptions_a_zero_grace_period_is_refused_by_producers(tmp_path: Path) -> None:
    store = fresh_memory()
    _claim(store, grace=0.0, window=0.0)
    with pytest.raises(ConfigError, match="grace period"):
        Producer(config(store, tmp_path / "wal"))


def test_timing_assumptions_a_shorter_gc_grace_period_is_refused(tmp_path: Path) -> None:
    store = fresh_memory()
    _claim(store, grace=600.0)
    _enqueue(store, 1)
    collector = GarbageCollector(GarbageCollectorConfig(store=store, gc_grace_period=0.0))
    with pytest.raises(ConfigError, match="gc_grace_period"):
        collector.run_once()
    consumer = Consumer(ConsumerConfig(store=store, gc_grace_period=60.0, retry=_FAST))
    with pytest.raises(ConfigError, match="gc_grace_period"):
        consumer.initialize()


@pytest.mark.parametrize("off", [-300.0, 300.0])
def test_timing_assumptions_clock_skew_against_the_store_is_refused(
    tmp_path: Path, off: float
) -> None:
    store = fresh_memory()  # stamps writes with this machine's real clock
    with pytest.raises(ConfigError, match="clock") as refused:
        Producer(config(store, tmp_path / "wal", clock=ClockOff(off)))
    assert ("behind" if off < 0 else "ahead of") in str(refused.value)
    # Within the bound it starts (the store's whole-second stamps are allowed for).
    with Producer(config(store, tmp_path / "ok", clock=ClockOff(20.0))) as producer:
        producer.produce([b"x"]).wait(timeout=30)
