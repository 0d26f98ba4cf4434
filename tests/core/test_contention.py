"""Many OS processes appending to one manifest at once, on SeaweedFS and on ``file://``.

Each worker is a real process (``_contention_worker.py``); all of them open their store first
and start writing together when the test writes a line to their stdin. The figures (committed
appends/s, conflicts) go to ``contention.json`` in the test's tmp dir, to the JUnit properties
and to the terminal summary (see ``conftest.py``), whether or not output is captured.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from millpond.localstack import start_latency_proxy
from millpond.queue import read_manifest
from millpond.storage import open_store
from tests.support import StoreTarget

from .conftest import record_figure

WORKER = Path(__file__).with_name("_contention_worker.py")
PROCESSES = 16
APPENDS_EACH = 50
WORKER_TIMEOUT = 240.0


def run_workers(
    mode: str,
    target: StoreTarget,
    processes: int,
    count: int,
    *,
    options: dict[str, str] | None = None,
    strategy: str | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """Start ``processes`` workers, release them together, return their results and wall time."""
    worker_options = dict(target.options or {}) if options is None else options
    env = {**os.environ, "MILLPOND_WORKER_OPTIONS": json.dumps(worker_options)}
    if strategy is not None:
        env["MILLPOND_WORKER_STRATEGY"] = strategy
    children = [
        subprocess.Popen(
            [sys.executable, str(WORKER), mode, target.url, str(w), str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for w in range(processes)
    ]
    try:
        for child in children:
            assert child.stdout is not None
            line = child.stdout.readline()  # blocks until the worker has opened its store
            assert line.strip() == "ready", child.communicate(timeout=WORKER_TIMEOUT)[1]
        started = time.monotonic()
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        results = []
        for child in children:
            out, err = child.communicate(timeout=WORKER_TIMEOUT)
            assert child.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results, time.monotonic() - started
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


@pytest.mark.slow
def test_sixteen_processes_append_fifty_each(
    shared_store_target: StoreTarget, tmp_path: Path, record_property: Any
) -> None:
    results, elapsed = run_workers("queue", shared_store_target, PROCESSES, APPENDS_EACH)
    store = open_store(shared_store_target.url, dict(shared_store_target.options or {}))
    manifest = read_manifest(store, "ingest/manifest").manifest

    total = PROCESSES * APPENDS_EACH
    assert len(manifest.entries) == total
    assert manifest.footer.entry_count == total
    assert [e.sequence for e in manifest.entries] == list(range(total))
    assert manifest.next_sequence == total
    payloads = Counter(item.payload for e in manifest.entries for item in e.metadata)
    expected = {f"w{w}-{i}".encode() for w in range(PROCESSES) for i in range(APPENDS_EACH)}
    assert set(payloads) == expected
    assert set(payloads.values()) == {1}
    assert len({e.location for e in manifest.entries}) == total
    # Each worker's appends keep its own order, and the sequences it was told are the truth.
    by_payload = {e.metadata[0].payload: e.sequence for e in manifest.entries}
    for w, result in enumerate(results):
        told = result["sequences"]
        assert told == [by_payload[f"w{w}-{i}".encode()] for i in range(APPENDS_EACH)]
        assert told == sorted(told)

    conflicts = sum(r["cas_conflicts"] for r in results)
    figures = {
        "store": shared_store_target.kind,
        "processes": PROCESSES,
        "appends": total,
        "seconds": round(elapsed, 3),
        "appends_per_second": round(total / elapsed, 1),
        "cas_conflicts": conflicts,
        "conflicts_per_append": round(conflicts / total, 2),
        "manifest_writes": sum(r["manifest_writes"] for r in results),
        "manifest_reads": sum(r["manifest_reads"] for r in results),
        "slowest_worker_seconds": round(max(r["elapsed"] for r in results), 3),
    }
    (tmp_path / "contention.json").write_text(json.dumps(figures, indent=2))
    for key, value in figures.items():
        record_property(key, value)
    record_figure(record_property, f"contention {shared_store_target.kind}", figures)


@pytest.mark.slow
def test_raw_cas_counter_shared_by_processes(shared_store_target: StoreTarget) -> None:
    # The store's own compare-and-swap, no queue logic: 8 processes x 40 increments.
    store = open_store(shared_store_target.url, dict(shared_store_target.options or {}))
    store.put_if_absent("counter", b"0")
    results, _ = run_workers("counter", shared_store_target, 8, 40)
    assert store.get("counter").data == b"320"
    assert len(results) == 8


@pytest.mark.slow
def test_aging_strategy_keeps_every_append_once_at_real_latency(
    shared_store_target: StoreTarget,
) -> None:
    """The fair ``aging`` strategy under contention: nothing lost, nothing doubled, order kept.

    On SeaweedFS the workers go through a latency proxy (20 ms a request), where the strategy
    yields and retries on a measured slot; on ``file://`` they contend at local speed.
    """
    processes, count = 6, 12
    with contextlib.ExitStack() as stack:
        options = dict(shared_store_target.options or {})
        if shared_store_target.endpoint is not None:
            proxy = stack.enter_context(
                start_latency_proxy(shared_store_target.endpoint, delay=0.02)
            )
            options = proxy.endpoint.store_options()
        results, _ = run_workers(
            "queue", shared_store_target, processes, count, options=options, strategy="aging"
        )
    store = open_store(shared_store_target.url, dict(shared_store_target.options or {}))
    manifest = read_manifest(store, "ingest/manifest").manifest
    total = processes * count
    assert [e.sequence for e in manifest.entries] == list(range(total))
    payloads = Counter(item.payload for e in manifest.entries for item in e.metadata)
    assert set(payloads) == {f"w{w}-{i}".encode() for w in range(processes) for i in range(count)}
    assert set(payloads.values()) == {1}
    by_payload = {e.metadata[0].payload: e.sequence for e in manifest.entries}
    for w, result in enumerate(results):
        assert result["sequences"] == [by_payload[f"w{w}-{i}".encode()] for i in range(count)]
