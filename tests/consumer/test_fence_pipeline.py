"""The service's pipelined loop against takeovers and crashes at every step, on real servers.

The loop acks the group it wrote and takes the next one in one ``next_batches(limit,
ack_through=n)`` call (one fencing check), on a thread of its own while the database writes
the group before. These tests step through every boundary of that path — each store request
of the older consumer (its fencing checks, batch fetches, dequeues' reads and writes, from
whichever thread) and the start and end of each database write — and at each one:

* a newer consumer takes over: no call of the older one that started after the newer
  ``initialize()`` returned may deliver or ack anything, and the rows end up in PostgreSQL
  exactly once after the newer side drains the queue;
* the older process crashes (before the request is sent, or right after it landed): a
  restarted service drains the queue, and every row is in PostgreSQL exactly once.

Stores: SeaweedFS and moto (S3 servers on loopback); the sink: the session PostgreSQL.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
from consumer_support import FAST_RETRY, Database, ForwardingSink, QueueWriter, numbered

from millpond.consumer import ConsumedBatch, Consumer, ConsumerConfig, takeover
from millpond.consumer.app.service import ConsumerService
from millpond.errors import FencedError
from millpond.storage import (
    DeleteFailure,
    ForwardingStore,
    GetResult,
    ObjectInfo,
    ObjectStore,
    open_store,
)
from tests.support import unique_root

BATCHES = 10
ROWS = 3


class Crash(BaseException):
    """The older consumer's process died (not a MillpondError: nothing handles it)."""


class Steps:
    """Numbers every step of the older consumer; runs ``action`` at step ``at``.

    ``mode`` ``before``: the action runs before the step (a request not sent yet, a write not
    started); ``after``: right after it (a request that landed, a write committed).
    """

    def __init__(self, at: int | None, mode: str, action: Callable[[], None]) -> None:
        self.at = at
        self.mode = mode
        self._action = action
        self._count = itertools.count(1)
        self._lock = threading.Lock()
        self.taken = 0
        self.dead = False
        self.armed = False
        """Set once the older consumer's own ``initialize()`` returned: what it does before
        is its own takeover, not a step of the path under test."""

    def step(self, call: Callable[[], Any]) -> Any:
        if self.dead:
            raise Crash("the process is gone")
        if not self.armed:
            return call()
        with self._lock:
            number = next(self._count)
            self.taken = number
        if number == self.at and self.mode == "before":
            self._action()
        result = call()
        if number == self.at and self.mode == "after":
            self._action()
        return result


class SteppedStore(ForwardingStore):
    """The older consumer's store: every request is a step."""

    def __init__(self, inner: ObjectStore, steps: Steps) -> None:
        super().__init__(inner)
        self.steps = steps

    def get(self, path: str) -> GetResult:
        return self.steps.step(lambda: self.inner.get(path))  # type: ignore[no-any-return]

    def get_if_changed(self, path: str, etag: str | None) -> GetResult | None:
        return self.steps.step(lambda: self.inner.get_if_changed(path, etag))  # type: ignore[no-any-return]

    def get_tail(self, path: str, length: int, etag: str | None = None) -> GetResult | None:
        return self.steps.step(lambda: self.inner.get_tail(path, length, etag))  # type: ignore[no-any-return]

    def head(self, path: str) -> ObjectInfo:
        return self.steps.step(lambda: self.inner.head(path))  # type: ignore[no-any-return]

    def put(self, path: str, data: bytes) -> str | None:
        return self.steps.step(lambda: self.inner.put(path, data))  # type: ignore[no-any-return]

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        return self.steps.step(lambda: self.inner.put_if_absent(path, data))  # type: ignore[no-any-return]

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        return self.steps.step(lambda: self.inner.put_if_match(path, data, etag))  # type: ignore[no-any-return]

    def list(self, prefix: str = "", *, recursive: bool = True) -> builtins.list[ObjectInfo]:
        return self.steps.step(lambda: self.inner.list(prefix, recursive=recursive))  # type: ignore[no-any-return]

    def delete_many(self, paths: Iterable[str]) -> builtins.list[DeleteFailure]:
        wanted = builtins.list(paths)
        return self.steps.step(lambda: self.inner.delete_many(wanted))  # type: ignore[no-any-return]


class SteppedSink(ForwardingSink):
    """The older consumer's sink: the start and the end of each write are steps.

    With ``serial``, the ``w``-th write waits until the consumer has finished ``w + 1``
    deliveries (the one that handed it the group, and the one that the service started
    before writing it): everything the delivery does — the ack it carries and the dequeue
    that may follow — then happens before the write, the interleaving where a crash would
    lose a group acked before it was written.
    """

    def __init__(self, inner: Any, steps: Steps, serial: Log | None = None) -> None:
        super().__init__(inner)
        self.steps = steps
        self._serial = serial
        self._writes = 0

    def write_many(self, batches: Sequence[ConsumedBatch]) -> list[bool]:
        self._writes += 1
        if self._serial is not None:
            self._serial.wait_for_deliveries(self._writes + 1)
        self.steps.step(lambda: None)
        return list(self.steps.step(lambda: self.inner.write_many(batches)))


class Log:
    """Orders the newer consumer's ``initialize()`` returning against the older one's calls."""

    def __init__(self) -> None:
        self._ticks = itertools.count()
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self.deliveries = 0
        self.initialized: int | None = None
        self.successes: list[tuple[int, str]] = []

    def delivered(self) -> None:
        with self._done:
            self.deliveries += 1
            self._done.notify_all()

    def wait_for_deliveries(self, count: int) -> None:
        with self._done:
            if not self._done.wait_for(lambda: self.deliveries >= count, timeout=60):
                raise AssertionError(f"delivery {count} never finished")

    def tick(self) -> int:
        with self._lock:
            return next(self._ticks)

    def success(self, started: int, what: str) -> None:
        with self._lock:
            self.successes.append((started, what))

    def late(self) -> list[tuple[int, str]]:
        """The older consumer's calls that started after the takeover and still did something."""
        if self.initialized is None:
            return []
        return [(t, what) for t, what in self.successes if t > self.initialized]


class WatchedConsumer(Consumer):
    """The older consumer: notes when each call that delivered or acked had started."""

    def __init__(self, config: ConsumerConfig, log: Log, steps: Steps) -> None:
        super().__init__(config)
        self._log = log
        self._steps = steps

    def initialize(self, last_acked_sequence: int | None = None) -> None:
        super().initialize(last_acked_sequence)
        self._steps.armed = True

    def next_batches(self, limit: int, *, ack_through: int | None = None) -> list[ConsumedBatch]:
        started = self._log.tick()
        acked_before = self.acked_sequence
        try:
            batches = super().next_batches(limit, ack_through=ack_through)
        finally:
            if self.acked_sequence != acked_before:
                self._log.success(started, f"acked through {self.acked_sequence}")
            self._log.delivered()
        if batches:
            self._log.success(started, f"delivered {[b.sequence for b in batches]}")
        return batches

    def flush(self, *, ack_through: int | None = None) -> None:
        started = self._log.tick()
        acked_before = self.acked_sequence
        try:
            super().flush(ack_through=ack_through)
        finally:
            if self.acked_sequence != acked_before:
                self._log.success(started, f"acked through {self.acked_sequence} (flush)")

    def ack(self, sequence: int) -> None:
        started = self._log.tick()
        super().ack(sequence)
        self._log.success(started, f"acked {sequence}")

    def ack_through(self, sequence: int) -> None:
        started = self._log.tick()
        super().ack_through(sequence)
        self._log.success(started, f"acked through {sequence}")


@pytest.fixture(params=["seaweedfs", "moto"])
def s3(request: pytest.FixtureRequest) -> Any:
    """An S3 server on loopback (its endpoint): SeaweedFS, then moto."""
    return request.getfixturevalue(f"{request.param}_s3")


def _queue(s3: Any) -> ObjectStore:
    store = open_store(s3.url_for(unique_root()), s3.store_options())
    QueueWriter(store).append_arrow_all([numbered(b * ROWS, ROWS) for b in range(BATCHES)])
    return store


def _config(store: ObjectStore) -> ConsumerConfig:
    # Small groups and frequent dequeues: every kind of step comes up several times, and the
    # ack a delivery carries is often followed by a dequeue inside the same call.
    return ConsumerConfig(
        store=store,
        gc_enabled=False,
        retry=FAST_RETRY,
        read_ahead=2,
        read_ahead_max=4,
        ack_batch_size=3,
        dequeue_fraction=0.0,
    )


def _service(consumer: Consumer, sink: Any) -> ConsumerService:
    return ConsumerService(
        consumer, sink, max_group=3, poll_min=0.001, poll_max=0.01, retry_initial_delay=0.01
    )


def _drain(store: ObjectStore, database: Database) -> None:
    """A service that (re)starts on the queue and drains it."""
    with contextlib.closing(database.sink()) as sink:
        _service(Consumer(_config(store)), sink).run(threading.Event(), until_idle=True)


def _assert_exactly_once(database: Database) -> None:
    rows = [row[0] for row in database.query(f'SELECT n FROM "{database.table}" ORDER BY n')]
    assert rows == list(range(BATCHES * ROWS))


def _older_run(
    store: ObjectStore, database: Database, steps: Steps, log: Log, *, serial: bool = False
) -> BaseException | None:
    """The older consumer's service until it is fenced, crashes or drains the queue."""
    older = WatchedConsumer(_config(SteppedStore(store, steps)), log, steps)
    sink = database.sink()
    stepped = SteppedSink(sink, steps, log if serial else None)
    try:
        _service(older, stepped).run(threading.Event(), until_idle=True)
    except (FencedError, Crash) as err:
        return err
    finally:
        older._shutdown()
        sink.close()
    return None


def test_a_takeover_at_any_step_fences_every_later_call(s3: Any, postgres_server: Any) -> None:
    # Threads make the number of steps vary a little from run to run: go on until a run
    # ends before the step comes.
    for at in itertools.count(1):
        database = Database("postgres", postgres_server.url)
        store = _queue(s3)
        log = Log()
        newer = Consumer(_config(store))
        reader = database.sink()

        # The step may come on another thread of the older consumer, whose run can end on
        # the fence before ``initialize()`` returned there.
        finished = threading.Event()
        failed: list[BaseException] = []

        def take_over(
            newer: Consumer = newer,
            reader: Any = reader,
            log: Log = log,
            finished: threading.Event = finished,
            failed: list[BaseException] = failed,
        ) -> None:
            try:
                # As the service does: the sink read again if the older one dequeued past it.
                takeover.take_over(newer, functools.partial(reader.last_sequence, newer.queue))
                log.initialized = log.tick()
            except BaseException as err:
                failed.append(err)
                raise
            finally:
                finished.set()

        steps = Steps(at, "before", take_over)
        try:
            outcome = _older_run(store, database, steps, log)
            if steps.taken >= at:  # the takeover started
                assert finished.wait(60), f"step {at}: the takeover never returned"
                assert not failed, f"step {at}: the takeover failed: {failed[0]!r}"
            if log.initialized is None:
                assert outcome is None
                _assert_exactly_once(database)  # ran to the end, alone
                break
            # It stops on the fence, or it had nothing left to do after the takeover.
            assert outcome is None or isinstance(outcome, FencedError), (at, outcome)
            assert log.late() == [], f"step {at}: the older acted after the takeover"
            # The newer side (restarted as a service) finishes the queue.
            newer.close()
            _drain(store, database)
            _assert_exactly_once(database)
        finally:
            newer.close()
            reader.close()
    assert at > 20  # checks, fetches, dequeues and writes of several groups


@pytest.mark.parametrize(
    ("mode", "order"), [("before", "serial"), ("after", "serial"), ("after", "pipelined")]
)
def test_a_crash_at_any_step_keeps_exactly_once(
    seaweedfs_s3: Any, postgres_server: Any, mode: str, order: str
) -> None:
    s3 = seaweedfs_s3  # moto runs the takeovers; one server is enough for the crashes
    for at in itertools.count(1):
        database = Database("postgres", postgres_server.url)
        store = _queue(s3)
        steps = Steps(at, mode, lambda: None)

        def die(steps: Steps = steps, at: int = at) -> None:
            steps.dead = True
            raise Crash(f"crashed at step {at}")

        steps._action = die
        outcome = _older_run(store, database, steps, Log(), serial=order == "serial")
        if outcome is None:
            assert not steps.dead
            _assert_exactly_once(database)  # ran to the end before the step came
            break
        assert isinstance(outcome, Crash), (at, outcome)
        _drain(store, database)
        _assert_exactly_once(database)
    assert at > 20


def test_the_service_acks_and_delivers_under_one_check_per_group(
    s3: Any, postgres_server: Any
) -> None:
    """One fencing request per group written (not one for the ack and one for the next)."""
    database = Database("postgres", postgres_server.url)
    store = _queue(s3)
    fence = _FenceCount(store)
    consumer = Consumer(_config(fence))
    with contextlib.closing(database.sink()) as sink:
        service = _service(consumer, _GroupCount(sink))
        service.run(threading.Event(), until_idle=True)
        groups = service._sink.groups  # type: ignore[attr-defined]
    _assert_exactly_once(database)
    # Each delivery checks once (the ack of the group before rides along), plus the final
    # ack; the idle reads at the end check with the manifest read itself.
    assert fence.checks <= groups + 1, (fence.checks, groups)


class _FenceCount(ForwardingStore):
    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.checks = 0

    def get_tail(self, path: str, length: int, etag: str | None = None) -> GetResult | None:
        self.checks += 1
        return self.inner.get_tail(path, length, etag)


class _GroupCount(ForwardingSink):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.groups = 0

    def write_many(self, batches: Sequence[ConsumedBatch]) -> list[bool]:
        self.groups += 1
        return list(self.inner.write_many(batches))


@pytest.mark.parametrize("index", [False, True])
def test_flush_with_an_ack_after_a_takeover_acks_nothing(seaweedfs_s3: Any, index: bool) -> None:
    """The dequeue is the fencing check of ``flush(ack_through=n)``: after a newer
    ``initialize()`` it raises and records nothing, whether the bytes it writes over are the
    ones it last saw (no read) or the backlog index holds the entries (a check of its own)."""
    store = _queue(seaweedfs_s3)
    options = {"backlog_index": index, "backlog_index_threshold": 2}
    older = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=FAST_RETRY, **options))
    older.initialize()
    batches = older.next_batches(3)
    assert batches
    newer = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=FAST_RETRY))
    newer.initialize()
    with pytest.raises(FencedError):
        older.flush(ack_through=batches[-1].sequence)
    assert older.acked_sequence is None
    older.close()
    # Nothing was dequeued: the newer one delivers every batch from the first.
    assert newer.next_batches(BATCHES)[0].sequence == 0
    newer.close()
