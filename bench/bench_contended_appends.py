"""Bare ``QueueProducer.append`` loops at real object-store latency: throughput and fairness.

Issue 11: at 50 ms per request, committed appends/s of N = 1..8 contending writers against a
lone writer, and their append latency. Target at N = 8: appends/s >= 0.9 of the lone writer
and p99 append latency <= 10x p50.

Setup: SeaweedFS on 127.0.0.1 behind the latency proxy (``DEFAULT_LATENCY_MS``, or
``--latency-ms``), so every GET and conditional PUT pays the delay. For each retry policy and
each N, N OS processes (spawned) are released together, each running a ``QueueProducer`` with
that policy for ``seconds``: locations "arrive" at ``RATE_PER_PRODUCER`` per second, and every
append commits all locations that arrived since its last commit, at least one (group commit),
so appends are back to back. Each append's latency runs from its call to its return. An append
that gives up (``StorageError``) is counted, and the writer checks the manifest before trying
the same locations again, as the producer does.

Baseline: the lone writer (N = 1, default policy), run first and again last; its mean
appends/s and p50 latency. Every figure is a ratio against it.

``ratio`` (target <= 1.0) judges the default policy at the largest N: the worse of the two
targets as a fraction of its limit, ``max(0.9 / (appends/s ratio), (p99 / p50) / 10)``.
Other policies are measured in the same run and reported beside it.

Fairness: each writer's share of the commits; Jain's index ``(sum x)^2 / (n sum x^2)`` is 1
when all writers commit equally and ``1/n`` when one writer takes everything.

Knobs for experiments (not for ``make bench``): ``MILLPOND_BENCH_COUNTS=1,8``,
``MILLPOND_BENCH_SECONDS=10``, ``MILLPOND_BENCH_POLICIES=default,exponential``,
``MILLPOND_BENCH_AGING=contended_yield=1,conflict_spread=1`` (fields of ``RetryPolicy``).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import uuid
from typing import Any

from bench.bench_manifest_appends import _collect, _entry, _percentile
from bench.common import latency_ms, make_result, plot_spec, report_to, seaweedfs_endpoints

logger = logging.getLogger(__name__)

NAME = "contended_appends"
DEFAULT_LATENCY_MS = 50.0
TARGET = 1.0
THROUGHPUT_LIMIT = 0.9  # appends/s >= 0.9x the lone writer
TAIL_LIMIT = 10.0  # p99 <= 10x p50
MANIFEST = "ingest/manifest"
COUNTS = (1, 2, 4, 8)
QUICK_COUNTS = (1, 8)
RATE_PER_PRODUCER = 20.0  # one batch every 50 ms
FULL_SECONDS = 15.0
QUICK_SECONDS = 5.0
START_TIMEOUT = 120.0
POLICIES = ("default", "exponential")  # the default (aging) and the strategy it replaced


def policy(name: str) -> Any:
    """The retry policy a benchmark run names: ``default`` is the producer's (``aging``
    since issue 11); a strategy's name is the producer's policy with that strategy."""
    from millpond.producer import ProducerConfig

    default = ProducerConfig(store="memory://bench", wal_dir="/nonexistent").retry
    if name == "default":
        return default
    import dataclasses

    from millpond.common.retry import STRATEGIES

    if name not in STRATEGIES:
        raise ValueError(f"policy: expected default or one of {STRATEGIES}, found {name}")
    # MILLPOND_BENCH_AGING="contended_yield=1,conflict_spread=1" tunes the aging strategy.
    tuning = {
        key: float(value)
        for key, _, value in (
            item.partition("=") for item in os.environ.get("MILLPOND_BENCH_AGING", "").split(",")
        )
        if key
    }
    return dataclasses.replace(default, strategy=name, **tuning)


def _append_loop(
    url: str, options: dict[str, str], seconds: float, policy_name: str, barrier: Any
) -> dict[str, Any]:
    from millpond.common.ulids import UlidMinter, batch_location
    from millpond.errors import StorageError
    from millpond.formats.manifest import find_locations
    from millpond.queue import QueueProducer
    from millpond.storage import open_store

    store = open_store(url, options)
    producer = QueueProducer(store, MANIFEST, retry=policy(policy_name))
    minter = UlidMinter()
    barrier.wait(timeout=START_TIMEOUT)
    start = time.monotonic()
    deadline = start + seconds
    committed = 0
    gave_up = 0
    # (seconds after start when the append returned, locations in it, latency)
    commits: list[tuple[float, int, float]] = []
    while (now := time.monotonic()) < deadline:
        arrived = int((now - start) * RATE_PER_PRODUCER)
        group = max(1, arrived - committed)
        now_ms = int(time.time() * 1000)
        entries = [_entry(batch_location("ingest", minter.mint()), now_ms) for _ in range(group)]
        while True:
            try:
                producer.append(entries)
                break
            except StorageError:
                # The producer's way: look whether the group landed before appending it again.
                gave_up += 1
                found = find_locations(store.get(MANIFEST).data, {e.location for e in entries})
                if found:
                    break
        done = time.monotonic()
        commits.append((done - start, group, done - now))
        committed += group
    return {
        "commits": commits,
        "committed": committed,
        "gave_up": gave_up,
        "counters": producer.counters.snapshot(),
    }


def _run(ctx: Any, endpoint: Any, n: int, seconds: float, policy_name: str) -> dict[str, Any]:
    from millpond.queue import read_manifest
    from millpond.storage import open_store

    url = endpoint.url_for(f"bench-contended-{policy_name}-{n}-{uuid.uuid4().hex[:8]}")
    options = endpoint.store_options()
    barrier = ctx.Barrier(n)
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=report_to,
            args=(out, _append_loop, url, options, seconds, policy_name, barrier),
            name=f"bench-writer-{i}",
        )
        for i in range(n)
    ]
    for proc in procs:
        proc.start()
    outs = _collect(out, procs, START_TIMEOUT + seconds * 30)
    manifest = read_manifest(open_store(url, options), MANIFEST).manifest
    committed = sum(o["committed"] for o in outs)
    if len(manifest.entries) != committed:
        raise RuntimeError(
            f"{policy_name} N={n}: manifest holds {len(manifest.entries)} entries, writers "
            f"committed {committed}"
        )
    inside = [c for o in outs for c in o["commits"] if c[0] <= seconds]
    latencies = sorted(c[2] for o in outs for c in o["commits"])
    shares = [sum(1 for c in o["commits"] if c[0] <= seconds) for o in outs]
    jain = sum(shares) ** 2 / (n * sum(x * x for x in shares)) if any(shares) else 0.0
    counters = {
        key: sum(o["counters"].get(key, 0) for o in outs)
        for key in ("manifest_reads", "manifest_writes", "cas_conflicts")
    }
    appends = len(inside)
    return {
        "policy": policy_name,
        "writers": n,
        "appends": appends,
        "appends_per_s": round(appends / seconds, 2),
        "locations_per_s": round(sum(c[1] for c in inside) / seconds, 1),
        "mean_group": round(sum(c[1] for c in inside) / max(1, appends), 2),
        "p50_ms": round(1000 * _percentile(latencies, 0.50), 1),
        "p90_ms": round(1000 * _percentile(latencies, 0.90), 1),
        "p99_ms": round(1000 * _percentile(latencies, 0.99), 1),
        "max_ms": round(1000 * latencies[-1], 1),
        "gave_up": sum(o["gave_up"] for o in outs),
        "requests_per_append": round(
            (counters["manifest_reads"] + counters["manifest_writes"]) / max(1, len(latencies)), 2
        ),
        "conflicts_per_append": round(counters["cas_conflicts"] / max(1, len(latencies)), 2),
        "commit_shares": sorted(shares),
        "jain_fairness": round(jain, 3),
        "seconds": seconds,
    }


def run(quick: bool) -> dict[str, Any]:
    counts: tuple[int, ...] = QUICK_COUNTS if quick else COUNTS
    seconds = QUICK_SECONDS if quick else FULL_SECONDS
    if os.environ.get("MILLPOND_BENCH_COUNTS"):
        counts = tuple(int(v) for v in os.environ["MILLPOND_BENCH_COUNTS"].split(","))
    if os.environ.get("MILLPOND_BENCH_SECONDS"):
        seconds = float(os.environ["MILLPOND_BENCH_SECONDS"])
    policies = (
        tuple(p for p in os.environ.get("MILLPOND_BENCH_POLICIES", "").split(",") if p) or POLICIES
    )
    delay = latency_ms(DEFAULT_LATENCY_MS)
    ctx = mp.get_context("spawn")
    runs: list[dict[str, Any]] = []
    with seaweedfs_endpoints(delay) as endpoints:
        endpoint = endpoints.measured
        _run(ctx, endpoint, 1, min(2.0, seconds), "default")  # warm the server and the proxy
        lone = [_run(ctx, endpoint, 1, seconds, "default")]
        for name in policies:
            for n in counts:
                if n == 1 and name == "default":
                    continue
                runs.append(_run(ctx, endpoint, n, seconds, name))
                logger.info("%s", {k: v for k, v in runs[-1].items() if k != "commit_shares"})
        lone.append(_run(ctx, endpoint, 1, seconds, "default"))
    lone_rate = sum(r["appends_per_s"] for r in lone) / len(lone)
    lone_p50 = sum(r["p50_ms"] for r in lone) / len(lone)
    by_policy: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
    if "default" in by_policy:
        by_policy["default"].append({**lone[0], "appends_per_s": round(lone_rate, 2)})
    for r in runs:
        r["throughput_ratio"] = round(r["appends_per_s"] / lone_rate, 3)
        r["p99_over_p50"] = round(r["p99_ms"] / r["p50_ms"], 2)
        r["p50_over_lone_p50"] = round(r["p50_ms"] / lone_p50, 2)
        r["p99_over_lone_p50"] = round(r["p99_ms"] / lone_p50, 2)
        by_policy[r["policy"]].append(r)
    for rows in by_policy.values():
        rows.sort(key=lambda r: r["writers"])
        for r in rows:
            r.setdefault("throughput_ratio", round(r["appends_per_s"] / lone_rate, 3))
            r.setdefault("p99_over_p50", round(r["p99_ms"] / r["p50_ms"], 2))
    judged_policy = "default" if "default" in by_policy else policies[0]
    judged = by_policy[judged_policy][-1]
    ratio = max(
        THROUGHPUT_LIMIT / max(judged["throughput_ratio"], 1e-9),
        judged["p99_over_p50"] / TAIL_LIMIT,
    )
    xs = list(counts)

    def line(key: str) -> dict[str, list[float]]:
        return {
            name: [next((r[key] for r in rows if r["writers"] == n), float("nan")) for n in xs]
            for name, rows in by_policy.items()
        }

    series = [
        plot_spec(
            "committed appends/s / lone writer",
            "writer processes",
            "ratio",
            xs,
            line("throughput_ratio"),
            log_x=True,
            hline=("target >= 0.9", THROUGHPUT_LIMIT),
        ),
        plot_spec(
            "append latency p99 / p50",
            "writer processes",
            "ratio",
            xs,
            line("p99_over_p50"),
            log_x=True,
            log_y=True,
            hline=("target <= 10", TAIL_LIMIT),
        ),
        plot_spec(
            "append latency p99 (ms)",
            "writer processes",
            "ms",
            xs,
            line("p99_ms"),
            log_x=True,
            log_y=True,
        ),
        plot_spec(
            "fairness (Jain's index of commits per writer)",
            "writer processes",
            "index (1 = equal)",
            xs,
            line("jain_fairness"),
            log_x=True,
        ),
    ]
    others = ", ".join(
        f"{name}: {rows[-1]['throughput_ratio']:.2f}x, p99/p50 {rows[-1]['p99_over_p50']:.1f}"
        for name, rows in by_policy.items()
        if name != judged_policy and rows
    )
    return make_result(
        NAME,
        ratio=ratio,
        target=TARGET,
        target_op="<=",
        figures={
            "latency_ms": delay,
            "judged_policy": judged_policy,
            "judged_writers": judged["writers"],
            "by_policy": by_policy,
            "rate_per_writer": RATE_PER_PRODUCER,
            "seconds_per_run": seconds,
        },
        baseline={
            "lone_appends_per_s": round(lone_rate, 2),
            "lone_p50_ms": round(lone_p50, 1),
            "lone_runs": lone,
        },
        series=series,
        headline=(
            f"{delay:g} ms, N={judged['writers']} {judged_policy}: "
            f"{judged['throughput_ratio']:.2f}x lone appends/s, p99/p50 "
            f"{judged['p99_over_p50']:.1f} (p99 {judged['p99_ms']:.0f} ms)"
            + (f"; {others}" if others else "")
        ),
        notes=(
            "ratio = max(0.9 / (appends/s over the lone writer's), (p99/p50) / 10) for the "
            "judged policy at the largest N; lone writer = N=1 default policy, run first and "
            "last, mean"
        ),
    )
