"""``produce()`` -> ``wait()`` latency of N producer processes at real object-store latency.

Issue 11 / DESIGN.md "Performance": N = 1, 2, 4, 8, 16 producer processes, each producing every
50 ms, the store 50 ms a request away. Target at every N: ``wait()`` p50 <= 3x and p99 <= 6x
the lone producer's p50, locations appended per second growing with N, and no "gave up"
warnings.

Setup: SeaweedFS on 127.0.0.1 behind the latency proxy (``DEFAULT_LATENCY_MS`` or
``--latency-ms``). For each policy and each N, N OS processes (spawned) each open a real
``Producer`` (its own WAL directory, ``wal_sync="always"``, ``flush_interval=0.1``) on one
fresh queue root and are released together. Each makes one ``produce()`` call of one 64-byte
entry every ``PERIOD`` seconds on a fixed schedule, for ``warm-up + seconds``; a thread in the
same process waits on the handles in order and records when each ``wait()`` returned. Only
calls made after the warm-up count. Locations/s is the producers' ``batches_committed`` over
the measured window. Every WARNING a producer logs is counted, and those whose text says "gave
up" separately. No consumer runs (the manifest grows by a few hundred KB per run, which costs
nothing measurable at this latency).

Policies, all measured in every run:

* ``default`` (judged): ``ProducerConfig``'s defaults. On an S3 store the producers of a queue
  on one machine share a coordinator the first of them hosts on 127.0.0.1
  (``host_coordinator``), so one compare-and-swap carries all their appends; ``shared`` says
  whether every row made more than 90 % of its appends through it.
* ``direct``: every producer appends itself (``host_coordinator=False``), lost races paced by
  age (the default retry policy). Held to the same targets, reported as ``direct_ratio``,
  ``direct_passed`` and the summary row ``wait_latency/direct``.
* ``exponential``: directly, lost races backing off exponentially (before issue 11).
* ``coordinator``: the N producers append through one ``millpond coordinator`` process serving
  the queue (started with ``--create``, stopped with SIGTERM after the run), one compare-and-
  swap per round; their direct appends (fallback) use the default retry policy. Its target
  (issue 11): p99 <= 3x the lone producer's p50 at N = 16, reported as
  ``coordinator_p99_over_lone_p50_at_max_n`` and ``coordinator_passed`` (``through_coordinator``
  per row: the share of appends the coordinator made; the rest fell back), and the summary row
  ``wait_latency/coordinator``.

Baseline: the faster of two lone producers in the same run, one with the defaults (hosting a
coordinator for itself) and one appending directly: its ``wait()`` p50.

``ratio`` (target <= 1.0), for the default policy: the worst over N of
``max(p50 / (3 x lone p50), p99 / (6 x lone p50))``. CPU: the producers' own CPU seconds over
the window, as a share of the machine (a figure near 1 means the machine, not the store, set
the pace).

Knobs for experiments (not for ``make bench``): ``MILLPOND_BENCH_COUNTS=1,4``,
``MILLPOND_BENCH_SECONDS=10``, ``MILLPOND_BENCH_POLICIES=default,direct``, ``aging`` with
``MILLPOND_BENCH_AGING=win_streak=1`` (direct appends, a tuned retry policy),
``MILLPOND_BENCH_COORDINATOR_ARGS="--yield-every 6"`` (extra ``millpond coordinator`` arguments),
``MILLPOND_BENCH_CONSUMER=1``: a consumer drains each row's queue while it runs
(:mod:`bench.draining_consumer`; its figures go in the row's ``consumer``), as in a deployment,
where every dequeue is one more write of the manifest; in coordinator rows its dequeues go
through the coordinator (``ConsumerConfig.coordinator``), or directly with
``MILLPOND_BENCH_CONSUMER=direct``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.bench_contended_appends import policy
from bench.bench_latency import _percentile
from bench.bench_manifest_appends import _collect
from bench.common import (
    latency_ms,
    make_result,
    plot_spec,
    report_to,
    seaweedfs_endpoints,
    stop_child,
)
from bench.draining_consumer import draining_consumer

logger = logging.getLogger(__name__)

NAME = "wait_latency"
DEFAULT_LATENCY_MS = 50.0
TARGET = 1.0
P50_LIMIT = 3.0
P99_LIMIT = 6.0
COUNTS = (1, 2, 4, 8, 16)
QUICK_COUNTS = (1, 4, 16)
PERIOD = 0.05  # one produce() call every 50 ms per producer
FULL_SECONDS = 20.0
QUICK_SECONDS = 6.0
WARMUP = 3.0
START_TIMEOUT = 300.0
PERCENTILES = (50, 90, 99, 100)
DEFAULT = "default"
"""The policy name of runs with ``ProducerConfig``'s defaults: on an S3 store the producers on
one machine share a coordinator one of them hosts (``host_coordinator``)."""
DIRECT = "direct"
"""Every producer appends directly (``host_coordinator=False``) with the default retry policy
(lost races paced by age)."""
EXPONENTIAL = "exponential"
"""Directly, lost races backing off exponentially (the strategy before issue 11)."""
COORDINATED = "coordinator"
"""The policy name of runs whose producers append through a ``millpond coordinator``."""
POLICIES = (DEFAULT, DIRECT, EXPONENTIAL, COORDINATED)
RETRY = {DEFAULT: "default", DIRECT: "default", COORDINATED: "default"}
"""The retry policy (``bench_contended_appends.policy``) of each run's direct appends."""
COORDINATOR_P99_LIMIT = 3.0


class _Warnings(logging.Handler):
    """Counts the producer's WARNING records; keeps a few for the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.gave_up = 0
        self.samples: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.count += 1
        if "gave up" in message:
            self.gave_up += 1
        if len(self.samples) < 3:
            self.samples.append(message[:300])


def _produce(
    url: str,
    options: dict[str, str],
    wal_dir: str,
    seconds: float,
    policy_name: str,
    barrier: Any,
    coordinator: str | None,
) -> dict[str, Any]:
    import resource

    from millpond.producer import Producer, ProducerConfig

    warnings = _Warnings()
    logging.getLogger("millpond").addHandler(warnings)
    config = ProducerConfig(
        store=url,
        store_options=options,
        wal_dir=wal_dir,
        retry=policy(RETRY.get(policy_name, policy_name)),
        coordinator=coordinator,
        # The default shares this machine's coordinator (SeaweedFS is an S3 store).
        host_coordinator=None if policy_name in (DEFAULT, COORDINATED) else False,
    )
    calls = int((WARMUP + seconds) / PERIOD)
    produced = [0.0] * calls
    durable = [0.0] * calls
    handles: list[Any] = []
    errors: list[BaseException] = []
    with Producer(config) as producer:

        def wait_all() -> None:
            try:
                for i in range(calls):
                    while len(handles) <= i:
                        time.sleep(0.001)
                    handles[i].wait()
                    durable[i] = time.monotonic()
            except BaseException as err:
                errors.append(err)

        barrier.wait(timeout=START_TIMEOUT)
        waiter = threading.Thread(target=wait_all, name="bench-waiter", daemon=True)
        waiter.start()
        start = time.monotonic() + 0.01
        measured_from = int(WARMUP / PERIOD)
        before: dict[str, Any] = {}
        cpu_before = 0.0
        payload = b"x" * 64
        for i in range(calls):
            if i == measured_from:
                before = producer.metrics()
                usage = resource.getrusage(resource.RUSAGE_SELF)
                cpu_before = usage.ru_utime + usage.ru_stime
            delay = start + i * PERIOD - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            produced[i] = time.monotonic()
            handles.append(producer.produce([payload]))
        window_end = time.monotonic()
        after = producer.metrics()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = usage.ru_utime + usage.ru_stime - cpu_before
        waiter.join(timeout=600)
        if errors:
            raise errors[0]
        if waiter.is_alive():
            raise RuntimeError("handles still not durable 600 s after the last produce()")
    window = window_end - produced[measured_from]
    keys = (
        "batches_committed",
        "manifest_appends",
        "manifest_reads",
        "manifest_writes",
        "coordinator_appends",
        "direct_appends",
        "coordinator_refused",
        "coordinator_unknown",
    )
    return {
        "latencies": [durable[i] - produced[i] for i in range(measured_from, calls)],
        "window": window,
        "delta": {k: after.get(k, 0) - before.get(k, 0) for k in (*keys, "cas_conflicts")},
        "cpu_seconds": cpu,
        "warnings": warnings.count,
        "gave_up": warnings.gave_up,
        "warning_samples": warnings.samples,
    }


@contextlib.contextmanager
def start_coordinator(url: str, options: dict[str, str]) -> Iterator[str]:
    """A ``millpond coordinator`` process for the queue at ``url``; yields its URL."""
    command = [sys.executable, "-m", "millpond.cli", "--log-level", "WARNING", "coordinator"]
    command += [url, "--port", "0", "--create"]
    command += os.environ.get("MILLPOND_BENCH_COORDINATOR_ARGS", "").split()
    for key, value in options.items():
        command += ["--store-option", f"{key}={value}"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if " on http://" not in line:
            raise RuntimeError(f"coordinator did not start: {line!r}")
        yield line.rsplit(" on ", 1)[1].strip()
    finally:
        stop_child(proc, 30)


def _coordinator_stats(coordinator: str | None) -> dict[str, Any] | None:
    if coordinator is None:
        return None
    try:
        with urllib.request.urlopen(f"{coordinator}/v1/health", timeout=5) as response:
            stats: dict[str, Any] = json.loads(response.read())
            return stats
    except OSError:
        return None


def _run(
    ctx: Any, endpoint: Any, workdir: Path, n: int, seconds: float, policy_name: str
) -> dict[str, Any]:
    root = f"bench-wait-{policy_name}-{n}-{uuid.uuid4().hex[:8]}"
    url = endpoint.url_for(root)
    with contextlib.ExitStack() as stack:
        coordinator = None
        if policy_name == COORDINATED:
            coordinator = stack.enter_context(start_coordinator(url, endpoint.store_options()))
        consumer = None
        drain = os.environ.get("MILLPOND_BENCH_CONSUMER", "")
        if drain not in ("", "0"):
            through = coordinator if drain != "direct" else None
            consumer = stack.enter_context(
                draining_consumer(ctx, url, endpoint.store_options(), through)
            )
        row = _measure(ctx, endpoint, workdir, n, seconds, policy_name, url, root, coordinator)
        row["coordinator_stats"] = _coordinator_stats(coordinator)
    if consumer is not None:
        row["consumer"] = consumer
    return row


def _measure(
    ctx: Any,
    endpoint: Any,
    workdir: Path,
    n: int,
    seconds: float,
    policy_name: str,
    url: str,
    root: str,
    coordinator: str | None,
) -> dict[str, Any]:
    barrier = ctx.Barrier(n)
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=report_to,
            args=(
                out,
                _produce,
                url,
                endpoint.store_options(),
                str(workdir / root / f"wal-{i}"),
                seconds,
                policy_name,
                barrier,
                coordinator,
            ),
            name=f"bench-producer-{i}",
        )
        for i in range(n)
    ]
    for proc in procs:
        proc.start()
    outs = _collect(out, procs, START_TIMEOUT + 600 + seconds * 4)
    latencies = [v for o in outs for v in o["latencies"]]
    window = sum(o["window"] for o in outs) / n
    delta = {k: sum(o["delta"][k] for o in outs) for k in outs[0]["delta"]}
    appends = max(1, delta["manifest_appends"])
    return {
        "policy": policy_name,
        "producers": n,
        "calls": len(latencies),
        **{f"p{p}_ms": round(1000 * _percentile(latencies, p), 1) for p in PERCENTILES},
        "locations_per_s": round(delta["batches_committed"] / window, 1),
        "appends_per_s": round(delta["manifest_appends"] / window, 1),
        "locations_per_append": round(delta["batches_committed"] / appends, 2),
        "requests_per_append": round(
            (delta["manifest_reads"] + delta["manifest_writes"]) / appends, 2
        ),
        "conflicts_per_append": round(delta["cas_conflicts"] / appends, 2),
        "through_coordinator": round(delta["coordinator_appends"] / appends, 3),
        # Why appends of a coordinated run went directly, when some did.
        "coordinator_refused": delta["coordinator_refused"],
        "coordinator_unknown": delta["coordinator_unknown"],
        "gave_up_warnings": sum(o["gave_up"] for o in outs),
        "warnings": sum(o["warnings"] for o in outs),
        "warning_samples": [s for o in outs for s in o["warning_samples"]][:3],
        "producer_cpu_share": round(
            sum(o["cpu_seconds"] for o in outs) / (window * (os.cpu_count() or 1)), 3
        ),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "window_seconds": round(window, 2),
    }


def _worst(rows: list[dict[str, Any]]) -> float:
    """The worst over ``rows`` of ``max(p50 / (3 x lone p50), p99 / (6 x lone p50))``."""
    worst: float = max(
        max(r["p50_over_lone_p50"] / P50_LIMIT, r["p99_over_lone_p50"] / P99_LIMIT) for r in rows
    )
    return worst


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
    workdir = Path(tempfile.mkdtemp(prefix="millpond-bench-wait-"))
    # The election files of the default runs, inherited by the producer processes spawned.
    os.environ["MILLPOND_RUN_DIR"] = str(workdir / "run")
    by_policy: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
    try:
        with seaweedfs_endpoints(delay) as endpoints:
            endpoint = endpoints.measured
            _run(ctx, endpoint, workdir, 1, 2.0, DEFAULT)  # warm the server and the proxy
            lone = _run(ctx, endpoint, workdir, 1, seconds, DEFAULT)
            lone_direct = _run(ctx, endpoint, workdir, 1, seconds, DIRECT)
            for name in policies:
                for n in counts:
                    if n == 1 and name in (DEFAULT, DIRECT):
                        row = lone if name == DEFAULT else lone_direct
                    else:
                        row = _run(ctx, endpoint, workdir, n, seconds, name)
                    by_policy[name].append(row)
                    logger.info("%s", {k: v for k, v in row.items() if k != "warning_samples"})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    # The baseline is the faster of the two lone producers (hosting a coordinator for itself
    # or appending directly), so sharing cannot pass by slowing the lone producer down.
    lone_p50 = min(lone["p50_ms"], lone_direct["p50_ms"])
    for rows in by_policy.values():
        for r in rows:
            r["p50_over_lone_p50"] = round(r["p50_ms"] / lone_p50, 2)
            r["p99_over_lone_p50"] = round(r["p99_ms"] / lone_p50, 2)
            r["max_over_lone_p50"] = round(r["p100_ms"] / lone_p50, 2)
            r["passed"] = (
                r["p50_over_lone_p50"] <= P50_LIMIT
                and r["p99_over_lone_p50"] <= P99_LIMIT
                and r["gave_up_warnings"] == 0
            )
    coordinated = by_policy.get(COORDINATED) or []
    at_max = max(coordinated, key=lambda r: r["producers"]) if coordinated else None
    for r in coordinated:
        r["passed"] = r["p99_over_lone_p50"] <= COORDINATOR_P99_LIMIT and r["gave_up_warnings"] == 0
    direct = by_policy.get(DIRECT) or []
    # Direct runs, beside the default, are held to the same targets.
    direct_ratio = _worst(direct) if direct else None
    judged_policy = DEFAULT if DEFAULT in by_policy else policies[0]
    judged = by_policy[judged_policy]
    ratio = _worst(judged)
    grows = all(b["locations_per_s"] >= a["locations_per_s"] for a, b in itertools.pairwise(judged))
    xs = list(counts)

    def line(key: str) -> dict[str, list[float]]:
        return {
            f"{name} {key.split('_')[0]}": [
                next((r[key] for r in rows if r["producers"] == n), float("nan")) for n in xs
            ]
            for name, rows in by_policy.items()
        }

    series = [
        plot_spec(
            f"wait() latency / lone p50 ({delay:g} ms per request)",
            "producer processes",
            "ratio",
            xs,
            {**line("p50_over_lone_p50"), **line("p99_over_lone_p50")},
            log_x=True,
            log_y=True,
            hline=("p99 target 6x (p50: 3x)", P99_LIMIT),
        ),
        plot_spec(
            "locations appended per second",
            "producer processes",
            "per second",
            xs,
            line("locations_per_s"),
            log_x=True,
        ),
        plot_spec(
            "wait() latency (ms)",
            "producer processes",
            "ms",
            xs,
            {**line("p50_ms"), **line("p99_ms")},
            log_x=True,
            log_y=True,
        ),
    ]
    worst = max(judged, key=lambda r: r["p99_over_lone_p50"])
    others = "; ".join(
        f"{name}: worst p99 {max(r['p99_over_lone_p50'] for r in rows):.1f}x"
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
            "locations_per_s_grow_with_n": grows,
            "gave_up_warnings": sum(r["gave_up_warnings"] for r in judged),
            "coordinator_p99_over_lone_p50_at_max_n": (
                at_max["p99_over_lone_p50"] if at_max is not None else None
            ),
            "coordinator_passed": (
                at_max["passed"] and all(r["through_coordinator"] > 0.9 for r in coordinated)
                if at_max is not None
                else None
            ),
            "shared": all(r["through_coordinator"] > 0.9 for r in judged)
            if judged_policy == DEFAULT
            else None,
            "direct_ratio": direct_ratio,
            "direct_passed": (
                all(r["passed"] for r in direct)
                and all(
                    b["locations_per_s"] >= a["locations_per_s"]
                    for a, b in itertools.pairwise(direct)
                )
                if direct
                else None
            ),
            "by_policy": by_policy,
            "period_s": PERIOD,
            "seconds_per_run": seconds,
            "warmup_s": WARMUP,
        },
        baseline={
            "lone_p50_ms": lone_p50,
            "lone_default_p50_ms": lone["p50_ms"],
            "lone_direct_p50_ms": lone_direct["p50_ms"],
            "lone_run": lone,
            "lone_direct_run": lone_direct,
        },
        series=series,
        headline=(
            f"{delay:g} ms, lone p50 {lone_p50:.0f} ms; {judged_policy} worst at "
            f"N={worst['producers']}: p50 {worst['p50_over_lone_p50']:.1f}x, p99 "
            f"{worst['p99_over_lone_p50']:.1f}x, {worst['gave_up_warnings']} gave-up"
            + (f"; {others}" if others else "")
            + (
                f"; coordinator at N={at_max['producers']}: p99 "
                f"{at_max['p99_over_lone_p50']:.1f}x (target {COORDINATOR_P99_LIMIT:g}x)"
                if at_max is not None
                else ""
            )
        ),
        notes=(
            "ratio = worst over N of max(p50 / (3 x lone p50), p99 / (6 x lone p50)) for the "
            "judged policy (default settings: producers on one machine share a coordinator one "
            "of them hosts); lone = the faster of N=1 default and N=1 direct in the same run"
        ),
        side_rows=(
            [
                {
                    "name": COORDINATED,
                    "ratio": at_max["p99_over_lone_p50"],
                    "target": COORDINATOR_P99_LIMIT,
                    "target_op": "<=",
                    "headline": (
                        f"through millpond coordinator, N={at_max['producers']}: wait() p99 "
                        f"{at_max['p99_ms']:.0f} ms = {at_max['p99_over_lone_p50']:.2f}x the "
                        f"lone producer's p50 {lone_p50:.0f} ms"
                    ),
                }
            ]
            if at_max is not None
            else []
        )
        + (
            [
                {
                    "name": DIRECT,
                    "ratio": direct_ratio,
                    "target": TARGET,
                    "target_op": "<=",
                    "headline": (
                        "every producer appending directly (host_coordinator=False): worst over "
                        "N of max(p50 / 3, p99 / 6) x lone p50 = " + f"{direct_ratio:.2f}"
                    ),
                }
            ]
            if direct_ratio is not None
            else []
        ),
    )
