"""The append coordinator on SeaweedFS: one CAS per round for many producers, and never a single
point of failure (producers append directly when it is down, killed or refusing).

Not timing tests: each test waits on a condition with a deadline and asserts what landed (the
manifest, a consumer's reads), never how fast.
"""

from __future__ import annotations

import http.client
import http.server
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import pytest

from millpond.common.ulids import UlidMinter
from millpond.consumer import Consumer, ConsumerConfig
from millpond.coordinator.connection import CoordinatorOptions
from millpond.coordinator.rounds import AppendCoordinator
from millpond.coordinator.server import CoordinatorServer
from millpond.coordinator.wire import APPEND_PATH, QUEUE_HEADER, REQUEST_HEADER, encode_entries
from millpond.errors import ConfigError, FencedError, NotFoundError
from millpond.formats.manifest import PendingEntry
from millpond.localstack import S3Endpoint
from millpond.localstack.latency_proxy import start_latency_proxy
from millpond.producer import Producer
from millpond.queue import read_manifest
from millpond.queue.claim import queue_identity
from millpond.storage import ForwardingStore, ObjectStore, open_store
from tests.producer.producer_support import (
    MANIFEST,
    PREFIX,
    all_entries,
    claim_queue,
    config,
    drain,
    produce_until,
    wait_for,
)
from tests.support import ClockOff, ManualClock, unique_root

DEADLINE = 120.0


def _store(endpoint: S3Endpoint, root: str | None = None) -> ObjectStore:
    return open_store(endpoint.url_for(root or unique_root()), options=endpoint.store_options())


def _locations(store: ObjectStore) -> list[str]:
    return [entry.location for entry in read_manifest(store, MANIFEST).manifest.entries]


class _Gate(ForwardingStore):
    """Holds the coordinator's manifest writes until ``open`` is set."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.open = threading.Event()
        self.waiting = threading.Event()

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        if path == MANIFEST:
            self.waiting.set()
            self.open.wait(DEADLINE)
        return self.inner.put_if_match(path, data, etag)

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        if path == MANIFEST:
            self.waiting.set()
            self.open.wait(DEADLINE)
        return self.inner.put_if_absent(path, data)


@pytest.fixture
def queue_store(seaweedfs_s3: S3Endpoint) -> ObjectStore:
    store = _store(seaweedfs_s3)
    claim_queue(store)
    return store


def _serve(store: ObjectStore, **kw: Any) -> CoordinatorServer:
    coordinator = AppendCoordinator(
        store, MANIFEST, data_path_prefix=PREFIX, queue=queue_identity(store.url, MANIFEST), **kw
    )
    return CoordinatorServer(coordinator).start()


def test_one_round_appends_every_waiting_producer_in_one_cas(
    queue_store: ObjectStore, tmp_path: Path
) -> None:
    gate = _Gate(queue_store)
    server = _serve(gate)
    producers = [
        Producer(config(queue_store, tmp_path / f"wal{i}", coordinator=server.url))
        for i in range(6)
    ]
    try:
        first = producers[0].produce([b"p0-0"])
        wait_for(gate.waiting.is_set, "the first round's write")
        # The first round is stuck in its write; the other five producers' appends queue up.
        handles = [p.produce([f"p{i}-0".encode()]) for i, p in enumerate(producers) if i]
        wait_for(lambda: server.coordinator.stats()["waiting_entries"] == 5, "five waiting entries")
        gate.open.set()
        for handle in [first, *handles]:
            handle.wait(DEADLINE)
        stats = server.coordinator.stats()
        assert stats["rounds"] == 2, stats
        assert stats["manifest_writes"] == 2, stats  # five producers' batches in one CAS
        assert stats["entries_appended"] == 6, stats
        for producer in producers:
            metrics = producer.metrics()
            assert metrics["coordinator_appends"] == 1, metrics
            assert metrics["manifest_writes"] == 0, metrics  # nothing written directly
    finally:
        gate.open.set()
        for producer in producers:
            producer.close(timeout=DEADLINE)
        server.close()
    locations = _locations(queue_store)
    assert len(locations) == len(set(locations)) == 6
    assert sorted(all_entries(queue_store)) == sorted(f"p{i}-0".encode() for i in range(6))


def test_a_producer_appends_directly_when_no_coordinator_answers(
    queue_store: ObjectStore, tmp_path: Path
) -> None:
    server = _serve(queue_store)
    url = server.url
    server.close()  # nothing listens on its port any more
    with Producer(config(queue_store, tmp_path / "wal", coordinator=url)) as producer:
        for n in range(5):
            producer.produce([b"r%d" % n]).wait(DEADLINE)
        metrics = producer.metrics()
    assert metrics["coordinator_appends"] == 0, metrics
    assert metrics["direct_appends"] >= 1, metrics
    assert sorted(all_entries(queue_store)) == [b"r%d" % n for n in range(5)]


def test_a_burst_of_producers_connecting_at_once_all_get_in(queue_store: ObjectStore) -> None:
    """Many producers (a Spark job's tasks, a fleet restarting) connect in the same moment,
    while the coordinator is busy and accepts none yet: every connection is made within the
    producers' connect timeout. A short listen backlog would drop the rest's handshakes; each
    retries only after a second, by when its producer has called the coordinator unreachable
    and appends directly for a while, contending with the rounds."""
    coordinator = AppendCoordinator(
        queue_store,
        MANIFEST,
        data_path_prefix=PREFIX,
        queue=queue_identity(queue_store.url, MANIFEST),
    )
    server = CoordinatorServer(coordinator)  # listening, not accepting yet
    timeout = CoordinatorOptions().connect_timeout
    clients = 64
    connections: list[http.client.HTTPConnection] = []
    failures: list[str] = []
    lock = threading.Lock()

    def connect() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
        try:
            conn.connect()
        except OSError as err:
            with lock:
                failures.append(repr(err))
            return
        with lock:
            connections.append(conn)

    threads = [threading.Thread(target=connect) for _ in range(clients)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DEADLINE)
        assert not failures, f"{len(failures)} of {clients} connections failed: {failures[:2]}"
        server.start()
        for conn in connections:  # each is served once accepted
            conn.sock.settimeout(DEADLINE)
            conn.request("GET", "/v1/health")
            response = conn.getresponse()
            assert response.status == 200, response.read()
            assert json.loads(response.read())["alive"] is True
    finally:
        for conn in connections:
            conn.close()
        server.close()


class _NotACoordinator(http.server.BaseHTTPRequestHandler):
    """Another service on the port a producer was given: it answers, but not as a coordinator."""

    protocol_version = "HTTP/1.1"
    requests: ClassVar[list[str]] = []

    def _answer(self) -> None:
        type(self).requests.append(f"{self.command} {self.path}")
        length = int(self.headers.get("Content-Length", "0") or 0)
        if length:
            self.rfile.read(length)
        body = b"<html>not here</html>"
        self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: Any) -> None:
        del format, args


def test_a_server_closed_before_it_served_closes_at_once(queue_store: ObjectStore) -> None:
    """A server made and closed without ever serving (its owner failed in between, or only
    wanted its port): ``close`` does not wait for a serving loop that never ran, which took
    the whole 30 s timeout; ``close_listener`` likewise (5 s)."""
    for close in ("close", "close_listener"):
        server = CoordinatorServer(
            AppendCoordinator(
                queue_store, MANIFEST, queue=queue_identity(queue_store.url, MANIFEST)
            )
        )
        closer = threading.Thread(target=getattr(server, close), daemon=True)
        closer.start()
        closer.join(3.0)  # closing a socket takes milliseconds; the loops waited 5 and 30 s
        assert not closer.is_alive(), f"{close}() still waiting after 3 s"
        with pytest.raises(OSError):  # the port is closed: nothing listens any more
            socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE).close()


def test_a_url_where_no_coordinator_answers_takes_no_append(
    queue_store: ObjectStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A producer given the port of something else (a typo, another service) asks who answers
    before it sends an append, appends directly and says so. It never sends the entries there:
    an append given to a server that answers but not as a coordinator gets no usable reply,
    and the producer would hold it for the coordinator's whole promise (5 s) before looking in
    the manifest, again every time it tried the URL."""
    _NotACoordinator.requests = []
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotACoordinator)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{other.server_address[1]}"
    try:
        with (
            caplog.at_level(logging.WARNING, logger="millpond.coordinator.client"),
            Producer(config(queue_store, tmp_path / "wal", coordinator=url)) as producer,
        ):
            for n in range(5):
                producer.produce([b"r%d" % n]).wait(DEADLINE)
            metrics = producer.metrics()
    finally:
        other.shutdown()
        other.server_close()
    assert _NotACoordinator.requests == ["GET /v1/health"], _NotACoordinator.requests
    assert metrics["coordinator_lost"] == 0, metrics
    assert metrics["coordinator_appends"] == 0, metrics
    assert metrics["direct_appends"] == 5, metrics
    assert metrics["coordinator_refused"] == 1, metrics
    assert any(
        url in r.getMessage() and "is not a millpond coordinator" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    assert sorted(all_entries(queue_store)) == [b"r%d" % n for n in range(5)]


def test_a_refusing_coordinator_sends_the_producer_to_append_directly(
    queue_store: ObjectStore, seaweedfs_s3: S3Endpoint, tmp_path: Path
) -> None:
    """A coordinator serving another queue refuses; the producer appends itself, once."""
    other = _store(seaweedfs_s3)
    claim_queue(other)
    server = _serve(other)
    try:
        with Producer(config(queue_store, tmp_path / "wal", coordinator=server.url)) as producer:
            producer.produce([b"x"]).wait(DEADLINE)
            metrics = producer.metrics()
    finally:
        server.close()
    assert metrics["coordinator_refused"] == 1, metrics
    assert metrics["direct_appends"] == 1, metrics
    assert all_entries(queue_store) == [b"x"]
    assert server.coordinator.stats()["manifest_writes"] == 0


def test_a_late_request_is_not_appended_again_after_its_producer_appended_it(
    queue_store: ObjectStore,
) -> None:
    """A request that reaches the coordinator after its producer gave up waiting and appended
    the entries itself: the round finds them in the manifest and does not write them twice."""
    from millpond.formats.manifest import Metadata, PendingEntry
    from millpond.queue import QueueProducer

    direct = QueueProducer(queue_store, MANIFEST)
    lower = 0
    entries = [
        PendingEntry(f"{PREFIX}/01J0000000000000000000000{i}.batch", (Metadata(0, 0, b""),))
        for i in range(2)
    ]
    landed = direct.append(entries)  # the producer's own append, after it stopped waiting
    coordinator = AppendCoordinator(queue_store, MANIFEST, data_path_prefix=PREFIX)
    coordinator.start()
    try:
        # The coordinator has never read the manifest: its round reads it and must look.
        ticket = coordinator.submit("late", list(entries), lower=lower)
        assert ticket.done.wait(DEADLINE)
    finally:
        coordinator.stop(DEADLINE)
    assert ticket.outcome is not None
    assert ticket.outcome.sequences == landed, ticket.outcome
    assert _locations(queue_store) == [e.location for e in entries]


def test_a_producer_restarted_before_its_old_round_landed_is_not_appended_twice(
    queue_store: ObjectStore,
) -> None:
    """A producer dies with a request in a round, restarts, finds the manifest without it (the
    round had not landed yet) and sends the same locations again: the coordinator, whose next
    round writes on its cached ETag without reading, answers with the sequences it gave them."""
    from millpond.formats.manifest import Metadata, PendingEntry

    entries = [
        PendingEntry(f"{PREFIX}/01J0000000000000000000001{i}.batch", (Metadata(0, 0, b""),))
        for i in range(3)
    ]
    coordinator = AppendCoordinator(queue_store, MANIFEST, data_path_prefix=PREFIX)
    coordinator.start()
    try:
        first = coordinator.submit("before-the-crash", entries[:2])
        assert first.done.wait(DEADLINE)
        again = coordinator.submit("after-the-restart", entries)  # and one batch more
        assert again.done.wait(DEADLINE)
    finally:
        coordinator.stop(DEADLINE)
    assert first.outcome is not None
    assert again.outcome is not None
    assert again.outcome.status == "appended", again.outcome
    assert again.outcome.sequences[:2] == first.outcome.sequences, again.outcome
    assert _locations(queue_store) == [e.location for e in entries]


def test_two_waiting_requests_for_one_batch_take_two_rounds_and_append_it_once(
    queue_store: ObjectStore,
) -> None:
    """Both requests wait before any round (the restarted producer's came in before the old
    one's round began): they never share a round, whose one append could not hold both."""
    from millpond.formats.manifest import Metadata, PendingEntry

    entry = PendingEntry(f"{PREFIX}/01J00000000000000000000020.batch", (Metadata(0, 0, b""),))
    other = PendingEntry(f"{PREFIX}/01J00000000000000000000021.batch", (Metadata(0, 0, b""),))
    coordinator = AppendCoordinator(queue_store, MANIFEST, data_path_prefix=PREFIX)
    old = coordinator.submit("old", [entry])
    new = coordinator.submit("new", [entry, other])
    coordinator.start()
    try:
        assert old.done.wait(DEADLINE)
        assert new.done.wait(DEADLINE)
    finally:
        coordinator.stop(DEADLINE)
    assert old.outcome is not None
    assert new.outcome is not None
    assert (old.outcome.status, new.outcome.status) == ("appended", "appended"), new.outcome
    assert new.outcome.sequences[0] == old.outcome.sequences[0]
    assert _locations(queue_store) == [entry.location, other.location]


def test_a_request_arriving_after_its_writers_deadline_is_refused_and_appended_directly(
    queue_store: ObjectStore, tmp_path: Path
) -> None:
    """A request held up on its way (here: the coordinator's clock a minute on from the one
    the request was sent by) past the deadline its producer gave it: the producer's batches
    may have been collected meanwhile, so the coordinator writes nothing of it and refuses;
    the producer appends directly (its own deadline check decides), once."""
    from millpond.common.clock import SystemClock
    from millpond.coordinator.client import CoordinatedAppender
    from millpond.formats.manifest import Metadata, PendingEntry
    from millpond.queue import QueueProducer

    server = _serve(queue_store, clock=ClockOff(60.0))
    entry = PendingEntry(f"{PREFIX}/01J00000000000000000000030.batch", (Metadata(0, 0, b""),))
    clock = SystemClock()
    appender = CoordinatedAppender(
        QueueProducer(queue_store, MANIFEST),
        [server.url],
        queue=queue_identity(queue_store.url, MANIFEST),
        clock=clock,
    )
    try:
        sequences = appender.append([entry], deadline=clock.monotonic() + 30.0)
        stats = server.coordinator.stats()
        counters = appender.counters.snapshot()
    finally:
        appender.close()
        server.close()
    assert stats["manifest_writes"] == 0, stats
    assert stats["late_requests"] == 1, stats
    assert counters["coordinator_refused"] == 1, counters
    assert counters["direct_appends"] == 1, counters
    assert _locations(queue_store) == [entry.location]
    assert sequences == (0,)


def test_a_writers_deadline_shortens_the_coordinators_budget(queue_store: ObjectStore) -> None:
    """A request whose writer has less time left than the coordinator's budget gets only that
    long: no write containing it is sent after the writer's deadline."""
    from millpond.formats.manifest import Metadata, PendingEntry

    clock = ManualClock()
    coordinator = AppendCoordinator(queue_store, MANIFEST, data_path_prefix=PREFIX, clock=clock)
    entry = PendingEntry(f"{PREFIX}/01J00000000000000000000031.batch", (Metadata(0, 0, b""),))
    ticket = coordinator.submit("short", [entry], 2.0, not_after_ms=clock.now_ms() + 500)
    assert ticket.deadline - clock.monotonic() <= 0.5
    plenty = coordinator.submit("plenty", [entry], 2.0, not_after_ms=clock.now_ms() + 60_000)
    assert plenty.deadline - clock.monotonic() > 1.5  # the budget, not the writer's minute
    assert ticket.outcome is None  # both wait for a round
    assert plenty.outcome is None


class _CoordinatorProcess:
    """``millpond coordinator`` as a child process."""

    def __init__(self, endpoint: S3Endpoint, url: str, port: int = 0) -> None:
        command = [sys.executable, "-m", "millpond.cli", "coordinator", url, "--create"]
        command += ["--port", str(port)]
        for key, value in endpoint.store_options().items():
            command += ["--store-option", f"{key}={value}"]
        env = {**os.environ, "AWS_METADATA_ENDPOINT": "http://127.0.0.1:9"}
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert " on http://" in line, f"coordinator did not start: {line!r}"
        self.url = line.rsplit(" on ", 1)[1].strip()

    def health(self) -> dict[str, Any]:
        import json
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/v1/health", timeout=10) as response:
            record: dict[str, Any] = json.loads(response.read())
            return record

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


def test_a_coordinator_restarted_on_its_port_keeps_its_producers(
    seaweedfs_s3: S3Endpoint, tmp_path: Path
) -> None:
    """A coordinator restarted (an upgrade, a supervisor bringing it back) closes its
    producers' keep-alive connections, as its idle timeout (2 minutes) does for a producer that
    produces less often. The next append goes out on the dead connection and is lost: the
    producer asks, hears it never arrived (that request id is refused for good), and sends it
    again on a fresh connection, rather than appending directly and leaving the coordinator
    alone for a while."""
    root = unique_root()
    store = _store(seaweedfs_s3, root)
    claim_queue(store)
    url = seaweedfs_s3.url_for(root)
    first = _CoordinatorProcess(seaweedfs_s3, url)
    port = urlsplit(first.url).port
    assert port is not None
    second: _CoordinatorProcess | None = None
    try:
        with Producer(config(store, tmp_path / "wal", coordinator=first.url)) as producer:
            producer.produce([b"before"]).wait(DEADLINE)
            first.stop()
            second = _CoordinatorProcess(seaweedfs_s3, url, port=port)
            producer.produce([b"after"]).wait(DEADLINE)
            metrics = producer.metrics()
    finally:
        first.proc.kill()
        first.proc.wait(30)
        if second is not None:
            second.stop()
    assert metrics["coordinator_appends"] == 2, metrics
    assert metrics["direct_appends"] == 0, metrics
    assert metrics["coordinator_refused"] == 0, metrics
    assert sorted(all_entries(store)) == [b"after", b"before"]


@pytest.fixture
def slow_endpoint(seaweedfs_s3: S3Endpoint) -> Iterator[S3Endpoint]:
    """SeaweedFS behind the latency proxy: a round's CAS takes long enough to be killed in."""
    with start_latency_proxy(seaweedfs_s3, delay=0.05) as proxy:
        yield proxy.endpoint


def test_sigkill_of_the_coordinator_mid_round_loses_and_doubles_nothing(
    slow_endpoint: S3Endpoint, seaweedfs_s3: S3Endpoint, tmp_path: Path
) -> None:
    root = unique_root()
    store = _store(slow_endpoint, root)
    claim_queue(store)
    child = _CoordinatorProcess(slow_endpoint, slow_endpoint.url_for(root))
    producers = [
        Producer(config(store, tmp_path / f"wal{i}", coordinator=child.url)) for i in range(4)
    ]
    staged: list[list[bytes]] = [[] for _ in producers]
    stop = threading.Event()
    threads = [
        threading.Thread(target=produce_until, args=(p, f"p{i}", stop, staged[i]))
        for i, p in enumerate(producers)
    ]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: child.health()["rounds"] >= 5, "five coordinator rounds")
        child.kill()  # with four producers appending, a round is always under way
        killed_at = sum(p.metrics()["coordinator_appends"] for p in producers)
        wait_for(
            lambda: sum(p.metrics()["direct_appends"] for p in producers) >= 4,
            "direct appends after the kill",
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(DEADLINE)
        for producer in producers:
            producer.flush(DEADLINE)
        metrics = [p.metrics() for p in producers]
        for producer in producers:
            producer.close(timeout=DEADLINE)
        if child.proc.poll() is None:
            child.kill()
    assert killed_at > 0
    # Some producer was waiting on the killed coordinator: its reply never came, and it looked
    # in the manifest before appending itself.
    assert sum(m["coordinator_lost"] + m["coordinator_unknown"] for m in metrics) >= 1, metrics
    counts = drain(_store(seaweedfs_s3, root))  # the same queue without the proxy
    wanted = [record for records in staged for record in records]
    assert [r for r, c in counts.items() if c > 1] == []
    assert sorted(counts) == sorted(wanted)


def _next(consumer: Consumer) -> Any:
    end = time.monotonic() + DEADLINE
    while (batch := consumer.next_batch()) is None:
        assert time.monotonic() < end, "timed out waiting for a batch"
        time.sleep(0.01)
    return batch


def test_a_consumer_takes_over_and_dequeues_while_the_coordinator_appends(
    slow_endpoint: S3Endpoint, seaweedfs_s3: S3Endpoint, tmp_path: Path
) -> None:
    """At 50 ms a request a coordinator appending back to back on its cached ETag would win
    every race against a consumer's read-then-write (measured: an epoch bump gave up after 100
    conflicts without the pauses); it leaves the manifest alone now and then, and the takeover
    and dequeues get in."""
    root = unique_root()
    store = _store(slow_endpoint, root)
    claim_queue(store)
    server = _serve(store)
    producers = [
        Producer(config(store, tmp_path / f"wal{i}", coordinator=server.url)) for i in range(4)
    ]
    staged: list[list[bytes]] = [[] for _ in producers]
    stop = threading.Event()
    threads = [
        threading.Thread(target=produce_until, args=(p, f"p{i}", stop, staged[i]))
        for i, p in enumerate(producers)
    ]
    read: list[bytes] = []
    epochs: list[int] = []
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: server.coordinator.stats()["yields"] >= 1, "back-to-back rounds")
        older = Consumer(
            ConsumerConfig(store=store, manifest_path=MANIFEST, gc_enabled=False, ack_batch_size=2)
        )
        older.initialize()
        for _ in range(6):  # consume and dequeue while the coordinator keeps appending
            batch = _next(older)
            read.extend(batch.entries)
            older.ack(batch.sequence)
        older.flush()
        newer = Consumer(ConsumerConfig(store=store, manifest_path=MANIFEST, gc_enabled=False))
        newer.initialize(last_acked_sequence=older.acked_sequence)
        assert newer.epoch is not None
        assert older.epoch is not None
        epochs = [older.epoch, newer.epoch]
        rounds = server.coordinator.stats()["rounds"]
        wait_for(lambda: server.coordinator.stats()["rounds"] >= rounds + 5, "five more rounds")
        with pytest.raises(FencedError):
            older.next_batch()
        older.close()
        # The coordinator's rounds after the takeover carried the newer epoch forward.
        assert read_manifest(store, MANIFEST).manifest.epoch == newer.epoch
    finally:
        stop.set()
        for thread in threads:
            thread.join(DEADLINE)
        for producer in producers:
            producer.close(timeout=DEADLINE)
        server.close()
    newer.close()
    assert epochs[1] > epochs[0]
    wanted = [record for records in staged for record in records]
    # What the older consumer dequeued, and what the manifest still holds (read without the
    # proxy): every staged record once.
    assert Counter(read + all_entries(_store(seaweedfs_s3, root))) == Counter(wanted)
    stats = server.coordinator.stats()
    assert stats["manifest_writes"] >= 15, stats
    assert stats["yields"] >= 2, stats  # it paused while the consumers bumped and dequeued


class _HoldSecondUpload(ForwardingStore):
    """Holds the upload of the batch holding the entry ``b"second"`` until ``release`` is set.

    Told apart by content, not by order: two uploaders may start the two batches' uploads in
    either order (CI once held the first batch's, and the test waited on it).
    """

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.release = threading.Event()
        self.held = threading.Event()

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        if path.endswith(".batch") and b"second" in data:
            self.held.set()
            self.release.wait(DEADLINE)
        return self.inner.put_if_absent(path, data)


def test_a_coordinated_producer_does_not_hold_an_uploaded_batch_for_uploads_in_flight(
    queue_store: ObjectStore, tmp_path: Path
) -> None:
    # Appending directly, an uploaded batch waits up to flush_interval for the uploads behind
    # it, to share their compare-and-swap; through a coordinator that saves no store request
    # (the coordinator groups many producers' batches), so it is appended at once.
    server = _serve(queue_store)
    store = _HoldSecondUpload(queue_store)
    options = {"coordinator": server.url, "flush_size_bytes": 1, "flush_interval": 60.0}
    producer = Producer(config(store, tmp_path / "wal", **options))
    try:
        first = producer.produce([b"first"])
        first.wait_staged(DEADLINE)
        second = producer.produce([b"second"])
        wait_for(store.held.is_set, "the second upload to be under way")
        first.wait(DEADLINE / 4)  # well inside the 60 s a direct producer would wait
        assert len(_locations(queue_store)) == 1
        assert not second.done()
        store.release.set()
        second.wait(DEADLINE)
        assert producer.metrics()["coordinator_appends"] == 2
    finally:
        store.release.set()
        producer.close(timeout=DEADLINE)
        server.close()
    assert all_entries(queue_store) == [b"first", b"second"]


@pytest.mark.parametrize(
    ("headers", "names"),
    [
        ({"Content-Length": "many"}, "Content-Length"),
        ({"Content-Length": "-1"}, "Content-Length"),
        ({"Content-Length": "\u00b2"}, "Content-Length"),  # a digit to isdigit(), not to int()
        ({"X-Millpond-Budget": "nan"}, "X-Millpond-Budget"),
    ],
    ids=["length-not-a-number", "length-negative", "length-superscript", "budget-nan"],
)
def test_a_malformed_append_is_refused_with_400_and_nothing_is_appended(
    queue_store: ObjectStore, headers: dict[str, str], names: str
) -> None:
    """A request no client of ours sends (another program, a proxy mangling headers) gets a
    400 naming the header, and the coordinator serves on. A budget that is not a number was
    taken as a deadline that never comes (every comparison with NaN is false): the entries
    were appended with no promise left about when; a negative Content-Length read the
    connection to its end."""
    server = _serve(queue_store)
    location = f"{PREFIX}/{UlidMinter().mint()}.batch"
    body = encode_entries([PendingEntry(location=location)])
    request_headers = {
        "Content-Length": str(len(body)),
        QUEUE_HEADER: server.coordinator.queue,
        REQUEST_HEADER: "r-1",
        **headers,
    }
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE)
    try:
        conn.putrequest("POST", APPEND_PATH)
        for key, value in request_headers.items():
            conn.putheader(key, value)
        conn.endheaders(body)
        response = conn.getresponse()
        answer = json.loads(response.read())
        assert response.status == 400, answer
        assert answer["status"] == "refused"
        assert names in answer["reason"]
        health = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE)
        health.request("GET", "/v1/health")
        assert health.getresponse().status == 200
        health.close()
        try:
            appended = _locations(queue_store)
        except NotFoundError:  # no manifest: nothing was ever appended
            appended = []
        assert location not in appended
    finally:
        conn.close()
        server.close()


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("yield_every", 0),
        ("yield_slots", float("nan")),
        ("yield_slots", -1.0),
        ("quiet_yield_interval", float("inf")),
        ("busy_seconds", float("nan")),
        ("consumer_yield_interval", -0.5),
    ],
)
def test_a_pacing_value_that_is_not_a_finite_number_is_refused_at_once(
    queue_store: ObjectStore, setting: str, value: float
) -> None:
    """Taken as given, these stopped the rounds at their first pause (``sleep(nan)`` raises)
    or made the coordinator pause forever; refused when the coordinator is made, naming the
    setting."""
    with pytest.raises(ConfigError, match=setting):
        AppendCoordinator(queue_store, MANIFEST, queue="q", **{setting: value})
