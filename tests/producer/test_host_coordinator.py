"""Producers of one queue on one machine sharing a coordinator one of them hosts
(``ProducerConfig(host_coordinator=True)``), on SeaweedFS behind 50 ms of latency.

Not timing tests: each waits on a condition with a deadline and asserts what landed.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from millpond.common.clock import SystemClock
from millpond.coordinator.hosted import HostCoordinator
from millpond.coordinator.wire import APPEND_PATH, QUEUE_HEADER, REQUEST_HEADER, TOKEN_HEADER
from millpond.errors import ConfigError
from millpond.localstack import S3Endpoint
from millpond.localstack.latency_proxy import start_latency_proxy
from millpond.producer import Producer, ProducerConfig
from millpond.storage import ObjectStore, open_store
from tests.producer.producer_support import (
    MANIFEST,
    PREFIX,
    claim_queue,
    config,
    drain,
    produce_until,
    wait_for,
)
from tests.support import unique_root

DEADLINE = 120.0

_HOST_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    from millpond.producer import Producer, ProducerConfig
    from millpond.common.retry import RetryPolicy

    url, wal_dir = sys.argv[1], sys.argv[2]
    options = json.loads(os.environ["HOST_CHILD_STORE_OPTIONS"])
    retry = RetryPolicy(max_attempts=200, max_elapsed=30, base_delay=0.005, max_delay=0.2,
                        strategy="aging")
    config = ProducerConfig(store=url, store_options=options, wal_dir=wal_dir, retry=retry,
                            flush_interval=0.02, host_coordinator=True)
    with Producer(config) as producer:
        n = 0
        while True:
            record = f"child-{n}".encode()
            producer.produce([record]).wait_staged(60)
            print("staged", record.decode(), flush=True)
            n += 1
            time.sleep(0.02)  # pacing the stream
    """
)


@pytest.fixture
def slow_endpoint(seaweedfs_s3: S3Endpoint) -> Iterator[S3Endpoint]:
    """SeaweedFS behind the latency proxy: rounds take long enough to gather several producers'
    appends, and to be killed in."""
    with start_latency_proxy(seaweedfs_s3, delay=0.05) as proxy:
        yield proxy.endpoint


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The election files of this test only (another test's queue never shares them anyway:
    the file is named for the queue)."""
    path = tmp_path / "run"
    monkeypatch.setenv("MILLPOND_RUN_DIR", str(path))
    return path


def _hosted(run_dir: Path) -> tuple[str, str] | None:
    """The URL and token in the election file (``None`` when it is empty or absent)."""
    files = list(run_dir.glob("coordinator-*.lock"))
    assert len(files) <= 1, files
    text = files[0].read_text().strip() if files else ""
    if not text:
        return None
    url, token = text.split(" ")
    return url, token


def _hosted_url(run_dir: Path) -> str | None:
    hosted = _hosted(run_dir)
    return hosted[0] if hosted else None


def _health(run_dir: Path) -> dict[str, Any]:
    hosted = _hosted(run_dir)
    assert hosted is not None
    url, token = hosted
    request = urllib.request.Request(f"{url}/v1/health", headers={TOKEN_HEADER: token})
    with urllib.request.urlopen(request, timeout=10) as response:
        record: dict[str, Any] = json.loads(response.read())
        return record


def _start_child(
    script: str, endpoint: S3Endpoint, url: str, wal_dir: Path
) -> subprocess.Popen[str]:
    """A producer process running ``script`` on ``url`` (no cloud credential chain)."""
    env = {
        **os.environ,
        "AWS_METADATA_ENDPOINT": "http://127.0.0.1:9",
        "HOST_CHILD_STORE_OPTIONS": json.dumps(endpoint.store_options()),
    }
    return subprocess.Popen(
        [sys.executable, "-c", script, url, str(wal_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _hosting(producer: Producer) -> bool:
    appender = producer._coordinated
    return bool(appender is not None and appender._host.hosting)


def test_producers_on_one_machine_share_one_coordinator_hosted_by_one_of_them(
    slow_endpoint: S3Endpoint, seaweedfs_s3: S3Endpoint, run_dir: Path, tmp_path: Path
) -> None:
    root = unique_root()
    store = open_store(slow_endpoint.url_for(root), options=slow_endpoint.store_options())
    claim_queue(store)
    producers = [
        Producer(config(store, tmp_path / f"wal{i}", host_coordinator=True)) for i in range(3)
    ]
    staged: list[list[bytes]] = [[] for _ in producers]
    stops = [threading.Event() for _ in producers]
    threads = [
        threading.Thread(target=produce_until, args=(p, f"p{i}", stops[i], staged[i]))
        for i, p in enumerate(producers)
    ]
    for thread in threads:
        thread.start()
    try:
        wait_for(
            lambda: all(p.metrics()["coordinator_appends"] >= 3 for p in producers),
            "three appends of every producer through the coordinator",
        )
        hosting = [i for i, p in enumerate(producers) if _hosting(p)]
        assert len(hosting) == 1, "one producer hosts the coordinator"
        hosts = [producers[hosting[0]]]
        url = _hosted_url(run_dir)
        assert url is not None
        # Rounds carry several producers' appends: fewer rounds than appends made through it.
        wait_for(
            lambda: (
                _health(run_dir)["rounds"]
                < sum(p.metrics()["coordinator_appends"] for p in producers)
            ),
            "a round carrying more than one producer's append",
        )
        # The host closes (its job ends): the others go on, and one of them hosts next.
        stops[hosting[0]].set()
        threads[hosting[0]].join(DEADLINE)
        hosts[0].close(timeout=DEADLINE)
        rest = [p for p in producers if p is not hosts[0]]
        wait_for(lambda: any(_hosting(p) for p in rest), "another producer hosting")
        next_url = _hosted_url(run_dir)
        assert next_url is not None
        assert next_url != url
        before = {id(p): p.metrics()["coordinator_appends"] for p in rest}
        wait_for(
            lambda: all(p.metrics()["coordinator_appends"] > before[id(p)] + 2 for p in rest),
            "appends through the next host",
        )
    finally:
        for stop in stops:
            stop.set()
        for thread in threads:
            thread.join(DEADLINE)
        for producer in producers:
            producer.close(timeout=DEADLINE)
    assert _hosted_url(run_dir) is None, "the last host cleared its URL on close"
    counts = drain(open_store(seaweedfs_s3.url_for(root), options=seaweedfs_s3.store_options()))
    wanted = [record for records in staged for record in records]
    assert [r for r, c in counts.items() if c > 1] == []
    assert sorted(counts) == sorted(wanted)


def test_a_killed_host_is_replaced_and_nothing_is_lost_or_doubled(
    slow_endpoint: S3Endpoint, seaweedfs_s3: S3Endpoint, run_dir: Path, tmp_path: Path
) -> None:
    root = unique_root()
    url = slow_endpoint.url_for(root)
    store = open_store(url, options=slow_endpoint.store_options())
    claim_queue(store)
    child_wal = tmp_path / "child-wal"
    child = _start_child(_HOST_CHILD, slow_endpoint, url, child_wal)
    child_staged: list[bytes] = []

    def read_child() -> None:
        assert child.stdout is not None
        for line in child.stdout:  # each line as it comes, seen by the waits meanwhile
            if line.startswith("staged "):
                child_staged.append(line.split(" ", 1)[1].strip().encode())  # noqa: PERF401

    reader = threading.Thread(target=read_child, daemon=True)
    reader.start()
    producers: list[Producer] = []
    stop = threading.Event()
    threads: list[threading.Thread] = []
    staged: list[list[bytes]] = [[], []]
    try:
        # The child appends first, so it is the host.
        wait_for(lambda: len(child_staged) >= 3 and _hosted_url(run_dir), "the child hosting")
        first = _hosted_url(run_dir)
        assert first is not None
        producers = [
            Producer(config(store, tmp_path / f"wal{i}", host_coordinator=True)) for i in range(2)
        ]
        threads = [
            threading.Thread(target=produce_until, args=(p, f"p{i}", stop, staged[i]))
            for i, p in enumerate(producers)
        ]
        for thread in threads:
            thread.start()
        wait_for(
            lambda: all(p.metrics()["coordinator_appends"] >= 3 for p in producers),
            "appends through the child's coordinator",
        )
        assert not any(_hosting(p) for p in producers)
        child.send_signal(signal.SIGKILL)  # mid-round: three producers keep it busy
        child.wait(30)
        wait_for(lambda: any(_hosting(p) for p in producers), "a producer hosting after the kill")
        second = _hosted_url(run_dir)
        assert second is not None
        assert second != first
        before = [p.metrics()["coordinator_appends"] for p in producers]
        wait_for(
            lambda: all(
                p.metrics()["coordinator_appends"] > b + 2
                for p, b in zip(producers, before, strict=True)
            ),
            "appends through the new host",
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(DEADLINE)
        for producer in producers:
            producer.close(timeout=DEADLINE)
        if child.poll() is None:
            child.kill()
            child.wait(30)
    reader.join(30)
    # What the killed host had staged is in its WAL: its next run publishes it.
    with Producer(config(store, child_wal)) as again:
        again.flush(DEADLINE)
    counts = drain(open_store(seaweedfs_s3.url_for(root), options=seaweedfs_s3.store_options()))
    assert [r for r, c in counts.items() if c > 1] == []
    wanted = {record for records in staged for record in records} | set(child_staged)
    missing = wanted - set(counts)
    assert not missing, sorted(missing)[:10]
    # Nothing appears that was never produced (a child record produced after its last
    # "staged" line was written may be there: staged, then killed before saying so).
    strays = {r for r in counts if r not in wanted and not r.startswith(b"child-")}
    assert not strays


def test_host_coordinator_is_an_option_and_not_with_coordinator_urls(tmp_path: Path) -> None:
    parsed = ProducerConfig.from_options(
        {"store": "memory://x", "wal_dir": str(tmp_path), "host_coordinator": "true"}
    )
    assert parsed.host_coordinator is True
    with pytest.raises(ConfigError, match="host_coordinator"):
        ProducerConfig.from_options(
            {"store": "memory://x", "wal_dir": str(tmp_path), "host_coordinator": "sometimes"}
        )
    with pytest.raises(ConfigError, match="found both"):
        ProducerConfig(
            store="memory://x",
            wal_dir=tmp_path,
            coordinator="http://127.0.0.1:1",
            host_coordinator=True,
        )


def test_by_default_producers_share_on_s3_and_append_directly_on_a_file_store(
    slow_endpoint: S3Endpoint, run_dir: Path, tmp_path: Path
) -> None:
    """``host_coordinator`` left at ``None``: producers on an S3 store share this machine's
    coordinator (one of them hosts it); on a file store, where a compare-and-swap costs
    microseconds, each appends itself and nothing is hosted."""
    assert ProducerConfig(store="memory://x", wal_dir=tmp_path).host_coordinator is None
    store = open_store(slow_endpoint.url_for(unique_root()), slow_endpoint.store_options())
    claim_queue(store)
    producers = [Producer(config(store, tmp_path / f"wal{i}")) for i in range(2)]
    try:
        for n in range(3):
            handles = [p.produce([f"p{i}-{n}".encode()]) for i, p in enumerate(producers)]
            for handle in handles:
                handle.wait(DEADLINE)
        assert sorted(_hosting(p) for p in producers) == [False, True]
        assert _hosted_url(run_dir) is not None
        assert all(p.metrics()["coordinator_appends"] >= 1 for p in producers)
    finally:
        for producer in producers:
            producer.close()
    assert drain(store) == {f"p{i}-{n}".encode(): 1 for i in range(2) for n in range(3)}

    files = tmp_path / "files"
    files.mkdir()
    file_store = _file_store(files)
    claim_queue(file_store)
    with Producer(config(file_store, tmp_path / "wal-file")) as producer:
        producer.produce([b"f"]).wait(DEADLINE)
        assert producer._coordinated is None
        assert producer.metrics()["coordinator_appends"] == 0
    assert len(list(run_dir.glob("coordinator-*.lock"))) == 1, "only the S3 queue's election"


def _appends(store: ObjectStore, wal_dir: Path) -> dict[str, Any]:
    with Producer(config(store, wal_dir, host_coordinator=True)) as producer:
        for n in range(3):
            producer.produce([f"r{n}".encode()]).wait(DEADLINE)
        return producer.metrics()


def _direct_appends_warnings(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Three appends of a host-mode producer on a file store, which all go directly; the
    warnings logged meanwhile."""
    store = _file_store(tmp_path)
    claim_queue(store)
    with caplog.at_level("WARNING", logger="millpond"):
        metrics = _appends(store, tmp_path / "wal")
    assert metrics["coordinator_appends"] == 0
    assert metrics["direct_appends"] == 3
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_run_directory_others_can_write_is_not_trusted(
    run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whoever can write the election file decides where appends go, and a coordinator's
    ``appended`` is believed: a directory others can write is refused, and the producer
    appends directly."""
    run_dir.mkdir(mode=0o700)
    run_dir.chmod(0o777)
    warnings = _direct_appends_warnings(tmp_path, caplog)
    assert not list(run_dir.iterdir()), "nothing hosted, no election file"
    assert any(str(run_dir) in warning for warning in warnings), warnings


def test_a_file_system_without_flock_is_named_once_and_appends_go_directly(
    run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ``flock`` is not supported (some NFS mounts answer ``ENOLCK``) nobody can be
    elected. That was taken for a lock held by another producer: every append went directly,
    and nothing said why. No such mount exists here, so ``flock`` fails as it would there."""
    import errno
    import fcntl

    from millpond.coordinator import hosted as _host_coordinator

    class NoLocks:  # the election's fcntl only: the file store beneath locks as usual
        LOCK_EX, LOCK_NB = fcntl.LOCK_EX, fcntl.LOCK_NB

        @staticmethod
        def flock(fd: int, operation: int) -> None:
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(_host_coordinator, "fcntl", NoLocks)
    warnings = _direct_appends_warnings(tmp_path, caplog)
    named = [warning for warning in warnings if "cannot lock" in warning]
    assert len(named) == 1, warnings
    assert str(run_dir) in named[0], named
    assert "appending directly" in named[0], named


def test_a_url_other_than_a_local_coordinators_is_not_followed(
    run_dir: Path, tmp_path: Path
) -> None:
    """The lock held by someone who wrote a URL elsewhere: appends go directly, not there."""
    import fcntl

    store = _file_store(tmp_path)
    claim_queue(store)
    # The file the producer will look for: the same queue identity, the same name.
    with Producer(config(store, tmp_path / "probe", host_coordinator=True)) as probe:
        probe.produce([b"first"]).wait(DEADLINE)
    (lock,) = run_dir.glob("coordinator-*.lock")
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Still this machine (127/8), but not where a host coordinator listens.
        os.write(fd, b"http://127.0.0.2:9 " + b"0" * 32 + b"\n")
        metrics = _appends(store, tmp_path / "wal")
    finally:
        os.close(fd)
    assert metrics["coordinator_appends"] == 0
    assert metrics["coordinator_refused"] == 0, "nothing was even tried there"
    assert metrics["direct_appends"] == 3


def _file_store(tmp_path: Path) -> ObjectStore:
    root = tmp_path / "store"
    root.mkdir()
    return open_store(f"file://{root}")


def test_the_same_bucket_and_root_on_two_servers_are_two_elections(
    seaweedfs_s3: S3Endpoint, moto_s3: S3Endpoint, run_dir: Path, tmp_path: Path
) -> None:
    """Two servers on this machine, each with a bucket of the same name and the same root:
    one queue identity, two queues. Their producers must not share a coordinator, which
    would append one store's batches to the other's manifest."""
    root = unique_root()
    stores = [
        open_store(e.url_for(root), options=e.store_options()) for e in (seaweedfs_s3, moto_s3)
    ]
    assert stores[0].url == stores[1].url, "the same bucket and root on both servers"
    for store in stores:
        claim_queue(store)
    producers = [
        Producer(config(store, tmp_path / f"wal{i}", host_coordinator=True))
        for i, store in enumerate(stores)
    ]
    try:
        for round_ in range(3):
            for i, producer in enumerate(producers):
                producer.produce([f"s{i}-{round_}".encode()]).wait(DEADLINE)
        assert all(_hosting(p) for p in producers), "each queue's producer hosts its own"
        assert len(list(run_dir.glob("coordinator-*.lock"))) == 2
    finally:
        for producer in producers:
            producer.close(timeout=DEADLINE)
    for i, store in enumerate(stores):
        assert sorted(drain(store)) == [f"s{i}-{n}".encode() for n in range(3)]


def test_a_child_forked_by_the_host_does_not_keep_the_coordinator(
    run_dir: Path, tmp_path: Path
) -> None:
    """A lock taken with ``flock`` is held while any copy of its descriptor is open, and a
    fork copies them: a child that outlives its parent (a worker pool, a daemon) would keep
    the coordinator from moving, every other producer appending directly for as long as it
    lives. The child lets go of it when forked."""
    import fcntl

    store = _file_store(tmp_path)
    claim_queue(store)
    producer = Producer(config(store, tmp_path / "wal", host_coordinator=True))
    producer.produce([b"before"]).wait(DEADLINE)
    assert _hosting(producer)
    (lock,) = run_dir.glob("coordinator-*.lock")
    port = int(lock.read_text().split(" ")[0].rsplit(":", 1)[1])
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: lives on, touches nothing
        os.close(write_end)
        os.read(read_end, 1)  # until the parent is done
        os._exit(0)
    os.close(read_end)
    try:
        producer.close(timeout=DEADLINE)
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: still held
        finally:
            os.close(fd)
        # Nor does it keep the old host's port listening, where a producer that read the
        # URL before the host went would connect and wait for an answer nobody gives.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        os.write(write_end, b"x")
        os.close(write_end)
        os.waitpid(pid, 0)


def test_the_hosted_coordinator_answers_only_requests_with_its_token(
    run_dir: Path, tmp_path: Path
) -> None:
    """Anyone on the machine can connect to 127.0.0.1; only a process that can read the
    user's private election file has the token. Without it, nothing is appended and not even
    the health is told."""
    import http.client

    from millpond.common.ulids import UlidMinter, batch_location
    from millpond.coordinator.wire import encode_entries
    from millpond.formats.manifest import Metadata, PendingEntry
    from millpond.queue.claim import queue_identity

    store = _file_store(tmp_path)
    claim_queue(store)
    with Producer(config(store, tmp_path / "wal", host_coordinator=True)) as producer:
        producer.produce([b"mine"]).wait(DEADLINE)
        hosted = _hosted(run_dir)
        assert hosted is not None
        url, _ = hosted
        port = int(url.rsplit(":", 1)[1])
        location = batch_location("ingest", UlidMinter().mint())
        body = encode_entries([PendingEntry(location, (Metadata(0, 0, b""),))])
        headers = {
            QUEUE_HEADER: queue_identity(store.url, "ingest/manifest"),
            REQUEST_HEADER: "intruder-1",
            "Content-Type": "application/octet-stream",
        }
        for sent in ({}, {TOKEN_HEADER: "0" * 32}):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("POST", APPEND_PATH, body, {**headers, **sent})
            assert conn.getresponse().status == 403
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/v1/health", headers=sent)
            assert conn.getresponse().status == 403
            conn.close()
        assert _health(run_dir)["queue"] == queue_identity(store.url, "ingest/manifest")
        producer.produce([b"still mine"]).wait(DEADLINE)
        assert producer.metrics()["coordinator_appends"] >= 2
    assert sorted(drain(store)) == [b"mine", b"still mine"]


_IDLE_HOST_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    from millpond.producer import Producer, ProducerConfig
    url, wal_dir = sys.argv[1], sys.argv[2]
    options = json.loads(os.environ["HOST_CHILD_STORE_OPTIONS"])
    config = ProducerConfig(store=url, store_options=options, wal_dir=wal_dir,
                            flush_interval=0.02, host_coordinator=True)
    with Producer(config) as producer:
        producer.produce([b"host-0"]).wait(60)  # the first to append hosts
        print("hosting", flush=True)
        while True:
            time.sleep(60)  # hosts, and appends nothing more of its own
    """
)


def test_a_client_of_a_killed_host_looks_in_the_manifest_at_once_not_after_its_promise(
    seaweedfs_s3: S3Endpoint, run_dir: Path, tmp_path: Path
) -> None:
    """A request in flight when its host is killed: the reply never comes and the coordinator
    cannot be asked. Its lock, which the kernel let go with the process, proves it starts no
    write any more, so the client looks in the manifest and appends directly at once instead
    of waiting out the coordinator's promise (2 s budget + 3 s grace: 5 s), and its record
    is in the queue once."""
    with start_latency_proxy(seaweedfs_s3, delay=0.05) as proxy:
        endpoint = proxy.endpoint
        root = unique_root()
        url = endpoint.url_for(root)
        store = open_store(url, options=endpoint.store_options())
        claim_queue(store)
        child = _start_child(_IDLE_HOST_CHILD, endpoint, url, tmp_path / "child-wal")
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "hosting"
            client = Producer(config(store, tmp_path / "wal", host_coordinator=True))
            try:
                # Rounds slow enough that the request is surely still out when the host dies.
                proxy.set_delay(0.5)
                before = _health(run_dir)["requests"]  # the host's own append came this way
                handle = client.produce([b"client-0"])
                wait_for(lambda: _health(run_dir)["requests"] > before, "the request at the host")
                child.send_signal(signal.SIGKILL)
                child.wait(30)
                killed = time.monotonic()
                handle.wait(DEADLINE)
                after_kill = time.monotonic() - killed
                metrics = client.metrics()
            finally:
                client.close(timeout=DEADLINE)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(30)
        proxy.set_delay(0.0)
        counts = drain(open_store(seaweedfs_s3.url_for(root), seaweedfs_s3.store_options()))
    assert metrics["coordinator_lost"] == 1, (
        {k: v for k, v in metrics.items() if "coord" in k or "direct" in k},
        after_kill,
    )
    # Looked at once: a read and a write at 0.5 s a request, not the 5 s promise first.
    assert after_kill < 3.0, f"{after_kill:.1f} s from the kill to wait() returning"
    assert counts[b"client-0"] == 1
    assert counts[b"host-0"] == 1


def test_a_host_counts_as_gone_only_once_it_let_go_of_the_lock(
    tmp_path: Path, run_dir: Path
) -> None:
    """``HostCoordinator.gone`` decides that a client stops waiting for a lost reply: never
    while the lock is held (the host alive, however slow), always once it is free or another
    host's URL is in the file."""
    store = open_store(f"file://{tmp_path / 'store'}")
    host = HostCoordinator(store, MANIFEST, data_path_prefix=PREFIX, queue="q", clock=SystemClock())
    at = ("http://127.0.0.1:4242", "ab" * 16)
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    host.path.write_text(f"{at[0]} {at[1]}\n")
    holder = os.open(host.path, os.O_RDWR)  # the host's lock: another open file, as a process
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert not host.gone(at)
        assert not host.gone(at)  # asking does not take the lock from it
    finally:
        os.close(holder)  # the host dies: the kernel lets go
    assert host.gone(at)
    host.path.write_text(f"http://127.0.0.1:4343 {'cd' * 16}\n")  # the next host's URL
    assert host.gone(at)
    host.path.write_text("")  # the next host between emptying the file and writing its URL
    assert host.gone(at)
