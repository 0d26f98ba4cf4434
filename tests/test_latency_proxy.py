"""The latency proxy in front of a real SeaweedFS: delays, signs through, cuts off, counts.

Timings are checked as lower bounds only (a request through a proxy that holds it back
``delay`` seconds cannot take less); nothing here asserts how fast anything is.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from botocore.exceptions import ClientError

from millpond.errors import ConflictError, StorageError
from millpond.formats.manifest import Metadata, PendingEntry
from millpond.localstack import LocalServiceError, S3Endpoint, listening_addresses
from millpond.localstack.latency_proxy import DelayModel, LatencyProxy, start_latency_proxy
from millpond.localstack.s3 import s3_client
from millpond.queue import QueueProducer, read_manifest
from millpond.storage import ObjectStore, open_store

LOOPBACK = "127.0.0.1"
DELAY = 0.05


@pytest.fixture
def proxy(seaweedfs_s3: S3Endpoint) -> Iterator[LatencyProxy]:
    """A proxy holding each request back 50 ms in front of the session SeaweedFS."""
    with start_latency_proxy(seaweedfs_s3, delay=DELAY) as running:
        yield running


def _store(endpoint: S3Endpoint) -> tuple[ObjectStore, str]:
    root = f"t-{uuid.uuid4().hex}"
    return open_store(endpoint.url_for(root), endpoint.store_options()), root


def _wait_until(condition: object, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.005)


# --- forwarding --------------------------------------------------------------------------------


def test_proxy_binds_loopback_and_forwards_signed_requests(
    proxy: LatencyProxy, seaweedfs_s3: S3Endpoint
) -> None:
    assert (LOOPBACK, proxy.port) in listening_addresses(os.getpid())
    assert proxy.endpoint.endpoint == f"http://{LOOPBACK}:{proxy.port}"
    assert proxy.endpoint.bucket == seaweedfs_s3.bucket
    store, root = _store(proxy.endpoint)
    store.put_if_absent("object", b"through the proxy")
    assert store.get("object").data == b"through the proxy"
    # The object is really on the server, read without the proxy.
    direct = s3_client(seaweedfs_s3).get_object(Bucket=seaweedfs_s3.bucket, Key=f"{root}/object")
    assert direct["Body"].read() == b"through the proxy"
    stats = proxy.stats()
    assert stats.by_method == {"PUT": 1, "GET": 1}
    assert stats.requests == 2
    assert stats.refused == stats.reset == 0


def test_server_still_checks_signatures_through_the_proxy(proxy: LatencyProxy) -> None:
    # SeaweedFS verifies the signature over the Host header the client signed (the proxy's):
    # right keys pass (the test above), a wrong secret is still refused.
    wrong = S3Endpoint(
        endpoint=proxy.url,
        bucket=proxy.endpoint.bucket,
        access_key_id=proxy.endpoint.access_key_id,
        secret_access_key="not-the-secret",
    )
    with pytest.raises(ClientError) as caught:
        s3_client(wrong).put_object(Bucket=wrong.bucket, Key=f"t-{uuid.uuid4().hex}", Body=b"x")
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


def test_each_request_takes_at_least_the_delay(proxy: LatencyProxy) -> None:
    store, _ = _store(proxy.endpoint)
    store.put_if_absent("object", b"x")
    proxy.reset_stats()
    for _ in range(5):
        started = time.perf_counter()
        store.get("object")
        assert time.perf_counter() - started >= DELAY
    stats = proxy.stats()
    assert stats.requests == 5
    assert stats.delay_seconds == pytest.approx(5 * DELAY)


def test_keep_alive_connections_are_reused(proxy: LatencyProxy) -> None:
    store, _ = _store(proxy.endpoint)
    store.put_if_absent("object", b"x")
    for _ in range(10):
        store.get("object")
    stats = proxy.stats()
    assert stats.requests == 11
    assert stats.connections <= 2  # one pooled connection serves request after request


def test_concurrent_requests_are_held_back_together(seaweedfs_s3: S3Endpoint) -> None:
    with start_latency_proxy(seaweedfs_s3, delay=0.3) as slow:
        store, _ = _store(slow.endpoint)
        store.put_if_absent("object", b"x")
        clients = 8
        barrier = threading.Barrier(clients)
        errors: list[BaseException] = []

        def read() -> None:
            barrier.wait()
            try:
                store.get("object")
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=read) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        stats = slow.stats()
    assert stats.requests == clients + 1
    assert stats.peak_held > 1, "requests were held back one after another"


# --- compare-and-swap through the proxy -------------------------------------------------------


def test_conditional_puts_still_conflict(proxy: LatencyProxy) -> None:
    store, _ = _store(proxy.endpoint)
    first = store.put_if_absent("manifest", b"v1")
    assert first is not None
    with pytest.raises(ConflictError):
        store.put_if_absent("manifest", b"again")
    second = store.put_if_match("manifest", b"v2", first)
    with pytest.raises(ConflictError):
        store.put_if_match("manifest", b"lost", first)
    assert second is not None
    store.put_if_match("manifest", b"v3", second)
    assert store.get("manifest").data == b"v3"


def test_racing_appends_through_the_proxy_keep_every_entry_once(proxy: LatencyProxy) -> None:
    store, _ = _store(proxy.endpoint)
    writers, appends = 3, 4
    errors: list[BaseException] = []

    def write(name: str) -> None:
        producer = QueueProducer(store, "ingest/manifest")
        try:
            for i in range(appends):
                producer.append([PendingEntry(f"ingest/{name}-{i}", (Metadata(0, 1, b""),))])
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=write, args=(f"w{n}",)) for n in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    manifest = read_manifest(store, "ingest/manifest").manifest
    locations = [entry.location for entry in manifest.entries]
    assert sorted(locations) == sorted(
        f"ingest/w{n}-{i}" for n in range(writers) for i in range(appends)
    )
    assert [entry.sequence for entry in manifest.entries] == list(range(writers * appends))


# --- the off switch ---------------------------------------------------------------------------


def test_cut_makes_the_store_unreachable_and_restore_brings_it_back(proxy: LatencyProxy) -> None:
    store, _ = _store(proxy.endpoint)
    store.put_if_absent("object", b"kept")
    proxy.cut()
    try:
        assert not proxy.reachable
        with pytest.raises(StorageError):
            store.get("object")
        with pytest.raises(StorageError):
            store.put_if_absent("other", b"x")
        assert proxy.stats().refused >= 1
    finally:
        proxy.restore()
    assert proxy.reachable
    # The same client (its pool held connections the cut reset) works again.
    assert store.get("object").data == b"kept"
    with proxy.unreachable(), pytest.raises(StorageError):
        store.get("object")
    assert store.get("object").data == b"kept"


def test_cut_drops_a_request_being_held_back(seaweedfs_s3: S3Endpoint) -> None:
    with start_latency_proxy(seaweedfs_s3, delay=0.5) as slow:
        store, _ = _store(slow.endpoint)
        store.put_if_absent("object", b"x")
        slow.reset_stats()
        failures: list[BaseException] = []

        def read() -> None:
            try:
                store.get("object")
            except BaseException as err:
                failures.append(err)

        reader = threading.Thread(target=read)
        reader.start()
        _wait_until(lambda: slow.stats().requests >= 1, "the GET reached the proxy")
        slow.cut()
        reader.join()
        assert slow.stats().reset >= 1
        assert len(failures) == 1
        assert isinstance(failures[0], StorageError)
        slow.restore()
        assert store.get("object").data == b"x"


# --- HTTP framing against a plain server ------------------------------------------------------


class _EchoLength(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_PUT(self) -> None:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            body = b""
            while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                body += self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b""):
                pass
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        reply = f"{self.path} {len(body)} {body[:8].decode()}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *_args: object) -> None:
        pass


def test_chunked_and_pipelined_requests_keep_their_framing() -> None:
    server = ThreadingHTTPServer((LOOPBACK, 0), _EchoLength)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        upstream = f"http://{LOOPBACK}:{server.server_address[1]}"
        with start_latency_proxy(upstream, delay=0.01) as proxy:
            chunked = (
                b"PUT /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nTrailer: t\r\n\r\n"
            )
            plain = b"PUT /b HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nbody"
            with socket.create_connection((LOOPBACK, proxy.port), timeout=10) as conn:
                conn.sendall(chunked + plain)  # pipelined: both before any answer
                received = b""
                while received.count(b"HTTP/1.1 200") < 2 or not received.endswith(b"body"):
                    data = conn.recv(65536)
                    assert data, f"connection closed early after {received!r}"
                    received += data
            stats = proxy.stats()
    finally:
        server.shutdown()
        server.server_close()
    assert b"/a 11 hello wo" in received
    assert b"/b 4 body" in received
    assert stats.requests == 2
    assert stats.by_method == {"PUT": 2}


# --- configuration ----------------------------------------------------------------------------


def test_delay_model_is_seeded_and_bounded() -> None:
    first = [DelayModel(0.05, 0.02, seed=7).next() for _ in range(1)]
    model_a, model_b = DelayModel(0.05, 0.02, seed=7), DelayModel(0.05, 0.02, seed=7)
    draws_a = [model_a.next() for _ in range(200)]
    assert draws_a == [model_b.next() for _ in range(200)]
    assert draws_a[0] == first[0]
    assert all(0.05 <= d <= 0.07 for d in draws_a)
    assert len(set(draws_a)) > 100  # jitter really varies
    assert {DelayModel(0.05).next() for _ in range(10)} == {0.05}
    with pytest.raises(ValueError, match="delay"):
        DelayModel(-1.0)
    with pytest.raises(ValueError, match="jitter"):
        DelayModel(0.0, -0.1)


def test_upstream_must_be_plain_http() -> None:
    with pytest.raises(ValueError, match="http://host:port"):
        LatencyProxy("https://s3.amazonaws.com")
    with pytest.raises(ValueError, match="http://host:port"):
        LatencyProxy("127.0.0.1:9000")
    proxy = LatencyProxy(f"http://{LOOPBACK}:9")
    with pytest.raises(LocalServiceError, match="not started"):
        _ = proxy.url
    with pytest.raises(LocalServiceError, match="not running"):
        proxy.cut()


def test_plain_url_upstream_has_no_s3_endpoint(seaweedfs_s3: S3Endpoint) -> None:
    with start_latency_proxy(seaweedfs_s3.endpoint, delay=0.0) as proxy:
        with pytest.raises(LocalServiceError, match="S3Endpoint"):
            _ = proxy.endpoint
        proxy.set_delay(0.02, jitter=0.01, seed=1)
        assert (proxy.delay, proxy.jitter) == (0.02, 0.01)


def test_command_line_prints_where_to_point_clients(seaweedfs_s3: S3Endpoint) -> None:
    command = [sys.executable, "-m", "millpond.localstack.latency_proxy"]
    command += ["--upstream", seaweedfs_s3.endpoint, "--delay-ms", "5"]
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert child.stdout is not None
        first = child.stdout.readline()
        assert first.startswith(f"proxy http://{LOOPBACK}:")
        assert f"-> {seaweedfs_s3.endpoint}, 5 ms per request" in first
        port = int(first.split()[1].rsplit(":", 1)[1])
        with socket.create_connection((LOOPBACK, port), timeout=5):
            pass  # it listens where it says
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=15) == 0
        assert "requests: 0" in child.stdout.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_running_it_as_a_module_warns_nothing() -> None:
    """``python -m millpond.localstack.latency_proxy`` began with ``RuntimeWarning:
    'millpond.localstack.latency_proxy' found in sys.modules after import of package
    'millpond.localstack' …``: the package imported the module before ``-m`` ran it."""
    done = subprocess.run(
        [sys.executable, "-m", "millpond.localstack.latency_proxy", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0
    assert done.stderr == ""
    assert done.stdout.startswith("usage: python -m millpond.localstack.latency_proxy")
