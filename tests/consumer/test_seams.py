"""Exactly once at the seams between the consumer's parts (issue 44, cases 3 to 6).

Each test is named after its case and reproduces what a user or reviewer ran into: a fenced
consumer's index head landing after a takeover (3), a service taking the queue back from its
successor after setting a batch aside (4), a manifest error blamed on a good batch (5), and a
consumer that failed its start checks leaving objects behind (6).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from consumer_support import (
    FAST_RETRY,
    MANIFEST,
    PREFIX,
    Database,
    QueueWriter,
    numbered,
    quiet_consumer,
)

from millpond.consumer import Consumer, ConsumerConfig
from millpond.consumer.app.service import MANIFEST_ATTEMPTS, ConsumerService, ServiceStats
from millpond.consumer.sinks import AdbcSink
from millpond.errors import (
    BadBatchError,
    FencedError,
    FormatError,
    NotFoundError,
    StoreAccessError,
)
from millpond.localstack import S3Endpoint
from millpond.localstack._process import free_ports
from millpond.queue import read_manifest
from millpond.queue.index import head_path, read_indexed
from millpond.storage import ForwardingStore, GetResult, ObjectStore, open_store
from millpond.storage.checks import preflight

GARBAGE = b"\x00 this is not a batch object \x00"
NOT_ARROW = [b"\xff\xff\xff\xffnot really an arrow stream"]  # decodes; its rows do not


class _BeforeWrite(ForwardingStore):
    """Runs ``hook`` once, just before the first conditional write of ``path`` is sent."""

    def __init__(self, inner: ObjectStore, path: str, hook: Callable[[], None]) -> None:
        super().__init__(inner)
        self._path = path
        self._hook: Callable[[], None] | None = hook

    def _maybe_hook(self, path: str) -> None:
        hook, self._hook = (self._hook, None) if path == self._path else (None, self._hook)
        if hook is not None:
            hook()

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        self._maybe_hook(path)
        return self.inner.put_if_absent(path, data)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        self._maybe_hook(path)
        return self.inner.put_if_match(path, data, etag)


@pytest.fixture
def store() -> ObjectStore:
    return open_store(f"memory://seams-{uuid.uuid4().hex}")


# -- case 3 --------------------------------------------------------------------------------


@pytest.mark.parametrize("newer_index", [False, True], ids=["newer-index-off", "newer-index-on"])
def test_case3_a_fenced_consumers_first_index_head_never_lands_after_a_takeover(
    store: ObjectStore, newer_index: bool
) -> None:
    """Consumer A starts its first move into the backlog index (no head yet) and passes its
    epoch check; B takes over right before A's head write is sent. A's write must not land:
    with B's index off nothing would ever rewrite a stale head, GC would treat its entries as
    the queue's oldest, and ``status`` would count them."""
    writer = QueueWriter(store)
    for n in range(6):
        writer.append([f"r{n}".encode()])
    newer = quiet_consumer(store, backlog_index=newer_index, backlog_index_threshold=3)
    taken: list[int] = []

    def take_over() -> None:
        newer.initialize()
        assert newer.epoch is not None
        taken.append(newer.epoch)

    older = quiet_consumer(
        _BeforeWrite(store, head_path(PREFIX), take_over),
        backlog_index=True,
        backlog_index_threshold=3,
    )
    with pytest.raises(FencedError):
        older.initialize()  # its move into the index runs inside initialize()
    assert taken, "the takeover never ran: the older consumer wrote no index head"
    head, _ = read_indexed(store, PREFIX)
    assert head is None or head.epoch >= taken[0], (
        f"a write of the fenced consumer landed after the takeover: the index head carries "
        f"epoch {head.epoch}, the newer consumer holds {taken[0]}"
    )
    delivered = _drain(newer)
    assert [b.entries for b in delivered] == [(f"r{n}".encode(),) for n in range(6)]
    newer.close()
    older.close()


def _drain(consumer: Consumer) -> list[Any]:
    out = []
    while (batch := consumer.next_batch()) is not None:
        out.append(batch)
        consumer.ack(batch.sequence)
    return out


# -- case 4 --------------------------------------------------------------------------------


class _LedgerHook:
    """The service's quarantine ledger (the sink), running ``hook`` once before the first look
    the service takes at it for a batch it cannot read: between the fencing check that let it
    see the batch and the move past it."""

    def __init__(self, sink: AdbcSink, hook: Callable[[], None]) -> None:
        self._sink = sink
        self._hook: Callable[[], None] | None = hook

    def _fire(self) -> None:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook()

    def skip_recorded(self, queue: str, *, sequence: int, location: str) -> int | None:
        self._fire()
        return self._sink.skip_recorded(queue, sequence=sequence, location=location)

    def quarantined(self, queue: str) -> Any:
        self._fire()
        return self._sink.quarantined(queue)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)


def _queue_for_case4(store: ObjectStore, database: Database, kind: str) -> None:
    """Sequence 1 is a batch the service cannot read: a corrupt object (``quarantine``), or
    (``duplicate``) a location written before whose object was collected since."""
    writer = QueueWriter(store)
    if kind == "quarantine":
        writer.append_arrow(numbered(0, 10))
        _seq, corrupt = writer.append_arrow(numbered(10, 10))
        store.put(corrupt, GARBAGE)
    else:
        _seq, location = writer.append_arrow(numbered(10, 10))
        _serve(store, database)  # written and dequeued
        store.delete_many([location])  # then collected
        writer.append_arrow(numbered(0, 10))
        writer.enqueue(location)  # the same location again: the sink skips it
    writer.append_arrow(numbered(20, 10))


def _serve(store: ObjectStore, database: Database, **options: Any) -> ServiceStats:
    consumer = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=FAST_RETRY))
    with database.sink() as sink:
        service = ConsumerService(consumer, sink, retry_initial_delay=0.01, **options)
        return service.run(threading.Event(), until_idle=True)


@pytest.mark.parametrize("kind", ["quarantine", "duplicate"])
def test_case4_an_older_service_never_takes_the_queue_back_after_moving_past_a_batch(
    store: ObjectStore, database: Database, kind: str
) -> None:
    """A service moving past a batch it could not read (set aside by ``--on-bad-batch
    quarantine``, or a duplicate of a location whose object is gone under the default policy)
    called ``initialize()`` again, bumping the epoch over a newer consumer that had taken
    over meanwhile (a rolling restart), and went on consuming."""
    _queue_for_case4(store, database, kind)
    newer = quiet_consumer(store)
    older = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=FAST_RETRY))
    with database.sink() as sink:
        service = ConsumerService(
            older,
            sink,
            retry_initial_delay=0.01,
            on_bad_batch="quarantine" if kind == "quarantine" else "stop",
            ledger=_LedgerHook(sink, newer.initialize),  # type: ignore[arg-type]
        )
        with pytest.raises(FencedError):
            service.run(threading.Event(), until_idle=True)
    assert newer.epoch is not None
    assert read_manifest(store, MANIFEST).manifest.epoch == newer.epoch
    with contextlib.suppress(BadBatchError):  # not FencedError: it still holds the queue
        newer.next_batch()  # the batch it cannot read, or the one after it
    newer.close()


def test_case4_a_consumer_that_lost_the_queue_never_bumps_the_epoch_again(
    store: ObjectStore,
) -> None:
    writer = QueueWriter(store)
    writer.append([b"r0"])
    older = quiet_consumer(store)
    older.initialize()
    newer = quiet_consumer(store)
    newer.initialize()
    with pytest.raises(FencedError):
        older.initialize()  # it has not even noticed yet: the manifest tells it
    with pytest.raises(FencedError):
        older.initialize()  # and once it knows, without a request
    assert read_manifest(store, MANIFEST).manifest.epoch == newer.epoch
    batch = newer.next_batch()
    assert batch is not None
    newer.ack(batch.sequence)
    newer.close()
    older.close()


# -- case 5 --------------------------------------------------------------------------------


class _ManifestAnswers(ForwardingStore):
    """The fencing checks' reads of the manifest answer 404 or garbage ``times`` times, after
    the first ``after`` of them."""

    def __init__(self, inner: ObjectStore, answer: str, times: int, *, after: int = 0) -> None:
        super().__init__(inner)
        self._answer = answer
        self._after = after
        self.left = times

    def get_tail(self, path: str, length: int, etag: str | None = None) -> GetResult | None:
        if path == MANIFEST and self._after > 0:
            self._after -= 1
        elif path == MANIFEST and self.left > 0:
            self.left -= 1
            if self._answer == "404":
                raise NotFoundError(f"{path}: not found (injected)")
            return GetResult(b"\xff" * length, "garbage-etag")
        return self.inner.get_tail(path, length, etag)


def _queue_of_three(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    for i in range(3):
        writer.append_arrow(numbered(i * 10, 10))


@pytest.mark.parametrize("policy", ["stop", "quarantine"])
@pytest.mark.parametrize("answer", ["404", "garbage"])
def test_case5_a_manifest_error_for_a_moment_sets_no_good_batch_aside(
    store: ObjectStore, database: Database, answer: str, policy: str
) -> None:
    """One transient 404 (or a read that does not decode) of the manifest at the fencing
    check was taken for the next batch's fault: set aside, or a stop telling the operator to
    quarantine a good batch."""
    _queue_of_three(store)
    flaky = _ManifestAnswers(store, answer, times=2)
    stats = _serve(flaky, database, on_bad_batch=policy)
    assert flaky.left == 0, "the fencing check never met the injected answer"
    assert (stats.batches, stats.quarantined, stats.skipped) == (3, 0, 0)
    assert sorted(n for (n,) in database.query(f'SELECT n FROM "{database.table}"')) == list(
        range(30)
    )
    assert read_manifest(store, MANIFEST).manifest.entries == ()
    with database.sink() as sink:
        assert sink.quarantined(queue=quiet_consumer(store).queue) == []


@pytest.mark.parametrize("answer", ["404", "garbage"])
def test_case5_a_manifest_error_at_an_ack_is_retried_not_a_stop(
    store: ObjectStore, database: Database, answer: str
) -> None:
    """The same for the fencing check of an ack (found by the whole-system checker): the
    service writing a refused group one by one went down on the first."""
    writer = QueueWriter(store)
    writer.append_arrow(numbered(0, 10))
    writer.append(NOT_ARROW)  # the group is refused: written one by one, each acked alone
    writer.append_arrow(numbered(20, 10))
    flaky = _ManifestAnswers(store, answer, times=2, after=1)  # the acks' checks
    stats = _serve(flaky, database, on_bad_batch="quarantine")
    assert flaky.left == 0, "no ack met the injected answer"
    assert (stats.batches, stats.quarantined) == (2, 1)
    assert read_manifest(store, MANIFEST).manifest.entries == ()
    with database.sink() as sink:
        assert [row.sequence for row in sink.quarantined(queue=quiet_consumer(store).queue)] == [1]


@pytest.mark.parametrize("answer", ["404", "garbage"])
def test_case5_a_manifest_that_stays_unreadable_stops_the_service_naming_it(
    store: ObjectStore, database: Database, answer: str
) -> None:
    _queue_of_three(store)
    flaky = _ManifestAnswers(store, answer, times=1000)
    expected = NotFoundError if answer == "404" else FormatError
    with pytest.raises(expected) as caught:
        _serve(flaky, database, on_bad_batch="quarantine")
    assert not isinstance(caught.value, BadBatchError)
    message = str(caught.value)
    assert f"the queue manifest {store.url}/{MANIFEST} could not be read" in message
    assert f"{MANIFEST_ATTEMPTS} times in a row" in message
    with database.sink() as sink:
        assert sink.quarantined(queue=quiet_consumer(store).queue) == []


# -- case 6 --------------------------------------------------------------------------------


def test_case6_a_consumer_that_fails_its_start_checks_leaves_nothing_behind(
    seaweedfs_s3: S3Endpoint, tmp_path: Path
) -> None:
    """``millpond consume s3://another-missing/q --create`` failed naming the missing bucket
    after writing its report (``q/ingest/_millpond/consumer.json``) there, which SeaweedFS
    took as the bucket's creation: a later write to the mistyped URL succeeded silently."""
    bucket = f"another-missing-{uuid.uuid4().hex[:12]}"
    sink = tmp_path / "sink.db"
    env = {
        **os.environ,
        **seaweedfs_s3.env(),
        "AWS_METADATA_ENDPOINT": f"http://127.0.0.1:{free_ports(1)[0]}",
    }
    done = subprocess.run(
        [
            *(sys.executable, "-m", "millpond.cli", "consume", f"s3://{bucket}/q", "--create"),
            *("--sink", f"sqlite://{sink}", "--exit-when-idle", "--report-interval", "0"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode != 0, done.stderr
    assert f"bucket '{bucket}' does not exist" in done.stderr, done.stderr
    # The bucket is still missing: the same start check still fails, as does a producer's.
    store = open_store(f"s3://{bucket}/q", seaweedfs_s3.store_options())
    with pytest.raises(StoreAccessError, match="does not exist"):
        preflight(store, write=True)
    # And the sink records no owner, no progress: nothing names the wrong queue.
    if sink.exists():
        with contextlib.closing(sqlite3.connect(sink)) as conn:
            tables = [
                name
                for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            ]
            rows = {t: conn.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}
        assert not any(rows.values()), f"the failed start wrote into the sink: {rows}"
