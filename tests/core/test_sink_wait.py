"""The consumer's written-through mark and waiting on it (``millpond.queue.written``,
``millpond.queue.sink_wait``), on a memory store under a clock that moves only when a waiter
sleeps: what each read costs, how waiters share reads, what a timeout says."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from millpond.errors import FormatError, InvalidInputError, SinkWaitError, SinkWaitTimeoutError
from millpond.queue import (
    SinkWatch,
    WrittenMark,
    note_set_aside,
    read_written,
    written_path,
)
from millpond.queue.written import MAX_SET_ASIDE
from millpond.storage import ForwardingStore, GetResult, ObjectStore, open_store
from tests.core._helpers import FakeClock
from tests.support import unique_root

QUEUE = "memory:///ingest/manifest"
PREFIX = "ingest"
START_MS = 1_700_000_000_000


class CountingStore(ForwardingStore):
    """Counts conditional GETs of the mark and how many found it unchanged (a 304)."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.gets = 0
        self.unchanged = 0

    def get_if_changed(self, path: str, etag: str | None) -> GetResult | None:
        got = self.inner.get_if_changed(path, etag)
        self.gets += 1
        self.unchanged += got is None
        return got


def mark(written_through: int | None, **changes: object) -> WrittenMark:
    base = WrittenMark(
        queue=QUEUE,
        epoch=1,
        written_through=written_through,
        state="running",
        updated_ms=START_MS,
        interval=5.0,
        host="db-host",
        pid=42,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def publish(store: ObjectStore, written: WrittenMark) -> None:
    store.put(written_path(PREFIX), written.to_json())


@pytest.fixture
def store() -> CountingStore:
    # Named memory stores are shared within the process: a fresh name per test.
    return CountingStore(open_store(f"memory://{unique_root()}"))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START_MS)


def watch(store: ObjectStore, clock: FakeClock) -> SinkWatch:
    return SinkWatch(store, data_path_prefix=PREFIX, queue=QUEUE, clock=clock)


def test_a_mark_reads_back_ignoring_keys_it_does_not_know_and_refuses_another_version() -> None:
    written = mark(7, set_aside=()).with_set_aside(3, "bad rows")
    assert WrittenMark.from_json(written.to_json(), name="w") == written
    newer = written.to_json().replace(b'"version": 1', b'"shard": "b", "version": 1')
    assert WrittenMark.from_json(newer, name="w") == written
    with pytest.raises(FormatError, match="version 1, found 2"):
        WrittenMark.from_json(written.to_json().replace(b'"version": 1', b'"version": 2'), name="w")
    with pytest.raises(FormatError, match="expected written-through"):
        WrittenMark.from_json(b"[1]", name="w")


def test_a_mark_lists_the_most_recent_set_aside_batches() -> None:
    written = mark(None)
    for sequence in range(MAX_SET_ASIDE + 5):
        written = written.with_set_aside(sequence, f"r{sequence}")
    listed = [m.sequence for m in written.set_aside]
    assert listed == list(range(5, MAX_SET_ASIDE + 5))


def test_a_running_consumer_is_stale_once_it_missed_its_promised_writes() -> None:
    written = mark(1, interval=5.0)
    assert not written.stale(START_MS + 15_000)
    assert written.stale(START_MS + 15_001)
    assert not replace(written, state="stopped").stale(START_MS + 99_000)
    assert not replace(written, interval=0.0).stale(START_MS + 99_000)


def test_the_wait_returns_once_the_mark_reaches_the_sequence_reading_with_etags(
    store: CountingStore, clock: FakeClock
) -> None:
    publish(store, mark(3))
    sleeps = 0

    def consumer_moves(_seconds: float) -> None:
        nonlocal sleeps
        sleeps += 1
        if sleeps == 6:
            publish(store, mark(5, updated_ms=START_MS + 1000))

    clock.on_sleep = consumer_moves
    found = watch(store, clock).wait([4, 5], timeout=60)
    assert found is not None
    assert found.written_through == 5
    assert store.gets == 7  # one a sleep, and the first
    assert store.unchanged == 5  # between the two writes: 304s
    # Backing off from 50 ms to the poll interval (0.25 s).
    assert clock.slept == [0.05, 0.1, 0.2, 0.25, 0.25, 0.25]


def test_nothing_to_wait_for_sends_nothing(store: CountingStore, clock: FakeClock) -> None:
    assert watch(store, clock).wait([], timeout=0) is None
    assert store.gets == 0
    with pytest.raises(InvalidInputError):
        watch(store, clock).wait([1], timeout=-1)


def test_waiters_on_one_watch_share_reads(store: CountingStore) -> None:
    """Eight threads wait on one watch with real time: each read serves every waiter that
    wakes after it, so they send fewer reads than they make looks."""
    shared = SinkWatch(store, data_path_prefix=PREFIX, queue=QUEUE)
    publish(store, mark(0))
    looks: list[int] = []
    barrier = threading.Barrier(9)

    def waiter() -> None:
        barrier.wait()
        seen, count = 0, 0
        while (look := shared.look(seen)).written_through != 1:
            seen, count = look.reads, count + 1
        looks.append(count)

    threads = [threading.Thread(target=waiter) for _ in range(8)]
    for thread in threads:
        thread.start()
    barrier.wait()
    publish(store, mark(1))
    for thread in threads:
        thread.join(10)
    assert len(looks) == 8
    assert store.gets < sum(looks) + 8  # without sharing, every look is a read


def test_a_late_write_of_an_older_consumer_takes_nothing_back(
    store: CountingStore, clock: FakeClock
) -> None:
    """A takeover continues from the sink's progress: an older consumer's mark landing late
    says less, and the waiter keeps the most it has read, and the newer consumer's words."""
    publish(store, mark(9, epoch=2, updated_ms=START_MS + 2000))
    shared = watch(store, clock)
    assert shared.look().written_through == 9
    publish(store, mark(4, epoch=1, state="fenced", updated_ms=START_MS + 3000))
    look = shared.look(1)
    assert look.written_through == 9
    assert look.mark is not None
    assert (look.mark.epoch, look.mark.state) == (2, "running")
    assert shared.wait([8, 9], timeout=0) is not None


def test_no_mark_times_out_saying_no_consumer_reported(
    store: CountingStore, clock: FakeClock
) -> None:
    with pytest.raises(SinkWaitTimeoutError) as info:
        watch(store, clock).wait([0], timeout=2)
    err = info.value
    assert isinstance(err, TimeoutError)
    assert (err.reason, err.waiting_for, err.written_through) == ("no_consumer", 0, None)
    assert "no consumer has said what it wrote" in str(err)
    assert "ingest/_millpond/written.json" in str(err)
    assert "not in the database after 2.0 s" in str(err)
    assert "enqueuing them again would double them" in str(err)


def test_a_consumer_behind_times_out_saying_by_how_much(
    store: CountingStore, clock: FakeClock
) -> None:
    publish(store, mark(10, state="retrying", error="database is locked"))
    with pytest.raises(SinkWaitTimeoutError) as info:
        watch(store, clock).wait(range(12, 15), timeout=1, what="job j")
    err = info.value
    assert (err.reason, err.behind) == ("behind", 4)
    assert str(err).startswith("job j: not in the database after 1.0 s: the consumer is behind")
    assert "behind by 4 entries: written through 10, waiting for 14" in str(err)
    assert "retrying: database is locked" in str(err)
    assert "epoch 1, db-host pid 42" in str(err)


def test_a_consumer_stopped_on_a_batch_is_named_with_its_error(
    store: CountingStore, clock: FakeClock
) -> None:
    publish(
        store,
        mark(4, state="stopped_on_batch", stopped_on=5, error="SinkError: column n is bigint"),
    )
    with pytest.raises(SinkWaitTimeoutError) as info:
        watch(store, clock).wait([6], timeout=0)
    err = info.value
    assert (err.reason, err.stopped_on, err.behind) == ("stopped_on_batch", 5, 2)
    assert "stopped on sequence 5: SinkError: column n is bigint" in str(err)


def test_a_stopped_or_silent_consumer_is_not_running(
    store: CountingStore, clock: FakeClock
) -> None:
    publish(store, mark(4, state="stopped"))
    with pytest.raises(SinkWaitTimeoutError, match="not running: it stopped 1 s ago") as info:
        watch(store, clock).wait([5], timeout=1)
    assert info.value.reason == "not_running"
    publish(store, mark(4))  # running, but its last word is older than its promise allows
    with pytest.raises(SinkWaitTimeoutError, match="no word from it for 17 s") as info:
        watch(store, clock).wait([5], timeout=16)
    assert info.value.reason == "not_running"
    assert "every 5 s" in str(info.value)


def test_a_batch_set_aside_fails_the_wait_naming_it(store: CountingStore, clock: FakeClock) -> None:
    publish(store, mark(8).with_set_aside(6, "a string into an integer column"))
    with pytest.raises(SinkWaitError) as info:
        watch(store, clock).wait([5, 6, 7], timeout=0)
    err = info.value
    assert not isinstance(err, TimeoutError)
    assert (err.reason, err.set_aside) == ("set_aside", (6,))
    assert "sequence 6 without writing the rows" in str(err)
    assert "a string into an integer column" in str(err)
    assert "millpond replay ... --sequence 6" in str(err)
    assert watch(store, clock).wait([7, 8], timeout=0) is not None  # not one of these


def test_a_mark_of_another_queue_is_not_taken(store: CountingStore, clock: FakeClock) -> None:
    publish(store, mark(99, queue="memory:///other/manifest"))
    with pytest.raises(SinkWaitTimeoutError) as info:
        watch(store, clock).wait([1], timeout=0)
    assert "a mark of queue memory:///other/manifest" in str(info.value)


def test_quarantine_lists_the_batch_in_the_mark(store: CountingStore) -> None:
    assert read_written(store, PREFIX) is None
    note_set_aside(store, PREFIX, queue=QUEUE, sequence=3, reason="by hand")
    created = read_written(store, PREFIX)
    assert created is not None
    assert (created.state, created.written_through) == ("stopped", None)
    publish(store, mark(2))
    note_set_aside(store, PREFIX, queue=QUEUE, sequence=3, reason="by hand")
    kept = read_written(store, PREFIX)
    assert kept is not None
    assert (kept.written_through, kept.state) == (2, "running")
    assert [(m.sequence, m.reason) for m in kept.set_aside] == [(3, "by hand")]
