"""What a long backlog costs: append, dequeue, status and GC against queue length, and draining.

Issue 11: the manifest grows by about 82 bytes an entry and every append and dequeue rewrites
it whole. Target: with 1,000,000 entries waiting, a producer append costs <= 2x its cost on an
empty queue, and draining the backlog costs O(backlog), not O(backlog^2).

Setup: SeaweedFS on 127.0.0.1; every measured request goes through the latency proxy
(``DEFAULT_LATENCY_MS`` or ``--latency-ms``). For each backlog size the manifest is built in
memory with the wire-format functions (``append_entries``: ULID-named locations, one metadata
item with a 9-byte payload, 82 bytes an entry) and written straight to SeaweedFS, bypassing
the proxy, so building it costs no simulated latency. Then, through the proxy, ``REPEATS``
times each:

* **append, cold** — a fresh ``QueueProducer`` appends one entry: GET + conditional PUT;
* **append, warm** — the same producer appends again with its cached manifest: one PUT;
* **dequeue 100** — ``QueueConsumer.dequeue`` of the next 100 entries (the consumer's default
  ``ack_batch_size``): GET + conditional PUT;
* **consumer read** — ``QueueConsumer.read``: GET + full decode (consumer start and refresh);
* **status** — ``queue_status(measure_bytes=False)``: GET + decode (``millpond status
  --no-bytes``); the default ``millpond status`` also HEADs every referenced object, timed
  separately at the small sizes (``status_heads``);
* **GC pass** — ``collect_once``: LIST of the data prefix + GET + decode + plan. The batch
  objects themselves are not created (a real backlog of N entries also has N objects to list,
  1,000 keys per LIST request; that part is not measured here);
* **CPU alone** — ``decode_manifest``, ``append_entries`` and ``remove_through`` on the bytes,
  no IO, to split transfer from Python work.

Baseline: the same append on an empty queue (footer only) in the same run.

Draining. Each dequeue rewrites what is left of the manifest. Dequeuing every 100 acks (the
consumer before issue 11) drains N entries moving about 82 N^2 / 200 bytes. The consumer now
dequeues in proportion to the backlog (``ConsumerConfig.dequeue_step``: at least
``ack_batch_size`` = 100, and 10% of the entries still behind), which is O(N). Measured by
draining a fresh copy with ``QueueConsumer.dequeue`` in the consumer's steps (the manifest side
of what a real consumer does; fetching batches is O(N) anyway): every 100 for the smaller
sizes (``DRAIN_SIZES``), proportionally for every size up to 1,000,000, and through the
backlog index (``index``: a real ``Consumer`` with ``backlog_index=True`` moves everything into
its index at ``initialize()``, then the same steps drain it, each a write of the small index
head). A linear fit of one dequeue's cost against manifest size projects the fixed step to
the sizes it was not run at.

The backlog index. For each size a real ``Consumer(backlog_index=True)`` (default threshold,
10,000 entries) takes over the built manifest and moves it into its index (``index_move``,
timed); then a producer's append is timed right after the move (``index_append_*``: the
manifest is nearly empty) and with the manifest refilled to one entry short of the threshold
(``index_worst_append_*``: the largest manifest a producer meets while the index is on).

``ratio`` (target <= 2.0): the worst cold append with the index on at the largest size / cold
append on the empty queue. ``append_cold_over_empty`` in ``by_size`` is the same without the
index (the manifest holds the whole backlog).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
import uuid
from typing import Any

from bench.common import latency_ms, make_result, plot_spec, seaweedfs_endpoints

logger = logging.getLogger(__name__)

NAME = "backlog"
DEFAULT_LATENCY_MS = 50.0
TARGET = 2.0
MANIFEST = "ingest/manifest"
SIZES = (1_000, 10_000, 100_000, 1_000_000)
QUICK_SIZES = (1_000, 10_000, 100_000)
DRAIN_SIZES = (1_000, 10_000, 100_000)
QUICK_DRAIN_SIZES = (1_000, 10_000)
HEAD_SIZES = (1_000, 10_000)
QUICK_HEAD_SIZES = (1_000,)
REPEATS = 3
PAYLOAD = b"source=a1"  # 9 bytes: 82 bytes an entry, as measured in issue 11
STEP = 100  # the consumer's default ack_batch_size


def _entries(n: int, minter: Any, now_ms: int) -> list[Any]:
    from millpond.common.ulids import batch_location
    from millpond.formats.manifest import Metadata, PendingEntry

    return [
        PendingEntry(batch_location("ingest", minter.mint()), (Metadata(0, now_ms, PAYLOAD),))
        for _ in range(n)
    ]


def _build(n: int) -> bytes:
    from millpond.common.ulids import UlidMinter
    from millpond.formats.manifest import append_entries, empty_manifest

    minter = UlidMinter()
    now_ms = int(time.time() * 1000)
    raw = empty_manifest(epoch=1)
    for first in range(0, n, 100_000):
        raw, _ = append_entries(raw, _entries(min(100_000, n - first), minter, now_ms))
    return raw


def _timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _ops(direct: Any, measured: Any, raw: bytes, n: int, repeats: int) -> dict[str, Any]:
    """Time every operation ``repeats`` times on a fresh root holding ``raw``."""
    from millpond.common.clock import SystemClock
    from millpond.common.ulids import UlidMinter
    from millpond.consumer.app.status import queue_status
    from millpond.formats.manifest import append_entries, decode_manifest, remove_through
    from millpond.queue import QueueConsumer, QueueProducer
    from millpond.queue.gc_rules import collect_once
    from millpond.storage import open_store

    root = f"bench-backlog-{n}-{uuid.uuid4().hex[:8]}"
    open_store(direct.url_for(root), direct.store_options()).put(MANIFEST, raw)
    store = open_store(measured.url_for(root), measured.store_options())
    minter = UlidMinter()
    now_ms = int(time.time() * 1000)
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "append_cold",
            "append_warm",
            "dequeue_100",
            "consumer_read",
            "status",
            "gc_pass",
            "decode_cpu",
            "append_cpu",
            "remove_cpu",
        )
    }
    consumer = QueueConsumer(store, MANIFEST)
    consumer.initialize()
    for _ in range(repeats):
        producer = QueueProducer(store, MANIFEST)
        times["append_cold"].append(
            _timed(lambda p=producer: p.append(_entries(1, minter, now_ms)))
        )
        times["append_warm"].append(
            _timed(lambda p=producer: p.append(_entries(1, minter, now_ms)))
        )
        if n >= STEP:
            first = consumer.read().manifest.first_sequence
            assert first is not None
            times["dequeue_100"].append(_timed(lambda f=first: consumer.dequeue(f + STEP - 1)))
        times["consumer_read"].append(_timed(consumer.read))
        times["status"].append(_timed(lambda: queue_status(store, MANIFEST, measure_bytes=False)))
        times["gc_pass"].append(
            _timed(
                lambda: collect_once(
                    store,
                    manifest_path=MANIFEST,
                    data_path_prefix="ingest",
                    clock=SystemClock(),
                    grace_period=600.0,
                )
            )
        )
        times["decode_cpu"].append(_timed(lambda: decode_manifest(raw)))
        times["append_cpu"].append(_timed(lambda: append_entries(raw, _entries(1, minter, now_ms))))
        times["remove_cpu"].append(_timed(lambda: remove_through(raw, STEP - 1)))
    return {
        "entries": n,
        "manifest_bytes": len(raw),
        **{f"{k}_ms": round(1000 * statistics.median(v), 1) for k, v in times.items() if v},
        "samples": {k: [round(1000 * x, 1) for x in v] for k, v in times.items()},
    }


def _status_heads(direct: Any, measured: Any, raw: bytes, n: int) -> float:
    from millpond.consumer.app.status import queue_status
    from millpond.storage import open_store

    root = f"bench-backlog-heads-{n}-{uuid.uuid4().hex[:8]}"
    open_store(direct.url_for(root), direct.store_options()).put(MANIFEST, raw)
    store = open_store(measured.url_for(root), measured.store_options())
    return _timed(lambda: queue_status(store, MANIFEST, measure_bytes=True))


def _steps(n: int, pattern: str) -> list[int]:
    """How many entries each dequeue of a drain of ``n`` takes, by the consumer's rule."""
    from millpond.consumer import ConsumerConfig

    config = ConsumerConfig(store="memory://bench-backlog-rule", ack_batch_size=STEP)
    if pattern == "every_100":
        return [min(STEP, n - first) for first in range(0, n, STEP)]
    # Ack by ack, as the consumer decides (the final flush takes the rest).
    steps, dequeued = [], 0
    for acked in range(1, n + 1):
        if acked - dequeued >= config.dequeue_step(n - acked):
            steps.append(acked - dequeued)
            dequeued = acked
    if dequeued < n:
        steps.append(n - dequeued)
    return steps


def _drain(direct: Any, measured: Any, raw: bytes, n: int, pattern: str) -> dict[str, Any]:
    """Dequeue a fresh copy down to empty; returns seconds, dequeues and bytes written."""
    from millpond.consumer import Consumer
    from millpond.formats.manifest import decode_footer
    from millpond.queue import QueueConsumer
    from millpond.queue.index import BacklogIndex
    from millpond.storage import open_store

    root = f"bench-backlog-drain-{n}-{uuid.uuid4().hex[:8]}"
    open_store(direct.url_for(root), direct.store_options()).put(MANIFEST, raw)
    store = open_store(measured.url_for(root), measured.store_options())
    through = decode_footer(raw).next_sequence - n - 1
    started = time.perf_counter()
    index: BacklogIndex | None = None
    if pattern == "index":
        # The consumer moves what it read into its index at initialize(); draining is then
        # the head's dequeued_through going up (drained segments deleted).
        consumer = Consumer(_index_config(store))
        consumer.initialize()
        epoch = consumer.epoch
        assert epoch is not None
        index = BacklogIndex(store, data_path_prefix="ingest", epoch=epoch)
        index.claim()
        dequeue = index.drain
    if index is None or not index.live:  # below the threshold nothing moves
        index = None
        queue = QueueConsumer(store, MANIFEST)
        queue.initialize()
        dequeue = queue.dequeue  # type: ignore[assignment]
    steps = _steps(n, pattern)
    written = 0
    remaining = n
    for step in steps:
        through += step
        dequeue(through)
        remaining -= step
        written += 22 + 82 * remaining if index is None else 200
    return {
        "entries": n,
        "pattern": pattern,
        "seconds": round(time.perf_counter() - started, 2),
        "dequeues": len(steps),
        "bytes_written": written,
    }


def _indexed_appends(direct: Any, measured: Any, raw: bytes, n: int) -> dict[str, Any]:
    """Appends with the backlog index on: right after the move, and just before the next."""
    from millpond.common.ulids import UlidMinter
    from millpond.consumer import Consumer
    from millpond.formats.manifest import append_entries
    from millpond.queue import QueueProducer
    from millpond.storage import open_store

    root = f"bench-backlog-index-{n}-{uuid.uuid4().hex[:8]}"
    plain = open_store(direct.url_for(root), direct.store_options())
    plain.put(MANIFEST, raw)
    store = open_store(measured.url_for(root), measured.store_options())
    config = _index_config(store)
    consumer = Consumer(config)
    move = _timed(consumer.initialize)
    minter = UlidMinter()
    now_ms = int(time.time() * 1000)
    times: dict[str, list[float]] = {k: [] for k in ("cold", "warm", "worst_cold", "worst_warm")}
    for _ in range(REPEATS):
        producer = QueueProducer(store, MANIFEST)
        times["cold"].append(_timed(lambda p=producer: p.append(_entries(1, minter, now_ms))))
        times["warm"].append(_timed(lambda p=producer: p.append(_entries(1, minter, now_ms))))
    # Refill the manifest (directly) to one entry short of the next move.
    current = plain.get(MANIFEST).data
    short = config.backlog_index_threshold - 1 - 2 * REPEATS
    refilled, _ = append_entries(current, _entries(short, minter, now_ms))
    plain.put(MANIFEST, refilled)
    for _ in range(REPEATS):
        producer = QueueProducer(store, MANIFEST)
        times["worst_cold"].append(_timed(lambda p=producer: p.append(_entries(1, minter, now_ms))))
        times["worst_warm"].append(_timed(lambda p=producer: p.append(_entries(1, minter, now_ms))))
    consumer.close()  # nothing acked: no dequeue
    return {
        "index_move_s": round(move, 2),
        "index_worst_manifest_bytes": len(refilled),
        **{f"index_append_{k}_ms": round(1000 * statistics.median(v), 1) for k, v in times.items()},
    }


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    return my - b * mx, b


def _project(n: int, a: float, b: float, pattern: str) -> float:
    """Seconds to drain ``n`` entries if one dequeue of a manifest of s bytes costs a + b s."""
    total, remaining = 0.0, n
    for step in _steps(n, pattern):
        total += a + b * (22 + 82 * remaining)  # the dequeue reads then writes what is left
        remaining -= step
    return total


def run(quick: bool) -> dict[str, Any]:
    sizes = QUICK_SIZES if quick else SIZES
    drain_sizes = QUICK_DRAIN_SIZES if quick else DRAIN_SIZES
    head_sizes = QUICK_HEAD_SIZES if quick else HEAD_SIZES
    if os.environ.get("MILLPOND_BENCH_SIZES"):
        sizes = tuple(int(v) for v in os.environ["MILLPOND_BENCH_SIZES"].split(","))
        drain_sizes = tuple(s for s in drain_sizes if s in sizes)
        head_sizes = tuple(s for s in head_sizes if s in sizes)
    delay = latency_ms(DEFAULT_LATENCY_MS)
    rows: list[dict[str, Any]] = []
    drains: list[dict[str, Any]] = []
    heads: dict[int, float] = {}
    with seaweedfs_endpoints(delay) as endpoints:
        direct, measured = endpoints.direct, endpoints.measured
        _ops(direct, measured, _build(0), 0, 1)  # warm-up: connections, first volume writes
        empty = _ops(direct, measured, _build(0), 0, REPEATS)
        for n in sizes:
            built = time.perf_counter()
            raw = _build(n)
            logger.info(
                "built %s entries (%s bytes) in %.1f s", n, len(raw), time.perf_counter() - built
            )
            rows.append(_ops(direct, measured, raw, n, REPEATS))
            rows[-1].update(_indexed_appends(direct, measured, raw, n))
            logger.info("%s", {k: v for k, v in rows[-1].items() if k != "samples"})
            if n in head_sizes:
                heads[n] = _status_heads(direct, measured, raw, n)
            for pattern in ("every_100", "proportional", "index"):
                if pattern != "every_100" or n in drain_sizes:
                    drains.append(_drain(direct, measured, raw, n, pattern))
                    logger.info("drain %s", drains[-1])
            del raw
        empty_again = _ops(direct, measured, _build(0), 0, REPEATS)
    base_cold = statistics.fmean([empty["append_cold_ms"], empty_again["append_cold_ms"]])
    base_warm = statistics.fmean([empty["append_warm_ms"], empty_again["append_warm_ms"]])
    for r in rows:
        r["append_cold_over_empty"] = round(r["append_cold_ms"] / base_cold, 2)
        r["append_warm_over_empty"] = round(r["append_warm_ms"] / base_warm, 2)
    a, b = _fit([(r["manifest_bytes"], r["dequeue_100_ms"] / 1000) for r in rows])
    for r in rows:
        r["index_worst_append_cold_over_empty"] = round(
            r["index_append_worst_cold_ms"] / base_cold, 2
        )
    projection = {
        n: {
            "every_100_s": round(_project(n, a, b, "every_100"), 1),
            "proportional_s": round(_project(n, a, b, "proportional"), 1),
        }
        for n in sizes
    }
    largest = rows[-1]
    ratio = largest["index_worst_append_cold_over_empty"]
    xs = [r["entries"] for r in rows]

    def drained(pattern: str) -> list[float]:
        found = {d["entries"]: d["seconds"] for d in drains if d["pattern"] == pattern}
        return [found.get(n, float("nan")) for n in xs]

    series = [
        plot_spec(
            f"cost of one operation vs backlog ({delay:g} ms per request)",
            "entries waiting",
            "ms",
            xs,
            {
                "append, no index (cold: GET + PUT)": [r["append_cold_ms"] for r in rows],
                "append, no index (warm: PUT)": [r["append_warm_ms"] for r in rows],
                "append, index on, worst (cold)": [r["index_append_worst_cold_ms"] for r in rows],
                "append, index on, after a move (cold)": [r["index_append_cold_ms"] for r in rows],
                "dequeue 100": [r.get("dequeue_100_ms", float("nan")) for r in rows],
                "status": [r["status_ms"] for r in rows],
                "GC pass": [r["gc_pass_ms"] for r in rows],
                "decode (CPU only)": [r["decode_cpu_ms"] for r in rows],
            },
            log_x=True,
            log_y=True,
            hline=("2x empty-queue append", 2 * base_cold),
        ),
        plot_spec(
            "draining the backlog (manifest side)",
            "entries waiting",
            "seconds",
            xs,
            {
                "every 100 acks, projected": [projection[n]["every_100_s"] for n in xs],
                "every 100 acks, measured": drained("every_100"),
                "proportional (consumer's rule), measured": drained("proportional"),
                "index on (move + head writes), measured": drained("index"),
            },
            log_x=True,
            log_y=True,
        ),
    ]
    return make_result(
        NAME,
        ratio=ratio,
        target=TARGET,
        target_op="<=",
        figures={
            "latency_ms": delay,
            "by_size": rows,
            "drains": drains,
            "dequeue_fit": {"a_s": round(a, 4), "b_s_per_mb": round(b * 1e6, 4)},
            "drain_projection_s": projection,
            "status_with_heads_s": {str(k): round(v, 2) for k, v in heads.items()},
            "bytes_per_entry": round((largest["manifest_bytes"] - 22) / largest["entries"], 1),
        },
        baseline={
            "append_cold_empty_ms": round(base_cold, 1),
            "append_warm_empty_ms": round(base_warm, 1),
            "empty_runs": [empty, empty_again],
        },
        series=series,
        headline=(
            f"{delay:g} ms: append at {largest['entries']:,} entries with the index "
            f"{ratio:.1f}x empty ({largest['index_append_worst_cold_ms']:.0f} vs "
            f"{base_cold:.0f} ms; {largest['append_cold_over_empty']:.1f}x without); drain "
            f"{drained('proportional')[-1]:.0f} s proportional, {drained('index')[-1]:.0f} s "
            f"with the index vs {projection[largest['entries']]['every_100_s']:.0f} s every "
            "100 (projected)"
        ),
        notes=(
            "ratio = cold append (fresh producer: GET + conditional PUT) with the backlog "
            "index on and the manifest one entry short of the next move, at the largest "
            "backlog / the same on an empty queue; drain projection = sum over the dequeues "
            "of a + b x manifest bytes, fitted to the measured dequeue costs"
        ),
    )


def _index_config(store: Any) -> Any:
    """A consumer with the backlog index on, its mover thread kept out of the timings."""
    from millpond.consumer import ConsumerConfig

    return ConsumerConfig(
        store=store,
        manifest_path=MANIFEST,
        data_path_prefix="ingest",
        gc_enabled=False,
        backlog_index=True,
        backlog_index_interval=3600.0,
    )
