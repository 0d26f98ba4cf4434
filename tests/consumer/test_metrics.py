"""``millpond consume --metrics-port``: Prometheus scrapes a running consumer.

A real ``millpond consume`` process on SeaweedFS writes into PostgreSQL while a writer keeps
appending; ``/metrics`` is scraped over HTTP the whole time and must carry every metric the
consumer exports, with values that match what happened: a backlog shows as length, bytes and
lag, the rows and batches counted are the rows and batches in the database, and once the
queue is drained the length and the lag are 0.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from consumer_support import Database, QueueWriter, numbered, open_target
from test_service import Service, _wait_for

from millpond.common.exposition import CATALOG
from millpond.consumer.app._metrics import CONSUMER_METRICS
from millpond.formats.arrow import encode_ipc
from tests.scrape import family, scrape, served_url
from tests.support import unique_root

ROWS = 200  # per batch
HOUR_MS = 3_600_000


def metrics_url(service: Service) -> str:
    return served_url(lambda: service.stderr)


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


@pytest.mark.slow
def test_scrape_a_consumer_writing_from_seaweedfs_to_postgres(
    seaweedfs_s3: Any, postgres_database: Database, services: Callable[..., Service]
) -> None:
    class Target:
        url = seaweedfs_s3.url_for(unique_root())
        options = seaweedfs_s3.store_options()

    store = open_target(Target)
    writer = QueueWriter(store)
    old = time.time_ns() // 1_000_000 - HOUR_MS  # every entry was produced an hour ago
    written = [0]
    stop_writing = threading.Event()

    def append_one() -> None:
        writer.append(encode_ipc(numbered(written[0] * ROWS, ROWS)), ingestion_ms=old)
        written[0] += 1

    for _ in range(20):  # a backlog before the service starts
        append_one()

    def keep_writing() -> None:
        while not stop_writing.is_set() and written[0] < 123:
            append_one()
            time.sleep(0.02)

    service = services(
        Target,
        postgres_database,
        "--metrics-port",
        "0",
        "--metrics-interval",
        "0.2",
        "--gc",
        "--gc-interval",
        "0.5",
        "--gc-grace-period",
        "0",
        "--max-group",
        "2",
        "--ack-batch-size",
        "5",  # dequeue often, so GC finds consumed objects to delete
    )
    url = metrics_url(service)
    assert url.startswith("http://127.0.0.1:")  # loopback unless --metrics-address says so
    thread = threading.Thread(target=keep_writing)
    thread.start()
    scrapes: list[dict[str, Any]] = []
    try:
        while thread.is_alive():  # scraped the whole time the writer appends
            scrapes.append(scrape(url))
            time.sleep(0.1)
    finally:
        stop_writing.set()
        thread.join()
    assert written[0] == 123  # not a multiple of --ack-batch-size: 3 acked, not dequeued
    # While it wrote: scrapes that caught entries waiting, an hour old, and their bytes.
    busy = [values for values in scrapes if values.get("millpond_queue_length", 0) >= 1]
    assert busy, scrapes[-1]
    for values in busy:
        assert values["millpond_consumer_lag_seconds"] >= HOUR_MS / 1000 - 60
        assert values["millpond_queue_bytes"] > 0
        assert values["millpond_queue_sample_age_seconds"] < 30
    rows_seen = [values["millpond_consumer_rows_total"] for values in scrapes]
    assert rows_seen == sorted(rows_seen)  # a counter only grows
    assert len(set(rows_seen)) > 2  # and it grew while the writer wrote
    total_rows = written[0] * ROWS

    # Drained: everything in the database, nothing waiting, no lag.
    last: list[dict[str, Any]] = []

    def drained() -> bool:
        values = scrape(url)
        last[:] = [values]
        return (
            values.get("millpond_consumer_rows_total") == total_rows
            and values.get("millpond_queue_length") == 0
            and values.get("millpond_gc_deleted_total", 0) > 0
        )

    try:
        _wait_for(drained, 120, f"{total_rows} rows and an empty queue")
    except AssertionError as err:
        raise AssertionError(f"{err}; last scrape: {last}") from None
    after = scrape(url)
    for name in CONSUMER_METRICS:
        assert after["#types"].get(family(name)) == CATALOG[name].kind.value, name
    assert after["millpond_queue_length"] == 0
    assert after["millpond_queue_bytes"] == 0
    assert after["millpond_consumer_lag_seconds"] == 0
    assert postgres_database.count() == total_rows
    assert after["millpond_consumer_batches_total"] == written[0]
    assert after["millpond_consumer_batches_skipped_total"] == 0
    assert after["millpond_consumer_last_sequence"] == written[0] - 1
    assert after["millpond_consumer_epoch"] == 1
    assert after["millpond_consumer_fetched_bytes_total"] > 0
    # The consumer writes the manifest to take over and to dequeue.
    assert after['millpond_manifest_writes_total{role="consumer"}'] >= 2
    assert after['millpond_manifest_conflicts_total{role="consumer"}'] >= 0
    assert after["millpond_gc_failed_total"] == 0
    assert after["millpond_gc_errors_total"] == 0
    assert after["millpond_gc_passes_total"] >= 1
    assert after["millpond_queue_sample_errors_total"] == 0
    # Histograms: one fetch per batch; at least one commit; every completed GC pass timed.
    assert after["millpond_consumer_fetch_duration_seconds_count"] == written[0]
    commits = after["millpond_consumer_sink_commit_duration_seconds_count"]
    assert written[0] / 2 <= commits <= written[0]  # groups of at most --max-group 2
    assert after['millpond_consumer_sink_commit_duration_seconds_bucket{le="+Inf"}'] == commits
    assert after["millpond_consumer_sink_commit_duration_seconds_sum"] > 0
    assert after["millpond_gc_duration_seconds_count"] >= after["millpond_gc_passes_total"] - 1
    assert after["millpond_gc_duration_seconds_count"] >= 1

    assert service.stop() == 0, service.stderr
    with pytest.raises(urllib.error.URLError):  # the port is released with the process
        scrape(url)


def test_metrics_port_errors_are_usage_errors(tmp_path: Any) -> None:
    """A bad or busy port is bad usage: exit 2, one line naming the option."""
    import subprocess
    import sys

    def consume(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "millpond.cli",
                "consume",
                (tmp_path / "q").as_uri(),
                "--create",
                "--sink",
                f"sqlite://{tmp_path / 'sink.db'}",
                "--exit-when-idle",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    bad = consume("--metrics-port", "70000")
    assert bad.returncode == 2
    assert "--metrics-port: expected a port 0..65535, found '70000'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = consume("--metrics-port", str(port))
    assert busy.returncode == 2, busy.stderr
    assert f"expected a free port on 127.0.0.1, found {port}" in busy.stderr
    interval = consume("--metrics-port", "0", "--metrics-interval", "0")
    assert interval.returncode == 2
    assert "--metrics-interval: expected seconds > 0" in interval.stderr


def test_the_queue_sampler_reads_an_unchanged_queue_for_two_304s(tmp_path: Any) -> None:
    from consumer_support import MANIFEST, RecordingStore

    from millpond.consumer.app._metrics import QueueSampler
    from millpond.storage import open_store

    url = (tmp_path / "store").as_uri()
    writer = QueueWriter(open_store(url))
    locations = [writer.append([b"x" * (100 + i)], ingestion_ms=1_000 + i)[1] for i in range(3)]
    sizes = [open_store(url).head(location).size for location in locations]
    store = RecordingStore(open_store(url))
    acked: list[int | None] = [None]
    sampler = QueueSampler(
        store, manifest_path=MANIFEST, data_path_prefix="ingest", acked=lambda: acked[0]
    )
    sampler.sample_once()
    # The manifest, then the backlog index head (none here); one listing from the oldest
    # waiting entry's name on for the bytes.
    assert store.calls == {"get:ingest/manifest": 1, "get": 1, "list": 1}
    gauges = sampler.gauges(acked=None)
    assert gauges is not None
    assert (gauges.length, gauges.bytes, gauges.oldest_ms) == (3, sum(sizes), 1_000)
    after_one = sampler.gauges(acked=1)
    assert after_one is not None
    # Counted from sequences; the bytes scaled to what still waits until the next look.
    assert (after_one.length, after_one.bytes) == (1, sum(sizes) // 3)
    store.calls.clear()
    sampler.sample_once()  # nothing changed, the ack neither: two 304s, no listing
    assert store.calls == {"get_if_changed": 2}
    acked[0] = 1
    store.calls.clear()
    sampler.sample_once()  # the ack moved: a look from past it
    assert store.calls == {"get:ingest/manifest": 1, "get": 1, "list": 1}
    gauges = sampler.gauges(acked=1)
    assert gauges is not None
    assert (gauges.length, gauges.bytes, gauges.oldest_ms) == (1, sizes[2], 1_002)
    writer.append([b"y"])
    store.calls.clear()
    sampler.sample_once()  # a new entry: a look
    assert store.calls == {"get_if_changed": 1, "get:ingest/manifest": 1, "get": 1, "list": 1}
    assert sampler.gauges(acked=1).length == 2  # type: ignore[union-attr]
