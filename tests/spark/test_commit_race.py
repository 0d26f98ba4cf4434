"""Issue 44, case 8: two jobs committing one ``write_id`` at the same time.

The driver's commit is run on two threads against one memory store, without Spark. Every
store request of either job is a *turn point*, once before it is sent and once after it was
served (the request has landed, its answer is not back yet). A scheduler lets exactly one job
run at a time, from one turn point to another, so an interleaving is a list of (job, how many
points) and every run of it is the same: no sleeps, only handshakes on a condition variable.
Time is virtual and shared: it moves only when a job sleeps (a backoff, a wait for another
job's outcome), so a job held at a turn point is, to the other, a driver that stopped there.
"""

from __future__ import annotations

import itertools
import math
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from millpond.common.retry import RetryPolicy
from millpond.common.ulids import UlidMinter, batch_location
from millpond.formats.batch import encode_batch
from millpond.producer.spark.commit import JobReceipt, commit_job, write_state_path
from millpond.producer.spark.commit_state import COMMITTED, CommitState
from millpond.producer.spark.upload import TaskCommitMessage, UploadedBatch, UploadStats
from millpond.queue import QueueConsumer, read_manifest
from millpond.storage import (
    DeleteFailure,
    ForwardingStore,
    GetResult,
    ObjectInfo,
    ObjectStore,
    open_store,
)

MANIFEST = "ingest/manifest"
PREFIX = "ingest"
WRITE_ID = "daily-2026-11-23"
# Two seconds of virtual time for the whole commit and for one append: a job that finds the
# other's pending state waits that long (a few polls) before it takes it over.
RETRY = RetryPolicy(max_attempts=50, max_elapsed=2.0, base_delay=0.001, max_delay=0.01)
# Each phase of a schedule ends within this many real seconds, or the test fails saying where.
_STALL = 30.0


class VirtualClock:
    """Wall and monotonic time that move only when a thread sleeps (by as long as it asked)."""

    def __init__(self, start_ms: int = 1_800_000_000_000) -> None:
        self._lock = threading.Lock()
        self._start_ms = start_ms
        self._now = 0.0

    def now_ms(self) -> int:
        with self._lock:
            return self._start_ms + round(self._now * 1000)

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self._now += max(0.0, seconds)


class Turns:
    """Runs one job at a time, from turn point to turn point (module docstring)."""

    def __init__(self, names: Iterable[str]) -> None:
        self._cond = threading.Condition()
        self.passed = dict.fromkeys(names, 0)
        self._budget: dict[str, float] = dict.fromkeys(self.passed, 0)
        self._held = dict.fromkeys(self.passed, False)
        self.finished: set[str] = set()
        self.trace: list[str] = []

    def point(self, name: str, what: str) -> None:
        """In job ``name``'s thread: go on only while its budget of points lasts."""
        with self._cond:
            self._held[name] = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.passed[name] < self._budget[name])
            self._held[name] = False
            self.passed[name] += 1
            self.trace.append(f"{name}:{what}")

    def finish(self, name: str) -> None:
        with self._cond:
            self.finished.add(name)
            self._cond.notify_all()

    def run(self, name: str, points: int | None) -> bool:
        """Let ``name`` pass ``points`` more turn points (``None``: until it finishes) and
        return once it is held at the next one or has finished; whether it finished."""
        with self._cond:
            target = math.inf if points is None else self.passed[name] + points
            self._budget[name] = target
            self._cond.notify_all()
            stopped = self._cond.wait_for(
                lambda: name in self.finished or (self._held[name] and self.passed[name] >= target),
                timeout=_STALL,
            )
            assert stopped, f"{name} neither finished nor stopped; turns so far: {self.trace}"
            return name in self.finished


class TurnStore(ForwardingStore):
    """Every request of a job's thread is a turn point before it is sent and after it was
    served; requests of other threads (the test's own) pass straight through."""

    def __init__(self, inner: ObjectStore, turns: Turns) -> None:
        super().__init__(inner)
        self.turns = turns

    def _turn(self, what: str, path: str, call: Callable[[], Any]) -> Any:
        name = threading.current_thread().name
        if name not in self.turns.passed:
            return call()
        short = path.rsplit("/", 1)[-1]
        self.turns.point(name, f"{what} {short}")
        try:
            return call()
        finally:
            self.turns.point(name, f"{what} {short} served")

    def get(self, path: str) -> GetResult:
        return self._turn("get", path, lambda: self.inner.get(path))

    def get_if_changed(self, path: str, etag: str | None) -> GetResult | None:
        return self._turn("get_if_changed", path, lambda: self.inner.get_if_changed(path, etag))

    def get_tail(self, path: str, length: int, etag: str | None = None) -> GetResult | None:
        return self._turn("get_tail", path, lambda: self.inner.get_tail(path, length, etag))

    def head(self, path: str) -> ObjectInfo:
        return self._turn("head", path, lambda: self.inner.head(path))

    def put(self, path: str, data: bytes) -> str | None:
        return self._turn("put", path, lambda: self.inner.put(path, data))

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        return self._turn("put_if_absent", path, lambda: self.inner.put_if_absent(path, data))

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        return self._turn("put_if_match", path, lambda: self.inner.put_if_match(path, data, etag))

    def copy(self, source: str, target: str) -> None:
        self._turn("copy", source, lambda: self.inner.copy(source, target))

    def list(self, prefix: str = "", *, recursive: bool = True) -> list[ObjectInfo]:
        return self._turn("list", prefix, lambda: self.inner.list(prefix, recursive=recursive))

    def delete_many(self, paths: Iterable[str]) -> list[DeleteFailure]:
        paths = list(paths)
        return self._turn("delete_many", ",".join(paths), lambda: self.inner.delete_many(paths))


@dataclass
class Race:
    """Two jobs with one write id, each with its own uploads, held before their first turn."""

    memory: ObjectStore
    clock: VirtualClock
    turns: Turns
    uploads: dict[str, tuple[str, ...]] = field(default_factory=dict)
    receipts: dict[str, JobReceipt] = field(default_factory=dict)
    errors: dict[str, BaseException] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)

    @classmethod
    def start(cls, names: tuple[str, ...] = ("A", "B")) -> Race:
        clock = VirtualClock()
        turns = Turns(names)
        race = cls(open_store(f"memory://{uuid.uuid4().hex}"), clock, turns)
        store = TurnStore(race.memory, turns)

        def job(name: str, messages: list[TaskCommitMessage]) -> None:
            try:
                race.receipts[name] = race.commit(store, name, messages)
            except BaseException as err:  # the test looks at it
                race.errors[name] = err
            finally:
                turns.finish(name)

        for name in names:
            thread = threading.Thread(
                target=job, args=(name, race.upload(name)), name=name, daemon=True
            )
            race.threads.append(thread)
            thread.start()
        return race

    def upload(self, name: str) -> list[TaskCommitMessage]:
        """Two tasks' uploads of job ``name`` (real objects, fresh on the virtual clock)."""
        minter = UlidMinter(self.clock)
        messages = []
        for partition in range(2):
            location = batch_location(PREFIX, minter.mint())
            self.memory.put_if_absent(location, encode_batch([f"{name}{partition}".encode()]))
            batch = UploadedBatch(location, self.clock.now_ms(), 1, 1)
            messages.append(
                TaskCommitMessage(partition, 0, (batch,), UploadStats(rows=1, batches=1))
            )
        self.uploads[name] = tuple(m.uploads[0].location for m in messages)
        return messages

    def commit(
        self, store: ObjectStore, name: str, messages: list[TaskCommitMessage]
    ) -> JobReceipt:
        return commit_job(
            store,
            messages,
            job_id=f"job-{name}",
            manifest_path=MANIFEST,
            data_path_prefix=PREFIX,
            gc_grace_period=600,
            write_id=WRITE_ID,
            retry=RETRY,
            clock=self.clock,
        )

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=_STALL)
            assert not thread.is_alive(), f"{thread.name} did not end: {self.turns.trace}"

    def manifest_locations(self) -> list[str]:
        return [e.location for e in read_manifest(self.memory, MANIFEST).manifest.entries]

    def state(self) -> CommitState:
        path = write_state_path(PREFIX, WRITE_ID)
        return CommitState.decode(self.memory.get(path).data, name=path)


def _check_one_append(race: Race, where: str) -> None:
    """Both jobs returned, the manifest holds one job's uploads exactly once (one append for
    the write id), the state and every receipt say where they went, and a third run of the
    write id afterwards, with uploads of its own, enqueues nothing."""
    detail = f"{where}; turns: {race.turns.trace}"
    assert not race.errors, f"{race.errors!r}; {detail}"
    located = race.manifest_locations()
    assert len(located) == len(set(located)), f"a location appended twice: {located}; {detail}"
    assert located in ([*race.uploads["A"]], [*race.uploads["B"]]), f"{located}; {detail}"
    state = race.state()
    assert state.status == COMMITTED, detail
    assert [e.location for e in state.entries] == located, detail
    assert state.sequences == tuple(range(len(located))), detail
    assert any(r.status == "appended" for r in race.receipts.values()), detail
    race.receipts["rerun"] = race.commit(race.memory, "rerun", race.upload("rerun"))
    assert race.receipts["rerun"].status == "skipped", detail
    assert race.manifest_locations() == located, detail
    for name, receipt in race.receipts.items():
        assert (receipt.first_sequence, receipt.last_sequence) == (0, len(located) - 1), (
            f"{name}: {receipt}; {detail}"
        )


@pytest.mark.parametrize("first", ["A", "B"])
def test_case8_two_jobs_with_one_write_id_append_it_once_in_every_interleaving(
    first: str,
) -> None:
    """Job ``first`` runs up to its k-th turn point, the other job up to its j-th (or to its
    end), then ``first`` to its end, then the other: for every k and every j. Before the fix,
    a job that found the other's pending state before that job's append landed appended the
    same locations too (``k`` just after the other's pending state was written, ``j`` to the
    end): the queue held them twice."""
    other = "B" if first == "A" else "A"
    schedules = 0
    for k in itertools.count():
        for j in itertools.count():
            race = Race.start()
            first_done = race.turns.run(first, k)
            other_done = race.turns.run(other, j)
            race.turns.run(first, None)
            race.turns.run(other, None)
            race.join()
            _check_one_append(race, f"{first} to turn {k}, {other} to turn {j}")
            schedules += 1
            if other_done or first_done:
                break
        if first_done:
            break
    assert schedules > 100  # the schedules really did interleave the two commits


def test_case8_a_job_that_finds_the_other_pending_waits_for_it_while_the_consumer_drains() -> None:
    """Job A's append lands and the consumer writes and dequeues it before A marks its state
    committed; job B, started meanwhile, finds the pending state and nothing in the manifest,
    dequeued past its sequence. B waits for A's outcome instead of appending the same
    locations again (before the fix it appended them: a second append of one write id)."""
    race = Race.start()
    appended = False
    while not appended:  # A up to the answer of its append: landed, not yet marked
        race.turns.run("A", 1)
        appended = race.turns.trace[-1] == "A:put_if_absent manifest served"
    assert race.manifest_locations() == [*race.uploads["A"]]
    consumer = QueueConsumer(race.memory, MANIFEST)
    consumer.initialize()
    consumer.dequeue(consumer.read().manifest.next_sequence - 1)
    assert race.manifest_locations() == []
    race.turns.run("B", 4)  # B reads the state and the manifest
    race.turns.run("A", None)  # A marks its state committed
    race.turns.run("B", None)
    race.join()
    assert not race.errors, race.errors
    assert race.manifest_locations() == [], f"appended again; turns: {race.turns.trace}"
    assert race.receipts["B"].status == "skipped"
    assert race.state().status == COMMITTED
