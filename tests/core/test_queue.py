"""The queue manifest on every store: group appends, fencing, dequeue, ambiguous writes."""

from __future__ import annotations

import pytest

from millpond.common.retry import RetryPolicy
from millpond.errors import (
    CommitStateUnknownError,
    ConflictError,
    FencedError,
    FormatError,
    InvalidInputError,
    MillpondError,
    NotFoundError,
    StorageError,
)
from millpond.formats.manifest import PendingEntry, decode_manifest, empty_manifest
from millpond.queue import QueueConsumer, QueueProducer, read_manifest
from millpond.storage.store import ObjectStore
from tests.support import StoreTarget

from ._helpers import FAST_RETRY, MANIFEST, FakeClock, FaultyStore, open_target, pending


@pytest.fixture
def store(any_store_target: StoreTarget) -> ObjectStore:
    return open_target(any_store_target)


def _producer(store: ObjectStore, clock: FakeClock | None = None) -> QueueProducer:
    return QueueProducer(store, MANIFEST, retry=FAST_RETRY, clock=clock or FakeClock())


def _consumer(store: ObjectStore) -> QueueConsumer:
    return QueueConsumer(store, MANIFEST, retry=FAST_RETRY, clock=FakeClock())


def _locations(store: ObjectStore) -> list[str]:
    return [e.location for e in read_manifest(store, MANIFEST).manifest.entries]


# --- appends ---------------------------------------------------------------------------------


def test_append_groups_get_contiguous_sequences(store: ObjectStore) -> None:
    first, second = _producer(store), _producer(store)
    a, b, c = pending(3), pending(1), pending(4)
    assert first.append(a) == (0, 1, 2)
    assert second.append(b) == (3,)  # second's view is stale: it must re-read
    assert first.append(c) == (4, 5, 6, 7)  # first's cached manifest is stale too
    manifest = read_manifest(store, MANIFEST).manifest
    assert [e.sequence for e in manifest.entries] == list(range(8))
    assert [e.location for e in manifest.entries] == [p.location for p in a + b + c]
    assert [e.metadata for e in manifest.entries] == [p.metadata for p in a + b + c]
    assert manifest.next_sequence == 8
    assert manifest.epoch == 0


def test_uncontended_append_uses_the_cached_manifest(store: ObjectStore) -> None:
    producer = _producer(store)
    producer.append(pending(1))
    reads = producer.counters.get("manifest_reads")
    for _ in range(3):
        producer.append(pending(2))
    # After the first append a lone producer writes without reading first.
    assert producer.counters.get("manifest_reads") == reads
    assert producer.counters.get("cas_conflicts") == 0
    assert len(_locations(store)) == 7


def test_a_producer_says_so_when_the_manifest_was_replaced_and_appends_to_it(
    store: ObjectStore, caplog: pytest.LogCaptureFixture
) -> None:
    first = _producer(store)
    assert first.append(pending(3)) == (0, 1, 2)
    assert not store.delete_many([MANIFEST])  # deleted; another producer creates it again
    assert _producer(store).append(pending(1)) == (0,)
    with caplog.at_level("WARNING", logger="millpond.queue.append"):
        assert first.append(pending(1)) == (1,)
        # The new manifest's, a bound for what this writer appends next (not the old 3).
        assert first.seen_next_sequence == 2
        store.put(MANIFEST, store.get(MANIFEST).data)  # a new ETag: the next append reads
        assert first.append(pending(1)) == (2,)
    replaced = [r for r in caplog.records if "was replaced" in r.getMessage()]
    assert len(replaced) == 1, caplog.text  # once, not on every read after
    assert "next_sequence is 1, below 3" in replaced[0].getMessage()


def test_append_rejects_bad_groups_before_writing(store: ObjectStore) -> None:
    producer = _producer(store)
    with pytest.raises(InvalidInputError):
        producer.append([])
    entry = pending(1)[0]
    with pytest.raises(InvalidInputError):
        producer.append([entry, entry])
    with pytest.raises(InvalidInputError):
        producer.append([PendingEntry("x" * 0x10000)])
    with pytest.raises(NotFoundError):
        store.get(MANIFEST)


def test_append_to_a_corrupt_manifest_raises_format_error(store: ObjectStore) -> None:
    store.put(MANIFEST, b"\x00" * 21)
    with pytest.raises(FormatError):
        _producer(store).append(pending(1))


def test_producers_carry_the_epoch_forward(store: ObjectStore) -> None:
    consumer = _consumer(store)
    assert consumer.initialize() == 1
    assert consumer.initialize() == 2
    _producer(store).append(pending(2))
    assert read_manifest(store, MANIFEST).manifest.epoch == 2


# --- fencing ---------------------------------------------------------------------------------


def test_a_newer_consumer_fences_the_older(store: ObjectStore) -> None:
    producer = _producer(store)
    producer.append(pending(3))
    a, b = _consumer(store), _consumer(store)
    epoch_a = a.initialize()
    assert [e.sequence for e in a.read().manifest.entries] == [0, 1, 2]
    epoch_b = b.initialize()
    assert epoch_b == epoch_a + 1
    producer.append(pending(2))  # between B's initialize and A's next call
    assert read_manifest(store, MANIFEST).manifest.epoch == epoch_b
    with pytest.raises(FencedError) as info:
        a.read()
    assert (info.value.expected_epoch, info.value.found_epoch) == (epoch_a, epoch_b)
    with pytest.raises(FencedError):
        a.read_if_changed()
    etag_before = store.get(MANIFEST).etag
    with pytest.raises(FencedError):
        a.dequeue(1)
    assert store.get(MANIFEST).etag == etag_before  # the fenced dequeue wrote nothing
    # B works, and sees everything including the append made after it took over.
    snapshot = b.read()
    assert [e.sequence for e in snapshot.manifest.entries] == [0, 1, 2, 3, 4]
    assert b.dequeue(1) == 2
    assert [e.sequence for e in b.read().manifest.entries] == [2, 3, 4]
    # Fencing is permanent for A.
    with pytest.raises(FencedError):
        a.read()


def test_read_if_changed_returns_none_until_a_write(store: ObjectStore) -> None:
    consumer = _consumer(store)
    consumer.initialize()
    first = consumer.read_if_changed()
    assert first is not None
    assert consumer.read_if_changed() is None
    _producer(store).append(pending(1))
    changed = consumer.read_if_changed()
    assert changed is not None
    assert len(changed.manifest.entries) == 1


def test_consumer_must_initialize_first(store: ObjectStore) -> None:
    _producer(store).append(pending(1))
    consumer = _consumer(store)
    with pytest.raises(MillpondError, match="initialize"):
        consumer.read()
    with pytest.raises(MillpondError, match="initialize"):
        consumer.dequeue(0)


def test_initialize_creates_an_empty_manifest(store: ObjectStore) -> None:
    consumer = _consumer(store)
    assert consumer.initialize() == 1
    assert store.get(MANIFEST).data == empty_manifest(epoch=1)


# --- dequeue edge cases ------------------------------------------------------------------------


def _queue_with(store: ObjectStore, *, dequeued: int, total: int) -> QueueConsumer:
    """A manifest holding sequences ``dequeued .. total - 1``, and its consumer."""
    _producer(store).append(pending(total))
    consumer = _consumer(store)
    consumer.initialize()
    if dequeued:
        assert consumer.dequeue(dequeued - 1) == dequeued
    return consumer


def test_dequeue_below_the_first_entry_writes_nothing(store: ObjectStore) -> None:
    consumer = _queue_with(store, dequeued=3, total=6)
    etag = store.get(MANIFEST).etag
    writes = consumer.counters.get("manifest_writes")
    assert consumer.dequeue(2) == 0
    assert consumer.dequeue(0) == 0
    assert consumer.dequeue(-1) == 0
    assert store.get(MANIFEST).etag == etag
    assert consumer.counters.get("manifest_writes") == writes
    assert [e.sequence for e in consumer.read().manifest.entries] == [3, 4, 5]


def test_dequeue_at_the_last_entry_empties_the_queue(store: ObjectStore) -> None:
    consumer = _queue_with(store, dequeued=2, total=5)
    assert consumer.dequeue(4) == 3
    manifest = consumer.read().manifest
    assert manifest.entries == ()
    assert manifest.next_sequence == 5  # never goes back
    assert manifest.first_sequence is None
    # New appends continue the sequence.
    assert _producer(store).append(pending(1)) == (5,)


def test_dequeue_in_the_middle(store: ObjectStore) -> None:
    consumer = _queue_with(store, dequeued=0, total=5)
    assert consumer.dequeue(2) == 3
    assert [e.sequence for e in consumer.read().manifest.entries] == [3, 4]


@pytest.mark.parametrize("through", [5, 6, 1000])
def test_dequeue_beyond_next_sequence_is_rejected(store: ObjectStore, through: int) -> None:
    consumer = _queue_with(store, dequeued=0, total=5)
    etag = store.get(MANIFEST).etag
    with pytest.raises(InvalidInputError, match="next_sequence"):
        consumer.dequeue(through)
    assert store.get(MANIFEST).etag == etag


def test_dequeue_on_an_empty_manifest(store: ObjectStore) -> None:
    consumer = _consumer(store)
    consumer.initialize()
    etag = store.get(MANIFEST).etag
    with pytest.raises(InvalidInputError):
        consumer.dequeue(0)  # next_sequence is 0: nothing was ever appended
    assert consumer.dequeue(-1) == 0
    assert store.get(MANIFEST).etag == etag
    # Emptied by dequeue: next_sequence 3, no entries.
    _producer(store).append(pending(3))
    assert consumer.dequeue(2) == 3
    etag = store.get(MANIFEST).etag
    assert consumer.dequeue(1) == 0
    with pytest.raises(InvalidInputError):
        consumer.dequeue(3)
    assert store.get(MANIFEST).etag == etag


def test_dequeue_without_a_manifest(store: ObjectStore) -> None:
    consumer = _consumer(store)
    consumer.initialize()
    store.delete_many([MANIFEST])
    with pytest.raises(NotFoundError):
        consumer.dequeue(0)


def test_dequeue_retries_past_a_concurrent_append(store: ObjectStore) -> None:
    faulty = FaultyStore(store)
    _producer(store).append(pending(2))
    consumer = _consumer(faulty)
    consumer.initialize()
    late = pending(1)
    # The first dequeue write loses to a producer append that lands in between.
    faulty.fail_next(land=False, error=ConflictError, hook=lambda: _producer(store).append(late))
    assert consumer.dequeue(1) == 2
    assert _locations(store) == [late[0].location]


# --- ambiguous writes ----------------------------------------------------------------------------


@pytest.mark.parametrize("error", [ConflictError, CommitStateUnknownError])
@pytest.mark.parametrize("manifest_exists", [True, False])
def test_ambiguous_write_that_landed_is_not_appended_twice(
    store: ObjectStore, error: type[Exception], manifest_exists: bool
) -> None:
    if manifest_exists:
        _producer(store).append(pending(2, tag="before"))
    faulty = FaultyStore(store)
    producer = _producer(faulty)
    group = pending(3, tag="mine")
    faulty.fail_next(land=True, error=error)
    start = 2 if manifest_exists else 0
    assert producer.append(group) == tuple(range(start, start + 3))
    assert faulty.landed_writes == 1
    locations = _locations(store)
    for entry in group:
        assert locations.count(entry.location) == 1
    assert len(locations) == start + 3
    # The producer keeps working afterwards.
    assert producer.append(pending(1)) == (start + 3,)


@pytest.mark.parametrize("error", [ConflictError, CommitStateUnknownError])
def test_ambiguous_write_that_did_not_land_is_retried(
    store: ObjectStore, error: type[Exception]
) -> None:
    _producer(store).append(pending(1))
    faulty = FaultyStore(store)
    producer = _producer(faulty)
    group = pending(2)
    faulty.fail_next(land=False, error=error, times=3)
    assert producer.append(group) == (1, 2)
    assert faulty.conditional_writes == 4
    assert _locations(store)[1:] == [e.location for e in group]


def test_ambiguous_write_with_a_concurrent_append_between(store: ObjectStore) -> None:
    faulty = FaultyStore(store)
    producer = _producer(faulty)
    producer.append(pending(1))
    other = pending(2, tag="other")
    mine = pending(2, tag="mine")
    # Our write lands at 1..2, another producer appends 3..4, then our request "times out".
    faulty.fail_next(
        land=True, error=CommitStateUnknownError, hook=lambda: _producer(store).append(other)
    )
    assert producer.append(mine) == (1, 2)
    assert _locations(store)[1:] == [e.location for e in mine + other]


def test_ambiguous_write_partly_dequeued_before_the_check(store: ObjectStore) -> None:
    # Our 3-entry group lands at 0..2; before our re-read the consumer takes 0..1 and
    # dequeues them. The one entry still present proves the whole group landed.
    faulty = FaultyStore(store)
    consumer = _consumer(store)
    consumer.initialize()
    producer = _producer(faulty)
    group = pending(3)

    def consume_two() -> None:
        consumer.dequeue(1)

    faulty.fail_next(land=True, error=CommitStateUnknownError, hook=consume_two)
    assert producer.append(group) == (0, 1, 2)
    assert _locations(store) == [group[2].location]
    assert read_manifest(store, MANIFEST).manifest.next_sequence == 3


def test_ambiguous_epoch_bump_is_never_taken_for_granted(store: ObjectStore) -> None:
    faulty = FaultyStore(store)
    consumer = _consumer(faulty)
    faulty.fail_next(land=True, error=CommitStateUnknownError)
    epoch = consumer.initialize()
    # The landed bump to 1 was not trusted; the consumer bumped past it and holds what is stored.
    assert epoch == 2
    assert read_manifest(store, MANIFEST).manifest.epoch == epoch
    consumer.read()


def test_ambiguous_dequeue_that_landed(store: ObjectStore) -> None:
    _producer(store).append(pending(4))
    faulty = FaultyStore(store)
    consumer = _consumer(faulty)
    consumer.initialize()
    faulty.fail_next(land=True, error=CommitStateUnknownError)
    consumer.dequeue(1)
    assert [e.sequence for e in consumer.read().manifest.entries] == [2, 3]


# --- retry budget ---------------------------------------------------------------------------


def test_retry_budget_by_attempts_raises_storage_error(store: ObjectStore) -> None:
    faulty = FaultyStore(store)
    clock = FakeClock()
    producer = QueueProducer(
        faulty, MANIFEST, retry=RetryPolicy(max_attempts=5, base_delay=0.01), clock=clock
    )
    faulty.fail_next(land=False, error=ConflictError, times=100)
    with pytest.raises(StorageError, match="gave up after 5 attempts"):
        producer.append(pending(1))
    assert faulty.conditional_writes == 5
    assert len(clock.slept) == 4
    assert producer.counters.get("cas_conflicts") == 5
    with pytest.raises(NotFoundError):
        store.get(MANIFEST)


def test_retry_budget_by_time_raises_storage_error(store: ObjectStore) -> None:
    faulty = FaultyStore(store)
    clock = FakeClock()
    policy = RetryPolicy(max_attempts=10_000, max_elapsed=2.0, base_delay=0.5, max_delay=0.5)
    producer = QueueProducer(faulty, MANIFEST, retry=policy, clock=clock)
    faulty.fail_next(land=False, error=CommitStateUnknownError, times=10_000)
    with pytest.raises(StorageError, match="gave up"):
        producer.append(pending(1))
    assert clock.monotonic() <= 2.0
    assert faulty.conditional_writes < 10_000
    # Backoff is capped and jittered: every pause is within [0, max_delay].
    assert all(0 <= s <= 0.5 for s in clock.slept)


def test_backoff_grows_exponentially_to_its_cap() -> None:
    clock = FakeClock()
    policy = RetryPolicy(max_attempts=50, max_elapsed=1e9, base_delay=0.01, max_delay=0.16)
    backoff = policy.start(clock)
    caps = [min(0.16, 0.01 * 2**i) for i in range(20)]
    delays = []
    while (delay := backoff.next_delay()) is not None:
        delays.append(delay)
    assert len(delays) == 49
    assert all(0 <= d <= cap for d, cap in zip(delays, caps + [0.16] * 49, strict=False))


def test_retry_policy_validates_its_fields() -> None:
    from millpond.errors import ConfigError

    for kwargs, key in [
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_elapsed": 0}, "max_elapsed"),
        ({"base_delay": 2.0, "max_delay": 1.0}, "base_delay"),
    ]:
        with pytest.raises(ConfigError) as info:
            RetryPolicy(**kwargs)  # type: ignore[arg-type]
        assert info.value.key == key


def test_read_manifest_of_a_corrupt_object(store: ObjectStore) -> None:
    store.put(MANIFEST, b"\x01" * 40)
    with pytest.raises(FormatError, match=MANIFEST):
        read_manifest(store, MANIFEST)
    with pytest.raises(NotFoundError):
        read_manifest(store, "ingest/other")
    assert decode_manifest(empty_manifest()).entries == ()
