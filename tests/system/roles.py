"""The roles of the simulated world, each a real millpond object on its own ``RoleStore``.

A role "process" is one object (a ``Producer``, a ``Consumer`` with its sink, a
``GarbageCollector``, a Spark driver's commit) and its store view. A crash abandons the object
mid-flight — its threads stopped, its WAL closed unreleased, its sink transaction rolled back —
and a restart builds a new one on the same WAL directory or sink. The roles run under the
checker's runtime (``tests/system/runtime.py``): their waits are simulated time, and the
coordinator serves on the simulated network (``tests/system/simnet.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import EllipsisType
from typing import Any

import pyarrow as pa

from millpond.common.retry import RetryPolicy
from millpond.common.ulids import UlidMinter, batch_location
from millpond.consumer import ConsumedBatch, Consumer, ConsumerConfig
from millpond.consumer.app.service import ConsumerService
from millpond.consumer.sinks import AdbcSink, SinkError, SinkTables, TableSettings, open_sink
from millpond.consumer.takeover import take_over
from millpond.coordinator.hosted import HostCoordinatedAppender
from millpond.coordinator.rounds import AppendCoordinator, DequeueTicket
from millpond.coordinator.server import CoordinatorServer
from millpond.errors import FencedError, MillpondError
from millpond.formats.batch import encode_batch
from millpond.formats.manifest import Metadata, PendingEntry
from millpond.gc import GarbageCollector, GarbageCollectorConfig
from millpond.producer import Producer, ProducerConfig
from millpond.producer.spark.commit import commit_micro_batch
from millpond.queue.claim import queue_identity
from tests.invariants import ConsumerEvent
from tests.system.primitives import SimEvent
from tests.system.runtime import current_runtime
from tests.system.sim import Fault, Recorder, RoleStore, SimClock, SimulatedCrash, SkewedClock

__all__ = [
    "PAIRS_TABLE",
    "STATE_TABLE",
    "ConsumerRole",
    "CoordinatorRole",
    "GcRole",
    "ProducerRole",
    "QueueSpec",
    "StreamRole",
    "Upsert",
    "open_world_sink",
    "sink_state",
    "sink_written",
]

# Short rounds: a role whose store is down gives up a round quickly (in simulated time).
RETRY = RetryPolicy(max_attempts=6, max_elapsed=2.0, base_delay=0.01, max_delay=0.2)
AGING_RETRY = RetryPolicy(
    max_attempts=6, max_elapsed=2.0, base_delay=0.01, max_delay=0.2, strategy="aging"
)
"""The fair pacing of contended appends (issue 11), for the schedules that switch it on."""
_FLUSH_ROUNDS = 400  # rounds of 20 ms of simulated time a flush is waited for
_ROUND = 0.02
# Real seconds each coordinator write takes: a producer uploads its next batches while its
# append is out, and sends them chained behind it (X-Millpond-After), faults and all.
_ROUND_WRITE = 0.015
TOKEN = "checker-token"
"""The coordinator's token (``MILLPOND_COORDINATOR_TOKEN`` of every role)."""


STATE_TABLE = "state_a"
"""Upserted by ``k``, rows with ``gone`` true deleting their key (the tables schedules)."""
PAIRS_TABLE = "pairs_a"
"""Upserted by ``(g, k)`` (the tables schedules)."""
TABLES = SinkTables(
    {
        STATE_TABLE: TableSettings("upsert", ("k",), "gone"),
        PAIRS_TABLE: TableSettings("upsert", ("g", "k")),
    }
)
"""What queue A's consumers may write besides their own table, in the tables schedules."""


def open_world_sink(path: Path, table: str, progress_table: str, *, tables: bool) -> AdbcSink:
    """A consumer's sink: opaque rows into ``table``; with ``tables``, batches naming
    :data:`TABLES` go there too, their Arrow rows upserted (issue 46)."""
    if not tables:
        return open_sink(
            f"sqlite://{path}", table=table, progress_table=progress_table, entry_format="opaque"
        )
    return open_sink(f"sqlite://{path}", table=table, progress_table=progress_table, tables=TABLES)


@dataclass(frozen=True, slots=True)
class Upsert:
    """One write a producer made to a key of an upserted table (the last of its call)."""

    table: str
    key: tuple[Any, ...]
    value: str | None
    """The row's ``v``; ``None``: a delete."""
    staged: bool
    """Whether its ``wait_staged()`` returned (it must reach the sink)."""


class QueueSpec:
    """One queue of the world: its manifest, data prefix and sink table."""

    def __init__(self, name: str, manifest_path: str, data_path_prefix: str) -> None:
        self.name = name
        self.manifest_path = manifest_path
        self.data_path_prefix = data_path_prefix
        self.table = f"rows_{name}"
        self.progress_table = f"progress_{name}"


class ProducerRole:
    """A producer process: produce records, flush, crash, restart on the same WAL."""

    def __init__(
        self,
        index: int,
        queue: QueueSpec,
        recorder: Recorder,
        clock: SimClock,
        skew_ms: int,
        wal_dir: Path,
        down: Callable[[], bool],
        coordinator: str | None = None,
        retry: RetryPolicy = RETRY,
        late_conflict: float = 0.0,
        host_coordinator: bool = False,
        upserts: str | None = None,
    ) -> None:
        self.source = f"{queue.name}p{index}"
        self._upserting = random.Random(upserts) if upserts is not None else None
        """In the tables schedules (seeded by ``upserts``): about half its produce() calls
        upsert or delete keys of its own in :data:`STATE_TABLE` or :data:`PAIRS_TABLE`."""
        self.upserts: list[Upsert] = []
        """Every such write, in the order it made them."""
        self.host_coordinator = host_coordinator
        """Whether it shares a coordinator with the queue's other producers, hosted by one of
        them (``ProducerConfig.host_coordinator``)."""
        self.retry = retry
        self.late_conflict = late_conflict
        """Real seconds its store holds the answer to a lost manifest write (``RoleStore``)."""
        self.coordinator = coordinator
        """The ``millpond coordinator`` URL its appends go through, if any."""
        self.queue = queue
        self._recorder = recorder
        self._clock = SkewedClock(clock, skew_ms)
        self._sim = clock
        self._wal_dir = wal_dir
        self._down = down
        self.store: RoleStore | None = None
        self.producer: Producer | None = None
        self.next_number = 0
        self.produced: list[bytes] = []
        self.staged: list[bytes] = []
        self._coordinated_before = 0  # by the processes of this role that died or closed

    @property
    def alive(self) -> bool:
        return self.producer is not None and self.store is not None and not self.store.dead

    @property
    def coordinated_appends(self) -> int:
        """Appends a coordinator made for this role's processes (``coordinator_appends``):
        the checker's proof that a schedule with a coordinator went through it."""
        return self._coordinated_before + _coordinated_appends(self.producer)

    def start(self) -> None:
        self.store = RoleStore(
            self._recorder,
            self.source,
            self._down,
            bounded=True,
            late_conflict=self.late_conflict,
        )
        config = ProducerConfig(
            store=self.store,
            wal_dir=self._wal_dir,
            manifest_path=self.queue.manifest_path,
            data_path_prefix=self.queue.data_path_prefix,
            flush_interval=3600.0,  # the schedule flushes; the clock never seals by itself
            flush_size_bytes=1,  # one batch per produce() call: appends of several batches
            upload_concurrency=1,
            retry=self.retry,
            coordinator=self.coordinator,
            host_coordinator=self.host_coordinator,
            clock=self._clock,
        )
        try:
            self.producer = Producer(config)
        except SimulatedCrash:
            self.producer = None

    def produce(self, count: int) -> None:
        producer = self.producer
        if producer is None:
            return
        for _ in range(count):
            if self._upserting is not None and self._upserting.random() < 0.5:
                if not self._upsert(producer):
                    return
                continue
            record = f"{self.source}-{self.next_number}".encode()
            self.next_number += 1
            self.produced.append(record)
            try:
                handle = producer.produce([record], timeout=10)
            except MillpondError:
                return  # the process died under it: never staged
            try:
                # Staging takes no store request and no time on the simulated clock: a call
                # is staged or failed at once. One that is neither was lost by the producer
                # (a stop from another thread while the WAL writer held it: seed 380552).
                handle.wait_staged(timeout=30)
            except TimeoutError:
                raise AssertionError(
                    f"{self.source}: produce() of {record!r} neither staged nor failed in 30 s"
                ) from None
            except MillpondError:
                return  # the process died under it: never staged
            self.staged.append(record)

    def _upsert(self, producer: Producer) -> bool:
        """One ``produce_arrow(..., table=)`` of 1-3 rows over a few keys of its own (some
        repeated, some deleted in :data:`STATE_TABLE`); ``False`` when the process died."""
        rng = self._upserting
        assert rng is not None
        number = self.next_number
        self.next_number += 1
        table = rng.choice([STATE_TABLE, PAIRS_TABLE])
        rows: list[dict[str, Any]] = []
        for i in range(rng.randint(1, 3)):
            value = f"{self.source}-{number}.{i}"
            if table == STATE_TABLE:
                key = f"{self.source}:{rng.randrange(4)}"
                rows.append({"k": key, "v": value, "gone": rng.random() < 0.25})
            else:
                rows.append({"g": self.source, "k": rng.randrange(3), "v": value})
        writes: dict[tuple[Any, ...], str | None] = {}  # the call's last row per key
        for row in rows:
            key_of = (row["k"],) if table == STATE_TABLE else (row["g"], row["k"])
            writes.pop(key_of, None)
            writes[key_of] = None if row.get("gone") else row["v"]
        # Made before it is handed over, as produce() notes a record: the process may die
        # inside the call (SimulatedCrash) after staging it.
        made = len(self.upserts)
        self.upserts += [Upsert(table, k, v, staged=False) for k, v in writes.items()]
        try:
            handle = producer.produce_arrow(pa.Table.from_pylist(rows), table=table, timeout=10)
            handle.wait_staged(timeout=30)
        except TimeoutError:
            raise AssertionError(
                f"{self.source}: upsert {number} neither staged nor failed"
            ) from None
        except MillpondError:
            return False  # the process died under it: never staged
        self.upserts[made:] = [Upsert(table, k, v, staged=True) for k, v in writes.items()]
        return True

    def flush(self, *, until_done: bool = False) -> bool:
        """Publish what is staged, moving the clock on while the producer waits for it (a
        re-upload waits out the collectors' delete window). ``False`` when it did not finish:
        the store is down, or the process died."""
        producer = self.producer
        if producer is None:
            return False
        return self._while_the_clock_runs(producer.flush, _FLUSH_ROUNDS * (10 if until_done else 1))

    def _while_the_clock_runs(self, call: Callable[[], object], rounds: int) -> bool:
        """Run ``call`` (which waits on the simulated clock) on a thread of its own, for at
        most ``rounds`` times 20 ms of simulated time, or until this process dies; ``False``
        if it failed or did not return by then."""
        runtime = current_runtime()
        assert runtime is not None, "the checker's roles run under its runtime"
        done = SimEvent()
        outcome: list[bool] = []
        store = self.store

        def run() -> None:
            try:
                call()
                outcome.append(True)
            except BaseException:  # the process died, or was closed under it
                outcome.append(False)
            finally:
                done.set()

        runtime.spawn(run, f"sim-{self.source}")
        for _ in range(rounds):
            if done.wait(_ROUND):
                break
            if store is not None and store.dead:
                break
        return bool(outcome) and outcome[0]

    def crash(self) -> None:
        """The process dies: threads gone, WAL closed as it is (nothing released)."""
        producer, self.producer = self.producer, None
        self._coordinated_before += _coordinated_appends(producer)
        if self.store is not None:
            self.store.dead = True
        if producer is not None:
            producer._stop_threads()
            producer._wal.close()
            _kill_hosted_coordinator(producer)

    def close(self) -> None:
        producer, self.producer = self.producer, None
        if producer is not None:
            self._while_the_clock_runs(lambda: producer.close(timeout=5), _FLUSH_ROUNDS)
        self._coordinated_before += _coordinated_appends(producer)


def _coordinated_appends(producer: Producer | None) -> int:
    appender = None if producer is None else producer._coordinated
    return 0 if appender is None else appender.counters.get("coordinator_appends")


def _kill_hosted_coordinator(producer: Producer) -> None:
    """The coordinator a dead producer process hosted dies with it: nothing listens on its
    port, the kernel releases its lock, and its URL stays in the election file."""
    appender = producer._coordinated
    if not isinstance(appender, HostCoordinatedAppender):
        return
    host = appender._host
    server, host._server = host._server, None
    fd, host._fd = host._fd, None
    if server is not None:
        server.close_listener()
        server.coordinator.stop(0)  # what waited for a round is refused, as in CoordinatorRole
    if fd is not None:
        os.close(fd)


class CoordinatorRole:
    """``millpond coordinator`` for one queue: a real ``AppendCoordinator`` served over HTTP on
    the schedule's simulated loopback (:mod:`tests.system.simnet`), on its own ``RoleStore``.
    A crash stops its listener and kills its store view (the round under way dies at its next
    store call); between a crash and the restart a connection is refused, as by a dead
    process; a restart serves on the same port.
    """

    def __init__(
        self, queue: QueueSpec, recorder: Recorder, clock: SimClock, down: Callable[[], bool]
    ) -> None:
        self.queue = queue
        self._recorder = recorder
        self._clock = clock
        self._down = down
        self.port = 0
        self.store: RoleStore | None = None
        self.server: CoordinatorServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.server is not None and self.store is not None and not self.store.dead

    def start(self) -> None:
        self.store = RoleStore(
            self._recorder, "coordinator", self._down, bounded=True, cas_delay=_ROUND_WRITE
        )
        coordinator = AppendCoordinator(
            self.store,
            self.queue.manifest_path,
            data_path_prefix=self.queue.data_path_prefix,
            queue=queue_identity(self._recorder.url, self.queue.manifest_path),
            retry=RETRY,
            clock=self._clock,
        )
        asked = coordinator.dequeue

        def dequeue(epoch: int, through: int) -> DequeueTicket:
            self._recorder.ask_dequeue(self.queue.manifest_path, epoch, through)
            return asked(epoch, through)

        coordinator.dequeue = dequeue  # type: ignore[method-assign]
        # With a token, as a coordinator off loopback must have: every role that talks to it
        # sends the one in its environment (test_whole_system sets TOKEN_ENV to it).
        self.server = CoordinatorServer(coordinator, port=self.port, token=TOKEN).start()
        self.port = self.server.port

    def arm(self, fault: Fault) -> None:
        if self.store is not None and not self.store.dead:
            self.store.arm(fault)

    def crash(self) -> None:
        """The process dies: no more store calls, nothing listens on its port."""
        server, self.server = self.server, None
        if self.store is not None:
            self.store.dead = True
        if server is not None:
            server.close_listener()
            # Lets an idle round thread end (a real crash takes it too). What was waiting for
            # a round is refused: true, since this store view writes nothing any more.
            server.coordinator.stop(0)

    def release_port(self) -> None:
        """Nothing to free: the simulated network binds no real port."""


class ConsumerRole:
    """One consumer process with its sink: takes over with ``initialize()``, consumes, dies."""

    def __init__(
        self,
        number: int,
        queue: QueueSpec,
        recorder: Recorder,
        clock: SimClock,
        sink_path: Path,
        events: list[ConsumerEvent],
        step: Callable[[], int],
        down: Callable[[], bool],
        *,
        table: str | None = None,
        progress_table: str | None = None,
        read_ahead: int = 1,
        backlog_index: bool = False,
        took_over: Callable[[ConsumerRole], None] | None = None,
    ) -> None:
        self.number = number
        self._took_over = took_over
        self.after_takeover: list[Fault] = []
        """Faults armed on its store once its takeover has returned (a manifest that answers
        404 for a while is met mid-run, not at start-up)."""
        self._read_ahead = read_ahead
        self.queue = queue
        self.backlog_index = backlog_index
        self.store = RoleStore(recorder, f"consumer-{number}", down)
        self._clock = clock
        self._events = events
        self._step = step
        self._sink_path = sink_path
        self._table = table or queue.table
        self._progress_table = progress_table or queue.progress_table
        self.tables = False
        """Whether its sink writes :data:`TABLES` too (queue A, the tables schedules)."""
        self.consumer: _RecordingConsumer | None = None
        self.sink: Any = None
        self.fenced = False
        self.coordinator: str | None = None
        """The ``millpond coordinator`` URL its dequeues go through, if any."""
        self._coordinated_before = 0  # by the processes of this role that died or closed

    @property
    def coordinator_dequeues(self) -> int:
        """Dequeues the coordinator made for this role's processes (``coordinator_dequeues``)."""
        consumer = self.consumer
        now = 0 if consumer is None else consumer.counters.get("coordinator_dequeues")
        return self._coordinated_before + now

    def _open(self) -> None:
        if self.consumer is not None:
            return
        self.consumer = _RecordingConsumer(
            self,
            ConsumerConfig(
                store=self.store,
                manifest_path=self.queue.manifest_path,
                data_path_prefix=self.queue.data_path_prefix,
                gc_enabled=False,
                read_ahead=self._read_ahead,
                ack_batch_size=3,
                # Half of what is queued behind: proportional steps even on short queues.
                dequeue_fraction=0.5,
                backlog_index=self.backlog_index,
                backlog_index_threshold=3,
                retry=RETRY,
                clock=self._clock,
                coordinator=self.coordinator,
            ),
        )
        self.sink = open_world_sink(
            self._sink_path, self._table, self._progress_table, tables=self.tables
        )

    def record(self, kind: str, sequence: int | None = None) -> None:
        self._events.append(ConsumerEvent(self._step(), self.number, kind, sequence))

    def _taken(self) -> None:
        """Its takeover returned: older consumers are fenced; faults for mid-run are armed."""
        assert self.consumer is not None
        self.record("initialized", self.consumer.epoch)
        if self._took_over is not None:
            self._took_over(self)
        for fault in self.after_takeover:
            self.store.arm(fault)
        self.after_takeover = []

    def take_over(self, read: int | EllipsisType | None = ...) -> None:
        """``initialize()`` at the sink's last sequence (a service start); ``read``: the
        progress as read earlier (a service that read it when it started, before an older
        one still running wrote and dequeued more)."""
        self._open()
        assert self.consumer is not None
        consumer = self.consumer
        take_over(consumer, lambda: self.sink.last_sequence(consumer.queue), read=read)
        self._taken()

    def progress(self) -> int | None:
        """The sink's last sequence for this role's queue, as a starting service reads it."""
        self._open()
        assert self.consumer is not None
        result: int | None = self.sink.last_sequence(self.consumer.queue)
        return result

    def run_service(self, on_bad_batch: str = "stop") -> None:
        """``millpond consume --exit-when-idle [--on-bad-batch ...]``: take over and drain."""
        self._open()
        assert self.consumer is not None
        service = ConsumerService(
            self.consumer,
            self.sink,
            poll_min=0.001,
            poll_max=0.002,
            retry_initial_delay=0.001,
            retry_max_delay=0.005,
            on_bad_batch=on_bad_batch,
            clock=self._clock,
        )
        stop = SimEvent()
        original = self.consumer.initialize

        def initialize(last_acked_sequence: int | None = None) -> None:
            original(last_acked_sequence)
            self._taken()

        self.consumer.initialize = initialize  # type: ignore[method-assign]
        service.run(stop, until_idle=True)

    def step_batches(self, count: int) -> None:
        """Deliver, write and ack up to ``count`` batches by hand (after ``take_over``)."""
        consumer = self.consumer
        if consumer is None:
            return
        for _ in range(count):
            batch = consumer.next_batch()
            if batch is None:
                return
            self.sink.write(batch)
            consumer.ack(batch.sequence)

    def crash(self) -> None:
        """The process dies: no close, no final dequeue; the open transaction rolls back."""
        self.store.dead = True
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.close()
        consumer, self.consumer = self.consumer, None
        if consumer is not None:
            self._coordinated_before += consumer.counters.get("coordinator_dequeues")
            with contextlib.suppress(BaseException):
                consumer._shutdown()

    def close(self) -> None:
        consumer, self.consumer = self.consumer, None
        if consumer is not None:
            with contextlib.suppress(MillpondError):
                consumer.close()
            self._coordinated_before += consumer.counters.get("coordinator_dequeues")
        if self.sink is not None:
            self.sink.close()
            self.sink = None


class _RecordingConsumer(Consumer):
    """A real consumer that also notes each delivery and ack, for the fencing invariant."""

    def __init__(self, role: ConsumerRole, config: ConsumerConfig) -> None:
        super().__init__(config)
        self._role = role

    # next_batch() goes through next_batches(), and the service delivers with next_batches()
    # (acking what it wrote before with the same call) and acks with ack_through(): each path
    # is noted once, under the consumer's own lock, so that no takeover can run (on another
    # thread, between two requests of this consumer's) between a delivery and its note.
    def next_batches(self, limit: int, *, ack_through: int | None = None) -> list[ConsumedBatch]:
        with self._lock:
            return self._next_batches(limit, ack_through=ack_through)

    def _next_batches(self, limit: int, *, ack_through: int | None) -> list[ConsumedBatch]:
        acked_before = self.acked_sequence
        try:
            batches = super().next_batches(limit, ack_through=ack_through)
        except FencedError:
            self._role.fenced = True
            raise
        except MillpondError:
            # A delivery that failed after the ack was recorded still acked.
            if self.acked_sequence != acked_before:
                self._role.record("acked", self.acked_sequence)
            raise
        if ack_through is not None:
            self._role.record("acked", ack_through)
        for batch in batches:
            self._role.record("delivered", batch.sequence)
        return batches

    def ack(self, sequence: int) -> None:
        with self._lock:
            try:
                super().ack(sequence)
            except FencedError:
                self._role.fenced = True
                raise
            self._role.record("acked", sequence)

    def ack_through(self, sequence: int) -> None:
        with self._lock:
            try:
                super().ack_through(sequence)
            except FencedError:
                self._role.fenced = True
                raise
            self._role.record("acked", sequence)


class GcRole:
    """``millpond gc --once``, with the world's clock."""

    def __init__(
        self, queue: QueueSpec, recorder: Recorder, clock: SimClock, grace: float, down: Any
    ) -> None:
        self.store = RoleStore(recorder, f"gc-{queue.name}", down)
        self.collector = GarbageCollector(
            GarbageCollectorConfig(
                store=self.store,
                manifest_path=queue.manifest_path,
                data_path_prefix=queue.data_path_prefix,
                gc_grace_period=grace,
                clock=clock,
            )
        )

    def run_once(self) -> None:
        with contextlib.suppress(MillpondError):
            self.collector.run_once()


class StreamRole:
    """A Spark streaming query's driver: each micro-batch's tasks upload, the driver commits.

    A crashed commit is run again with the same batch id and fresh uploads of the same rows
    (Spark's replay after a driver restart).
    """

    def __init__(
        self, queue: QueueSpec, recorder: Recorder, clock: SimClock, down: Callable[[], bool]
    ) -> None:
        self.queue = queue
        self._recorder = recorder
        self._clock = clock
        self._down = down
        self.store = RoleStore(recorder, "driver", down, bounded=True)
        self.next_batch_id = 0
        self.pending: int | None = None
        """A batch id whose commit did not return; it is run again before the next."""
        self.coordinator: str | None = None
        """The coordinator the driver commits through (``.option("coordinator", ...)``)."""
        self.records: list[bytes] = []

    def rows(self, batch_id: int) -> list[bytes]:
        return [f"s-{batch_id * 10 + j}".encode() for j in range(3)]

    def micro_batch(self) -> bool:
        """Run the pending batch again, or the next one; ``True`` once committed."""
        batch_id = self.pending if self.pending is not None else self.next_batch_id
        if self.pending is None:
            self.next_batch_id += 1
            self.records.extend(self.rows(batch_id))
        self.pending = batch_id
        if self.store.dead:
            self.store = RoleStore(
                self._recorder, "driver", self._down, bounded=True
            )  # a restarted driver
        minter = UlidMinter(self._clock)
        entries = []
        try:
            for index, row in enumerate(self.rows(batch_id)):
                location = batch_location(self.queue.data_path_prefix, minter.mint())
                self.store.put_if_absent(location, encode_batch([row]))
                entries.append(PendingEntry(location, (Metadata(0, index, b"spark"),)))
            commit_micro_batch(
                self.store,
                entries,
                stream_id="s1",
                batch_id=batch_id,
                manifest_path=self.queue.manifest_path,
                data_path_prefix=self.queue.data_path_prefix,
                gc_grace_period=60.0,
                retry=RETRY,
                clock=self._clock,
                coordinator=(self.coordinator,) if self.coordinator else (),
            )
        except (MillpondError, SimulatedCrash):
            return False
        self.pending = None
        return True


def sink_state(
    path: Path, table: str, key: tuple[str, ...]
) -> dict[tuple[Any, ...], tuple[str, int]]:
    """An upserted table's rows: key -> (``v``, the sequence of the batch that wrote it)."""
    names = ", ".join(f'"{column}"' for column in key)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        try:
            rows = conn.execute(f'SELECT {names}, v, _millpond_sequence FROM "{table}"')
        except sqlite3.OperationalError:  # no table: nothing was ever written
            return {}
        return {tuple(row[:-2]): (str(row[-2]), int(row[-1])) for row in rows.fetchall()}


def sink_written(path: Path, progress_table: str, table: str) -> set[int]:
    """The sequences the sink's progress records as written (not skipped as duplicates)."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        try:
            rows = conn.execute(
                f'SELECT sequence FROM "{progress_table}" WHERE target_table = ? AND NOT duplicate',
                (table,),
            ).fetchall()
        except sqlite3.OperationalError:  # no table: nothing was ever recorded
            return set()
    return {int(row[0]) for row in rows}


def sink_rows(path: Path, table: str) -> list[bytes]:
    """The records a sink table holds, in queue order."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        try:
            rows = conn.execute(
                f'SELECT payload FROM "{table}" ORDER BY sequence, entry_index'
            ).fetchall()
        except sqlite3.OperationalError:  # no table: nothing was ever written
            return []
    return [bytes(row[0]) for row in rows]


def sink_progress(path: Path, progress_table: str, table: str) -> list[list[int]]:
    """The sequences the sink's progress records for ``table``, grouped by commit, in commit
    order.

    SQLite gives a new row the rowid one past the largest, and the sink never deletes progress
    rows, so rowid order is commit order between transactions; inside one (a group written
    together) the order is the sink's own. Rows of one transaction share ``committed_at_ms``:
    consecutive rows with the same value are one group (two transactions in one millisecond
    merge, which can hide a misordering but never invent one).
    """
    with contextlib.closing(sqlite3.connect(path)) as conn:
        try:
            rows = conn.execute(
                f'SELECT sequence, committed_at_ms FROM "{progress_table}" '
                "WHERE target_table = ? ORDER BY rowid",
                (table,),
            ).fetchall()
        except sqlite3.OperationalError:  # no table: nothing was ever recorded
            return []
    return [[int(row[0]) for row in group] for _, group in itertools.groupby(rows, lambda r: r[1])]


_ = SinkError  # raised through ConsumerRole by a sink of another queue
