"""``commit_interval``: fewer manifest writes per batch, traded for latency."""

from __future__ import annotations

import time
from pathlib import Path

from millpond.producer import Producer
from tests.producer.producer_support import config, fresh_memory, read_back


def _publish(tmp_path: Path, commit_interval: float) -> tuple[int, int, list[bytes]]:
    """Produce 60 calls that seal ~60 small batches; returns (batches, appends, entries)."""
    store = fresh_memory()
    cfg = config(
        store,
        tmp_path / f"wal-{commit_interval}",
        flush_size_bytes=64,
        commit_interval=commit_interval,
    )
    with Producer(cfg) as producer:
        handles = [producer.produce([f"{i:04d}".encode() * 20]) for i in range(60)]
        for handle in handles:
            handle.wait(timeout=30)
        appends = producer.counters.get("manifest_appends")
    published = read_back(store)
    return len(published), appends, [e for p in published for e in p.entries]


def test_commit_interval_groups_batches_into_fewer_appends(tmp_path: Path) -> None:
    expected = [f"{i:04d}".encode() * 20 for i in range(60)]
    batches, appends, entries = _publish(tmp_path, commit_interval=0.2)
    assert entries == expected  # nothing lost, nothing doubled, order kept
    assert batches >= 30  # each call over flush_size_bytes: about a batch per call
    assert appends <= batches / 3, f"{appends} appends for {batches} batches"


def test_flush_does_not_wait_for_the_commit_interval(tmp_path: Path) -> None:
    store = fresh_memory()
    cfg = config(store, tmp_path / "wal", commit_interval=30.0)
    with Producer(cfg) as producer:
        producer.produce([b"first"]).wait(timeout=30)  # the first append starts the interval
        handle = producer.produce([b"second"])
        started = time.monotonic()
        producer.flush(timeout=10)
        assert handle.done()
        assert time.monotonic() - started < 10
    assert [e for p in read_back(store) for e in p.entries] == [b"first", b"second"]
