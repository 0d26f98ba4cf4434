"""What ``.option("await_sink", ...)`` adds to a Spark job while ``millpond consume`` keeps up.

Setup: a SeaweedFS S3 server and one Spark session (``local[2]``) on 127.0.0.1, and
``millpond consume`` as a child process writing the queue into SQLite, with its defaults
(``--poll-interval 1``: an idle service looks at the queue at most a second apart; a report,
and a heartbeat of its written-through mark, every 5 s). The same DataFrame is written round
after round, alternately:

* **plain** — ``df.write.format("millpond").mode("append").save()``: returns once the job's
  rows are in the queue;
* **await_sink** — the same with ``.option("await_sink", "600s")``: returns once the service
  says (in ``{prefix}/_millpond/written.json``) it has written the job's last entry.

Before each job the service has written everything before it, so it is idle, polling at its
longest pause: the steady state of a consumer that keeps up. Each job is timed from the
``save()`` call to its return. What ``await_sink`` adds is the median of the per-round
differences (await_sink - plain, the two jobs of a round run back to back); the target is at
most one consumer poll interval (ratio = added ÷ 1 s, ≤ 1). The wall-time ratio of the two
medians is reported beside it.

A second, shorter measure weighs the mark's writes on the service itself: the service loop
(``ConsumerService``, groups of up to 64 batches a transaction) drains the same backlog of
small batches twice, with its report only and with its report and the mark; the ratio of the
two drain times (mark ÷ report only), and how many times the mark was written per group
committed. The mark is written from a thread of its own, at most once each 0.2 s, so the loop
should not notice it, also at 50 ms a request (``make bench`` runs it again through the
latency proxy).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
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

from bench.common import latency_ms, make_result, plot_spec, seaweedfs_endpoint, stop_child

logger = logging.getLogger(__name__)

NAME = "await_sink"
TARGET = 1.0
POLL_INTERVAL = 1.0  # millpond consume's default --poll-interval
FULL = {"rows": 200_000, "partitions": 4, "rounds": 6, "drain_batches": 480}
QUICK = {"rows": 50_000, "partitions": 2, "rounds": 3, "drain_batches": 160}


@contextlib.contextmanager
def _service(store_url: str, options: dict[str, str], database: Path) -> Iterator[None]:
    """``millpond consume`` with its defaults (no GC), stopped with SIGTERM by its PID."""
    log = database.with_suffix(".log").open("w")
    command = [
        sys.executable, "-m", "millpond.cli", "--log-level", "INFO", "consume", store_url,
        "--create", *(f"--store-option={k}={v}" for k, v in options.items()),
        "--sink", f"sqlite:///{database}", "--table", "rows", "--no-gc", "--quiet",
    ]  # fmt: skip
    child = subprocess.Popen(command, stderr=log, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while "consuming" not in database.with_suffix(".log").read_text():
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"millpond consume did not start; see {log.name}")
            time.sleep(0.05)
        yield
    finally:
        stop_child(child)
        log.close()


def _wait_for_rows(database: Path, rows: int) -> None:
    """Until the service has written ``rows`` rows into the table (none: at once)."""
    deadline = time.monotonic() + 600
    while rows > 0:
        with contextlib.suppress(sqlite3.OperationalError), sqlite3.connect(database) as db:
            if int(db.execute('SELECT count(*) FROM "rows"').fetchone()[0]) >= rows:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the consumer did not write {rows} rows within 600 s")
        time.sleep(0.05)


def _spark_rounds(endpoint: Any, plan: dict[str, int], work: Path) -> dict[str, list[float]]:
    """Seconds of each plain and each await_sink job, the service running all along."""
    from millpond.producer.spark import local_spark_session

    rows, rounds = plan["rows"], plan["rounds"]
    options = endpoint.store_options()
    url = endpoint.url_for(f"bench-await-{uuid.uuid4().hex[:8]}")
    database = work / "sink.db"
    times: dict[str, list[float]] = {"plain": [], "await_sink": []}
    with _service(url, options, database):
        spark = local_spark_session("local[2]", app_name="millpond-bench-await-sink")
        try:
            frame = spark.range(rows, numPartitions=plan["partitions"]).selectExpr(
                "id", "concat('user-', id % 5000) AS user_id", "CAST(id % 100 AS DOUBLE) AS x"
            )
            written = 0

            def job(mode: str) -> float:
                nonlocal written
                _wait_for_rows(database, written)  # the service is idle: it kept up
                extra = {"await_sink": "600s"} if mode == "await_sink" else {}
                started = time.perf_counter()
                frame.write.format("millpond").options(store=url, **options, **extra).mode(
                    "append"
                ).save()
                elapsed = time.perf_counter() - started
                written += rows
                return elapsed

            job("plain")  # warm-up: Python workers, connection pools, the table created
            for index in range(rounds):
                order = ("plain", "await_sink") if index % 2 == 0 else ("await_sink", "plain")
                for mode in order:
                    times[mode].append(job(mode))
                logger.info(
                    "round %s: plain %.2f s, await_sink %.2f s",
                    index,
                    times["plain"][-1],
                    times["await_sink"][-1],
                )
            _wait_for_rows(database, written)
        finally:
            spark.stop()
    return times


def _counting_marks(store: Any, counts: dict[str, int]) -> Any:
    """``store``, counting its writes of the queue's written-through mark in ``counts``."""
    from millpond.queue.written import written_path
    from millpond.storage import ForwardingStore

    mark_path = written_path("ingest")

    class Counting(ForwardingStore):
        # The mark is a fenced object: written with put_if_absent, then put_if_match.
        def put_if_absent(self, path: str, data: bytes) -> str | None:
            counts["mark_puts"] += path == mark_path
            return self.inner.put_if_absent(path, data)

        def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
            counts["mark_puts"] += path == mark_path
            return self.inner.put_if_match(path, data, etag)

    return Counting(store)


def _drain(endpoint: Any, batches: int, *, with_mark: bool, work: Path) -> dict[str, Any]:
    """``ConsumerService`` drains ``batches`` small batches into SQLite: seconds, groups
    committed, and writes of the mark."""
    import pyarrow as pa

    from millpond.common.ulids import UlidMinter, batch_location
    from millpond.consumer import Consumer, ConsumerConfig
    from millpond.consumer.app._report import ServiceReporter
    from millpond.consumer.app._written import WrittenPublisher
    from millpond.consumer.app.service import ConsumerService
    from millpond.consumer.sinks import open_sink
    from millpond.formats.arrow import encode_ipc
    from millpond.formats.batch import encode_batch
    from millpond.formats.manifest import Metadata, PendingEntry
    from millpond.queue import QueueProducer
    from millpond.storage import open_store

    counts = {"mark_puts": 0, "groups": 0}
    url = endpoint.url_for(f"bench-drain-{uuid.uuid4().hex[:8]}")
    store = _counting_marks(open_store(url, endpoint.store_options()), counts)
    minter = UlidMinter()
    body = encode_batch(encode_ipc(pa.table({"n": list(range(200)), "s": ["x" * 20] * 200})))
    entries = []
    for _ in range(batches):
        location = batch_location("ingest", minter.mint())
        store.put_if_absent(location, body)
        entries.append(PendingEntry(location, (Metadata(0, int(time.time() * 1000), b""),)))
    QueueProducer(store, "ingest/manifest").append(entries)
    consumer = Consumer(ConsumerConfig(store=store, gc_enabled=False))
    sink = open_sink(f"sqlite:///{work / f'drain-{uuid.uuid4().hex[:6]}.db'}", table="rows")
    write_many = sink.write_many

    def counted(group: Any) -> list[bool]:
        counts["groups"] += 1
        return write_many(group)

    sink.write_many = counted  # type: ignore[method-assign]
    mark = WrittenPublisher(store, data_path_prefix="ingest", queue=consumer.queue)
    reporter = ServiceReporter(
        store, data_path_prefix="ingest", queue=consumer.queue, written=mark if with_mark else None
    )
    service = ConsumerService(consumer, sink, reporter=reporter)
    started = time.perf_counter()
    stats = service.run(threading.Event(), until_idle=True)
    seconds = time.perf_counter() - started
    sink.close()
    if stats.batches != batches:
        raise RuntimeError(f"drained {stats.batches} batches, expected {batches}")
    return {"seconds": round(seconds, 3), **counts}


def run(quick: bool) -> dict[str, Any]:
    """Run the benchmark; see the module docstring."""
    plan = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="bench-await-") as tmp, seaweedfs_endpoint() as ep:
        work = Path(tmp)
        times = _spark_rounds(ep, plan, work)
        drains: dict[str, list[dict[str, Any]]] = {"report_only": [], "with_mark": []}
        for index in range(2):
            for with_mark in (index % 2 == 0, index % 2 != 0):
                key = "with_mark" if with_mark else "report_only"
                drains[key].append(
                    _drain(ep, plan["drain_batches"], with_mark=with_mark, work=work)
                )
    return _result(plan, times, drains)


def _result(
    plan: dict[str, int], times: dict[str, list[float]], drains: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    plain, waited = times["plain"], times["await_sink"]
    added = [w - p for p, w in zip(plain, waited, strict=True)]
    ratio = statistics.median(added) / POLL_INTERVAL
    wall = statistics.median(waited) / statistics.median(plain)
    marked = min(d["seconds"] for d in drains["with_mark"])
    bare = min(d["seconds"] for d in drains["report_only"])
    puts = sum(d["mark_puts"] for d in drains["with_mark"])
    groups = sum(d["groups"] for d in drains["with_mark"]) or 1
    rounds = list(range(1, len(plain) + 1))
    return make_result(
        NAME,
        ratio=ratio,
        target=TARGET,
        target_op="<=",
        figures={
            "rows": plan["rows"],
            "partitions": plan["partitions"],
            "await_sink_seconds": [round(s, 3) for s in waited],
            "added_seconds": [round(s, 3) for s in added],
            "added_median_s": round(statistics.median(added), 3),
            "wall_ratio": round(wall, 3),
            "drain_batches": plan["drain_batches"],
            "drain_with_mark": drains["with_mark"],
            "drain_report_only": drains["report_only"],
            "drain_ratio": round(marked / bare, 3),
            "mark_puts_per_group": round(puts / groups, 3),
            "latency_ms": latency_ms(),
        },
        baseline={
            "what": "the same job without await_sink, in the same rounds; the consumer's "
            f"poll interval ({POLL_INTERVAL:g} s)",
            "plain_seconds": [round(s, 3) for s in plain],
            "poll_interval_s": POLL_INTERVAL,
        },
        series=[
            plot_spec(
                "Spark job wall time",
                x=rounds,
                x_label="round",
                y_label="seconds",
                lines={"plain save()": plain, "await_sink": waited},
            )
        ],
        headline=f"await_sink adds {statistics.median(added):.2f} s (median) to a "
        f"{statistics.median(plain):.1f} s job: {ratio:.2f} poll intervals, wall {wall:.2f}x; "
        f"the mark costs the service's drain {marked / bare:.2f}x",
    )
