"""``millpond consume`` as a real process: exactly once through SIGKILLs, fencing, bad data."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from consumer_support import MANIFEST, Database, QueueWriter, numbered, open_target

from millpond.formats.manifest import Manifest
from millpond.queue import read_manifest
from millpond.queue.index import queue_view, read_indexed
from millpond.storage.store import ObjectStore
from tests.conftest import SHARED_STORE_KINDS
from tests.invariants import assert_exactly_once
from tests.support import CliProcess

ROWS_PER_BATCH = 500
BATCHES = 100  # 50,000 numbered rows


class Service(CliProcess):
    """A ``millpond consume`` process whose stderr is collected line by line."""

    def __init__(self, target: Any, database: Database, *extra: str) -> None:
        options = [f"--store-option={k}={v}" for k, v in dict(target.options or {}).items()]
        super().__init__(
            *("--log-level", "INFO", "consume", target.url, "--create", *options),
            *database.sink_arguments(),
            *("--poll-interval", "0.1", "--progress-interval", "1", "--no-gc", *extra),
        )

    def wait_started(self) -> None:
        """Until the service holds its epoch (its signal handlers are in place)."""
        _wait_for(lambda: "consuming" in self.stderr, 60, "the service to start")


def _wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def services() -> Iterator[Callable[..., Service]]:
    """Starts services for a test; any still running at the end are killed."""
    started: list[Service] = []

    def start(target: Any, database: Database, *extra: str) -> Service:
        service = Service(target, database, *extra)
        started.append(service)
        return service

    yield start
    for service in started:
        service.kill()


def _check_exactly_once(database: Database, total_rows: int, batches: int) -> None:
    numbers = [n for (n,) in database.query(f'SELECT n FROM "{database.table}"')]
    expected = [b"%d" % n for n in range(total_rows)]
    assert_exactly_once((b"%d" % n for n in numbers), expected, produced=expected)
    # Row order follows sequence order: numbers grow with the batch sequence they came in.
    pairs = database.query(f'SELECT n, _millpond_sequence FROM "{database.table}" ORDER BY n')
    sequences = [sequence for _n, sequence in pairs]
    assert sequences == sorted(sequences)
    assert sequences == [i // ROWS_PER_BATCH for i in range(total_rows)]
    progress = database.query(
        f'SELECT sequence, row_count, duplicate, committed_at_ms FROM "{database.progress}" '
        "ORDER BY sequence"
    )
    assert [row[0] for row in progress] == list(range(batches))
    assert all(not row[2] for row in progress)
    commit_times = [row[3] for row in progress]
    assert commit_times == sorted(commit_times)


# Every store, every database and both queue layouts, and every pair of them, in four runs
# instead of all eight combinations (each run is 12-17 s of SIGKILLs).
_SIGKILL_RUNS = [
    pytest.param(store, database, index, id=f"{store}-{database}-{layout}")
    for store, database, index, layout in [
        (SHARED_STORE_KINDS[0], "sqlite", False, "manifest"),
        (SHARED_STORE_KINDS[0], "postgres", True, "backlog-index"),
        (SHARED_STORE_KINDS[1], "sqlite", True, "backlog-index"),
        (SHARED_STORE_KINDS[1], "postgres", False, "manifest"),
    ]
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shared_store_target", "database", "backlog_index"),
    _SIGKILL_RUNS,
    indirect=["shared_store_target", "database"],
)
def test_exactly_once_through_repeated_sigkills(
    shared_store_target: Any,
    database: Database,
    services: Callable[..., Service],
    backlog_index: bool,
) -> None:
    """50,000 numbered rows; the service is SIGKILLed at random points at least 10 times.

    The producer appends a batch every 0.1 s, so each new life starts with the backlog that
    piled up while the last one was dead and starting; most lives are killed soon after they
    are up, while they drain it: inside a transaction, between a commit and its dequeue, or
    inside a dequeue. One life in four is killed at a random moment of its start-up instead.
    """
    store = open_target(shared_store_target)
    writer = QueueWriter(store)
    rng = random.Random(20240611)
    total = BATCHES * ROWS_PER_BATCH
    produced = threading.Event()

    def produce() -> None:
        for i in range(BATCHES):
            writer.append_arrow(numbered(i * ROWS_PER_BATCH, ROWS_PER_BATCH))
            time.sleep(0.1)
        produced.set()

    options: tuple[str, ...] = ("--ack-batch-size", "3", "--max-group", "2", "--read-ahead", "2")
    if backlog_index:
        # Every life moves what piled up into its index: kills land between every step.
        options += ("--backlog-index", "--backlog-index-threshold", "3")
    else:
        options += ("--no-backlog-index",)  # the default is on
    producer = threading.Thread(target=produce)
    producer.start()
    kills = 0
    cut_short = 0  # lives that wrote rows and were killed with rows still to come
    committed_not_dequeued = 0
    try:
        while kills < 10 or not produced.is_set():
            before = database.count()
            service = services(shared_store_target, database, *options)
            if rng.random() < 0.25:
                time.sleep(rng.uniform(0.0, 0.8))  # somewhere in start-up or the first writes
            else:
                service.wait_started()
                time.sleep(rng.uniform(0.0, 0.25))
            service.proc.send_signal(signal.SIGKILL)
            assert service.wait() == -signal.SIGKILL
            kills += 1
            after = database.count()
            if before < after < total:
                cut_short += 1
            # Killed after a commit but before its dequeue: the next life must skip ahead.
            queued = _queue(store).first_sequence
            recorded = database.last_recorded()
            if queued is not None and recorded is not None and queued <= recorded:
                committed_not_dequeued += 1
    finally:
        producer.join()
    assert kills >= 10
    assert cut_short >= 3
    assert committed_not_dequeued >= 1

    service = services(shared_store_target, database, *options)
    service.wait_started()
    _wait_for(lambda: database.count() >= total, 120, f"{total} rows")
    assert service.stop() == 0, service.stderr
    _check_exactly_once(database, total, BATCHES)
    # The final service flushed its acks on SIGTERM: nothing is left in the queue.
    assert _queue(store).entries == ()
    # Lives did move entries into the index (and only with the option).
    head = read_indexed(store, "ingest")[0]
    assert (head is not None and not head.blank) == backlog_index


def _queue(store: ObjectStore) -> Manifest:
    """The queue as its consumer sees it: the backlog index's entries, then the manifest's."""
    manifest = read_manifest(store, MANIFEST).manifest
    head, indexed = read_indexed(store, "ingest")
    return queue_view(manifest, head, indexed)


@pytest.mark.slow
def test_two_services_the_older_is_fenced(
    shared_store_target: Any, services: Callable[..., Service], postgres_server: Any
) -> None:
    database = Database("postgres", postgres_server.url)
    store = open_target(shared_store_target)
    writer = QueueWriter(store)
    batches = 20
    for i in range(5):
        writer.append_arrow(numbered(i * ROWS_PER_BATCH, ROWS_PER_BATCH))
    old = services(shared_store_target, database)
    _wait_for(lambda: database.count() >= 5 * ROWS_PER_BATCH, 60, "the first service's rows")
    new = services(shared_store_target, database)
    new.wait_started()
    for i in range(5, batches):
        writer.append_arrow(numbered(i * ROWS_PER_BATCH, ROWS_PER_BATCH))
        time.sleep(0.05)
    assert old.wait() == 3, old.stderr
    assert "another consumer took over" in old.stderr
    _wait_for(lambda: database.count() >= batches * ROWS_PER_BATCH, 60, "all rows")
    assert new.stop() == 0, new.stderr
    _check_exactly_once(database, batches * ROWS_PER_BATCH, batches)


def _bad_entry(kind: str, store: ObjectStore, writer: QueueWriter) -> str:
    """Enqueue one bad entry; returns the text the service must name."""
    if kind == "corrupt_batch":
        location = writer.upload([b"x"])
        store.put(location, b"this is not a batch object at all")
        writer.enqueue(location)
        return location
    if kind == "missing_object":
        location = writer.upload([b"x"])
        assert store.delete_many([location]) == []
        writer.enqueue(location)
        return location
    if kind == "outside_prefix":
        location = "elsewhere/01ARZ3NDEKTSV4RRFFQ69G5FAV.batch"
        store.put(location, b"")
        writer.enqueue(location)
        return location
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["corrupt_batch", "missing_object", "outside_prefix"])
def test_bad_entry_stops_the_service_and_nothing_after_it_is_written(
    shared_store_target: Any,
    database: Database,
    services: Callable[..., Service],
    kind: str,
) -> None:
    store = open_target(shared_store_target)
    writer = QueueWriter(store)
    for i in range(3):
        writer.append_arrow(numbered(i * 10, 10))
    named = _bad_entry(kind, store, writer)
    for i in range(4, 6):
        writer.append_arrow(numbered(i * 10, 10))
    service = services(shared_store_target, database)
    assert service.wait() == 1, service.stderr
    assert named in service.stderr
    assert "sequence 3" in service.stderr
    assert database.query(f'SELECT count(*), max(n) FROM "{database.table}"') == [(30, 29)]
    # What was written before the bad entry was acked and dequeued: a fixed entry resumes there.
    assert [e.sequence for e in read_manifest(store, MANIFEST).manifest.entries] == [3, 4, 5]


def test_corrupt_manifest_stops_the_service(
    shared_store_target: Any, database: Database, services: Callable[..., Service]
) -> None:
    store = open_target(shared_store_target)
    writer = QueueWriter(store)
    for i in range(3):
        writer.append_arrow(numbered(i * 10, 10))
    raw = store.get(MANIFEST).data
    store.put(MANIFEST, raw[:40] + b"\xff\xff" + raw[42:])
    service = services(shared_store_target, database)
    assert service.wait() == 1, service.stderr
    assert MANIFEST in service.stderr
    assert database.count() == 0


@pytest.mark.parametrize(
    ("shared_store_target", "database"),
    [(SHARED_STORE_KINDS[0], "postgres"), (SHARED_STORE_KINDS[1], "sqlite")],
    indirect=True,
)
def test_a_manifest_created_again_stops_the_service_naming_the_record(
    shared_store_target: Any, database: Database, services: Callable[..., Service]
) -> None:
    """Before the fix the second run resumed after the sink's sequence 2 in a manifest whose
    sequences had started over: the new batches 0..2 were dequeued unwritten (30 rows lost).
    The first run, replaced under it, said "another consumer took over" and exited 3 (the
    code a supervisor reads as "leave it to the newer one"): there is no newer one."""
    store = open_target(shared_store_target)
    writer = QueueWriter(store)
    for i in range(3):
        writer.append_arrow(numbered(i * 10, 10))
    older_copy = store.get(MANIFEST).data  # epoch 0: no consumer yet
    first = services(shared_store_target, database)
    _wait_for(lambda: database.count() == 30, 60, "30 rows")
    store.put(MANIFEST, older_copy)  # restored under the running service
    assert first.wait() == 1, first.stderr
    assert "the manifest was replaced" in first.stderr
    assert "another consumer took over" not in first.stderr
    assert not store.delete_many([MANIFEST])
    again = QueueWriter(store)
    for i in range(6):
        again.append_arrow(numbered(100 + i * 10, 10))  # sequences 0..5
    second = services(shared_store_target, database, "--exit-when-idle")
    assert second.wait() == 1, second.stderr
    assert "deleted and created again" in second.stderr
    assert "_millpond/epoch" in second.stderr
    assert database.query(f'SELECT count(*), max(n) FROM "{database.table}"') == [(30, 29)]
    assert [e.sequence for e in read_manifest(store, MANIFEST).manifest.entries] == list(range(6))


def test_sigterm_flushes_acks_and_exits_zero(
    shared_store_target: Any, database: Database, services: Callable[..., Service]
) -> None:
    store = open_target(shared_store_target)
    writer = QueueWriter(store)
    for i in range(7):
        writer.append_arrow(numbered(i * 10, 10))
    service = services(shared_store_target, database)  # dequeues only every 100 acks
    _wait_for(lambda: database.count() == 70, 60, "70 rows")
    assert len(read_manifest(store, MANIFEST).manifest.entries) == 7
    assert service.stop() == 0, service.stderr
    assert "stopped" in service.stderr  # progress and the final summary are logged
    assert read_manifest(store, MANIFEST).manifest.entries == ()
    # A restart resumes after the sink's sequence and writes nothing twice.
    writer.append_arrow(numbered(70, 10))
    service = services(shared_store_target, database)
    _wait_for(lambda: database.count() == 80, 60, "80 rows")
    assert service.stop() == 0, service.stderr
    assert database.query(f'SELECT count(DISTINCT n) FROM "{database.table}"') == [(80,)]
