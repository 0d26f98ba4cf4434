"""One simulated world: two queues in one store, every role, a seeded schedule of faults.

:func:`schedule` turns a seed into a list of events; :class:`World` runs them, heals (the store
comes back, crashed roles restart, everything is published and consumed) and checks the
invariants of :mod:`tests.invariants`. A failure names the seed and the events, so
``MILLPOND_CHECKER_SEED=<seed>`` replays it (``tests/system/test_whole_system.py``).

The events cover what the issue asks a checker to throw at the system: a store call that fails
before it lands, one that lands and reports failure, a conditional write held back and landed
behind a newer one, the store down for a while, a crash of any role at any store call (before
or after it lands) and a restart much later, the clock jumping past ``reupload_after`` and the
GC grace period, producers with skewed clocks, a second consumer taking over at any point, a
Spark stream's driver dying mid-commit, an operator pointing a consumer of one queue at the
other queue's table, and poison batches (an object corrupted in the store, rows the database
refuses for good): the consumer stops on one and the operator quarantines it, or the service
sets it aside itself (``--on-bad-batch quarantine``); at the end the cause is fixed and the
batch replayed (``tests/system/poison.py``).

The actors go on while the schedule does (issue 45): an event hands a consumer's run, a flush,
a collection or a Spark micro-batch to the actor's lane (one per producer, per queue's consumers,
the collector, the Spark driver; ``Lanes`` in ``tests/system/runtime.py``), and the schedule
waits for the lanes for a while its seed chooses (not at all, a moment, or until they are idle)
before the next event. Under the runtime any thread may act between any two requests of
another, as the seed's scheduler picks; ``takeover_at`` still forces a takeover at a request.

The seams (issue 44): a newer consumer takes over between any two store requests of an older
one — hand-stepped, or the service under either bad-batch policy, its backlog index mover
included (``takeover_at``); the manifest answers 404 or garbage to the service for a while
(``consume_with_fault`` with ``manifest``); a producer restarts on a WAL whose batches were
uploaded and bound but not appended, later than ``reupload_after`` (``stale_restart``). At the
store, no conditional write of a consumer lands after a newer consumer's takeover returned.

Many tables (issue 46): in the schedules ``upserts_into_tables`` picks, queue A's producers
also upsert and delete keys of two more tables, named in their metadata, and its consumers
write all three with one progress; the last write per key must win.
"""

from __future__ import annotations

import contextlib
import random
import uuid
from pathlib import Path
from types import EllipsisType
from typing import Any

from millpond.consumer.sinks import SinkError, open_sink
from millpond.errors import FencedError, FormatError, MillpondError, StorageError
from millpond.queue import read_manifest
from millpond.queue.claim import QueueClaim, open_claim, queue_identity
from millpond.storage import open_store
from tests.invariants import (
    ConsumerEvent,
    assert_exactly_once,
    assert_fenced_delivered_nothing,
    assert_in_sink_or_set_aside,
    assert_last_write_wins,
    assert_never_back,
    assert_no_live_batch_deleted,
    assert_order_per_source,
    assert_recorded_in_queue_order,
)
from tests.system.poison import Poisoner
from tests.system.roles import (
    AGING_RETRY,
    PAIRS_TABLE,
    RETRY,
    STATE_TABLE,
    ConsumerRole,
    CoordinatorRole,
    GcRole,
    ProducerRole,
    QueueSpec,
    StreamRole,
    sink_progress,
    sink_rows,
    sink_state,
    sink_written,
)
from tests.system.runtime import Lanes, current_runtime
from tests.system.sim import Fault, Recorder, SimClock, SimulatedCrash

__all__ = ["World", "schedule"]

GRACE = 60.0  # the queues' GC grace period; producers re-upload after 30 s
DELETE_WINDOW = 0.05  # seconds: short, since a producer waits it out in real time too
_MAX_SKEW_MS = 20_000
_LATE_CONFLICT = 0.02  # real seconds a fairly paced producer's lost write waits for its answer

Event = tuple[Any, ...]

_CONSUMING = {"consume", "consume_with_fault", "takeover", "takeover_at", "stall"}
"""Events that run a consumer of queue A."""


def coordinated(seed: int) -> bool:
    """Whether queue A's producers append through a ``millpond coordinator`` in this schedule
    (a third of the seeds; the others keep the schedules they always had)."""
    return seed % 3 == 2


def hosts_coordinator(seed: int) -> bool:
    """Whether queue A's producers share a coordinator one of them hosts
    (``ProducerConfig.host_coordinator``; half the seeds without a ``millpond coordinator``,
    a draw of its own). A producer's crash takes the coordinator it hosts with it."""
    return not coordinated(seed) and random.Random(seed ^ 0x4057).random() < 0.5


def uses_backlog_index(seed: int) -> bool:
    """Whether queue A's consumers run with the backlog index in this schedule (half do).

    A draw of its own, so the events the main draw makes stay what they were for every seed.
    """
    return random.Random(seed ^ 0x1DE5).random() < 0.5


def paces_fairly(seed: int) -> bool:
    """Whether queue A's producers pace contended appends with the ``aging`` strategy (half
    the schedules; a draw of its own, so the events of a seed stay what they were)."""
    return random.Random(seed ^ 0xFA1E).random() < 0.5


def upserts_into_tables(seed: int) -> bool:
    """Whether queue A feeds three tables in this schedule (issue 46; about a third of the
    seeds, a draw of its own, so the events of a seed stay what they were): about half its
    producers' calls upsert or delete keys of :data:`STATE_TABLE` and ``pairs_a`` (named in
    their metadata, ``produce_arrow(table=)``), the rest and the stream still append to its
    own table, and one consumer writes all three, one progress for the queue."""
    return random.Random(seed ^ 0x7AB1E5).random() < 0.35


def schedule(seed: int, length: int = 28) -> list[Event]:
    """The events of one schedule, chosen by ``seed``."""
    events = _base_schedule(seed, length)
    if uses_backlog_index(seed):
        # A consumer that dies behind, leaving the index full: once, with time passing and
        # the collector running before anyone drains it (a day-long outage in small), and
        # twice more anywhere. Inserted by a draw of their own, after the main ones.
        rng_index = random.Random(seed ^ 0xBAC1)
        at = rng_index.randrange(len(events) + 1)
        events[at:at] = [("stall", rng_index.randint(0, 2)), ("advance", 200.0), ("gc",)]
        for _ in range(2):
            events.insert(rng_index.randrange(len(events) + 1), ("stall", rng_index.randint(0, 3)))
    # The seams (issue 44, issue 50): a draw of their own, inserted after the main ones.
    seams = random.Random(seed ^ 0x5EA45)
    for _ in range(seams.choice([1, 2, 2])):
        at = seams.randrange(len(events) + 1)
        how = seams.choice(["consumer", "service"])
        # Before the older's n-th request of a kind: any (its takeover, fetches' checks,
        # acks), or the manifest, the backlog index, a set-aside copy in particular.
        kind = seams.choice(["any", "write", "manifest", "index", "dead-letter"])
        nth = seams.randrange(
            {"any": 40, "write": 8, "manifest": 12, "index": 6, "dead-letter": 2}[kind]
        )
        # A service run meets a batch it cannot read, sets it aside, moves past it.
        poison = how == "service" and seams.random() < 0.5
        # In a schedule that uses the backlog index, the newer consumer may run without it.
        index = seams.random() < 0.5
        events.insert(at, ("takeover_at", kind, nth, how, seams.randint(0, 3), poison, index))
    if uses_backlog_index(seed) and seams.random() < 0.5:
        # The queue's first move into the backlog index, by a consumer a newer one takes over
        # from before one of its first writes: there is no index head yet.
        first = next((i for i, e in enumerate(events) if e[0] in _CONSUMING), len(events))
        first_move = ("takeover_at", "write", seams.randrange(6), "consumer", 1, False, False)
        events.insert(first, first_move)
    if seams.random() < 0.4:
        mode = seams.choice(["missing", "garbage"])
        fault = ("consume_with_fault", "manifest", mode, seams.randrange(3), seams.randint(1, 3))
        events.insert(seams.randrange(len(events) + 1), fault)
    if seams.random() < 0.3:
        stale = ("stale_restart", seams.randrange(2), seams.randint(1, 4))
        events.insert(seams.randrange(len(events) + 1), stale)
    if coordinated(seed):
        # The coordinator is started first, then crashed, restarted and faulted at points
        # its own generator picks (the other events stay those of the seed).
        rng = random.Random(seed ^ 0xC00D)
        for _ in range(rng.randint(4, 8)):
            kind = rng.choices(
                ["crash_coordinator", "restart_coordinator", "arm_coordinator"], [1, 2, 4]
            )[0]
            event: Event = (kind,)
            if kind == "arm_coordinator":
                # Mostly its compare-and-swap, and mostly a death around it: the cases where a
                # producer gets no answer and must look in the manifest itself.
                event = (
                    kind,
                    rng.choices(["cas", "read", "any"], [4, 1, 1])[0],
                    rng.choices(["fail", "land", "hold", "crash", "crash_after"], [1, 1, 1, 2, 3])[
                        0
                    ],
                    rng.randrange(2),
                )
            events.insert(rng.randrange(len(events) + 1), event)
        events.insert(0, ("start_coordinator",))
    return events


def _base_schedule(seed: int, length: int) -> list[Event]:
    rng = random.Random(seed)
    ops = ["cas", "put", "read", "any"]
    modes = ["fail", "land", "hold", "crash", "crash_after"]
    events: list[Event] = []
    weights = {
        "produce_flush": 10,
        "produce": 3,
        "flush": 3,
        "arm_producer": 6,
        "crash_producer": 2,
        "restart_producer": 3,
        "consume": 5,
        "consume_with_fault": 3,
        "takeover": 3,
        "gc": 3,
        "gc_with_fault": 1,
        "advance": 4,
        "outage": 2,
        "stream": 3,
        "stream_with_fault": 2,
        "delayed_append": 2,
        "produce_b": 2,
        "consume_b": 1,
        "misconfigured": 1,
    }
    kinds = list(weights)
    for _ in range(length):
        kind = rng.choices(kinds, [weights[k] for k in kinds])[0]
        if kind in ("produce_flush", "produce"):
            events.append((kind, rng.randrange(2), rng.randint(1, 3)))
        elif kind in ("flush", "crash_producer", "restart_producer"):
            events.append((kind, rng.randrange(2)))
        elif kind == "arm_producer":
            mode = rng.choice(modes)
            times = rng.randint(1, 8) if mode == "fail" else 1
            events.append((kind, rng.randrange(2), rng.choice(ops), mode, rng.randrange(3), times))
        elif kind == "delayed_append":
            # An append held back in the network while its producer gives up on it and
            # appends again with more batches: the held one lands first.
            events.append((kind, rng.randrange(2), rng.randint(2, 3)))
        elif kind == "consume_with_fault":
            events.append((kind, rng.choice(ops), rng.choice(modes), rng.randrange(6)))
        elif kind == "gc_with_fault":
            events.append((kind, rng.choice(["read", "delete", "put"]), rng.choice(modes), 0))
        elif kind == "takeover":
            events.append((kind, rng.randint(0, 2), rng.randint(0, 3)))
        elif kind == "advance":
            events.append((kind, rng.choice([0.5, 5.0, 31.0, 45.0, 70.0, 200.0])))
        elif kind == "outage":
            events.append((kind, rng.randint(3, 30)))
        elif kind == "stream_with_fault":
            events.append((kind, rng.choice(["cas", "put", "read"]), rng.choice(modes), 0))
        elif kind == "produce_b":
            events.append((kind, rng.randint(1, 3)))
        else:
            events.append((kind,))
    # Poison batches come from their own random stream, so the schedules above stay what
    # they were for every seed (MUTATIONS.md's seeds keep their meaning up to the poison).
    poison = random.Random(seed ^ 0xBAD)
    for _ in range(poison.choice([0, 0, 1, 1, 2])):
        how = poison.choice(["corrupt", "refuse"])
        mode = poison.choice(["operator", "auto"])
        at = poison.randrange(len(events) + 1)
        events.insert(at, ("poison", poison.randrange(8), how, mode))
    return events


class World:
    """Everything of one schedule: the store, the clock, the roles, what they did."""

    def __init__(self, seed: int, directory: Path, clock: SimClock | None = None) -> None:
        rng = random.Random(seed ^ 0x5EED)
        self.seed = seed
        runtime = current_runtime()
        assert runtime is not None, "a world runs under the checker's runtime (simulate.py)"
        self.lanes = Lanes(runtime, self._lane_failed)
        """The actors that keep running while the schedule goes on (consumers, flushes, the
        collector, the Spark driver): each event hands its actor's work to a lane, and the
        schedule waits for the lanes a while the seed chooses before the next event."""
        self._pauses = random.Random(seed ^ 0x9A05E)
        # Read-ahead 4 (the default) lets the service write several fetched batches in one
        # transaction, so a refused batch can sit inside a group; 1 keeps the older schedules.
        self.read_ahead = random.Random(seed ^ 0xA4EAD).choice([1, 4])
        self.directory = directory
        # Half the schedules run queue A's consumers with the backlog index (its own draw, so
        # the schedules of a seed stay what they were).
        self.backlog_index = uses_backlog_index(seed)
        self.clock = clock or SimClock()
        self.queue_a = QueueSpec("a", "ingest/manifest", "ingest")
        self.queue_b = QueueSpec("b", "qb/manifest", "qb")
        inner = open_store(f"memory://world-{uuid.uuid4().hex}")
        self.recorder = Recorder(
            inner,
            self.clock,
            [self.queue_a.manifest_path, self.queue_b.manifest_path],
            in_flight_limit=GRACE / 2,  # grace period - reupload_after
        )
        for queue in (self.queue_a, self.queue_b):
            self.recorder.index_of(
                f"{queue.data_path_prefix}/_millpond/index/head", queue.manifest_path
            )
            open_claim(
                self.recorder,
                data_path_prefix=queue.data_path_prefix,
                manifest_path=queue.manifest_path,
                create=QueueClaim(
                    manifest_path=queue.manifest_path,
                    gc_grace_period=GRACE,
                    gc_delete_window=DELETE_WINDOW,
                ),
            )
        self.recorder.private.append(str(directory).encode())
        self.outage_left = 0
        self.step = 0
        self.sink = directory / "sink.db"
        self.events_a: list[ConsumerEvent] = []
        self.events_b: list[ConsumerEvent] = []
        self.consumers = 0
        self._roles: dict[str, list[ConsumerRole]] = {}
        """Per queue, every consumer role made, oldest first."""
        self._epochs: dict[str, int] = {}
        """The epoch each consumer role (by store name) bumped to last, once known."""
        self.consumers_a: list[ConsumerRole] = []
        """Queue A's consumer roles, in the order they were made."""
        self.violations: list[str] = []
        self.producers = [
            ProducerRole(
                i,
                self.queue_a,
                self.recorder,
                self.clock,
                rng.randint(-_MAX_SKEW_MS, _MAX_SKEW_MS),
                directory / f"wal-a{i}",
                self._outage,
                retry=AGING_RETRY if paces_fairly(seed) else RETRY,
                # Fair pacing reads alongside contended writes; a lost write answered late
                # is then gone past on what that read shows (Peek.outrun).
                late_conflict=_LATE_CONFLICT if paces_fairly(seed) else 0.0,
                host_coordinator=hosts_coordinator(seed),
                upserts=f"{seed}-a{i}" if upserts_into_tables(seed) else None,
            )
            for i in range(2)
        ]
        self.producer_b = ProducerRole(
            0, self.queue_b, self.recorder, self.clock, 0, directory / "wal-b0", self._outage
        )
        self.stream = StreamRole(self.queue_a, self.recorder, self.clock, self._outage)
        self.coordinator: CoordinatorRole | None = None
        if coordinated(seed):
            self.coordinator = CoordinatorRole(
                self.queue_a, self.recorder, self.clock, self._outage
            )
            self.coordinator.start()
            for producer in self.producers:
                producer.coordinator = self.coordinator.url
            self.stream.coordinator = self.coordinator.url
        self.tables = upserts_into_tables(seed)
        self.poison = Poisoner(
            self.recorder, self.queue_a, self.sink, self._outage, tables=self.tables
        )
        for producer in [*self.producers, self.producer_b]:
            producer.start()
        # Queue A's consumer has run before (its table is A's): the misconfigured consumer of
        # queue B meets a table that is already someone else's.
        with open_sink(
            f"sqlite://{self.sink}",
            table=self.queue_a.table,
            progress_table=self.queue_a.progress_table,
            entry_format="opaque",
        ) as sink:
            sink.claim(queue_identity(self.recorder.url, self.queue_a.manifest_path))

    # -- the world's outage ---------------------------------------------------------------

    def _outage(self) -> bool:
        if self.outage_left > 0:
            self.outage_left -= 1
            return True
        return False

    def _consumer(
        self,
        queue: QueueSpec,
        *,
        table: str | None = None,
        progress: str | None = None,
        index: bool = True,
    ) -> ConsumerRole:
        """A new consumer role; ``index=False`` runs it without the backlog index even in a
        schedule that uses it (the default setting of a consumer an operator starts)."""
        self.consumers += 1
        events = self.events_a if queue is self.queue_a else self.events_b
        role = ConsumerRole(
            self.consumers,
            queue,
            self.recorder,
            self.clock,
            self.sink,
            events,
            lambda: self.step,
            self._outage,
            table=table,
            progress_table=progress,
            read_ahead=self.read_ahead,
            backlog_index=self.backlog_index and queue is self.queue_a and index,
            took_over=self._fence_older,
        )
        if queue is self.queue_a and self.coordinator is not None:
            role.coordinator = self.coordinator.url  # its dequeues too, with their fallback
        # Queue A's own table is the queue's progress key whatever table it writes; an
        # operator's consumer of queue B on A's table is refused either way.
        role.tables = self.tables and queue is self.queue_a
        if queue is self.queue_a:
            self.consumers_a.append(role)
        self._roles.setdefault(queue.name, []).append(role)
        return role

    def _fence_older(self, role: ConsumerRole) -> None:
        """``role``'s takeover returned: every consumer of its queue holding a lower epoch —
        one whose takeover returned earlier, or one still inside its own takeover past its
        epoch bump — is fenced, at the store too (no conditional write of theirs may land from
        now on); so is ``role`` itself if a takeover that ran inside its own bumped past it."""
        for other in self._roles.get(role.queue.name, []):
            epoch = other.consumer.epoch if other.consumer is not None else None
            if epoch is not None:
                self._epochs[other.store.name] = epoch
        newest = max(
            self._epochs[r.store.name]
            for r in self._roles[role.queue.name]
            if r.store.name in self._epochs
        )
        self.recorder.fence(
            r.store.name
            for r in self._roles[role.queue.name]
            if self._epochs.get(r.store.name, newest) < newest
        )

    # -- running --------------------------------------------------------------------------

    def run(self, events: list[Event]) -> None:
        for event in events:
            self.step += 1
            self.recorder.step = self.step
            with contextlib.suppress(SimulatedCrash):  # the role is dead; _reap cleans it up
                self._apply(event)
            # The actors go on for a while before the next event: not at all, a moment, or
            # (mostly) until they are done.
            self.lanes.settle(self._pauses.choice([0.0, 0.05, 0.5, 5.0, 60.0, 60.0]))
            self._reap()
        self.lanes.drain()
        self._reap()
        self.heal()

    def _lane_failed(self, lane: str, err: BaseException) -> None:
        if not isinstance(err, SimulatedCrash):  # the role is dead; _reap cleans it up
            self.violations.append(f"step {self.step}: {lane} failed: {err!r}")

    def _flush(self, index: int) -> None:
        """Producer ``index`` of queue A publishes what it staged, while the schedule goes on."""
        producer = self.producers[index]
        self.lanes.run(f"flush-{producer.source}", producer.flush)

    def _consumers(self, queue: QueueSpec, action: Any, *args: Any, **kwargs: Any) -> None:
        """A consumer action of ``queue``, after the ones before it (one consumer lane per
        queue: a takeover between two requests of another consumer is the events' own)."""
        self.lanes.run(f"consumers-{queue.name}", lambda: action(*args, **kwargs))

    def _reap(self) -> None:
        for producer in [*self.producers, self.producer_b]:
            if producer.producer is not None and producer.store is not None and producer.store.dead:
                producer.crash()
        coordinator = self.coordinator
        if coordinator is not None and coordinator.server is not None and not coordinator.alive:
            coordinator.crash()  # died at a store call: its listener goes with it

    def _apply(self, event: Event) -> None:
        kind = event[0]
        if kind == "produce_flush":
            producer = self.producers[event[1]]
            producer.produce(event[2])
            self._flush(event[1])
        elif kind == "produce":
            self.producers[event[1]].produce(event[2])
        elif kind == "flush":
            self._flush(event[1])
        elif kind == "arm_producer":
            _, index, op, mode, after, times = event
            store = self.producers[index].store
            if store is not None and not store.dead:
                store.arm(Fault(op, mode, after, times))
        elif kind == "delayed_append":
            _, index, count = event
            producer = self.producers[index]
            if producer.store is not None and not producer.store.dead:
                producer.store.arm(Fault("cas", "hold"))
                producer.store.arm(Fault("read", "fail", times=5))  # its own look fails too
            producer.produce(count)
            self._flush(index)
        elif kind == "start_coordinator":
            pass  # started with the world (the producers need its address)
        elif kind == "crash_coordinator":
            if self.coordinator is not None:
                self.coordinator.crash()
        elif kind == "restart_coordinator":
            if self.coordinator is not None and not self.coordinator.alive:
                self.coordinator.crash()
                self.coordinator.start()
        elif kind == "arm_coordinator":
            _, op, mode, after = event
            if self.coordinator is not None:
                self.coordinator.arm(Fault(op, mode, after))
        elif kind == "crash_producer":
            self.producers[event[1]].crash()
        elif kind == "restart_producer":
            producer = self.producers[event[1]]
            if not producer.alive:
                producer.crash()
                producer.start()
        elif kind == "consume":
            self._consumers(self.queue_a, self._consume, self.queue_a)
        elif kind == "consume_with_fault":
            _, op, mode, after, *times = event
            fault = Fault(op, mode, after, *times)
            self._consumers(self.queue_a, self._consume, self.queue_a, fault=fault)
        elif kind == "takeover":
            self._consumers(self.queue_a, self._takeover, event[1], event[2])
        elif kind == "takeover_at":
            self._consumers(self.queue_a, self._takeover_at, *event[1:])
        elif kind == "stale_restart":
            self.lanes.wait(f"flush-{self.producers[event[1]].source}")
            self._stale_restart(event[1], event[2])
        elif kind == "stall":
            self._consumers(self.queue_a, self._stall, event[1])
        elif kind == "gc":
            gc = GcRole(self.queue_a, self.recorder, self.clock, GRACE, self._outage)
            self.lanes.run("gc-a", gc.run_once)
        elif kind == "gc_with_fault":
            _, op, mode, after = event
            gc = GcRole(self.queue_a, self.recorder, self.clock, GRACE, self._outage)
            gc.store.arm(Fault(op, mode, after))
            self.lanes.run("gc-a", gc.run_once)
        elif kind == "advance":
            self.clock.advance(event[1])
        elif kind == "outage":
            self.outage_left = event[1]
        elif kind == "stream":
            self.lanes.run("stream", self.stream.micro_batch)
        elif kind == "stream_with_fault":
            self.lanes.run("stream", lambda: self._stream_with_fault(*event[1:]))
        elif kind == "produce_b":
            self.producer_b.produce(event[1])
            self.lanes.run("flush-b", self.producer_b.flush)
        elif kind == "consume_b":
            self._consumers(self.queue_b, self._consume, self.queue_b)
        elif kind == "misconfigured":
            self._consumers(self.queue_b, self._misconfigured)
        elif kind == "poison":
            self.poison.poison(event[1], event[2], event[3])
        else:  # pragma: no cover - schedule() makes only the kinds above
            raise AssertionError(f"unknown event {event}")

    def _stream_with_fault(self, op: str, mode: str, after: int) -> None:
        if self.stream.store.dead:
            self.stream.micro_batch()  # the restarted driver runs the pending batch first
        self.stream.store.arm(Fault(op, mode, after))
        self.stream.micro_batch()

    def _consume(self, queue: QueueSpec, *, fault: Fault | None = None) -> None:
        # A stop on a poisoned batch: the operator sets it aside and starts the service again
        # (once per poisoned batch at most; batches may be poisoned while it runs).
        runs = 0
        while runs <= self.poison.poisoned:
            runs += 1
            role = self._consumer(queue)
            if fault is not None and fault.op == "manifest":
                role.after_takeover.append(fault)  # met mid-run, not at start-up
                fault = None
            if fault is not None:
                role.store.arm(fault)
                fault = None
            policy = self.poison.on_bad_batch  # the operator's, when it started
            try:
                role.run_service(policy)
            except SimulatedCrash:
                role.crash()
                return
            except FencedError:
                role.close()
                return
            except MillpondError as err:
                role.close()
                if self.poison.stopped_on_poison(err) and policy == "stop":
                    try:
                        if self.poison.operator_sets_aside(err):
                            continue
                    except MillpondError as refused:
                        self.violations.append(f"step {self.step}: quarantine: {refused}")
                    return
                self.violations.append(f"step {self.step}: consumer {role.number} stopped: {err}")
                return
            role.close()
            return
        self.violations.append(
            f"step {self.step}: the consumer stopped on poison more often than "
            f"{self.poison.poisoned} batches were poisoned"
        )

    def _takeover(self, before: int, after: int) -> None:
        """A consumer consumes a little; a newer one takes over; the older one goes on."""
        older = self._consumer(self.queue_a)
        newer = self._consumer(self.queue_a)
        try:
            older.take_over()
            older.step_batches(before)
            newer.take_over()
            with contextlib.suppress(FencedError):
                older.step_batches(1)  # must be fenced at once: delivers nothing
            newer.step_batches(after)
        except (SimulatedCrash, StorageError):
            pass  # a dead role, or the store down: nothing is promised about progress
        except (FormatError, SinkError) as err:
            if not self.poison.stopped_on_poison(err):  # stopped on poison: right
                self.violations.append(f"step {self.step}: takeover failed: {err}")
        except MillpondError as err:
            self.violations.append(f"step {self.step}: takeover failed: {err}")
        for role in (older, newer):
            role.close()

    def _takeover_at(
        self, kind: str, at: int, how: str, after: int, poison: bool, index: bool
    ) -> None:
        """An older consumer runs — by hand, or as the service with this schedule's bad-batch
        policy — and a newer one takes over just before the older's request number ``at`` of
        ``kind`` (its takeover's requests, its fetches' fencing checks, its index mover's
        writes, its moves past bad batches alike). The newer read the sink's progress when the
        event began, as a service does when it starts. The older must be fenced and write
        nothing that lands after that; the newer goes on (without the backlog index unless
        ``index``: nothing of its own then rewrites an index head the older left)."""
        older = self._consumer(self.queue_a)
        newer = self._consumer(self.queue_a, index=index)
        outcome: list[BaseException | None] = []
        # The newer service reads the sink's progress as it starts, before the older one
        # (still running: a rolling restart) writes and dequeues more.
        try:
            read: int | EllipsisType | None = newer.progress()
        except (SimulatedCrash, MillpondError):
            read = ...

        def take_over() -> None:
            try:
                newer.take_over(read=read)
                outcome.append(None)
            except (SimulatedCrash, MillpondError) as err:
                outcome.append(err)

        older.store.interleave(kind, at, take_over)
        if poison:
            self.poison.poison(at, "corrupt", "auto")
        try:
            if how == "service":
                older.run_service(self.poison.on_bad_batch)
            else:
                older.take_over()
                older.step_batches(3)
        except (FencedError, SimulatedCrash, StorageError):
            pass  # fenced: right; a dead role or the store down: nothing promised
        except (FormatError, SinkError) as err:
            if not self.poison.stopped_on_poison(err):
                self.violations.append(f"step {self.step}: older consumer failed: {err}")
        except MillpondError as err:
            self.violations.append(f"step {self.step}: older consumer failed: {err}")
        if not outcome:
            take_over()  # the older made fewer requests: the takeover comes after
        taken = outcome[0]
        # A takeover inside the older's own takeover, before its epoch bump: the older bumped
        # last and holds the queue now (two takeovers raced; the last bump wins).
        epochs = self._epochs
        older_last = epochs.get(older.store.name, -1) > epochs.get(newer.store.name, -1)
        try:
            if taken is not None:
                raise taken
            newer.step_batches(after)
        except FencedError as err:
            if not older_last:
                self.violations.append(f"step {self.step}: takeover at {kind} {at}: {err}")
        except (SimulatedCrash, StorageError):
            pass
        except (FormatError, SinkError) as err:
            if not self.poison.stopped_on_poison(err):
                self.violations.append(f"step {self.step}: takeover at {kind} {at}: {err}")
        except MillpondError as err:
            self.violations.append(f"step {self.step}: takeover at {kind} {at}: {err}")
        for role in (older, newer):
            role.close()

    def _stale_restart(self, index: int, count: int) -> None:
        """A producer uploads (and binds) batches whose append fails, dies, and restarts on
        its WAL later than ``reupload_after``: every batch must be written again under its own
        name, confirmed after the delete window, and appended (issue 50)."""
        producer = self.producers[index]
        if producer.alive and producer.store is not None:
            producer.store.arm(Fault("cas", "fail", times=1000))
            producer.produce(count)
            producer.flush()
            producer.crash()
        self.clock.advance(GRACE / 2 + 15.0)  # past reupload_after (GRACE / 2)
        if not producer.alive:
            producer.crash()
            producer.start()
        producer.flush()

    def _stall(self, count: int) -> None:
        """A consumer takes over (moving what is queued into its index), writes ``count``
        batches and dies: the index stays full until the next consumer."""
        role = self._consumer(self.queue_a)
        try:
            role.take_over()
            role.step_batches(count)
        except (SimulatedCrash, StorageError):
            pass
        except (FormatError, SinkError) as err:
            if not self.poison.stopped_on_poison(err):  # stopped on poison: right
                self.violations.append(f"step {self.step}: stalled consumer failed: {err}")
        except MillpondError as err:
            self.violations.append(f"step {self.step}: stalled consumer failed: {err}")
        role.crash()

    def _misconfigured(self) -> None:
        """An operator starts a consumer of queue B on queue A's database (its table and its
        progress table): it must be refused before it dequeues anything."""
        role = self._consumer(
            self.queue_b, table=self.queue_a.table, progress=self.queue_a.progress_table
        )
        try:
            role.run_service()
        except SinkError:
            pass  # refused, naming both queues: right
        except (SimulatedCrash, MillpondError):
            pass
        role.close()

    # -- healing and checking -------------------------------------------------------------

    def heal(self) -> None:
        """The store is back for good; crashed roles restart; everything is published and
        consumed; the collector runs once everything is old."""
        self.lanes.drain()
        self.outage_left = 0
        self.recorder.release_held()
        if self.coordinator is not None:
            if not self.coordinator.alive:
                self.coordinator.crash()
                self.coordinator.start()
            assert self.coordinator.store is not None
            self.coordinator.store.disarm()
        for producer in [*self.producers, self.producer_b]:
            if producer.store is not None:
                producer.store.disarm()
            # A background thread may have taken a fault just before it was disarmed and die of
            # it during the heal (seen: a crash after a read, 3 runs in 30 of seed 448): a
            # process that died is restarted, once; one that lives and cannot publish is a
            # violation.
            for restarts_left in (1, 0):
                if not producer.alive:
                    producer.crash()
                    producer.start()
                if producer.flush(until_done=True):
                    break
                if producer.alive or not restarts_left:
                    self.violations.append(f"heal: {producer.source} could not publish")
                    break
            producer.close()
        for _ in range(5):
            if self.stream.pending is None:
                break
            self.stream.micro_batch()
        if self.stream.pending is not None:
            self.violations.append(f"heal: stream batch {self.stream.pending} never committed")
        self._consume(self.queue_a)
        self._consume(self.queue_b)
        self.clock.advance(3 * GRACE)
        for queue in (self.queue_a, self.queue_b):
            GcRole(queue, self.recorder, self.clock, GRACE, self._outage).run_once()
        self._consume(self.queue_a)  # nothing left, and nothing it needs was collected
        if self.coordinator is not None:
            self.coordinator.crash()  # its threads end with the schedule
            self.coordinator.release_port()
        self.violations += self.poison.replay_all()

    def check(self) -> None:
        """Assert every invariant; raises ``AssertionError`` naming the first broken one."""
        assert not self.violations, "; ".join(self.violations)
        assert not self.recorder.fenced_writes, (
            f"a fenced consumer's write landed after the takeover: {self.recorder.fenced_writes}"
        )
        assert not self.recorder.unasked_dequeues, (
            f"the coordinator dequeued for a fenced consumer: {self.recorder.unasked_dequeues}"
        )
        assert not self.recorder.stale_heads, (
            f"an index head older than the current epoch was created: {self.recorder.stale_heads}"
        )
        assert not self.recorder.doubled, (
            f"a location twice in one manifest: {self.recorder.doubled}"
        )
        rows_a = sink_rows(self.sink, self.queue_a.table)
        rows_b = sink_rows(self.sink, self.queue_b.table)
        staged_a = [r for p in self.producers for r in p.staged] + self.stream.records
        produced_a = [r for p in self.producers for r in p.produced] + self.stream.records
        assert_in_sink_or_set_aside(
            self.poison.rows_before_replay, staged_a, self.poison.set_aside, produced=produced_a
        )
        assert_exactly_once(rows_a, staged_a, produced=produced_a)
        assert_exactly_once(rows_b, self.producer_b.staged, produced=self.producer_b.produced)
        assert_order_per_source(rows_a, _source_and_number)
        assert_order_per_source(rows_b, _source_and_number)
        upserts = [write for producer in self.producers for write in producer.upserts]
        written = sink_written(self.sink, self.queue_a.progress_table, self.queue_a.table)
        for table, key in ((STATE_TABLE, ("k",)), (PAIRS_TABLE, ("g", "k"))):
            state = sink_state(self.sink, table, key)
            assert_last_write_wins(
                {k: value for k, (value, _) in state.items()},
                [(w.key, w.value, w.staged) for w in upserts if w.table == table],
                table=table,
            )
            # Only a batch recorded as written wrote rows: a skipped one (its location
            # recorded under an earlier sequence) wrote none, so no row carries its sequence.
            strays = sorted(s for _, s in state.values() if s not in written)
            assert not strays, f"{table}: rows written by batches not recorded: {strays[:5]}"
        for queue in (self.queue_a, self.queue_b):
            assert_recorded_in_queue_order(
                sink_progress(self.sink, queue.progress_table, queue.table),
                read_manifest(self.recorder, queue.manifest_path).manifest.next_sequence,
            )
        for footers in self.recorder.footers.values():
            assert_never_back(footers)
        assert_no_live_batch_deleted(self.recorder.objects)
        assert_fenced_delivered_nothing(self.events_a)
        assert_fenced_delivered_nothing(self.events_b)


def _source_and_number(record: bytes) -> tuple[str, int] | None:
    source, _, number = record.decode().rpartition("-")
    return (source, int(number)) if number.isdigit() else None
