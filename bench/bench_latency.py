"""End-to-end latency: ``produce()`` -> the row committed in PostgreSQL, against the sum of the
steps on the path, each measured alone on the same servers in the same run.

DESIGN.md "Performance": end-to-end latency, produce -> row committed in the database; baseline
flush interval + PUT + CAS + GET + DB commit, each measured alone; target p50 <= 1.5x their
sum, p99 <= 3x.

Setup: a SeaweedFS S3 server and a throwaway PostgreSQL (``fsync`` on), both on 127.0.0.1.

* **pipeline** — a real ``Producer`` in this process (``wal_sync="always"``,
  ``flush_interval=0.1``) makes one ``produce()`` call of one small entry every 1/``RATE`` s,
  paced on a fixed schedule. The consumer is the real service, ``millpond consume ... --sink
  postgresql://...`` as a child process with its default settings (entries stored opaque, one
  row each). A watcher thread here polls the table every ``WATCH_INTERVAL`` s over its own
  autocommit connection; a row's commit time is taken as the start of the first query that
  returned it. The commit happened between the previous query's snapshot and this one's (taken
  a fraction of a millisecond after the recorded start), so this is an upper bound to within
  that fraction: the latency is overstated by about ``WATCH_INTERVAL``/2 + one query on
  average, never flattered by more than the time to send a query.
  A few warm-up calls go through first (the sink creates its table on the first batch).
* **baseline** — on the same servers, through the same store adapter and driver, each step
  alone, back to back: ``put_if_absent`` of a batch-sized object (PUT), ``put_if_match`` of a
  manifest-sized object (CAS), ``get`` of the batch object (GET), and an ``INSERT`` of one row +
  ``COMMIT`` in PostgreSQL (DB commit). Half the samples are taken before the pipeline runs and
  half after; each step's figure is its median. Sum = ``flush_interval`` + the four medians.

``ratio`` (target <= 1.0) is the worse of the two targets as a fraction of its limit:
``max((p50 / sum) / 1.5, (p99 / sum) / 3)``. Both raw ratios, p50/sum (<= 1.5) and p99/sum
(<= 3), are in ``figures`` with their own verdicts. The latency is also split at the moment
``WriteHandle.wait()`` returned (batch written and in the manifest): producer side and
consumer side.

Knob for experiments (not for ``make bench``): ``MILLPOND_BENCH_POLL_INTERVAL=0.05`` passes
``--poll-interval`` to the consumer service (its idle backoff cap; default 1 s).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import make_result, plot_spec, seaweedfs_endpoint, stop_child

logger = logging.getLogger(__name__)

NAME = "latency"
TARGET = 1.0  # max(p50 ratio / 1.5, p99 ratio / 3.0)
P50_LIMIT = 1.5
P99_LIMIT = 3.0
RATE = 20.0  # produce() calls per second
FLUSH_INTERVAL = 0.1
WATCH_INTERVAL = 0.002
WARMUP_CALLS = 10
MANIFEST = "ingest/manifest"
PERCENTILES = (10, 25, 50, 75, 90, 95, 99, 100)


def _percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile (``pct`` in 0..100)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(pct / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


# -- the baseline: each step alone ------------------------------------------------------------


class _Steps:
    """PUT, CAS, GET and DB commit, one sample of each per :meth:`sample` call."""

    def __init__(self, store: Any, pg_url: str, batch_bytes: bytes, manifest_bytes: bytes) -> None:
        import adbc_driver_postgresql.dbapi as pg

        self._store = store
        self._batch = batch_bytes
        self._manifest = manifest_bytes
        self._cas_path = f"baseline/{uuid.uuid4().hex}.manifest"
        self._etag = store.put_if_absent(self._cas_path, manifest_bytes)
        self._conn = pg.connect(pg_url)
        self._table = f"bench_commit_{uuid.uuid4().hex[:8]}"
        with self._conn.cursor() as cur:
            cur.execute(f'CREATE TABLE "{self._table}" (id BIGINT, payload BYTEA)')
        self._conn.commit()
        self._n = 0
        self.samples: dict[str, list[float]] = {"put": [], "cas": [], "get": [], "commit": []}

    def sample(self) -> None:
        self._n += 1
        path = f"baseline/{uuid.uuid4().hex}.batch"
        started = time.perf_counter()
        self._store.put_if_absent(path, self._batch)
        self.samples["put"].append(time.perf_counter() - started)

        started = time.perf_counter()
        self._etag = self._store.put_if_match(self._cas_path, self._manifest, self._etag)
        self.samples["cas"].append(time.perf_counter() - started)

        started = time.perf_counter()
        self._store.get(path)
        self.samples["get"].append(time.perf_counter() - started)

        with self._conn.cursor() as cur:
            started = time.perf_counter()
            cur.execute(f'INSERT INTO "{self._table}" VALUES ($1, $2)', (self._n, self._batch))
            self._conn.commit()
            self.samples["commit"].append(time.perf_counter() - started)

    def close(self) -> None:
        self._conn.close()


# -- the pipeline -----------------------------------------------------------------------------


class _Watcher:
    """Polls the sink's table; records when each ``lat-`` row was first seen."""

    def __init__(self, pg_url: str, table: str) -> None:
        self._pg_url = pg_url
        self._table = table
        self.seen: dict[int, float] = {}
        self.warm: set[int] = set()
        self.queries = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-watcher", daemon=True)
        self._error: BaseException | None = None
        self._last_sequence = -1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        import adbc_driver_postgresql.dbapi as pg

        try:
            with pg.connect(self._pg_url, autocommit=True) as conn, conn.cursor() as cur:
                while not self._stop.is_set():
                    self._poll(cur)
                    time.sleep(WATCH_INTERVAL)
        except BaseException as err:  # surfaced by stop()
            self._error = err

    def _poll(self, cur: Any) -> None:
        started = time.monotonic()
        try:
            cur.execute(
                f'SELECT sequence, payload FROM "{self._table}" WHERE sequence > $1',
                (self._last_sequence,),
            )
            rows = cur.fetchall()
        except Exception as err:
            if "does not exist" in str(err):  # the sink creates the table on its first batch
                return
            raise
        self.queries += 1
        for sequence, payload in rows:
            self._last_sequence = max(self._last_sequence, int(sequence))
            kind, _, number = bytes(payload).partition(b"-")
            if kind == b"lat":
                self.seen.setdefault(int(number), started)
            else:
                self.warm.add(int(number))


@contextlib.contextmanager
def _consumer_service(
    store_url: str, endpoint: Any, pg_url: str, table: str, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """``millpond consume`` as a child process (default settings), stopped with SIGTERM."""
    command = [
        sys.executable, "-m", "millpond.cli", "--log-level", "INFO", "consume", store_url,
        "--create", "--sink", pg_url, "--table", table, "--progress-table", f"{table}_progress",
        "--entry-format", "opaque",
    ]  # fmt: skip
    poll = os.environ.get("MILLPOND_BENCH_POLL_INTERVAL")
    if poll:
        command += ["--poll-interval", poll]
    env = {**os.environ, **endpoint.env()}
    with log.open("wb") as out:
        child = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield child
    finally:
        stop_child(child, 15)
        if child.returncode not in (0, -signal.SIGTERM):
            logger.warning("consumer exited with %s; log %s", child.returncode, log)


def _wait_for(what: str, ready: Any, timeout: float, alive: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if alive is not None and not alive():
            raise RuntimeError(f"{what}: the consumer process exited")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(0.01)


def _pipeline(endpoint: Any, pg_url: str, workdir: Path, calls: int) -> dict[str, Any]:
    from millpond.producer import Producer, ProducerConfig
    from millpond.queue import read_manifest
    from millpond.storage import open_store

    root = f"latency-{uuid.uuid4().hex[:8]}"
    store_url = endpoint.url_for(root)
    table = f"bench_latency_{uuid.uuid4().hex[:8]}"
    store = open_store(store_url, endpoint.store_options())
    log = workdir / "consumer.log"

    def consumer_holds_epoch() -> bool:
        try:
            return read_manifest(store, MANIFEST).manifest.epoch >= 1
        except Exception:
            return False

    config = ProducerConfig(
        store=store_url,
        store_options=endpoint.store_options(),
        wal_dir=workdir / "wal",
        wal_sync="always",
        flush_interval=FLUSH_INTERVAL,
    )
    produced: list[float] = [0.0] * calls
    durable: list[float] = [0.0] * calls
    handles: list[Any] = []
    watcher = _Watcher(pg_url, table)
    with _consumer_service(store_url, endpoint, pg_url, table, log) as child:

        def alive() -> bool:
            return child.poll() is None

        _wait_for("consumer start", consumer_holds_epoch, 60, alive)
        with Producer(config) as producer:
            watcher.start()
            for i in range(WARMUP_CALLS):
                producer.produce([b"warm-%04d" % i])
                time.sleep(1 / RATE)
            _wait_for("warm-up rows", lambda: len(watcher.warm) >= WARMUP_CALLS, 60, alive)

            def wait_durable() -> None:
                for i in range(calls):
                    while len(handles) <= i:
                        time.sleep(0.001)
                    handles[i].wait()
                    durable[i] = time.monotonic()

            waiter = threading.Thread(target=wait_durable, name="bench-durable", daemon=True)
            waiter.start()
            start = time.monotonic() + 0.05
            for i in range(calls):
                delay = start + i / RATE - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                produced[i] = time.monotonic()
                handles.append(producer.produce([b"lat-%08d" % i]))
            waiter.join()
            _wait_for("all rows", lambda: len(watcher.seen) >= calls, 60, alive)
            watcher.stop()
            metrics = producer.metrics()
    consumer_log = log.read_text(errors="replace").strip().splitlines()
    end_to_end = [watcher.seen[i] - produced[i] for i in range(calls)]
    producer_side = [durable[i] - produced[i] for i in range(calls)]
    consumer_side = [watcher.seen[i] - durable[i] for i in range(calls)]
    return {
        "end_to_end": end_to_end,
        "producer_side": producer_side,
        "consumer_side": consumer_side,
        "offsets": [p - produced[0] for p in produced],
        "watch_queries": watcher.queries,
        "producer_metrics": {
            key: metrics[key]
            for key in ("batches_committed", "manifest_appends", "wal_syncs", "cas_retries")
            if key in metrics
        },
        "fsync_p50_ms": _ms(metrics["fsync_latency"]["p50"]),
        "consumer_log_tail": consumer_log[-3:],
    }


def _windows(
    offsets: list[float], e2e: list[float], producer_side: list[float]
) -> list[dict[str, float]]:
    """Per whole second of the run: max and median end to end, median producer side."""
    by_second: dict[int, list[int]] = {}
    for i, offset in enumerate(offsets):
        by_second.setdefault(int(offset), []).append(i)
    return [
        {
            "second": second,
            "e2e_max": _ms(max(e2e[i] for i in idx)),
            "e2e_p50": _ms(statistics.median(e2e[i] for i in idx)),
            "producer_p50": _ms(statistics.median(producer_side[i] for i in idx)),
        }
        for second, idx in sorted(by_second.items())
    ]


def _sample_bytes() -> tuple[bytes, bytes]:
    """A batch like the pipeline's (two calls of one entry) and a manifest of 50 entries."""
    from millpond.common.ulids import UlidMinter, batch_location
    from millpond.formats.batch import encode_batch
    from millpond.formats.manifest import Metadata, PendingEntry, append_entries, empty_manifest

    batch = encode_batch([b"lat-%08d" % i for i in range(2)])
    minter = UlidMinter()
    now = int(time.time() * 1000)
    entries = [
        PendingEntry(batch_location("ingest", minter.mint()), (Metadata(0, now, b""),))
        for _ in range(50)
    ]
    manifest, _ = append_entries(empty_manifest(), entries)
    return batch, manifest


def run(quick: bool) -> dict[str, Any]:
    from millpond.localstack import start_postgres
    from millpond.storage import open_store

    seconds = 10.0 if quick else 45.0
    calls = int(seconds * RATE)
    samples_per_side = 15 if quick else 40
    workdir = Path(tempfile.mkdtemp(prefix="millpond-bench-latency-"))
    try:
        with start_postgres() as server, seaweedfs_endpoint() as endpoint:
            store = open_store(
                endpoint.url_for(f"latency-base-{uuid.uuid4().hex[:8]}"),
                endpoint.store_options(),
            )
            batch_bytes, manifest_bytes = _sample_bytes()
            steps = _Steps(store, server.url, batch_bytes, manifest_bytes)
            for _ in range(3):  # warm connections on both servers
                steps.sample()
            for values in steps.samples.values():
                values.clear()
            try:
                for _ in range(samples_per_side):
                    steps.sample()
                run_ = _pipeline(endpoint, server.url, workdir, calls)
                for _ in range(samples_per_side):
                    steps.sample()
            finally:
                steps.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    medians = {step: statistics.median(values) for step, values in steps.samples.items()}
    total = FLUSH_INTERVAL + sum(medians.values())
    e2e = run_["end_to_end"]
    p50, p99 = _percentile(e2e, 50), _percentile(e2e, 99)
    p50_ratio, p99_ratio = p50 / total, p99 / total
    ratio = max(p50_ratio / P50_LIMIT, p99_ratio / P99_LIMIT)

    def summary(values: list[float]) -> dict[str, float]:
        return {f"p{p}_ms": _ms(_percentile(values, p)) for p in PERCENTILES} | {
            "mean_ms": _ms(statistics.fmean(values))
        }

    pct_x = list(PERCENTILES)
    windows = _windows(run_["offsets"], e2e, run_["producer_side"])
    return make_result(
        NAME,
        ratio=ratio,
        target=TARGET,
        target_op="<=",
        figures={
            "p50_ms": _ms(p50),
            "p99_ms": _ms(p99),
            "p50_ratio": round(p50_ratio, 3),
            "p50_limit": P50_LIMIT,
            "p50_passed": p50_ratio <= P50_LIMIT,
            "p99_ratio": round(p99_ratio, 3),
            "p99_limit": P99_LIMIT,
            "p99_passed": p99_ratio <= P99_LIMIT,
            "end_to_end": summary(e2e),
            "producer_side": summary(run_["producer_side"]),
            "consumer_side": summary(run_["consumer_side"]),
            "calls": calls,
            "rate_per_s": RATE,
            "flush_interval_s": FLUSH_INTERVAL,
            "wal_sync": "always",
            "watch_interval_ms": WATCH_INTERVAL * 1000,
            "watch_queries": run_["watch_queries"],
            "producer": run_["producer_metrics"],
            "fsync_p50_ms": run_["fsync_p50_ms"],
            "consumer_log_tail": run_["consumer_log_tail"],
        },
        baseline={
            "sum_ms": _ms(total),
            "flush_interval_ms": _ms(FLUSH_INTERVAL),
            **{f"{step}_median_ms": _ms(value) for step, value in medians.items()},
            **{
                f"{step}_p90_ms": _ms(_percentile(values, 90))
                for step, values in steps.samples.items()
            },
            "samples_per_step": len(steps.samples["put"]),
            "batch_bytes": len(batch_bytes),
            "manifest_bytes": len(manifest_bytes),
        },
        series=[
            plot_spec(
                "produce -> row committed in PostgreSQL, per 1 s window",
                "seconds into the run",
                "ms",
                [w["second"] for w in windows],
                {
                    "end to end, max": [w["e2e_max"] for w in windows],
                    "end to end, median": [w["e2e_p50"] for w in windows],
                    "producer side, median": [w["producer_p50"] for w in windows],
                },
                hline=("baseline sum", _ms(total)),
            ),
            plot_spec(
                "latency percentiles",
                "percentile",
                "ms",
                pct_x,
                {
                    "end to end": [_ms(_percentile(e2e, p)) for p in pct_x],
                    "producer side": [_ms(_percentile(run_["producer_side"], p)) for p in pct_x],
                    "consumer side": [_ms(_percentile(run_["consumer_side"], p)) for p in pct_x],
                    "limit (1.5x sum at p50, 3x sum at p99)": [
                        _ms(total * (P99_LIMIT if p >= 99 else P50_LIMIT)) for p in pct_x
                    ],
                },
                hline=("baseline sum", _ms(total)),
            ),
            plot_spec(
                "baseline steps, each alone (sample order)",
                "sample",
                "ms",
                list(range(len(steps.samples["put"]))),
                {step: [_ms(v) for v in values] for step, values in steps.samples.items()},
                log_y=True,
            ),
        ],
        headline=(
            f"p50 {_ms(p50):.0f} ms ({p50_ratio:.2f}x, <= {P50_LIMIT}), p99 {_ms(p99):.0f} ms "
            f"({p99_ratio:.2f}x, <= {P99_LIMIT}) of sum {_ms(total):.0f} ms"
        ),
        notes=(
            "ratio = max((p50/sum)/1.5, (p99/sum)/3); sum = flush_interval + median PUT + CAS + "
            "GET + INSERT/COMMIT, each alone on the same servers. Commit time is the start of "
            f"the first {WATCH_INTERVAL * 1000:.0f}-ms-spaced poll that saw the row (an upper "
            "bound, to within the time to send a query)."
        ),
    )
