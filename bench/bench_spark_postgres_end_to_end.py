"""Spark -> Millpond -> PostgreSQL end to end, the consumer running as a service, against
Spark's JDBC writer (issue 49).

Setup: a throwaway PostgreSQL (``fsync`` on), a SeaweedFS S3 server and one Spark session
(``local[2]``, PostgreSQL's JDBC driver on its class path), all on 127.0.0.1, and two
``millpond consume`` services as child processes (their defaults; ``--metrics-port`` only to
watch them): one appending into ``mp_append``, one with ``--mode upsert --key id`` into
``mp_upsert``. One generated DataFrame of ``rows`` rows in ``partitions`` partitions: ``id``
(bigint), ``s`` (string, 10 % null), ``ts`` (timestamp), ``d`` (decimal(18,4)), ``x``
(double). Round after round, alternating the order, each side into a table emptied before the
round (outside the timer):

* **append, millpond** — ``df.write.format("millpond").option("await_sink", "600s")``: timed
  from the call until it returns, which it does once the service says it has committed the
  job's rows in PostgreSQL; then ``count(*)``, ``sum(id)`` and the distinct ids are checked.
* **append, jdbc** — ``df.write.jdbc(...)`` with ``reWriteBatchedInserts=true`` and
  ``batchsize`` 10,000, the same partitions, into a table Spark created in the warm-up.
* **upsert** — both tables start the round with every even id of the job (half its keys,
  written by the server from ``generate_series``, ``x = -1``); the job writes every id.
  Millpond: the same write into the upsert service's queue. JDBC: what users do today, the
  JDBC writer into a staging table (emptied first) and one ``INSERT ... SELECT ... ON CONFLICT
  (id) DO UPDATE``, timed together. Checked: ``count(*)`` is ``rows`` and no row has ``x < 0``.

The warm-up round (each of the four) leaves the JVM, the Python workers, both services and
both tables warm. The ratios are median JDBC seconds over median millpond seconds: the main
row's for append (target >= 2.0), a side row ``upsert`` (target >= 1.5).

Where the time goes: while each millpond job runs, a thread samples (every 25 ms) Spark's
status tracker (tasks finished), the queue manifest's ETag (the driver's commit landing) and
the service's ``/metrics`` (rows written, seconds fetching, seconds in write transactions),
so each round gives a timeline: tasks done, commit landed, first and last rows written, job
returned. The figures keep the medians of these marks and of the consumer's busy seconds.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.bench_spark_postgres import _jdbc_url, jdbc_jar
from bench.common import make_result, plot_spec, seaweedfs_endpoint, stop_child

logger = logging.getLogger(__name__)

NAME = "spark_postgres_end_to_end"
TARGET = 2.0
UPSERT_TARGET = 1.5
AWAIT = "600s"
FULL = {"rows": 2_000_000, "partitions": 8, "rounds": 4}
QUICK = {"rows": 200_000, "partitions": 4, "rounds": 1}

COLUMNS = {
    "id": "id",
    "s": "CASE WHEN id % 10 = 3 THEN NULL ELSE concat('user-', id % 100000) END",
    "ts": "timestamp_micros(1767225600000000 + id * 1000)",
    "d": "CAST(id / 7 AS DECIMAL(18, 4))",
    "x": "CAST(id AS DOUBLE) / 7",
}
VALUES = ("s", "ts", "d", "x")


def _sql(pg_url: str, *statements: str) -> list[tuple[Any, ...]]:
    """Run ``statements`` in one transaction; the last one's rows (if it returns any)."""
    import adbc_driver_postgresql.dbapi as pg

    rows: list[tuple[Any, ...]] = []
    with pg.connect(pg_url) as conn, conn.cursor() as cur:
        for statement in statements:
            cur.execute(statement)
            rows = cur.fetchall() if cur.description else []
        conn.commit()
    return rows


def _check(pg_url: str, table: str, rows: int) -> None:
    """Every id once, and no row left from the prefill (``x < 0``)."""
    found = _sql(
        pg_url,
        f"SELECT count(*), sum(id), count(DISTINCT id), count(*) FILTER (WHERE x < 0) FROM {table}",
    )[0]
    expected = (rows, rows * (rows - 1) // 2, rows, 0)
    if tuple(int(v or 0) for v in found) != expected:
        raise RuntimeError(f"{table}: (count, sum, distinct, x < 0) {found}, expected {expected}")


def _prefill(pg_url: str, table: str, rows: int) -> None:
    """Empty ``table`` and give it every even id below ``rows`` (``x = -1``)."""
    _sql(
        pg_url,
        f"TRUNCATE {table}",
        f"INSERT INTO {table} (id, s, ts, d, x) SELECT g, 'old', now(), 0, -1 "
        f"FROM generate_series(0, {rows - 1}, 2) g",
    )
    _sql(pg_url, f"ANALYZE {table}")


@contextlib.contextmanager
def _service(
    store_url: str, options: dict[str, str], pg_url: str, table: str, log: Path, *extra: str
) -> Iterator[int]:
    """``millpond consume`` with its defaults (plus ``extra``) as a child process; yields its
    metrics port. Stopped with SIGTERM by its PID."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable, "-m", "millpond.cli", "--log-level", "INFO", "consume", store_url,
        "--create", *(f"--store-option={k}={v}" for k, v in options.items()),
        "--sink", pg_url, "--table", table, "--metrics-port", str(port), *extra,
    ]  # fmt: skip
    with log.open("w") as out:
        child = subprocess.Popen(command, stderr=out, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while "consuming" not in log.read_text():
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"millpond consume did not start; see {log}")
            time.sleep(0.05)
        yield port
    finally:
        stop_child(child)


def _scrape(port: int) -> dict[str, float]:
    """The service's rows written, and its fetch and write-transaction seconds (sums)."""
    wanted = {
        "millpond_consumer_rows_total": "rows",
        "millpond_consumer_fetch_duration_seconds_sum": "fetch_s",
        "millpond_consumer_fetch_duration_seconds_count": "fetches",
        "millpond_consumer_sink_commit_duration_seconds_sum": "write_s",
        "millpond_consumer_sink_commit_duration_seconds_count": "transactions",
    }
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            found[wanted[name]] = float(value)
    return found


class _Timeline:
    """Marks of one millpond job, sampled every 25 ms on a thread (see the module docstring):
    seconds from the job's start to the first task done, every task done, the commit landed
    in the manifest, the first and the last rows written, the job returned."""

    def __init__(self, spark: Any, store: Any, manifest: str, port: int, rows: int) -> None:
        self._tracker = spark.sparkContext.statusTracker()
        self._store, self._manifest, self._port, self._rows = store, manifest, port, rows
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.marks: dict[str, float] = {}
        self.before: dict[str, float] = {}
        self.after: dict[str, float] = {}
        self.started = 0.0

    def __enter__(self) -> _Timeline:
        self.before = _scrape(self._port)
        self._etag = self._etag_now()
        self._stages_seen: set[int] = set()
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._mark("returned")
        self._stop.set()
        self._thread.join()
        self.after = _scrape(self._port)

    def _etag_now(self) -> str | None:
        try:
            return self._store.head(self._manifest).etag
        except Exception:  # no manifest yet
            return None

    def _mark(self, name: str) -> None:
        self.marks.setdefault(name, round(time.perf_counter() - self.started, 3))

    def _run(self) -> None:
        rows0 = self.before.get("rows", 0.0)
        while not self._stop.wait(0.025):
            self._sample_tasks()
            if "commit_landed" not in self.marks and self._etag_now() != self._etag:
                self._mark("commit_landed")
            rows = _scrape(self._port).get("rows", 0.0) - rows0
            if rows > 0:
                self._mark("first_rows_written")
            if rows >= self._rows:
                self._mark("all_rows_written")

    def _sample_tasks(self) -> None:
        active = set(self._tracker.getActiveStageIds())
        for stage_id in active:
            info = self._tracker.getStageInfo(stage_id)
            if info is not None and info.numCompletedTasks:
                self._mark("first_task_done")
            if info is not None and info.numCompletedTasks >= info.numTasks:
                self._mark("tasks_done")
        if self._stages_seen - active:  # a stage finished between two samples
            self._mark("first_task_done")
            self._mark("tasks_done")
        self._stages_seen |= active

    def busy(self) -> dict[str, float]:
        """The consumer's counters over the job (rows, fetches and their seconds, write
        transactions and their seconds)."""
        return {k: round(v - self.before.get(k, 0.0), 3) for k, v in self.after.items()}


class _Bench:
    """The servers, the Spark session, the services and the DataFrame of one run."""

    def __init__(self, spark: Any, endpoint: Any, pg_url: str, rows: int, parts: int) -> None:
        self.spark, self.endpoint, self.pg_url, self.rows = spark, endpoint, pg_url, rows
        self.options = endpoint.store_options()
        self.frame = spark.range(rows, numPartitions=parts).selectExpr(
            *(f"{expr} AS {name}" for name, expr in COLUMNS.items())
        )
        self.ports: dict[str, int] = {}
        self.timelines: dict[str, list[dict[str, Any]]] = {"append": [], "upsert": []}

    def store_url(self, mode: str) -> str:
        return self.endpoint.url_for(f"bench-e2e-{mode}")

    def millpond(self, mode: str, *, record: bool = True) -> float:
        """One job into the ``mode`` service's queue, until it returns; its seconds."""
        table = f"mp_{mode}"
        if not record:
            pass  # the warm-up: the service creates the table
        elif mode == "upsert":
            _prefill(self.pg_url, table, self.rows)
        else:
            _sql(self.pg_url, f"TRUNCATE {table}")
        store = _open_store(self.store_url(mode), self.options)
        writer = self.frame.write.format("millpond").options(
            store=self.store_url(mode), **self.options, await_sink=AWAIT
        )
        timeline = _Timeline(self.spark, store, "ingest/manifest", self.ports[mode], self.rows)
        with timeline:
            writer.mode("append").save()
        _check(self.pg_url, table, self.rows)
        if record:
            self.timelines[mode].append({**timeline.marks, "consumer": timeline.busy()})
        return timeline.marks["returned"]

    def jdbc(self, mode: str) -> float:
        """The JDBC writer (append), or into a staging table and ``INSERT ... ON CONFLICT``
        (upsert); its seconds."""
        table = f"jdbc_{mode}"
        if mode == "upsert":
            _prefill(self.pg_url, table, self.rows)
            _sql(self.pg_url, "TRUNCATE jdbc_stage")
        else:
            _sql(self.pg_url, f"TRUNCATE {table}")
        writer = (
            self.frame.write.mode("append")
            .option("driver", "org.postgresql.Driver")
            .option("batchsize", "10000")
        )
        started = time.perf_counter()
        if mode == "upsert":
            writer.jdbc(_jdbc_url(self.pg_url, tuned=True), "jdbc_stage")
            updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in VALUES)
            _sql(
                self.pg_url,
                f"INSERT INTO {table} (id, {', '.join(VALUES)}) SELECT id, {', '.join(VALUES)} "
                f"FROM jdbc_stage ON CONFLICT (id) DO UPDATE SET {updates}",
            )
        else:
            writer.jdbc(_jdbc_url(self.pg_url, tuned=True), table)
        elapsed = time.perf_counter() - started
        _check(self.pg_url, table, self.rows)
        return elapsed


def _open_store(url: str, options: dict[str, str]) -> Any:
    from millpond.storage.open import open_store

    return open_store(url, options)


def _warm_up(bench: _Bench) -> None:
    """Each of the four once: the JVM, the Python workers, both services, the tables."""
    bench.millpond("append", record=False)
    bench.millpond("upsert", record=False)
    started = time.perf_counter()
    bench.frame.limit(0).write.mode("overwrite").option("driver", "org.postgresql.Driver").jdbc(
        _jdbc_url(bench.pg_url, tuned=True), "jdbc_append"
    )
    logger.info("jdbc table created in %.1f s", time.perf_counter() - started)
    # The upsert target as the service made its own (primary key on id), without the
    # service's sequence column; the staging table as Spark makes one.
    _sql(
        bench.pg_url,
        "CREATE TABLE jdbc_upsert (LIKE mp_upsert INCLUDING ALL)",
        "ALTER TABLE jdbc_upsert DROP COLUMN IF EXISTS _millpond_sequence",
    )
    bench.frame.limit(0).write.mode("overwrite").option("driver", "org.postgresql.Driver").jdbc(
        _jdbc_url(bench.pg_url, tuned=True), "jdbc_stage"
    )
    bench.jdbc("append")
    bench.jdbc("upsert")


def _rounds(bench: _Bench, rounds: int) -> dict[str, dict[str, list[float]]]:
    """``rounds`` rounds of the four, alternating which side goes first."""
    seconds: dict[str, dict[str, list[float]]] = {
        mode: {"millpond": [], "jdbc": []} for mode in ("append", "upsert")
    }
    for index in range(rounds):
        for mode in ("append", "upsert"):
            sides = ["jdbc", "millpond"] if index % 2 == 0 else ["millpond", "jdbc"]
            for side in sides:
                run_side = bench.millpond if side == "millpond" else bench.jdbc
                seconds[mode][side].append(run_side(mode))
            logger.info(
                "round %s %s: millpond %.2f s, jdbc %.2f s",
                index,
                mode,
                seconds[mode]["millpond"][-1],
                seconds[mode]["jdbc"][-1],
            )
    return seconds


def run(quick: bool) -> dict[str, Any]:
    """Run the benchmark; see the module docstring."""
    import tempfile

    from millpond.localstack import start_postgres
    from millpond.producer.spark import local_spark_session

    plan = QUICK if quick else FULL
    rows, partitions, rounds = plan["rows"], plan["partitions"], plan["rounds"]
    jar = jdbc_jar()
    with (
        tempfile.TemporaryDirectory(prefix="millpond-e2e-") as scratch,
        start_postgres() as server,
        seaweedfs_endpoint() as endpoint,
        contextlib.ExitStack() as services,
    ):
        spark = local_spark_session(
            "local[2]", app_name="millpond-bench-e2e", conf={"spark.jars": jar}
        )
        try:
            bench = _Bench(spark, endpoint, server.url, rows, partitions)
            for mode, extra in (("append", ()), ("upsert", ("--mode", "upsert", "--key", "id"))):
                bench.ports[mode] = services.enter_context(
                    _service(
                        bench.store_url(mode),
                        bench.options,
                        server.url,
                        f"mp_{mode}",
                        Path(scratch) / f"consume-{mode}.log",
                        *extra,
                    )
                )
            _warm_up(bench)
            seconds = _rounds(bench, rounds)
        finally:
            spark.stop()
    return _result(seconds, bench.timelines, rows=rows, partitions=partitions)


def _medians(timelines: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each mark, and of each consumer counter, over the rounds."""
    marks = {k for t in timelines for k, v in t.items() if isinstance(v, float | int)}
    out: dict[str, Any] = {
        k: round(statistics.median(t[k] for t in timelines if k in t), 3) for k in sorted(marks)
    }
    out["consumer_after_commit"] = round(
        statistics.median(t["all_rows_written"] - t["commit_landed"] for t in timelines), 3
    )
    counters = {k for t in timelines for k in t["consumer"]}
    out["consumer"] = {
        k: round(statistics.median(t["consumer"].get(k, 0.0) for t in timelines), 3)
        for k in sorted(counters)
    }
    return out


def _series(seconds: dict[str, dict[str, list[float]]], rows: int) -> list[dict[str, Any]]:
    return [
        plot_spec(
            f"Spark -> PostgreSQL end to end, {rows:,} rows ({mode})",
            x=list(range(1, len(seconds[mode]["jdbc"]) + 1)),
            x_label="round",
            y_label="seconds until the rows are in PostgreSQL",
            lines={
                "millpond (await_sink, consumer service)": seconds[mode]["millpond"],
                "Spark JDBC writer" + (" + INSERT ON CONFLICT" if mode == "upsert" else ""): (
                    seconds[mode]["jdbc"]
                ),
            },
        )
        for mode in ("append", "upsert")
    ]


def _result(
    seconds: dict[str, dict[str, list[float]]],
    timelines: dict[str, list[dict[str, Any]]],
    *,
    rows: int,
    partitions: int,
) -> dict[str, Any]:
    med = {m: {s: statistics.median(v) for s, v in sides.items()} for m, sides in seconds.items()}
    ratio = med["append"]["jdbc"] / med["append"]["millpond"]
    upsert = med["upsert"]["jdbc"] / med["upsert"]["millpond"]
    upsert_line = (
        f"upsert (half the keys present): millpond {med['upsert']['millpond']:.2f} s, JDBC into "
        f"a staging table + INSERT ... ON CONFLICT {med['upsert']['jdbc']:.2f} s, {upsert:.2f}x"
    )
    return make_result(
        NAME,
        ratio=ratio,
        target=TARGET,
        figures={
            "rows": rows,
            "partitions": partitions,
            "columns": COLUMNS,
            "await_sink": AWAIT,
            "millpond_seconds": {
                m: [round(s, 3) for s in v["millpond"]] for m, v in seconds.items()
            },
            "upsert_ratio": round(upsert, 3),
            "timeline_append": _medians(timelines["append"]),
            "timeline_upsert": _medians(timelines["upsert"]),
            "timelines": timelines,
            "what": "df.write.format('millpond').option('await_sink', ...) until it returns, "
            "the rows committed in PostgreSQL by the millpond consume service already running",
        },
        baseline={
            "what": "df.write.jdbc, reWriteBatchedInserts=true, batchsize 10000, same partitions "
            "(upsert: into a staging table, then INSERT ... SELECT ... ON CONFLICT (id) DO UPDATE)",
            "seconds": {m: [round(s, 3) for s in v["jdbc"]] for m, v in seconds.items()},
        },
        series=_series(seconds, rows),
        headline=f"{rows:,} rows Spark -> PostgreSQL, job returned with its rows committed: "
        f"millpond {med['append']['millpond']:.2f} s, JDBC writer {med['append']['jdbc']:.2f} s "
        f"({ratio:.2f}x); {upsert_line}",
        side_rows=[
            {
                "name": "upsert",
                "ratio": round(upsert, 4),
                "target": UPSERT_TARGET,
                "target_op": ">=",
                "headline": upsert_line,
            }
        ],
    )
