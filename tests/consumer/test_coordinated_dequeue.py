"""A consumer's dequeues sent through ``millpond coordinator`` (``ConsumerConfig.coordinator``).

Real servers: SeaweedFS for S3, the coordinator's HTTP server on 127.0.0.1, real producers and
consumers. What must hold: the dequeues land without racing the coordinator's rounds (it sees
no other writer after the consumer's takeover), a fenced consumer's dequeue is never written
even when the coordinator's cached manifest still carries the old epoch, and a coordinator
that does not answer, or serves another queue, leaves the consumer dequeuing directly.
"""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from millpond.common.ulids import UlidMinter, batch_location
from millpond.consumer import Consumer, ConsumerConfig
from millpond.coordinator.connection import send_dequeue
from millpond.coordinator.rounds import AppendCoordinator
from millpond.coordinator.server import CoordinatorServer
from millpond.coordinator.wire import DEQUEUED, FENCED
from millpond.errors import FencedError
from millpond.formats.batch import encode_batch
from millpond.formats.manifest import Metadata, PendingEntry
from millpond.localstack import S3Endpoint
from millpond.producer import Producer
from millpond.queue import read_manifest
from millpond.queue.claim import queue_identity
from millpond.storage import ObjectStore, open_store
from tests.core._helpers import SlowStore
from tests.producer.producer_support import MANIFEST, PREFIX, claim_queue, config
from tests.support import unique_root

DEADLINE = 60.0
SLOT = 0.03  # seconds a manifest request takes in the takeover test


@pytest.fixture
def queue_store(seaweedfs_s3: S3Endpoint) -> ObjectStore:
    store = open_store(seaweedfs_s3.url_for(unique_root()), options=seaweedfs_s3.store_options())
    claim_queue(store)
    return store


def _serve(store: ObjectStore, manifest: str = MANIFEST) -> CoordinatorServer:
    coordinator = AppendCoordinator(
        store, manifest, data_path_prefix=PREFIX, queue=queue_identity(store.url, manifest)
    )
    return CoordinatorServer(coordinator).start()


def _queue_url(endpoint: S3Endpoint, store: ObjectStore) -> str:
    return endpoint.url_for(store.url.rstrip("/").rsplit("/", 1)[-1])


def _consumer(store: ObjectStore, coordinator: str | None, **kw: object) -> Consumer:
    return Consumer(
        ConsumerConfig(
            store=store,
            manifest_path=MANIFEST,
            gc_enabled=False,
            coordinator=coordinator,
            **kw,  # type: ignore[arg-type]
        )
    )


def _sequences(store: ObjectStore) -> list[int]:
    return [e.sequence for e in read_manifest(store, MANIFEST).manifest.entries]


def test_a_consumers_dequeues_go_through_the_coordinator_and_never_race_its_rounds(
    queue_store: ObjectStore, tmp_path: Path
) -> None:
    server = _serve(queue_store)
    stats = server.coordinator.stats
    try:
        with Producer(config(queue_store, tmp_path / "wal", coordinator=server.url)) as producer:
            producer.produce([b"before the consumer"]).wait(DEADLINE)
            consumer = _consumer(queue_store, server.url, ack_batch_size=2)
            consumer.initialize()  # the one write the coordinator does not make
            for i in range(7):
                producer.produce([f"e{i}".encode()]).wait(DEADLINE)
                batch = consumer.next_batch()
                assert batch is not None
                consumer.ack(batch.sequence)
            assert consumer.next_batch() is not None  # the eighth, left unacked
            consumer.close()
            producer.produce([b"after"]).wait(DEADLINE)
            assert producer.metrics()["direct_appends"] == 0
        counters = consumer.counters
        # Acked 0..6 two at a time: dequeues through 1, 3 and 5, then close() through 6.
        assert counters.get("coordinator_dequeues") == 4, counters.snapshot()
        assert counters.get("coordinator_dequeue_fallbacks") == 0
        assert counters.get("manifest_writes") == 1  # initialize() alone
        assert stats()["dequeues"] == 4, stats()
        # The consumer's initialize() cost the coordinator one lost race; the dequeues none.
        assert stats()["cas_conflicts"] == 1, stats()
    finally:
        server.close()
    assert _sequences(queue_store) == [7, 8]


def test_a_fenced_consumers_dequeue_is_not_written_though_the_coordinator_cached_its_epoch(
    queue_store: ObjectStore, tmp_path: Path
) -> None:
    server = _serve(queue_store)
    queue = queue_identity(queue_store.url, MANIFEST)
    try:
        older = _consumer(queue_store, server.url)
        older.initialize()
        with Producer(config(queue_store, tmp_path / "wal", coordinator=server.url)) as producer:
            for i in range(3):
                producer.produce([f"e{i}".encode()]).wait(DEADLINE)
        delivered = [older.next_batch(), older.next_batch()]
        assert [b.sequence for b in delivered if b is not None] == [0, 1]
        # The coordinator last wrote the manifest at the older consumer's epoch; the newer
        # consumer's takeover changes it behind the coordinator's back.
        newer = _consumer(queue_store, server.url)
        newer.initialize()
        # flush(ack_through) takes the dequeue as its fencing check: "fenced" from the
        # coordinator, then the consumer's own read, which raises.
        with pytest.raises(FencedError):
            older.flush(ack_through=1)
        assert older.acked_sequence is None
        assert older.counters.get("coordinator_dequeue_fallbacks") == 1
        old_epoch, new_epoch = older.epoch, newer.epoch
        assert old_epoch is not None
        assert new_epoch is not None
        status, reason = send_dequeue(server.url, queue, old_epoch, 1, timeout=DEADLINE)
        assert status == FENCED, reason
        assert f"the consumer holds {old_epoch}" in reason
        assert _sequences(queue_store) == [0, 1, 2]
        assert read_manifest(queue_store, MANIFEST).manifest.epoch == new_epoch
        status, reason = send_dequeue(server.url, queue, new_epoch, 1, timeout=DEADLINE)
        assert status == DEQUEUED, reason
        assert _sequences(queue_store) == [2]
        older.close()
        newer.close()
    finally:
        server.close()


@pytest.mark.parametrize("where", ["nothing listening", "another queue's coordinator"])
def test_a_consumer_dequeues_directly_when_the_coordinator_does_not_dequeue(
    queue_store: ObjectStore, tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """Gone after the takeover: the first dequeue finds nobody, later ones do not try. Serving
    another queue: the takeover's request for a pause is refused, and no dequeue tries."""
    other = where == "another queue's coordinator"
    server = _serve(queue_store, manifest="other/manifest" if other else MANIFEST)
    url = server.url
    try:
        with Producer(config(queue_store, tmp_path / "wal")) as producer:
            for i in range(3):
                producer.produce([f"e{i}".encode()]).wait(DEADLINE)
        consumer = _consumer(queue_store, url, ack_batch_size=1)
        with caplog.at_level(logging.WARNING, logger="millpond"):
            consumer.initialize()
            ways = server.coordinator.stats()["ways_made"]
            server.close()
            for _ in range(2):
                batch = consumer.next_batch()
                assert batch is not None
                consumer.ack(batch.sequence)
        consumer.close()
    finally:
        server.close()
    counters = consumer.counters
    assert ways == (0 if other else 1)
    # Tried once at most; then left alone, every dequeue made directly.
    assert counters.get("coordinator_dequeue_fallbacks") == (0 if other else 1), counters.snapshot()
    assert counters.get("coordinator_dequeues") == 0
    assert counters.get("dequeues") == 2
    assert _sequences(queue_store) == [2]
    warned = [r.getMessage() for r in caplog.records if url in r.getMessage()]
    assert len(warned) == 1, warned
    assert "dequeuing directly" in warned[0]
    assert ("made no way for the takeover" if other else "did not dequeue through 0") in warned[0]


def test_millpond_consume_with_coordinator_dequeues_through_it(
    seaweedfs_s3: S3Endpoint, queue_store: ObjectStore, tmp_path: Path
) -> None:
    server = _serve(queue_store)
    try:
        with Producer(config(queue_store, tmp_path / "wal", coordinator=server.url)) as producer:
            for i in range(5):
                producer.produce([f"e{i}".encode()]).wait(DEADLINE)
        options = [f"--store-option={k}={v}" for k, v in seaweedfs_s3.store_options().items()]
        result = subprocess.run(
            [
                sys.executable, "-m", "millpond.cli", "consume",
                _queue_url(seaweedfs_s3, queue_store), *options,
                "--sink", f"sqlite:///{tmp_path / 'db.sqlite'}", "--entry-format", "opaque",
                "--coordinator", server.url, "--exit-when-idle", "--no-gc", "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert server.coordinator.stats()["dequeues"] >= 1, server.coordinator.stats()
    finally:
        server.close()
    assert _sequences(queue_store) == []
    with sqlite3.connect(tmp_path / "db.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM millpond_rows").fetchone() == (5,)


def _keep_busy(
    coordinator: AppendCoordinator, store: ObjectStore, stop: threading.Event, errors: list[str]
) -> None:
    """One batch after another appended through the coordinator, as producers keep its rounds
    going."""
    minter = UlidMinter()
    while not stop.is_set():
        entry = PendingEntry(batch_location(PREFIX, minter.mint()), (Metadata(0, 0, b""),))
        store.put(entry.location, encode_batch([b"busy"]))
        ticket = coordinator.submit(uuid.uuid4().hex, [entry], budget=DEADLINE)
        if not ticket.done.wait(DEADLINE) or ticket.outcome is None:
            errors.append("an append got no answer")
            return
        if ticket.outcome.status != "appended":
            errors.append(str(ticket.outcome))
            return


def test_a_consumers_takeover_lands_in_the_pause_it_asks_the_coordinator_for() -> None:
    """The whole takeover: ``initialize()`` asks for the pause, then reads the manifest and
    bumps the epoch inside it, while the coordinator's rounds run back to back. Asking after
    its first read of the manifest left the bump writing over a manifest the rounds had
    changed since: a lost race, then a read and a write that no longer fit in the pause."""
    inner = open_store(f"memory://make-way-{uuid.uuid4().hex}")
    store = SlowStore(inner, SLOT)
    claim_queue(store)
    coordinator = AppendCoordinator(
        store,
        MANIFEST,
        data_path_prefix=PREFIX,
        queue=queue_identity(store.url, MANIFEST),
        yield_slots=4.0,  # generous, so a loaded test machine still fits a read and a write in
    )
    coordinator.slot = SLOT
    server = CoordinatorServer(coordinator).start()
    stop, errors = threading.Event(), []
    writers = [
        threading.Thread(target=_keep_busy, args=(coordinator, inner, stop, errors), daemon=True)
        for _ in range(3)
    ]
    try:
        for writer in writers:
            writer.start()
        # A batch in the queue first: on a loaded machine the consumer could otherwise look
        # before the first round landed and find nothing (CI with three workers did).
        end = time.monotonic() + DEADLINE
        while coordinator.stats()["rounds"] < 1:
            assert time.monotonic() < end, "no round landed"
            time.sleep(SLOT)
        older = _consumer(store, server.url)
        older.initialize()
        batch = older.next_batch()
        assert batch is not None
        older.flush(ack_through=batch.sequence)  # through the coordinator: it knows a consumer
        assert coordinator.stats()["dequeues"] == 1
        rounds = coordinator.stats()["rounds"]
        while coordinator.stats()["rounds"] < rounds + 5:  # back to back
            time.sleep(SLOT)
        newer = _consumer(store, server.url)
        newer.initialize()
        assert newer.epoch == (older.epoch or 0) + 1
        assert newer.counters.get("cas_conflicts") == 0, newer.counters.snapshot()
        assert coordinator.stats()["ways_made"] == 2  # one per takeover
        older.close()
        newer.close()
    finally:
        stop.set()
        for writer in writers:
            writer.join(DEADLINE)
        server.close()
    assert errors == []
