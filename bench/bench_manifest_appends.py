"""Committed manifest appends/s with 1..32 producer processes on SeaweedFS.

DESIGN.md "Performance": committed manifest appends/s against one writer doing back-to-back
CAS on the same key, measured side by side in the same run; target: no collapse, ratio >= 0.9
at every N, and locations/s growing with N through group commit.

For each N a fresh manifest key is used and two things run back to back:

* **N producers** — N OS processes (spawned), released together, each running a
  ``QueueProducer`` with the default ``RetryPolicy`` for ``duration`` seconds. Batch locations
  "arrive" at each producer at ``rate`` per second (a producer flushing a batch every
  ``1/rate`` s); every append commits all locations that arrived since its last commit (group
  commit), and at least one, so producers are never idle and appends are back to back.
* **baseline** — one process doing back-to-back raw compare-and-swap on its own fresh key:
  ``put_if_match`` with the ETag of its previous write, appending the same mean group size
  through the pure wire-format function, no queue logic, no contention. Its object grows as the
  producers' manifest does, so both write the same bytes per request.

Per N the runs go baseline, producers, baseline (twice over in a full run) and each producer
run is compared with the mean of the baselines on either side. The ratio at N is producers'
committed appends/s over that baseline CAS/s; the benchmark's ratio is the minimum over N.
Only commits that returned inside the window count.

Knobs for experiments (not for ``make bench``): ``MILLPOND_BENCH_COUNTS=8,16,32``,
``MILLPOND_BENCH_SECONDS=4``, ``MILLPOND_BENCH_RETRY=base_delay,max_delay``.
"""

from __future__ import annotations

import itertools
import logging
import math
import multiprocessing as mp
import os
import queue
import time
import uuid
from typing import Any

from bench.common import make_result, plot_spec, report_to, seaweedfs_endpoint

logger = logging.getLogger(__name__)

NAME = "manifest_appends"
TARGET = 0.9
MANIFEST = "ingest/manifest"
PRODUCER_COUNTS = (1, 2, 4, 8, 16, 32)
QUICK_PRODUCER_COUNTS = (1, 4, 16, 32)
RATE_PER_PRODUCER = 100.0  # locations/s arriving at each producer (one flush every 10 ms)
FULL_SECONDS = 5.0
QUICK_SECONDS = 2.0
FULL_REPEATS = 2  # producer runs per N, each between two baseline runs
QUICK_REPEATS = 1
START_TIMEOUT = 120.0


def _entry(location: str, now_ms: int) -> Any:
    from millpond.formats.manifest import Metadata, PendingEntry

    return PendingEntry(location, (Metadata(0, now_ms, b"source=bench-0001"),))


def _retry_policy() -> Any:
    """The default ``RetryPolicy``, or ``MILLPOND_BENCH_RETRY=base_delay,max_delay`` to compare."""
    from millpond.common.retry import RetryPolicy

    override = os.environ.get("MILLPOND_BENCH_RETRY")
    if not override:
        return RetryPolicy()
    base, cap = (float(v) for v in override.split(","))
    return RetryPolicy(base_delay=base, max_delay=cap)


def _produce(
    url: str, options: dict[str, str], seconds: float, rate: float, barrier: Any
) -> dict[str, Any]:
    """One producer process: group-commit appends for ``seconds`` after the barrier."""
    from millpond.common.ulids import UlidMinter, batch_location
    from millpond.queue import QueueProducer
    from millpond.storage import open_store

    store = open_store(url, options)
    producer = QueueProducer(store, MANIFEST, retry=_retry_policy())
    minter = UlidMinter()
    barrier.wait(timeout=START_TIMEOUT)
    start = time.monotonic()
    deadline = start + seconds
    locations = 0
    # (seconds after start when the commit returned, locations in it, latency)
    commits: list[tuple[float, int, float]] = []
    counters_at_deadline: dict[str, int] | None = None
    while (now := time.monotonic()) < deadline:
        arrived = int((now - start) * rate)
        group = max(1, arrived - locations)
        now_ms = int(time.time() * 1000)
        entries = [_entry(batch_location("ingest", minter.mint()), now_ms) for _ in range(group)]
        producer.append(entries)
        done = time.monotonic()
        commits.append((done - start, group, done - now))
        locations += group
        if done >= deadline and counters_at_deadline is None:
            counters_at_deadline = producer.counters.snapshot()
    return {
        "commits": commits,
        "counters": counters_at_deadline or producer.counters.snapshot(),
        "total_locations": locations,
    }


def _cas_back_to_back(
    url: str, options: dict[str, str], seconds: float, group: int
) -> dict[str, Any]:
    """One writer doing back-to-back CAS on one key, growing it like the manifest grows."""
    from millpond.common.ulids import UlidMinter, batch_location
    from millpond.formats.manifest import append_entries, empty_manifest
    from millpond.storage import open_store

    store = open_store(url, options)
    minter = UlidMinter()
    data = empty_manifest()
    etag = store.put_if_absent(MANIFEST, data)
    start = time.monotonic()
    deadline = start + seconds
    writes = 0
    while time.monotonic() < deadline:
        now_ms = int(time.time() * 1000)
        entries = [_entry(batch_location("ingest", minter.mint()), now_ms) for _ in range(group)]
        data, _ = append_entries(data, entries)
        assert etag is not None
        etag = store.put_if_match(MANIFEST, data, etag)
        if time.monotonic() <= deadline:
            writes += 1
    return {"writes": writes, "bytes": len(data)}


def _run_producers(ctx: Any, endpoint: Any, n: int, seconds: float, rate: float) -> dict[str, Any]:
    url = endpoint.url_for(f"bench-appends-{n}-{uuid.uuid4().hex[:8]}")
    options = endpoint.store_options()
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=report_to,
            args=(results, _produce, url, options, seconds, rate, barrier),
            name=f"bench-producer-{i}",
        )
        for i in range(n)
    ]
    for proc in procs:
        proc.start()
    outs = _collect(results, procs, START_TIMEOUT + seconds * 20)
    from millpond.queue import read_manifest
    from millpond.storage import open_store

    snapshot = read_manifest(open_store(url, options), MANIFEST)
    total_locations = sum(o["total_locations"] for o in outs)
    if len(snapshot.manifest.entries) != total_locations:
        raise RuntimeError(
            f"N={n}: manifest holds {len(snapshot.manifest.entries)} entries, producers "
            f"committed {total_locations}"
        )
    # Only commits that returned inside the window count: a producer that was backing off
    # at the deadline finishes alone afterwards, which is not steady state.
    inside = [c for o in outs for c in o["commits"] if c[0] <= seconds]
    appends = len(inside)
    locations = sum(c[1] for c in inside)
    latencies = sorted(c[2] for o in outs for c in o["commits"])
    conflicts = sum(o["counters"].get("cas_conflicts", 0) for o in outs)
    return {
        "producers": n,
        "appends": appends,
        "locations": locations,
        "seconds": seconds,
        "appends_per_s": round(appends / seconds, 1),
        "locations_per_s": round(locations / seconds, 1),
        "mean_group": round(locations / appends, 2),
        "cas_conflicts": conflicts,
        "conflicts_per_append": round(conflicts / appends, 3),
        "manifest_reads": sum(o["counters"].get("manifest_reads", 0) for o in outs),
        "manifest_writes": sum(o["counters"].get("manifest_writes", 0) for o in outs),
        "append_p50_ms": round(1000 * _percentile(latencies, 0.50), 2),
        "append_p99_ms": round(1000 * _percentile(latencies, 0.99), 2),
        "append_max_ms": round(1000 * latencies[-1], 2),
        "manifest_bytes": snapshot.size,
    }


def _measure(
    ctx: Any, endpoint: Any, n: int, seconds: float, group: int, repeats: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Baseline, N producers, baseline, ... ``repeats`` times; figures summed over the repeats.

    Every producer run sits between two baseline runs and its ratio uses their mean, so drift
    of the server (or load from other processes on the machine) weighs on both sides alike.
    The first baseline uses the previous N's group size, later ones this N's.
    """
    baseline_runs = [_run_baseline(ctx, endpoint, seconds, group)]
    runs = []
    for _ in range(repeats):
        runs.append(_run_producers(ctx, endpoint, n, seconds, RATE_PER_PRODUCER))
        group = max(1, math.floor(runs[-1]["mean_group"] + 0.5))
        baseline_runs.append(_run_baseline(ctx, endpoint, seconds, group))
    # Each producer run against the mean of the baselines on either side of it.
    around = [
        (baseline_runs[i]["cas_per_s"] + baseline_runs[i + 1]["cas_per_s"]) / 2
        for i in range(repeats)
    ]
    total_seconds = seconds * repeats
    summed = {
        key: sum(r[key] for r in runs)
        for key in ("appends", "locations", "cas_conflicts", "manifest_reads", "manifest_writes")
    }
    figures: dict[str, Any] = {
        "producers": n,
        **summed,
        "seconds": total_seconds,
        "appends_per_s": round(summed["appends"] / total_seconds, 1),
        "locations_per_s": round(summed["locations"] / total_seconds, 1),
        "mean_group": round(summed["locations"] / summed["appends"], 2),
        "conflicts_per_append": round(summed["cas_conflicts"] / summed["appends"], 3),
        "append_p50_ms": max(r["append_p50_ms"] for r in runs),
        "append_p99_ms": max(r["append_p99_ms"] for r in runs),
        "append_max_ms": max(r["append_max_ms"] for r in runs),
        "manifest_bytes": max(r["manifest_bytes"] for r in runs),
        "baseline_cas_per_s": round(sum(around) / repeats, 1),
        "ratio": round(summed["appends"] / seconds / sum(around), 3),
        "runs": runs,
    }
    baseline = {"cas_per_s": figures["baseline_cas_per_s"], "runs": baseline_runs}
    return figures, baseline


def _collect(results: Any, procs: list[Any], timeout: float) -> list[dict[str, Any]]:
    """One result per process; fails fast when a process dies or reports an error."""
    deadline = time.monotonic() + timeout
    outs: list[dict[str, Any]] = []
    while len(outs) < len(procs):
        try:
            out = results.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with {dead[0].exitcode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"no result from {len(procs) - len(outs)} processes") from None
            continue
        if "error" in out:
            raise RuntimeError(f"a worker process failed: {out['error']}")
        outs.append(out)
    for proc in procs:
        proc.join(timeout=60)
    return outs


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _run_baseline(ctx: Any, endpoint: Any, seconds: float, group: int) -> dict[str, Any]:
    url = endpoint.url_for(f"bench-baseline-{uuid.uuid4().hex[:8]}")
    results = ctx.Queue()
    proc = ctx.Process(
        target=report_to,
        args=(results, _cas_back_to_back, url, endpoint.store_options(), seconds, group),
        name="bench-baseline",
    )
    proc.start()
    (out,) = _collect(results, [proc], START_TIMEOUT + seconds * 20)
    return {
        "group": group,
        "writes": out["writes"],
        "seconds": seconds,
        "cas_per_s": round(out["writes"] / seconds, 1),
        "object_bytes": out["bytes"],
    }


def run(quick: bool) -> dict[str, Any]:
    counts: tuple[int, ...] = QUICK_PRODUCER_COUNTS if quick else PRODUCER_COUNTS
    seconds = QUICK_SECONDS if quick else FULL_SECONDS
    repeats = QUICK_REPEATS if quick else FULL_REPEATS
    if os.environ.get("MILLPOND_BENCH_COUNTS"):
        counts = tuple(int(v) for v in os.environ["MILLPOND_BENCH_COUNTS"].split(","))
    if os.environ.get("MILLPOND_BENCH_SECONDS"):
        seconds = float(os.environ["MILLPOND_BENCH_SECONDS"])
    ctx = mp.get_context("spawn")
    per_n: list[dict[str, Any]] = []
    baselines: list[dict[str, Any]] = []
    with seaweedfs_endpoint() as endpoint:
        # Warm the server up (first writes to a fresh volume are slower).
        _run_baseline(ctx, endpoint, min(1.0, seconds), 1)
        group = 1
        for n in counts:
            figures, baseline = _measure(ctx, endpoint, n, seconds, group, repeats)
            group = max(1, math.floor(figures["mean_group"] + 0.5))
            logger.info(
                "N=%s: %s appends/s (%s locations/s, group %s, %s conflicts) vs baseline %s CAS/s"
                " -> ratio %s",
                n,
                figures["appends_per_s"],
                figures["locations_per_s"],
                figures["mean_group"],
                figures["cas_conflicts"],
                baseline["cas_per_s"],
                figures["ratio"],
            )
            per_n.append(figures)
            baselines.append({"producers": n, **baseline})
    ratio = min(f["ratio"] for f in per_n)
    xs = [f["producers"] for f in per_n]
    locations_grow = all(
        b["locations_per_s"] >= a["locations_per_s"] * 0.9 for a, b in itertools.pairwise(per_n)
    )
    series = [
        plot_spec(
            "committed appends/s vs single-writer CAS/s",
            "producer processes",
            "per second",
            xs,
            {
                "appends/s (N producers)": [f["appends_per_s"] for f in per_n],
                "baseline CAS/s (1 writer)": [f["baseline_cas_per_s"] for f in per_n],
            },
            log_x=True,
        ),
        plot_spec(
            "ratio (target >= 0.9)",
            "producer processes",
            "appends/s / baseline",
            xs,
            {"ratio": [f["ratio"] for f in per_n]},
            log_x=True,
            hline=("target", TARGET),
        ),
        plot_spec(
            "group commit",
            "producer processes",
            "per second",
            xs,
            {
                "locations/s": [f["locations_per_s"] for f in per_n],
                "conflicts/s": [round(f["cas_conflicts"] / f["seconds"], 1) for f in per_n],
            },
            log_x=True,
        ),
    ]
    worst = min(per_n, key=lambda f: f["ratio"])
    return make_result(
        NAME,
        ratio=ratio,
        target=TARGET,
        figures={
            "per_producer_count": per_n,
            "locations_per_s_grows_with_n": locations_grow,
            "rate_per_producer": RATE_PER_PRODUCER,
            "seconds_per_run": seconds,
            "repeats": repeats,
        },
        baseline={"per_producer_count": baselines},
        series=series,
        headline=(
            f"min ratio {ratio:.2f} at N={worst['producers']}; locations/s "
            f"{per_n[0]['locations_per_s']:.0f} (N={xs[0]}) -> {per_n[-1]['locations_per_s']:.0f} "
            f"(N={xs[-1]})"
        ),
        notes=(
            "ratio = committed appends/s of N producer processes / back-to-back CAS/s of one "
            "writer on its own key, same group size, same run; the benchmark ratio is the "
            "minimum over N"
        ),
    )
