"""A consumer that drains a benchmark's queue while its producers run, in its own process.

A deployed queue always has its consumer reading, acknowledging and dequeuing: every dequeue
is a compare-and-swap on the manifest the producers (or a coordinator) append to. Benchmarks
that measure appends alone leave that writer out; this one puts it back. It opens a real
``Consumer`` on the queue (waiting for the manifest to exist) and takes what has arrived as the
consumer service does: ``next_batches()``, acknowledging the previous group in the same call
(one fencing check for both; a due dequeue runs inside it). No sink: what is measured is the
manifest traffic. It reports how long those calls took and how long after its ``produce()``
each batch was read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from bench.common import report_to

__all__ = ["draining_consumer"]

_START_TIMEOUT = 120.0
_IDLE_SLEEP = 0.02
_GROUP = 256  # batches per next_batches() call at most


@contextlib.contextmanager
def draining_consumer(
    ctx: Any, url: str, options: dict[str, str], coordinator: str | None = None
) -> Iterator[dict[str, Any]]:
    """Run a draining consumer on the queue at ``url`` for the ``with`` body; the yielded dict
    is filled with its figures when the body ends (``ctx``: a multiprocessing context;
    ``coordinator``: the URL its dequeues go through, as ``ConsumerConfig.coordinator``)."""
    stop = ctx.Event()
    out = ctx.Queue()
    proc = ctx.Process(
        target=report_to,
        args=(out, _drain, url, options, coordinator, stop),
        name="bench-consumer",
        daemon=True,
    )
    proc.start()
    figures: dict[str, Any] = {}
    try:
        yield figures
    finally:
        stop.set()
        try:
            figures.update(out.get(timeout=_START_TIMEOUT))
        finally:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if "error" in figures:
        raise RuntimeError(f"the draining consumer failed: {figures['error']}")


def _drain(url: str, options: dict[str, str], coordinator: str | None, stop: Any) -> dict[str, Any]:
    from millpond.consumer import Consumer, ConsumerConfig
    from millpond.errors import NotFoundError

    consumer = Consumer(
        ConsumerConfig(store=url, store_options=options, gc_enabled=False, coordinator=coordinator)
    )
    deadline = time.monotonic() + _START_TIMEOUT
    while True:
        try:
            started = time.monotonic()
            consumer.initialize()
            initialize_s = time.monotonic() - started
            break
        except NotFoundError:
            if stop.is_set() or time.monotonic() > deadline:
                return {"batches": 0, "note": "no manifest appeared"}
            time.sleep(_IDLE_SLEEP)
    calls: list[float] = []
    lags: list[float] = []
    batches = 0
    acked: int | None = None  # delivered, acknowledged with the next call (as the service does)
    try:
        while not stop.is_set():
            started = time.monotonic()
            got = consumer.next_batches(_GROUP, ack_through=acked)
            calls.append(time.monotonic() - started)
            acked = None
            if not got:
                time.sleep(_IDLE_SLEEP)
                continue
            now = time.time()
            lags.extend(now - min(m.ingestion_time_ms for m in b.metadata) / 1000 for b in got)
            batches += len(got)
            acked = got[-1].sequence
        if acked is not None:
            consumer.ack_through(acked)
        dequeues = consumer.counters.get("dequeues")
        through_coordinator = consumer.counters.get("coordinator_dequeues")
        conflicts = consumer.counters.get("cas_conflicts")
    finally:
        consumer.close()
    calls.sort()
    lags.sort()
    return {
        "batches": batches,
        "dequeues": dequeues,
        "dequeue_conflicts": conflicts,
        "dequeues_through_coordinator": through_coordinator,
        "initialize_s": round(initialize_s, 3),
        "calls": len(calls),
        "call_p50_ms": round(1000 * _at(calls, 0.50), 1),
        "call_max_ms": round(1000 * _at(calls, 1.0), 1),
        "produced_to_read_p50_ms": round(1000 * _at(lags, 0.50), 1),
        "produced_to_read_p99_ms": round(1000 * _at(lags, 0.99), 1),
    }


def _at(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
