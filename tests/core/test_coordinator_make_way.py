"""A consumer's takeover while the append coordinator writes back to back.

A coordinator on its cached ETag wins nearly every race against a writer that must read first,
and while a consumer sends its dequeues through it, it pauses on its own only every
``consumer_yield_interval`` seconds. So the consumer asks for a pause before its epoch bump
(``make_way``): the bump lands in that pause, at its first attempt. (Without asking, the bump
lost 12, 14 and 46 races in three runs of this test, and landed only when its read happened to
fall in the moment between two rounds, or in the quiet pause; chance, so not asserted.)

Real time here (each manifest request takes ``SLOT``), and writers that keep the coordinator's
rounds back to back, as producers do.
"""

from __future__ import annotations

import threading
import time
import uuid

from millpond.common.retry import RetryPolicy
from millpond.coordinator.rounds import AppendCoordinator
from millpond.queue.append import QueueProducer
from millpond.queue.dequeue import QueueConsumer
from millpond.storage.obstore_store import ObstoreStore
from tests.core._helpers import FAST_RETRY, MANIFEST, SlowStore, pending

SLOT = 0.03
QUIET = 3.0  # consumer_yield_interval, seconds: what a takeover that does not ask waits for
YIELD_SLOTS = 4.0  # generous, so a loaded test machine still fits a read and a write in
WRITERS = 3


def _keep_busy(coordinator: AppendCoordinator, stop: threading.Event, errors: list[str]) -> None:
    """One request after another, each sent once the last was appended."""
    while not stop.is_set():
        ticket = coordinator.submit(uuid.uuid4().hex, pending(1, tag="busy"), budget=60.0)
        if not ticket.done.wait(60) or ticket.outcome is None:
            errors.append("a request got no answer")
            return
        if ticket.outcome.status != "appended":
            errors.append(str(ticket.outcome))
            return


def test_a_takeover_that_asks_for_a_pause_lands_at_its_first_attempt() -> None:
    inner = ObstoreStore.from_url(f"memory://make-way-{uuid.uuid4().hex}")
    QueueProducer(inner, MANIFEST, retry=FAST_RETRY).append(pending(1, tag="seed"))
    store = SlowStore(inner, SLOT)
    coordinator = AppendCoordinator(
        store,
        MANIFEST,
        yield_slots=YIELD_SLOTS,
        consumer_yield_interval=QUIET,
        retry=RetryPolicy(max_attempts=1000, max_elapsed=60.0),
    )
    coordinator.slot = SLOT
    older = QueueConsumer(store, MANIFEST, retry=FAST_RETRY)
    assert older.initialize() == 1
    stop, errors = threading.Event(), []
    writers = [
        threading.Thread(target=_keep_busy, args=(coordinator, stop, errors), daemon=True)
        for _ in range(WRITERS)
    ]
    coordinator.start()
    try:
        # The older consumer dequeues through the coordinator: from now on it pauses on its
        # own only every QUIET seconds.
        assert coordinator.dequeue(1, 0).done.wait(60)
        for writer in writers:
            writer.start()
        _wait_for_rounds(coordinator, 5)  # back to back by now
        newer = QueueConsumer(store, MANIFEST, retry=RetryPolicy(max_elapsed=60.0))
        assert coordinator.make_way(10.0)
        epoch = newer.initialize()
        _wait_for_rounds(coordinator, coordinator.stats()["rounds"] + 10)
        stats = coordinator.stats()
    finally:
        stop.set()
        for writer in writers:
            writer.join(60)
        coordinator.stop(10)
    assert errors == []
    assert epoch == 2
    assert newer.counters.get("cas_conflicts") == 0, newer.counters.snapshot()
    assert stats["ways_made"] == 1
    # The next round lost its race to the epoch bump, once. That write is the one the pause
    # was made for, no sign of another writer: the coordinator did not start pausing every
    # few rounds after it (nor quietly: QUIET seconds have not passed).
    assert stats["cas_conflicts"] == 1, stats
    assert stats["yields"] == 0, stats


def _wait_for_rounds(coordinator: AppendCoordinator, rounds: int) -> None:
    deadline = time.monotonic() + 60
    while coordinator.stats()["rounds"] < rounds:
        assert time.monotonic() < deadline, coordinator.stats()
        time.sleep(SLOT)
