"""``millpond coordinator`` with a token: nobody without it appends or dequeues through it.

A dequeue names only the consumer's epoch, a small number anyone can guess, and removes entries
whether or not a sink has written them; a coordinator that took requests from whoever reached
its port would let any process on its host (or its network, off loopback) empty the queue. With
``MILLPOND_COORDINATOR_TOKEN`` set the service refuses every request without that token, and
producers and consumers given the same variable send it; off loopback the service does not
start without one. Real child processes on a file store, real HTTP.
"""

from __future__ import annotations

import http.client
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from millpond.common.metrics import Counters
from millpond.common.ulids import UlidMinter
from millpond.consumer import Consumer, ConsumerConfig
from millpond.coordinator.client import CoordinatedDequeue
from millpond.coordinator.connection import FORBIDDEN, send_dequeue
from millpond.coordinator.wire import (
    APPEND_PATH,
    QUEUE_HEADER,
    REQUEST_HEADER,
    TOKEN_ENV,
    TOKEN_HEADER,
    encode_entries,
)
from millpond.formats.manifest import PendingEntry
from millpond.producer import Producer
from millpond.queue import read_manifest
from millpond.queue.claim import queue_identity
from millpond.storage import ObjectStore, open_store
from tests.producer.producer_support import MANIFEST, PREFIX, all_entries, claim_queue, config

DEADLINE = 120.0
SECRET = "s3cr3t-token"


def service_command(url: str, *args: str) -> list[str]:
    """``millpond coordinator`` on a free port (a later ``--port`` in ``args`` wins)."""
    return [
        sys.executable,
        "-m",
        "millpond.cli",
        "coordinator",
        url,
        "--create",
        "--port",
        "0",
        *args,
    ]


def service_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    return {**env, "AWS_METADATA_ENDPOINT": "http://127.0.0.1:9", **extra}


def run_to_exit(url: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The service run with ``args`` until it exits (it is expected not to start)."""
    return subprocess.run(
        service_command(url, *args),
        capture_output=True,
        text=True,
        env=env,
        timeout=DEADLINE,
        check=False,
    )


@pytest.fixture
def queue(tmp_path: Path) -> tuple[ObjectStore, str]:
    url = f"file://{tmp_path / 'store'}"
    store = open_store(url)
    claim_queue(store)
    return store, url


@pytest.fixture
def service(queue: tuple[ObjectStore, str]) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """The service with ``SECRET`` as its token, on 127.0.0.1: ``(its URL, its process)``."""
    _, url = queue
    proc = subprocess.Popen(
        service_command(url),
        stdout=subprocess.PIPE,
        text=True,
        env=service_env(**{TOKEN_ENV: SECRET}),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert " on http://" in line, f"coordinator did not start: {line!r}"
    yield line.rsplit(" on ", 1)[1].strip(), proc
    proc.terminate()
    proc.wait(30)


def _post_append(url: str, queue_id: str, token: str | None) -> int:
    entry = PendingEntry(f"{PREFIX}/{UlidMinter().mint()}.batch", b"")
    headers = {QUEUE_HEADER: queue_id, REQUEST_HEADER: "r1", "Content-Type": "x"}
    if token is not None:
        headers[TOKEN_HEADER] = token
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=DEADLINE)
    try:
        conn.request("POST", APPEND_PATH, encode_entries([entry]), headers)
        return conn.getresponse().status
    finally:
        conn.close()


def test_without_the_token_nothing_is_appended_or_dequeued_and_with_it_all_is(
    queue: tuple[ObjectStore, str],
    service: tuple[str, subprocess.Popen[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, _ = queue
    url, _ = service
    queue_id = queue_identity(store.url, MANIFEST)
    # A producer that has the token appends through the coordinator.
    monkeypatch.setenv(TOKEN_ENV, SECRET)
    with Producer(config(store, tmp_path / "wal-a", coordinator=url)) as producer:
        producer.produce([b"with-token"]).wait(DEADLINE)
        with_token = producer.metrics()
    assert with_token["coordinator_appends"] == 1, with_token
    assert with_token["direct_appends"] == 0, with_token
    # A consumer holds the queue; nobody without the token may dequeue for it, whatever epoch
    # they name (on a coordinator taking anyone's requests, this emptied the queue).
    consumer = Consumer(
        ConsumerConfig(store=store, manifest_path=MANIFEST, gc_enabled=False, ack_batch_size=1)
    )
    consumer.initialize()
    try:
        epoch = consumer.epoch
        assert epoch is not None
        before = read_manifest(store, MANIFEST).manifest
        last = before.entries[-1].sequence
        for token in (None, "a-guess"):
            status, reason = send_dequeue(url, queue_id, epoch, last, timeout=DEADLINE, token=token)
            assert status == FORBIDDEN, (status, reason)
            assert TOKEN_ENV in reason, reason
            assert _post_append(url, queue_id, token) == 403
        after = read_manifest(store, MANIFEST).manifest
        assert [e.location for e in after.entries] == [e.location for e in before.entries]
    finally:
        consumer.close()

    # A producer without the token is refused, says why naming the coordinator, and appends
    # directly.
    monkeypatch.delenv(TOKEN_ENV)
    with (
        caplog.at_level(logging.WARNING),
        Producer(config(store, tmp_path / "wal-b", coordinator=url)) as producer,
    ):
        producer.produce([b"without-token"]).wait(DEADLINE)
        without = producer.metrics()
    assert without["coordinator_appends"] == 0, without
    assert without["direct_appends"] == 1, without
    assert any(
        url in r.getMessage() and "did not take our token" in r.getMessage() for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    assert sorted(all_entries(store)) == [b"with-token", b"without-token"]

    # The queue's own consumer, given the token, dequeues through the coordinator.
    monkeypatch.setenv(TOKEN_ENV, SECRET)
    consumer = Consumer(
        ConsumerConfig(
            store=store, manifest_path=MANIFEST, gc_enabled=False, ack_batch_size=1, coordinator=url
        )
    )
    consumer.initialize()
    try:
        read: list[bytes] = []
        while len(read) < 2:
            batch = consumer.next_batch()
            assert batch is not None  # both entries are in the manifest already
            read.extend(batch.entries)
            consumer.ack(batch.sequence)
        consumer.flush()
        counters = consumer.counters.snapshot()
    finally:
        consumer.close()
    assert sorted(read) == [b"with-token", b"without-token"]
    assert counters["coordinator_dequeues"] >= 1, counters
    assert counters["coordinator_dequeue_fallbacks"] == 0, counters
    assert list(read_manifest(store, MANIFEST).manifest.entries) == []


def test_off_loopback_the_service_does_not_start_without_a_token(
    queue: tuple[ObjectStore, str],
) -> None:
    """Checked before anything is bound: 10.255.255.1 is not an address of this machine, so
    even a service that skipped the check could not listen there."""
    _, url = queue
    result = run_to_exit(url, "--bind", "10.255.255.1", env=service_env())
    assert result.returncode == 2, result.stderr
    assert TOKEN_ENV in result.stderr, result.stderr
    assert "10.255.255.1" in result.stderr, result.stderr


def test_a_token_an_http_header_cannot_carry_is_a_usage_error(
    queue: tuple[ObjectStore, str],
) -> None:
    _, url = queue
    result = run_to_exit(url, env=service_env(**{TOKEN_ENV: "two words"}))
    assert result.returncode == 2, result.stderr
    assert TOKEN_ENV in result.stderr, result.stderr


class _SteppedClock:
    """Monotonic time the test steps by hand (the wall clock and sleep are real)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


def test_a_consumer_whose_token_is_refused_says_so_and_asks_again_a_minute_later(
    queue: tuple[ObjectStore, str],
    service: tuple[str, subprocess.Popen[str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A wrong token is a setting to fix, not a moment to wait out: one warning naming the
    variable, then the consumer dequeues directly for a minute (a refusal for another reason
    is asked again after a few seconds, which with a wrong token warned every 5 s)."""
    store, _ = queue
    url, _ = service
    clock = _SteppedClock()
    counters = Counters()
    dequeue = CoordinatedDequeue(
        url, queue_identity(store.url, MANIFEST), counters, clock, token="wrong"
    )
    with caplog.at_level(logging.WARNING):
        dequeue.make_way()  # the takeover's request: refused
        for step in (10.0, 30.0):  # within the minute: left alone, nothing sent, no warning
            clock.now += step
            assert dequeue.dequeue(1, 0) is False
        clock.now += 21.0  # a minute on: asked again, refused again
        assert dequeue.dequeue(1, 0) is False
    warnings = [r.getMessage() for r in caplog.records if url in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert all(TOKEN_ENV in w for w in warnings), warnings
    assert counters.get("coordinator_dequeue_fallbacks") == 1, counters.snapshot()
