"""A hypothesis state machine of the queue against a plain-Python model.

Producers append groups (sometimes losing the CAS to another producer, sometimes with a write
that lands but reports a failure), a consumer reads in order, acks and dequeues, and a new
consumer can take over and fence the old one. After every step the manifest must equal the
model: nothing lost, nothing duplicated, order kept.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from millpond.errors import CommitStateUnknownError, ConflictError, FencedError
from millpond.formats.manifest import PendingEntry
from millpond.queue import QueueConsumer, QueueProducer, read_manifest
from millpond.storage.file_store import FileStore
from millpond.storage.obstore_store import ObstoreStore
from millpond.storage.store import ObjectStore

from ._helpers import FAST_RETRY, MANIFEST, FakeClock, FaultyStore, pending

PRODUCERS = 3
FAULTS = ["none", "lost_race", "landed_conflict", "landed_unknown", "unsent_unknown"]


@dataclass
class Model:
    """What the queue must hold: plain lists, no millpond code."""

    queued: list[PendingEntry] = field(default_factory=list)  # in the manifest, in order
    first_sequence: int = 0  # sequence of queued[0]
    appended: list[str] = field(default_factory=list)  # every location ever appended
    dequeued: list[str] = field(default_factory=list)  # removed by dequeue, in order
    epoch: int = 0
    read_through: int = -1  # the active consumer's read position (last sequence it got)
    acked_through: int = -1  # the active consumer's acknowledged position

    @property
    def next_sequence(self) -> int:
        return self.first_sequence + len(self.queued)


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = self.make_store()
        self.clock = FakeClock()
        self.faulty = [FaultyStore(self.store) for _ in range(PRODUCERS)]
        self.producers = [
            QueueProducer(f, MANIFEST, retry=FAST_RETRY, clock=self.clock) for f in self.faulty
        ]
        self.consumer: QueueConsumer | None = None
        self.fenced: list[QueueConsumer] = []
        self.model = Model()
        self.delivered: list[tuple[int, str]] = []  # (sequence, location) handed to consumers

    def make_store(self) -> ObjectStore:
        # A fresh name per example: named memory stores are shared within the process.
        return ObstoreStore.from_url(f"memory://sm-{uuid.uuid4().hex}")

    def _append_model(self, group: list[PendingEntry]) -> tuple[int, ...]:
        start = self.model.next_sequence
        self.model.queued.extend(group)
        self.model.appended.extend(e.location for e in group)
        return tuple(range(start, start + len(group)))

    # --- producers -----------------------------------------------------------------------

    @rule(
        producer=st.integers(0, PRODUCERS - 1),
        size=st.integers(1, 3),
        fault=st.sampled_from(FAULTS),
        rival=st.integers(0, PRODUCERS - 1),
    )
    def append(self, producer: int, size: int, fault: str, rival: int) -> None:
        group = pending(size, tag=f"p{producer}")
        rival_group = pending(1, tag=f"rival{rival}")
        faulty = self.faulty[producer]
        expected: list[range] = []

        def rival_appends() -> None:
            # Another producer commits first: our conditional write must then lose.
            expected.append(self.producers[rival].append(rival_group))
            assert expected[-1] == self._append_model(rival_group)

        if fault == "lost_race" and rival != producer:
            faulty.fail_next(land=True, error=None, before=rival_appends)
        elif fault == "landed_conflict":
            faulty.fail_next(land=True, error=ConflictError)
        elif fault == "landed_unknown":
            faulty.fail_next(land=True, error=CommitStateUnknownError)
        elif fault == "unsent_unknown":
            faulty.fail_next(land=False, error=CommitStateUnknownError)
        got = self.producers[producer].append(group)
        faulty.faults.clear()  # a plan not consumed (the cached write won) must not linger
        assert got == self._append_model(group)

    # --- the consumer ----------------------------------------------------------------------

    @rule()
    def start_consumer(self) -> None:
        """A new consumer takes over; the old one (if any) is fenced from now on."""
        consumer = QueueConsumer(self.store, MANIFEST, retry=FAST_RETRY, clock=self.clock)
        epoch = consumer.initialize()
        assert epoch == self.model.epoch + 1
        self.model.epoch = epoch
        if self.consumer is not None:
            self.fenced.append(self.consumer)
        self.consumer = consumer
        # It resumes at the earliest entry still queued: acked-but-not-dequeued entries are
        # delivered again (the database sink skips them by location).
        self.model.read_through = self.model.first_sequence - 1
        self.model.acked_through = self.model.first_sequence - 1

    @precondition(lambda self: self.consumer is not None)
    @rule(count=st.integers(1, 4))
    def read(self, count: int) -> None:
        assert self.consumer is not None
        manifest = self.consumer.read().manifest
        after = [e for e in manifest.entries if e.sequence > self.model.read_through][:count]
        for entry in after:
            assert entry.sequence == self.model.read_through + 1  # in order, no gap
            index = entry.sequence - self.model.first_sequence
            assert entry.location == self.model.queued[index].location
            self.delivered.append((entry.sequence, entry.location))
            self.model.read_through = entry.sequence

    @precondition(lambda self: self.consumer is not None)
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        if self.model.read_through > self.model.acked_through:
            self.model.acked_through = data.draw(
                st.integers(self.model.acked_through + 1, self.model.read_through)
            )

    @precondition(lambda self: self.consumer is not None)
    @rule()
    def dequeue(self) -> None:
        assert self.consumer is not None
        through = self.model.acked_through
        removed = self.consumer.dequeue(through)
        drop = max(0, through - self.model.first_sequence + 1)
        assert removed == drop
        self.model.dequeued.extend(e.location for e in self.model.queued[:drop])
        del self.model.queued[:drop]
        self.model.first_sequence += drop

    @precondition(lambda self: bool(self.fenced))
    @rule(data=st.data())
    def fenced_consumer_is_refused(self, data: st.DataObject) -> None:
        old = data.draw(st.sampled_from(self.fenced))
        etag = self.store.get(MANIFEST).etag
        with pytest.raises(FencedError):
            old.read()
        with pytest.raises(FencedError):
            old.dequeue(self.model.next_sequence - 1)
        assert self.store.get(MANIFEST).etag == etag

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def manifest_matches_the_model(self) -> None:
        if not self.model.appended and self.model.epoch == 0:
            return  # nothing written yet
        manifest = read_manifest(self.store, MANIFEST).manifest
        assert manifest.epoch == self.model.epoch
        assert manifest.next_sequence == self.model.next_sequence
        assert [e.sequence for e in manifest.entries] == list(
            range(self.model.first_sequence, self.model.next_sequence)
        )
        assert [(e.location, e.metadata) for e in manifest.entries] == [
            (p.location, p.metadata) for p in self.model.queued
        ]

    @invariant()
    def nothing_lost_nothing_duplicated_order_kept(self) -> None:
        queued = [e.location for e in self.model.queued]
        # Every location ever appended is dequeued or still queued, exactly once, in order.
        assert self.model.dequeued + queued == self.model.appended
        assert len(set(self.model.appended)) == len(self.model.appended)
        # Dequeued entries were all delivered to a consumer first.
        delivered = {location for _, location in self.delivered}
        assert set(self.model.dequeued) <= delivered
        # Deliveries to the active consumer are in sequence order.
        sequences = [s for s, _ in self.delivered]
        for before, after in itertools.pairwise(sequences):
            assert after == before + 1 or after <= before  # a takeover may go back, never skip

    def teardown(self) -> None:
        self.cleanup()

    def cleanup(self) -> None:
        pass


class FileQueueMachine(QueueMachine):
    def make_store(self) -> ObjectStore:
        self._root = tempfile.mkdtemp(prefix="millpond-stateful-")
        return FileStore(self._root)

    def cleanup(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)


_SETTINGS = {
    "deadline": None,
    "stateful_step_count": 40,
    "suppress_health_check": [HealthCheck.too_slow],
}

TestQueueOnMemory = QueueMachine.TestCase
TestQueueOnMemory.settings = settings(max_examples=300, **_SETTINGS)  # type: ignore[arg-type]

TestQueueOnFile = FileQueueMachine.TestCase
TestQueueOnFile.settings = settings(max_examples=40, **_SETTINGS)  # type: ignore[arg-type]
