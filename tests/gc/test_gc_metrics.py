"""``millpond gc --metrics-port``: passes, deletes, failures and pass times on ``/metrics``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gc_support import FailingDeletes, enqueue, paths, put_batch
from prometheus_client import CollectorRegistry, generate_latest

from millpond.common.exposition import CATALOG
from millpond.gc import GarbageCollector, GarbageCollectorConfig
from millpond.gc.command import GC_METRICS, metrics_collector
from millpond.storage import open_store
from tests.scrape import family, parse, scrape, served_url

HOUR_MS = 3_600_000


def _old_queue(root: Path, orphans: int) -> tuple[str, set[str], str]:
    """A file store with ``orphans`` unreferenced batch objects and one queued, two hours old."""
    url = root.as_uri()
    store = open_store(url)
    old_ms = int(time.time() * 1000) - 2 * HOUR_MS
    garbage = {put_batch(store, old_ms + i) for i in range(orphans)}
    live = put_batch(store, old_ms + 100)
    enqueue(store, live)
    for path in [*garbage, live]:
        os.utime(root / path, (old_ms / 1000, old_ms / 1000))
    return url, garbage, live


def test_gc_interval_serves_its_metrics(tmp_path: Path) -> None:
    url, garbage, live = _old_queue(tmp_path / "store", 3)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "millpond.cli",
            "gc",
            url,
            "--interval",
            "0.2",
            "--grace-period",
            "60",
            "--metrics-port",
            "0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        lines.extend(proc.stderr)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        metrics = served_url(lambda: "".join(lines))
        assert metrics.startswith("http://127.0.0.1:")
        deadline = time.monotonic() + 60
        while (values := scrape(metrics)).get("millpond_gc_passes_total", 0) < 3:
            assert time.monotonic() < deadline, values
            time.sleep(0.05)
        for name in GC_METRICS:
            assert values["#types"][family(name)] == CATALOG[name].kind.value, name
        assert values["millpond_gc_deleted_total"] == 3  # once: later passes find nothing
        assert values["millpond_gc_failed_total"] == 0
        assert values["millpond_gc_errors_total"] == 0
        # Every completed pass is timed (a pass may finish between the two reads).
        count = values["millpond_gc_duration_seconds_count"]
        assert values["millpond_gc_passes_total"] <= count <= values["millpond_gc_passes_total"] + 1
        assert values['millpond_gc_duration_seconds_bucket{le="60.0"}'] == count
        assert not garbage & paths(open_store(url))
        assert live in paths(open_store(url))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        reader.join(timeout=10)
    assert proc.returncode == 0, "".join(lines)


def test_gc_metrics_count_failed_deletes(tmp_path: Path) -> None:
    url, garbage, _live = _old_queue(tmp_path / "store", 2)
    store = FailingDeletes(open_store(url))
    store.failing = {sorted(garbage)[0]}
    collector = GarbageCollector(GarbageCollectorConfig(store=store, gc_grace_period=60))
    registry = CollectorRegistry(auto_describe=True)
    registry.register(metrics_collector(collector))
    collector.run_once()
    collector.run_once()  # the failed delete is tried again, and fails again
    values = parse(generate_latest(registry).decode())
    assert values["millpond_gc_passes_total"] == 2
    assert values["millpond_gc_deleted_total"] == 1
    assert values["millpond_gc_failed_total"] == 2
    assert values["millpond_gc_duration_seconds_count"] == 2
    assert values["millpond_gc_duration_seconds_sum"] > 0
