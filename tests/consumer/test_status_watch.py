"""``millpond status``: a cheap default, ``--bytes``, and ``--watch`` refreshing in place."""

from __future__ import annotations

import argparse
import io
import json
import os
import pty
import select
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from consumer_support import MANIFEST, Database, QueueWriter, RecordingStore, numbered

from millpond.consumer import Consumer, ConsumerConfig
from millpond.consumer.app._watch import rates_between, watch
from millpond.consumer.app.status import queue_status, status_record
from millpond.formats.arrow import encode_ipc
from millpond.queue import QueueConsumer
from millpond.storage import open_store


def _queue(tmp_path: Path, entries: int) -> tuple[str, QueueWriter]:
    url = (tmp_path / "store").as_uri()
    writer = QueueWriter(open_store(url))
    for i in range(entries):
        writer.append([b"payload-%d" % i])
    return url, writer


def test_the_default_reads_manifest_and_index_head_bytes_cost_one_listing(tmp_path: Path) -> None:
    url, _writer = _queue(tmp_path, 40)
    store = RecordingStore(open_store(url))
    cheap = queue_status(store, MANIFEST)
    assert cheap.queue_length == 40
    assert cheap.bytes_referenced is None
    # The manifest, the epoch record and the backlog index head (none here): three requests,
    # whatever the backlog.
    assert store.calls == {f"get:{MANIFEST}": 1, "get": 2}
    store.calls.clear()
    measured = queue_status(store, MANIFEST, measure_bytes=True)
    assert store.calls == {f"get:{MANIFEST}": 1, "get": 2, "list": 1}  # no HEAD per entry
    plain = open_store(url)
    sizes = {e.location: plain.head(e.location).size for e in _entries(url)}
    assert measured.bytes_referenced == sum(sizes.values())
    assert measured.missing_objects == 0


def _entries(url: str) -> Any:
    from millpond.queue import read_manifest

    return read_manifest(open_store(url), MANIFEST).manifest.entries


def test_watch_shows_rates_and_the_last_error_and_goes_on(tmp_path: Path) -> None:
    url, writer = _queue(tmp_path, 5)
    store = open_store(url)
    consumer = QueueConsumer(store, MANIFEST)
    consumer.initialize()
    manifest = tmp_path / "store" / MANIFEST
    saved: list[bytes] = []
    step = [0]

    def look() -> dict[str, Any]:
        # Between refreshes the queue moves: 10 appended and 4 dequeued, then the manifest
        # disappears (a refresh fails), then it is back.
        step[0] += 1
        if step[0] == 2:
            for i in range(10):
                writer.append([b"more-%d" % i])
            consumer.dequeue(3)
        if step[0] == 3:
            saved.append(manifest.read_bytes())
            manifest.unlink()
        if step[0] == 4:
            manifest.write_bytes(saved[0])
        return status_record(queue_status(store, MANIFEST))

    def render(record: Any) -> list[str]:
        return [f"queue length     {record['queue_length']} entries"]

    out = io.StringIO()
    args = argparse.Namespace(watch=0.05, output="text")
    assert watch(args, look, render, out=out, refreshes=4) == 0
    blocks = out.getvalue().split("-- every 0.05 s")[1:]
    assert len(blocks) == 4
    assert "queue length     5 entries" in blocks[0]
    assert "rates            - (after the second refresh)" in blocks[0]
    assert "last error       -" in blocks[0]
    assert "queue length     11 entries" in blocks[1]
    assert "entries/s appended" in blocks[1]
    appended, dequeued = _rates(blocks[1])
    assert appended > 0
    assert dequeued == pytest.approx(appended * 4 / 10, rel=0.05)  # 10 appended, 4 dequeued
    # The failed refresh: the last good figures, marked stale, and the error with its time.
    assert "queue length     11 entries" in blocks[2]
    assert "ingest/manifest" in blocks[2].split("last error")[1]
    assert "from the last good refresh" in blocks[2]
    # The next one recovers; the last error stays on screen.
    assert "from the last good refresh" not in blocks[3]
    assert "ingest/manifest" in blocks[3].split("last error")[1]


def _rates(block: str) -> tuple[float, float]:
    line = next(line for line in block.splitlines() if line.startswith("rates"))
    words = line.split()
    return float(words[1]), float(words[4])


def _status_process(url: str, *args: str, tty: bool) -> tuple[subprocess.Popen[bytes], int]:
    command = [sys.executable, "-m", "millpond.cli", "status", url, *args]
    if not tty:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None
        return proc, proc.stdout.fileno()
    main, child = pty.openpty()
    proc = subprocess.Popen(command, stdout=child, stderr=subprocess.PIPE)
    os.close(child)
    return proc, main


def _read_until(fd: int, done: Any, timeout: float = 60) -> bytes:
    data = b""
    deadline = time.monotonic() + timeout
    while not done(data):
        assert time.monotonic() < deadline, data[-2000:]
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the pty closed
                break
            data += chunk
    return data


def test_watch_redraws_in_place_on_a_terminal(tmp_path: Path) -> None:
    url, _writer = _queue(tmp_path, 3)
    proc, fd = _status_process(url, "--watch", "0.1", tty=True)
    try:
        data = _read_until(fd, lambda d: d.count(b"\x1b[H\x1b[J") >= 4)
        # The text after the last clear may still be being written: look at the one before.
        screen = data.decode().split("\x1b[H\x1b[J")[-2]
        assert "queue length     3 entries" in screen
        assert "Ctrl-C to stop" in screen
        assert "0.0 entries/s appended" in screen
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        os.close(fd)


def test_watch_with_json_prints_one_record_per_refresh(tmp_path: Path) -> None:
    url, _writer = _queue(tmp_path, 2)
    proc, fd = _status_process(url, "--watch", "0.1", "--output", "json", tty=False)
    try:
        data = _read_until(fd, lambda d: d.count(b"\n") >= 2)
        first, second = (json.loads(line) for line in data.decode().splitlines()[:2])
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    assert first["queue_length"] == second["queue_length"] == 2
    assert first["metrics"]["millpond_queue_length"] == 2
    assert first["metrics"]["millpond_consumer_lag_seconds"] > 0
    assert first["appended_per_second"] is None
    assert second["appended_per_second"] == 0
    assert second["last_error"] is None
    assert second["stale"] is False


def test_watch_interval_is_checked(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "millpond.cli", "status", tmp_path.as_uri(), "--watch", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2
    assert "--watch: expected seconds >= 0.05, found '0'" in run.stderr


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "millpond.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_status_with_the_sink_counts_what_the_consumer_wrote(
    tmp_path: Path, database: Database
) -> None:
    """``--sink``: rows, batches and the last sequence from the progress table (read-only),
    and the length and lag of what is not in the database yet."""
    url = (tmp_path / "store").as_uri()
    store = open_store(url)
    writer = QueueWriter(store)
    old = time.time_ns() // 1_000_000 - 3_600_000
    for i in range(5):
        writer.append(encode_ipc(numbered(i * 10, 10)), ingestion_ms=old + i)
    sink_args = ["--sink", database.url, "--table", database.table]
    sink_args += ["--progress-table", database.progress]

    if database.kind == "sqlite":  # a database, but nothing consumed into it yet
        sqlite3.connect(database.url.removeprefix("sqlite://")).close()
    before = _cli(url, *sink_args, "--output", "json")  # no progress table yet
    assert before.returncode == 0, before.stderr
    record = json.loads(before.stdout)
    assert record["sink"] == {
        "rows": 0,
        "batches": 0,
        "last_sequence": None,
        "last_commit_age_seconds": None,
    }
    assert record["metrics"]["millpond_queue_length"] == 5

    consumer = Consumer(ConsumerConfig(store=url, gc_enabled=False, ack_batch_size=100))
    with database.sink() as sink:
        consumer.initialize(last_acked_sequence=sink.last_sequence(consumer.queue))
        for _ in range(3):
            batch = consumer.next_batch()
            assert batch is not None
            sink.write(batch)
            consumer.ack(batch.sequence)
    consumer.close()
    after = json.loads(_cli(url, *sink_args, "--output", "json").stdout)
    assert after["sink"]["rows"] == 30
    assert after["sink"]["batches"] == 3
    assert after["sink"]["last_sequence"] == 2
    assert 0 <= after["sink"]["last_commit_age_seconds"] < 60
    assert after["unconsumed_entries"] == after["metrics"]["millpond_queue_length"] == 2
    assert after["metrics"]["millpond_consumer_rows_total"] == 30
    assert after["metrics"]["millpond_consumer_batches_total"] == 3
    assert after["metrics"]["millpond_consumer_last_sequence"] == 2
    # The lag is the oldest entry not in the database: sequence 3, produced at old + 3.
    assert after["consumer_lag_seconds"] >= 3_600 - 60
    text = _cli(url, *sink_args)
    assert "30 rows in 3 batches, last sequence 2" in text.stdout
    assert "2 entries not yet written" in text.stdout


def test_status_sink_never_creates_a_database(tmp_path: Path) -> None:
    url, _writer = _queue(tmp_path, 1)
    missing = tmp_path / "typo.db"
    run = _cli(url, "--sink", f"sqlite://{missing}")
    assert run.returncode == 2
    assert f"expected an SQLite database file, found none at {missing}" in run.stderr
    assert not missing.exists()


def test_rates_between_two_looks() -> None:
    def look(next_sequence: int, length: int, rows: int | None) -> dict[str, Any]:
        record: dict[str, Any] = {"next_sequence": next_sequence, "queue_length": length}
        if rows is not None:
            record["sink"] = {"rows": rows}
        return record

    rates = rates_between(look(10, 4, 1_000), look(30, 6, 5_000), 2.0)
    assert rates is not None
    assert (rates.appended_per_second, rates.dequeued_per_second) == (10.0, 9.0)
    assert rates.rows_per_second == 2_000.0
    no_sink = rates_between(look(10, 4, None), look(30, 6, None), 2.0)
    assert no_sink is not None
    assert no_sink.rows_per_second is None
    assert rates_between(look(30, 4, None), look(10, 4, None), 2.0) is None  # recreated
