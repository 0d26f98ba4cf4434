"""Consumer -> PostgreSQL rows/s against raw ``adbc_ingest`` of the same Arrow tables.

DESIGN.md "Performance": consumer -> PostgreSQL rows/s, baseline ``adbc_ingest`` of the same
Arrow tables, measured side by side in the same run on the same server; target >= 0.8.

Setup: a throwaway PostgreSQL (``fsync`` on) and a SeaweedFS S3 server on 127.0.0.1. A queue
of ``batches`` batch objects, each holding one Arrow table of ``rows`` rows (an id, a float, a
short string, a timestamp) as IPC stream entries, as ``produce_arrow`` writes them.

* **consumer** — the whole exactly-once path, as ``millpond consume`` runs it: ``Consumer``
  (read-ahead GETs from S3, batch decode, conditional manifest reads, default dequeues)
  and ``PostgresSink`` (Arrow IPC decode, cast to the table's types, progress row + binary
  COPY + commit, one transaction per batch), into a fresh table.
* **baseline** — the same Arrow tables, already decoded in memory, each ingested with
  ``cursor.adbc_ingest`` into a fresh table, with one commit at the end: plain bulk loading,
  no S3, no decoding, no per-batch durability. The same with a commit after every table (what
  a naive exactly-once writer pays) is reported as ``baseline.commit_per_table_rows_per_s``.

The consumer writes the batches its read-ahead has already fetched in one transaction (each
batch still with its own progress row), so with a backlog it commits once per few batches.

The queue holds 480 batches (2.4 million rows): a running service's rate is what is judged,
and its start-up (takeover, epoch mark, index claim, first fetches: about five round trips
before the first write) is paid once per process. At 50 ms a request that start-up is about
0.28 s; with 120 batches, as until 2026-11-28, a drain took 1.1 s and the start-up was a
quarter of it (0.77x-0.79x on a machine where the same drain's writes alone beat the
baseline). Each round reports it apart: ``startup_s`` (the run's start to its first database
write) and ``tail_s`` (the last write's end to the run's end: the final ack).
Rounds alternate baseline and consumer; the ratio is median consumer rows/s over median
single-commit baseline rows/s.

Fencing costs: every delivery and ack checks the epoch with one conditional GET of the
manifest's 22-byte footer; the service acks a written group and takes the next one in one call
(one check), on a thread of its own while the database writes the group before. The consumer's
store is wrapped to time those requests and the sink to time its writes; ``fence`` reports how
many checks there were, their share of the run, the part of it no database write overlapped
(``exposed_share_of_run``: what the checks really cost the run), and the rows/s the run would
have reached without that part.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import uuid
from typing import Any

import pyarrow as pa

from bench.common import make_result, plot_spec, seaweedfs_endpoint, stopwatch

logger = logging.getLogger(__name__)

NAME = "consumer_postgres"
TARGET = 0.8
MANIFEST = "ingest/manifest"


def _tables(batches: int, rows: int) -> list[pa.Table]:
    base = 1_700_000_000_000_000
    out = []
    for b in range(batches):
        start = b * rows
        ids = pa.array(range(start, start + rows), pa.int64())
        out.append(
            pa.table(
                {
                    "id": ids,
                    "value": pa.array([i * 0.5 for i in range(start, start + rows)], pa.float64()),
                    "label": pa.array(
                        [f"event-{i % 1000:04d}" for i in range(start, start + rows)]
                    ),
                    "at": pa.array(
                        [base + i for i in range(start, start + rows)], pa.timestamp("us", "UTC")
                    ),
                }
            )
        )
    return out


def _upload(store: Any, tables: list[pa.Table]) -> list[str]:
    from millpond.common.ulids import UlidMinter, batch_location
    from millpond.formats.arrow import encode_ipc
    from millpond.formats.batch import encode_batch

    minter = UlidMinter()
    locations = []
    for table in tables:
        location = batch_location("ingest", minter.mint())
        store.put_if_absent(location, encode_batch(encode_ipc(table)))
        locations.append(location)
    return locations


def _enqueue(store: Any, locations: list[str], payloads: list[bytes]) -> None:
    from millpond.formats.manifest import Metadata, PendingEntry
    from millpond.queue import QueueProducer

    now = int(time.time() * 1000)
    producer = QueueProducer(store, MANIFEST)
    pairs = list(zip(locations, payloads, strict=True))
    for start in range(0, len(pairs), 50):
        producer.append(
            [PendingEntry(loc, (Metadata(0, now, p),)) for loc, p in pairs[start : start + 50]]
        )


def _fence_timer(store: Any) -> Any:
    """``store``, timing its footer reads (the consumer's fencing checks)."""
    from millpond.storage.store import ForwardingStore, GetResult

    class FenceTimer(ForwardingStore):
        def __init__(self, inner: Any) -> None:
            super().__init__(inner)
            self.checks = 0
            self.seconds = 0.0
            self.spans: list[tuple[float, float]] = []
            self._lock = threading.Lock()

        def get_tail(self, path: str, length: int, etag: str | None = None) -> GetResult | None:
            start = time.perf_counter()
            try:
                return self.inner.get_tail(path, length, etag)
            finally:
                end = time.perf_counter()
                with self._lock:
                    self.checks += 1
                    self.seconds += end - start
                    self.spans.append((start, end))

    return FenceTimer(store)


def _write_timer(sink: Any) -> list[tuple[float, float]]:
    """Time ``sink``'s transactions (start, end) into the returned list (``write`` goes
    through ``write_many`` too)."""
    spans: list[tuple[float, float]] = []
    inner = sink.write_many

    def timed(batches: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(batches)
        finally:
            spans.append((start, time.perf_counter()))

    sink.write_many = timed
    return spans


def _exposed(checks: list[tuple[float, float]], writes: list[tuple[float, float]]) -> float:
    """Seconds of ``checks`` that no span of ``writes`` overlaps."""
    total = 0.0
    for start, end in checks:
        covered = sum(max(0.0, min(end, w_end) - max(start, w_start)) for w_start, w_end in writes)
        total += max(0.0, (end - start) - covered)  # writes never overlap one another
    return total


def _run_consumer(store: Any, pg_url: str, expected_rows: int) -> dict[str, Any]:
    """The service loop of ``millpond consume``, until the queue is drained."""
    from millpond.consumer import Consumer, ConsumerConfig
    from millpond.consumer.app.service import ConsumerService
    from millpond.consumer.sinks import PostgresSink

    store = _fence_timer(store)
    suffix = uuid.uuid4().hex[:8]
    sink = PostgresSink(
        pg_url,
        table=f"bench_consumer_{suffix}",
        progress_table=f"bench_progress_{suffix}",
        sequence_column=None,
    )
    consumer = Consumer(ConsumerConfig(store=store, gc_enabled=False))
    sink.last_sequence(consumer.queue)  # connect outside the timing, as the baseline does
    writes = _write_timer(sink)
    service = ConsumerService(consumer, sink)
    started = time.perf_counter()
    stats = service.run(threading.Event(), until_idle=True)
    ended = time.perf_counter()
    seconds = ended - started
    sink.close()
    if sink.rows_written != expected_rows:
        raise RuntimeError(f"consumer wrote {sink.rows_written} rows, expected {expected_rows}")
    exposed = _exposed(store.spans, writes)
    return {
        "rows_per_s": round(expected_rows / seconds),
        "batches_per_s": round(stats.batches / seconds, 1),
        "seconds": round(seconds, 3),
        "startup_s": round(writes[0][0] - started, 3) if writes else None,
        "tail_s": round(ended - writes[-1][1], 3) if writes else None,
        "transactions": len(writes),
        "fence_checks": store.checks,
        "fence_seconds": round(store.seconds, 3),
        "fence_exposed_seconds": round(exposed, 3),
        "rows_per_s_without_fencing": round(expected_rows / max(seconds - exposed, 1e-9)),
    }


def _run_baseline(pg_url: str, tables: list[pa.Table], *, commit_each: bool) -> dict[str, Any]:
    import adbc_driver_postgresql.dbapi as pg

    name = f"bench_baseline_{uuid.uuid4().hex[:8]}"
    rows = sum(t.num_rows for t in tables)
    with pg.connect(pg_url) as conn, conn.cursor() as cur:
        cur.execute(
            f'CREATE TABLE "{name}" (id BIGINT, value DOUBLE PRECISION, label TEXT, at TIMESTAMPTZ)'
        )
        conn.commit()
        with stopwatch() as sw:
            for table in tables:
                cur.adbc_ingest(name, table, mode="append")
                if commit_each:
                    conn.commit()
            conn.commit()
    return {"rows_per_s": round(rows / sw.seconds), "seconds": round(sw.seconds, 3)}


def run(quick: bool) -> dict[str, Any]:
    from millpond.localstack import start_postgres
    from millpond.storage import open_store

    batches, rows, rounds = (40, 5_000, 2) if quick else (480, 5_000, 5)
    tables = _tables(batches, rows)
    total = batches * rows
    consumer_runs: list[dict[str, Any]] = []
    baseline_runs: list[dict[str, Any]] = []
    single_commit_runs: list[dict[str, Any]] = []
    with start_postgres() as server, seaweedfs_endpoint() as endpoint:
        store = open_store(
            endpoint.url_for(f"bench-{uuid.uuid4().hex[:8]}"), endpoint.store_options()
        )
        locations = _upload(store, tables)
        # Warm-up: the first COPY into a fresh cluster and the first S3 GETs are slower.
        _run_baseline(server.url, tables[:5], commit_each=True)
        for round_ in range(rounds):
            baseline_runs.append(_run_baseline(server.url, tables, commit_each=True))
            _enqueue(store, locations, [b"bench"] * len(locations))
            consumer_runs.append(_run_consumer(store, server.url, total))
            single_commit_runs.append(_run_baseline(server.url, tables, commit_each=False))
            logger.info(
                "round %s: consumer %s rows/s, baseline %s rows/s (single commit %s)",
                round_,
                consumer_runs[-1]["rows_per_s"],
                baseline_runs[-1]["rows_per_s"],
                single_commit_runs[-1]["rows_per_s"],
            )
    consumer_rate = statistics.median(r["rows_per_s"] for r in consumer_runs)
    baseline_rate = statistics.median(r["rows_per_s"] for r in baseline_runs)
    single_rate = statistics.median(r["rows_per_s"] for r in single_commit_runs)
    ratio = consumer_rate / single_rate
    rounds_x = list(range(1, rounds + 1))
    fence_share = statistics.median(r["fence_seconds"] / r["seconds"] for r in consumer_runs)
    exposed_share = statistics.median(
        r["fence_exposed_seconds"] / r["seconds"] for r in consumer_runs
    )
    unfenced_rate = statistics.median(r["rows_per_s_without_fencing"] for r in consumer_runs)
    startup = statistics.median(r["startup_s"] for r in consumer_runs)
    return make_result(
        NAME,
        ratio=ratio,
        target=TARGET,
        figures={
            "consumer_rows_per_s": consumer_rate,
            "fence": {
                "checks_per_run": statistics.median(r["fence_checks"] for r in consumer_runs),
                "share_of_run": round(fence_share, 4),
                "exposed_share_of_run": round(exposed_share, 4),
                "rows_per_s_without_fencing": unfenced_rate,
                "rows_per_s_cost": round(unfenced_rate - consumer_rate),
            },
            "startup_s": startup,
            "batches": batches,
            "rows_per_batch": rows,
            "rounds": consumer_runs,
        },
        baseline={
            "adbc_ingest_rows_per_s": single_rate,
            "commit_per_table_rows_per_s": baseline_rate,
            "ratio_vs_commit_per_table": round(consumer_rate / baseline_rate, 3),
            "rounds": single_commit_runs,
            "commit_per_table_rounds": baseline_runs,
        },
        series=[
            plot_spec(
                "consumer -> PostgreSQL vs raw adbc_ingest",
                "round",
                "rows/s",
                rounds_x,
                {
                    "consumer (S3 GET + decode + exactly-once commit)": [
                        r["rows_per_s"] for r in consumer_runs
                    ],
                    "adbc_ingest, commit per table": [r["rows_per_s"] for r in baseline_runs],
                    "adbc_ingest, one commit": [r["rows_per_s"] for r in single_commit_runs],
                },
            )
        ],
        headline=(
            f"{consumer_rate:,.0f} rows/s vs adbc_ingest {single_rate:,.0f} rows/s "
            f"({batches} batches x {rows} rows); fencing checks {fence_share:.1%} of the run, "
            f"{exposed_share:.1%} not overlapped by database writes "
            f"(~{unfenced_rate - consumer_rate:,.0f} rows/s); start-up {startup:.2f} s"
        ),
        notes=(
            "baseline: adbc_ingest of the decoded tables with one commit; "
            "commit_per_table_rows_per_s commits after each table"
        ),
    )
