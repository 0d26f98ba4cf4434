"""Poison batches in-process: quarantine's refusals, replay exactly once, the service's opt-in.

Every test runs on SQLite and PostgreSQL (the ``database`` fixture) over an in-memory store;
``test_quarantine_cli.py`` drives the commands as processes against SeaweedFS.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from consumer_support import FAST_RETRY, MANIFEST, PREFIX, Database, QueueWriter, numbered

from millpond.consumer import ConsumedBatch, Consumer, ConsumerConfig
from millpond.consumer.app._report import ServiceReporter, ServiceState, read_report
from millpond.consumer.app.quarantine import dead_letter_paths, quarantine, replay
from millpond.consumer.app.service import ConsumerService
from millpond.consumer.sinks import AdbcSink, SetAside, SinkError
from millpond.errors import (
    ConfigError,
    FormatError,
    InvalidInputError,
    MillpondError,
    NotFoundError,
)
from millpond.formats.batch import decode_batch
from millpond.queue import read_manifest
from millpond.queue.claim import queue_identity
from millpond.storage import ObjectStore, open_store

DEAD = f"{PREFIX}-dead-letter"
GARBAGE = b"\x00 this is not a batch object \x00"
NOT_ARROW = [b"\xff\xff\xff\xffnot really an arrow stream"]  # decodes; its rows do not


@pytest.fixture
def store() -> ObjectStore:
    return open_store(f"memory://{uuid.uuid4().hex}")  # memory stores are shared by name


def _config(store: ObjectStore) -> ConsumerConfig:
    return ConsumerConfig(store=store, gc_enabled=False, retry=FAST_RETRY)


def _serve(
    store: ObjectStore, database: Database, *, reporter: bool = False, **options: Any
) -> ConsumerService:
    """One ``millpond consume --exit-when-idle`` run; raises what stopped it."""
    consumer = Consumer(_config(store))
    report = (
        ServiceReporter(
            store,
            data_path_prefix=PREFIX,
            queue=consumer.queue,
            interval=0,
            quarantine_command=lambda n: f"millpond quarantine --sequence {n}",
        )
        if reporter
        else None
    )
    with database.sink() as sink:
        service = ConsumerService(consumer, sink, reporter=report, **options)
        service.run(threading.Event(), until_idle=True)
    return service


def _stopped_on(store: ObjectStore, database: Database) -> MillpondError:
    with pytest.raises(MillpondError) as caught:
        _serve(store, database)
    return caught.value


def _numbers(database: Database) -> list[int]:
    return sorted(n for (n,) in database.query(f'SELECT n FROM "{database.table}"'))


def _quarantine_rows(database: Database) -> list[tuple[Any, ...]]:
    try:
        return database.query(
            f'SELECT sequence, reason, replayed_at_ms FROM "{database.progress}_quarantine" '
            "ORDER BY sequence"
        )
    except Exception:  # no table yet: no sink ever connected
        return []


def _queue_with_poison(store: ObjectStore, *, poison_at: int = 2, batches: int = 5) -> bytes:
    """``batches`` batches of 10 numbered rows; the one at ``poison_at`` is overwritten with
    garbage. Returns its original bytes."""
    writer = QueueWriter(store)
    locations = [writer.append_arrow(numbered(i * 10, 10))[1] for i in range(batches)]
    original = store.get(locations[poison_at]).data
    store.put(locations[poison_at], GARBAGE)
    return original


def test_quarantine_moves_the_consumer_past_and_replay_writes_it_once(
    store: ObjectStore, database: Database
) -> None:
    original = _queue_with_poison(store)
    err = _stopped_on(store, database)
    assert isinstance(err, FormatError)
    assert "sequence 2" in str(err)
    assert _numbers(database) == list(range(20))
    with database.sink() as sink:
        outcome = quarantine(_config(store), sink, sequence=2, reason="garbage bytes")
    assert outcome.state == SetAside.QUARANTINED
    batch_copy, record = dead_letter_paths(DEAD, 2)
    assert outcome.dead_letter == batch_copy
    assert store.get(batch_copy).data == GARBAGE  # copied as it is, byte for byte
    assert store.head(record).size > 0
    assert [(s, r) for s, r, _ in _quarantine_rows(database)] == [(2, "garbage bytes")]

    _serve(store, database)  # resumes after the quarantined sequence
    assert _numbers(database) == [*range(20), *range(30, 50)]
    assert read_manifest(store, MANIFEST).manifest.entries == ()

    # The cause is fixed (the copy repaired); replaying twice writes it once.
    store.put(batch_copy, original)
    with database.sink() as sink:
        first = replay(_config(store), sink, sequence=2)
        again = replay(_config(store), sink, sequence=2)
    assert (first.rows, again.rows) == (10, None)
    assert _numbers(database) == list(range(50))
    assert _quarantine_rows(database)[0][2] is not None
    assert database.query(f'SELECT row_count FROM "{database.progress}" WHERE sequence = 2') == [
        (10,)
    ]


def test_two_replays_at_once_write_once(store: ObjectStore, database: Database) -> None:
    """The sink's mark decides, not the caller's look beforehand: two replays that both saw
    the batch still set aside race on the mark, and one of them writes."""
    original = _queue_with_poison(store, poison_at=0, batches=1)
    _stopped_on(store, database)
    with database.sink() as sink:
        quarantine(_config(store), sink, sequence=0, reason="garbage")
    batch = ConsumedBatch(
        entries=tuple(decode_batch(original, name="original")),
        sequence=0,
        location=read_manifest(store, MANIFEST).manifest.entries[0].location,
        queue=queue_identity(store.url, MANIFEST),
    )
    barrier = threading.Barrier(2)
    results: list[int | None] = []

    def replay_once() -> None:
        with database.sink() as sink:
            sink.last_sequence(batch.queue)  # connected before the race starts
            barrier.wait()
            results.append(sink.replay(batch))

    threads = [threading.Thread(target=replay_once) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(results, key=str) == [10, None]
    assert _numbers(database) == list(range(10))
    with database.sink() as sink:
        assert sink.replay(batch) is None  # and a third, later, writes nothing either


def test_quarantine_refuses_what_the_consumer_is_not_stopped_on(
    store: ObjectStore, database: Database
) -> None:
    _queue_with_poison(store, poison_at=2, batches=6)
    _stopped_on(store, database)
    manifest_before = store.get(MANIFEST).data
    config = _config(store)
    refusals = {
        1: "already recorded",  # written
        3: "expected 2",  # behind the one it is stopped on
        5: "expected 2",
        6: "expected a sequence in the queue",  # never appended
        99: "expected a sequence in the queue",
    }
    with database.sink() as sink:
        for sequence, message in refusals.items():
            with pytest.raises(InvalidInputError, match=message):
                quarantine(config, sink, sequence=sequence, reason="typo")
        with pytest.raises(ConfigError, match="reason"):
            quarantine(config, sink, sequence=2, reason="  ")
        with pytest.raises(ConfigError, match="dead_letter_prefix"):
            quarantine(config, sink, sequence=2, reason="x", dead_letter_prefix=PREFIX)
    # Nothing copied, nothing recorded, the queue untouched.
    assert store.list(DEAD) == []
    assert _quarantine_rows(database) == []
    assert store.get(MANIFEST).data == manifest_before
    assert _numbers(database) == list(range(20))


def test_quarantine_refuses_a_batch_a_running_consumer_would_write(
    store: ObjectStore, database: Database
) -> None:
    writer = QueueWriter(store)
    for i in range(3):
        writer.append_arrow(numbered(i * 10, 10))
    consumer = Consumer(_config(store))
    consumer.initialize()
    reporter = ServiceReporter(store, data_path_prefix=PREFIX, queue=consumer.queue, interval=60)
    reporter.start(consumer.epoch)  # a live service, writing normally
    try:
        with database.sink() as sink:
            with pytest.raises(InvalidInputError, match="is running"):
                quarantine(_config(store), sink, sequence=0, reason="by mistake")
            assert store.list(DEAD) == []
            forced = quarantine(_config(store), sink, sequence=0, reason="known bad", force=True)
        assert forced.state == SetAside.QUARANTINED
        # The running consumer meets the recorded sequence and skips it: never written.
        with database.sink() as sink:
            while (batch := consumer.next_batch()) is not None:
                sink.write(batch)
                consumer.ack(batch.sequence)
        assert _numbers(database) == list(range(10, 30))
    finally:
        reporter.finish(ServiceState.STOPPED)
        consumer.close()


def test_quarantine_is_idempotent_and_a_missing_object_is_never_recorded(
    store: ObjectStore, database: Database
) -> None:
    writer = QueueWriter(store)
    writer.append_arrow(numbered(0, 10))
    _sequence, location = writer.append_arrow(numbered(10, 10))
    store.delete_many([location])
    err = _stopped_on(store, database)
    assert isinstance(err, NotFoundError)
    with database.sink() as sink:
        with pytest.raises(NotFoundError, match="nothing to set aside"):
            quarantine(_config(store), sink, sequence=1, reason="lost")
        assert _quarantine_rows(database) == []
        assert sink.last_sequence(queue_identity(store.url, MANIFEST)) == 0
        store.put(location, GARBAGE)  # now there is something to keep
        first = quarantine(_config(store), sink, sequence=1, reason="corrupt")
        again = quarantine(_config(store), sink, sequence=1, reason="corrupt, retried")
    assert (first.state, again.state) == (SetAside.QUARANTINED, SetAside.ALREADY_QUARANTINED)
    assert [(s, r) for s, r, _ in _quarantine_rows(database)] == [(1, "corrupt")]


@pytest.mark.parametrize("order", ["replay_first", "location_first"])
def test_a_replay_and_the_location_coming_back_write_once(
    store: ObjectStore, database: Database, order: str
) -> None:
    """A producer that recovers appends the quarantined location again: whichever comes
    first, the replay or the consumer meeting it, its rows are written once."""
    writer = QueueWriter(store)
    writer.append_arrow(numbered(0, 10))
    _seq, location = writer.append_arrow(numbered(10, 10))
    original = store.get(location).data
    store.put(location, GARBAGE)
    _stopped_on(store, database)
    with database.sink() as sink:
        quarantine(_config(store), sink, sequence=1, reason="garbage")
    store.put(location, original)  # the producer writes it again under the same name
    store.put(dead_letter_paths(DEAD, 1)[0], original)  # and the operator repairs the copy
    if order == "replay_first":
        with database.sink() as sink:
            assert replay(_config(store), sink, sequence=1).rows == 10
    writer.enqueue(location)  # sequence 2: the same location again
    writer.append_arrow(numbered(20, 10))
    service = _serve(store, database)
    assert (service.stats.batches, service.stats.skipped) == (1, 1)
    with database.sink() as sink:
        rows = replay(_config(store), sink, sequence=1).rows
    assert rows == (None if order == "replay_first" else 10)
    assert _numbers(database) == list(range(30))
    assert database.query(
        f'SELECT sequence, duplicate FROM "{database.progress}" ORDER BY sequence'
    ) == [(0, False), (1, False), (2, True), (3, False)]


def test_a_set_aside_location_appended_again_still_bad_is_a_duplicate_not_a_stop(
    store: ObjectStore, database: Database
) -> None:
    """A producer that recovers after its append was dequeued appends the same location again
    (the whole-system checker found it, seed 142): the object is still the bad one, and the
    consumer, stopping on the default policy, must not stop on it a second time."""
    writer = QueueWriter(store)
    writer.append_arrow(numbered(0, 10))
    _seq, location = writer.append_arrow(numbered(10, 10))
    store.put(location, GARBAGE)
    _stopped_on(store, database)
    with database.sink() as sink:
        quarantine(_config(store), sink, sequence=1, reason="garbage")
    writer.enqueue(location)  # sequence 2: the same location again, the object still bad
    writer.append_arrow(numbered(20, 10))
    service = _serve(store, database)  # the default policy: stop on a bad batch
    assert (service.stats.batches, service.stats.skipped, service.stats.quarantined) == (1, 1, 0)
    assert _numbers(database) == [*range(10), *range(20, 30)]
    assert database.query(
        f'SELECT sequence, duplicate FROM "{database.progress}" ORDER BY sequence'
    ) == [(0, False), (1, False), (2, True), (3, False)]
    assert [(s, r) for s, r, _ in _quarantine_rows(database)] == [(1, "garbage")]


def test_a_written_location_appended_again_after_its_object_was_collected_is_skipped(
    store: ObjectStore, database: Database
) -> None:
    """A location appended again after its first entry was consumed (a Spark commit or a
    producer recovering), whose object the garbage collector removed meanwhile: its rows are
    in the table, so the consumer records the duplicate and goes on, whatever the policy. It
    stopped on the missing object for good before (the whole-system checker, seeds 10064,
    11588 and 11801 of a 2,000-schedule soak)."""
    writer = QueueWriter(store)
    writer.append_arrow(numbered(0, 10))
    _seq, location = writer.append_arrow(numbered(10, 10))
    _serve(store, database)
    store.delete_many([location])  # consumed, then collected
    writer.enqueue(location)  # sequence 2: the same location again
    writer.append_arrow(numbered(20, 10))
    service = _serve(store, database)  # the default policy: stop on a bad batch
    assert (service.stats.batches, service.stats.skipped, service.stats.quarantined) == (1, 1, 0)
    assert _numbers(database) == list(range(30))
    assert database.query(
        f'SELECT sequence, duplicate FROM "{database.progress}" ORDER BY sequence'
    ) == [(0, False), (1, False), (2, True), (3, False)]
    assert _quarantine_rows(database) == []
    # A missing object whose location was never recorded is still a stop, recording nothing.
    _seq, lost = writer.append_arrow(numbered(30, 10))
    store.delete_many([lost])
    with pytest.raises(NotFoundError, match=f"sequence 4: batch object {lost} is missing"):
        _serve(store, database)
    assert _numbers(database) == list(range(30))


def test_replay_refuses_what_is_not_quarantined_and_keeps_a_still_bad_batch_aside(
    store: ObjectStore, database: Database
) -> None:
    original = _queue_with_poison(store, poison_at=1, batches=3)
    _stopped_on(store, database)
    config = _config(store)
    with database.sink() as sink:
        with pytest.raises(NotFoundError, match="no dead-letter record of sequence 0"):
            replay(config, sink, sequence=0)
        quarantine(config, sink, sequence=1, reason="garbage")
        with pytest.raises(FormatError, match="still cannot be decoded"):
            replay(config, sink, sequence=1)  # nothing fixed yet
        assert _quarantine_rows(database)[0][2] is None  # still set aside
        store.put(dead_letter_paths(DEAD, 1)[0], original)
        assert replay(config, sink, sequence=1).rows == 10
    # The sink refuses to replay a sequence it never quarantined, whatever it is handed.
    batch = ConsumedBatch(
        entries=(), sequence=0, location="ingest/x.batch", queue=queue_identity(store.url, MANIFEST)
    )
    with database.sink() as sink, pytest.raises(SinkError, match="is not quarantined"):
        sink.replay(batch)


def test_a_refused_batch_is_replayed_once_the_table_is_fixed(
    store: ObjectStore, database: Database
) -> None:
    """The database refuses a batch for good (a unique index on ``label``); it is set aside,
    the index dropped, and the replay writes it."""
    writer = QueueWriter(store)
    writer.append_arrow(numbered(0, 10))
    _serve(store, database)
    index = f'"{database.table}_label"'
    _commit_ddl(database, f'CREATE UNIQUE INDEX {index} ON "{database.table}" (label)')
    writer.append_arrow(numbered(5, 10))  # labels row-5..row-9 again
    writer.append_arrow(numbered(100, 10))
    err = _stopped_on(store, database)
    assert isinstance(err, SinkError)
    assert not err.transient
    assert "sequence 1" in str(err)
    with database.sink() as sink:
        quarantine(_config(store), sink, sequence=1, reason="duplicate labels")
    _serve(store, database)
    assert _numbers(database) == [*range(10), *range(100, 110)]
    _commit_ddl(database, f"DROP INDEX {index}")
    with database.sink() as sink:
        assert replay(_config(store), sink, sequence=1).rows == 10
    assert len(_numbers(database)) == 30


def _commit_ddl(database: Database, sql: str) -> None:
    """Run DDL that must stay (``Database.query`` rolls PostgreSQL back)."""
    if database.kind == "sqlite":
        database.query(sql)
        return
    import adbc_driver_postgresql.dbapi as pg

    with pg.connect(database.url) as conn, conn.cursor() as cur:
        cur.execute(sql)
        conn.commit()


def test_on_bad_batch_quarantine_sets_each_aside_and_counts_it(
    store: ObjectStore, database: Database
) -> None:
    writer = QueueWriter(store)
    _seq, corrupt = writer.append_arrow(numbered(0, 10))
    store.put(corrupt, GARBAGE)  # cannot be decoded: never delivered
    writer.append_arrow(numbered(10, 10))
    writer.append(NOT_ARROW)  # decodes, but its rows cannot be read: the sink refuses it
    writer.append_arrow(numbered(30, 10))
    service = _serve(store, database, reporter=True, on_bad_batch="quarantine")
    assert (service.stats.batches, service.stats.quarantined) == (2, 2)
    assert _numbers(database) == [*range(10, 20), *range(30, 40)]
    rows = _quarantine_rows(database)
    assert [s for s, _r, _ in rows] == [0, 2]
    # Sequence 0 cannot be decoded (its object's error), sequence 2's rows are refused.
    assert [r.split(":")[:2] for _s, r, _ in rows] == [
        ["--on-bad-batch quarantine", " CorruptBatchError"],
        ["--on-bad-batch quarantine", " FormatError"],
    ]
    assert {o.path for o in store.list(DEAD)} == {
        path for sequence in (0, 2) for path in dead_letter_paths(DEAD, sequence)
    }
    assert read_manifest(store, MANIFEST).manifest.entries == ()
    report = read_report(store, PREFIX)
    assert report is not None
    assert (report.state, report.quarantined, report.rows) == (ServiceState.STOPPED, 2, 20)


def test_on_bad_batch_quarantine_stops_at_the_limit_and_on_a_missing_object(
    store: ObjectStore, database: Database
) -> None:
    writer = QueueWriter(store)
    for _ in range(3):
        writer.append(NOT_ARROW)
    with pytest.raises(MillpondError, match="2 batches in a row were set aside"):
        _serve(store, database, on_bad_batch="quarantine", quarantine_limit=2)
    assert [s for s, _r, _ in _quarantine_rows(database)] == [0, 1]
    # A missing object cannot be set aside: the service stops on it, recording nothing.
    _seq, location = writer.append_arrow(numbered(0, 10))
    store.delete_many([location])
    writer.append_arrow(numbered(10, 10))
    with pytest.raises(NotFoundError, match="nothing to set aside"):
        _serve(store, database, on_bad_batch="quarantine", quarantine_limit=5)
    assert [s for s, _r, _ in _quarantine_rows(database)] == [0, 1, 2]
    assert database.count() == 0


def test_a_stop_on_a_batch_is_reported_with_the_command(
    store: ObjectStore, database: Database
) -> None:
    _queue_with_poison(store, poison_at=1, batches=3)
    with pytest.raises(FormatError):
        _serve(store, database, reporter=True)
    report = read_report(store, PREFIX)
    assert report is not None
    assert report.state == ServiceState.STOPPED_ON_BATCH
    assert report.stopped_on is not None
    assert report.stopped_on.sequence == 1
    assert report.stopped_on.command == "millpond quarantine --sequence 1"
    assert "CorruptBatchError" in report.stopped_on.error
    assert (report.rows, report.last_sequence) == (10, 0)


def test_the_quarantine_table_belongs_to_the_progress_table(database: Database) -> None:
    with database.sink() as sink:
        assert isinstance(sink, AdbcSink)
        assert sink.quarantine_table == f"{database.progress}_quarantine"
        assert sink.quarantined("some queue") == []
