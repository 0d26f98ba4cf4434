"""How often the append coordinator leaves the manifest alone, and how a consumer gets in.

A coordinator appending back to back on its cached ETag wins every race against a consumer's
read-then-write, so it pauses now and then. Every pause also delays the requests waiting
behind it (at 50 ms a request, pausing every 3 rounds cost about 0.8 lone-producer p50 of
``wait()`` p99 at N = 16 in ``bench/bench_wait_latency.py``), so it pauses often only while
someone else writes, and about once a second otherwise. A consumer that lost a race reads and
writes again at once, so one such pause is enough for it.

Time here is a fake clock that each store request advances by one slot (50 ms): the counts are
exact, and nothing waits for real time.
"""

from __future__ import annotations

import uuid

from millpond.common.retry import RetryPolicy
from millpond.coordinator.rounds import AppendCoordinator
from millpond.queue.append import QueueProducer
from millpond.queue.dequeue import QueueConsumer
from millpond.storage.obstore_store import ObstoreStore
from millpond.storage.store import ForwardingStore, GetResult, ObjectStore
from tests.core._helpers import FAST_RETRY, MANIFEST, FakeClock, FaultyStore, pending

SLOT = 0.05
ROUNDS = 200  # 10 s of back-to-back rounds on the fake clock
BUDGET = 60.0


class _SlowStore(ForwardingStore):
    """Every manifest request takes one slot of the fake clock; ``before_write`` runs first."""

    def __init__(self, inner: ObjectStore, clock: FakeClock) -> None:
        super().__init__(inner)
        self.clock = clock
        self.before_write: list[object] = []  # callables, one per write, run before it

    def get(self, path: str) -> GetResult:
        self.clock.sleep(SLOT)
        return self.inner.get(path)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        if self.before_write:
            hook = self.before_write.pop(0)
            if callable(hook):
                hook()
        self.clock.sleep(SLOT)
        return self.inner.put_if_match(path, data, etag)


def _memory() -> ObjectStore:
    return ObstoreStore.from_url(f"memory://pauses-{uuid.uuid4().hex}")


def _coordinator(store: ObjectStore, clock: FakeClock) -> AppendCoordinator:
    return AppendCoordinator(
        store,
        MANIFEST,
        clock=clock,
        retry=RetryPolicy(max_attempts=1000, max_elapsed=BUDGET),
        max_round_entries=1,  # one request per round: ROUNDS back-to-back rounds
    )


def _run_rounds(coordinator: AppendCoordinator, rounds: int) -> None:
    """Queue ``rounds`` one-entry requests at once and wait until every one is appended."""
    tickets = [
        coordinator.submit(uuid.uuid4().hex, pending(1, tag=f"r{i}"), budget=BUDGET)
        for i in range(rounds)
    ]
    coordinator.start()
    try:
        for ticket in tickets:
            assert ticket.done.wait(60), "a round never finished"
            assert ticket.outcome is not None
            assert ticket.outcome.status == "appended", ticket.outcome
    finally:
        coordinator.stop(10)


def _seed(store: ObjectStore) -> None:
    QueueProducer(store, MANIFEST, retry=FAST_RETRY).append(pending(1, tag="seed"))


def test_a_coordinator_alone_pauses_about_every_three_seconds() -> None:
    clock = FakeClock()
    inner = _memory()
    _seed(inner)
    coordinator = _coordinator(_SlowStore(inner, clock), clock)
    _run_rounds(coordinator, ROUNDS * 3)
    stats = coordinator.stats()
    assert stats["rounds"] == ROUNDS * 3
    assert stats["cas_conflicts"] == 0
    seconds = clock.monotonic()
    assert seconds > 29
    # About one pause per three seconds of rounds (each pause itself 1.5 slots), never every
    # few rounds: with nobody else writing, pausing only delays the requests behind it.
    assert seconds / 3.6 <= stats["yields"] <= seconds / 3 + 1, (stats, seconds)
    assert stats["yields"] < ROUNDS / 10, stats


def test_a_coordinator_whose_consumer_dequeues_through_it_pauses_about_every_ten_seconds() -> None:
    """That consumer asks for a pause before a takeover (make_way) and needs none for its
    dequeues: the quiet pause is left for writers that do not know the coordinator."""
    clock = FakeClock()
    inner = _memory()
    _seed(inner)
    coordinator = _coordinator(_SlowStore(inner, clock), clock)
    dequeue = coordinator.dequeue(0, 0)  # the consumer's: written before the first round
    _run_rounds(coordinator, ROUNDS * 3)
    assert dequeue.status == "dequeued", dequeue.reason
    stats = coordinator.stats()
    assert stats["cas_conflicts"] == 0
    seconds = clock.monotonic()
    assert seconds > 30
    assert seconds / 12 <= stats["yields"] <= seconds / 10 + 1, (stats, seconds)


def test_after_another_writer_lands_the_coordinator_pauses_every_few_rounds() -> None:
    clock = FakeClock()
    inner = _memory()
    _seed(inner)
    slow = _SlowStore(inner, clock)
    other = QueueProducer(inner, MANIFEST, retry=FAST_RETRY)
    seen: dict[str, int] = {}
    coordinator = _coordinator(slow, clock)

    def foreign_write() -> None:
        seen.update(coordinator.stats())
        other.append(pending(1, tag="other"))  # lands before the coordinator's write

    # The coordinator's first write is on a manifest it reads; from the 21st on it writes on
    # its cached ETag, and the 21st finds another writer's entry in first.
    slow.before_write = [None] * 20 + [foreign_write]
    _run_rounds(coordinator, ROUNDS)
    stats = coordinator.stats()
    assert stats["cas_conflicts"] == 1
    rounds_after = stats["rounds"] - seen["rounds"]
    yields_after = stats["yields"] - seen["yields"]
    # busy_seconds (10 s) covers every later round: a pause after every 3 back-to-back rounds.
    assert yields_after >= rounds_after // 4 - 1, (stats, seen)
    assert seen["yields"] <= 2, seen  # before: the quiet pace


def test_a_consumer_that_lost_a_race_reads_and_writes_again_at_once() -> None:
    """No sleep between lost races: a consumer that slept after each would seldom be reading
    during a coordinator's pause, and its epoch bump or dequeue would take many seconds."""
    clock = FakeClock()
    store = FaultyStore(_memory())
    _seed(store)
    rival = QueueProducer(store.inner, MANIFEST, retry=FAST_RETRY)
    consumer = QueueConsumer(store, MANIFEST, retry=RetryPolicy(), clock=clock)

    def rival_writes() -> None:
        rival.append(pending(1, tag="rival"))

    # Five writes in a row lose to a rival's append landing just before each of them.
    store.fail_next(land=True, error=None, before=rival_writes, times=5)
    epoch = consumer.initialize()
    assert epoch == 1
    assert consumer.counters.get("cas_conflicts") == 5
    assert clock.slept == []

    store.fail_next(land=True, error=None, before=rival_writes, times=5)
    removed = consumer.dequeue(0)
    assert removed == 1
    assert consumer.counters.get("cas_conflicts") == 10
    assert clock.slept == []
