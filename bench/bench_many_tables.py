"""Consumer -> PostgreSQL rows/s when one queue feeds ten tables, against the same rows into one.

Issue 46 target: ten tables from one queue >= 0.9x one table, same rows.

Setup: a throwaway PostgreSQL (``fsync`` on) and a SeaweedFS S3 server on 127.0.0.1; the batch
objects of ``bench_consumer_postgres`` (``batches`` x ``rows`` rows of an id, a float, a short
string, a timestamp), uploaded once.

* **ten tables** — the batches enqueued with metadata naming a table each
  (``millpond.table=<prefix>_<i % 10>``, as ``produce_arrow(..., table=)`` writes it) and drained
  by the consumer service (``ConsumerService``, groups of up to 64 batches per transaction) into
  a sink allowed ``<prefix>_*``: each group writes its rows into the tables they name (one
  binary COPY per table) with the queue's progress rows, in one transaction.
* **one table** (the baseline) — the same batch objects enqueued naming no table, drained by the
  same service into its own table.

Rounds alternate the two on fresh tables; the ratio is median ten-table rows/s over median
one-table rows/s.

Both sides find their tables made (``CREATE TABLE``, the columns the sink would give them)
before the timing starts: a running service creates a table once, and ten ``CREATE TABLE``
statements inside a 2-3 s drain, against one on the other side, would be start-up measured as
throughput. The sink still reflects each table and records it as the queue's inside the timing.
Each round also reports, as ``bench_consumer_postgres`` does, ``startup_s`` (the run's start to
its first database write), ``first_write_s`` (that transaction: the tables reflected and
claimed), ``tail_s`` (the last write's end to the run's end), the transactions and the bulk
copies.
"""

from __future__ import annotations

import logging
import statistics
import threading
import uuid
from typing import Any

import pyarrow as pa

from bench.bench_consumer_postgres import _enqueue, _tables, _upload, _write_timer
from bench.common import make_result, plot_spec, seaweedfs_endpoint

logger = logging.getLogger(__name__)

NAME = "many_tables"
TARGET = 0.9
TABLES = 10


def _run(store: Any, pg_url: str, tables: list[pa.Table], prefix: str | None) -> dict[str, Any]:
    """One drain of the queue by the service; with ``prefix``, the batches name the tables
    ``<prefix>_0`` .. ``<prefix>_9`` and the sink may write ``<prefix>_*``."""
    import time

    from millpond.consumer import Consumer, ConsumerConfig
    from millpond.consumer.app.service import ConsumerService
    from millpond.consumer.sinks import PostgresSink, SinkTables, TableSettings

    suffix = uuid.uuid4().hex[:8]
    sink = PostgresSink(
        pg_url,
        table=f"bench_own_{suffix}",
        progress_table=f"bench_progress_{suffix}",
        sequence_column=None,
        tables=SinkTables({f"{prefix}_*": TableSettings()}) if prefix else None,
    )
    names = [f"{prefix}_{i}" for i in range(TABLES)] if prefix else [f"bench_own_{suffix}"]
    _create(pg_url, names)
    consumer = Consumer(ConsumerConfig(store=store, gc_enabled=False))
    sink.last_sequence(consumer.queue)  # connect outside the timing
    writes = _write_timer(sink)
    copies = _copy_counter(sink)
    started = time.perf_counter()
    stats = ConsumerService(consumer, sink).run(threading.Event(), until_idle=True)
    ended = time.perf_counter()
    seconds = ended - started
    rows = sum(t.num_rows for t in tables)
    sink.close()
    logger.info("%s: %s rows in %.2f s", sink.table, rows, seconds)
    if sink.rows_written != rows:
        raise RuntimeError(f"consumer wrote {sink.rows_written} rows, expected {rows}")
    _check(pg_url, names, rows)
    return {
        "rows_per_s": round(rows / seconds),
        "seconds": round(seconds, 3),
        "batches": stats.batches,
        "startup_s": round(writes[0][0] - started, 3),
        "first_write_s": round(writes[0][1] - writes[0][0], 3),
        "tail_s": round(ended - writes[-1][1], 3),
        "transactions": len(writes),
        "copies": copies[0],
    }


def _create(pg_url: str, names: list[str]) -> None:
    """Make ``names`` with the columns the sink would give them (outside the timing)."""
    import adbc_driver_postgresql.dbapi as pg

    with pg.connect(pg_url) as conn, conn.cursor() as cur:
        for name in names:
            cur.execute(
                f'CREATE TABLE "{name}" ("id" bigint, "value" double precision, "label" text, '
                '"at" timestamp with time zone)'
            )
        conn.commit()


def _copy_counter(sink: Any) -> list[int]:
    """Count ``sink``'s bulk copies (one ``adbc_ingest`` each) into the returned cell."""
    count = [0]
    inner = sink._ingest

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return inner(*args, **kwargs)

    sink._ingest = counted
    return count


def _check(pg_url: str, names: list[str], rows: int) -> None:
    import adbc_driver_postgresql.dbapi as pg

    counts = " + ".join(f'(SELECT count(*) FROM "{name}")' for name in names)
    with pg.connect(pg_url) as conn, conn.cursor() as cur:
        cur.execute(f"SELECT {counts}")
        found = cur.fetchall()[0][0]
    if found != rows:
        raise RuntimeError(f"{len(names)} tables hold {found} rows, expected {rows}")


def _payloads(count: int, prefix: str) -> list[bytes]:
    from millpond.formats.routing import with_table

    return [with_table(b"bench", f"{prefix}_{i % TABLES}") for i in range(count)]


def run(quick: bool) -> dict[str, Any]:
    from millpond.localstack import start_postgres
    from millpond.storage import open_store

    batches, rows, rounds = (40, 5_000, 2) if quick else (400, 5_000, 5)
    tables = _tables(batches, rows)
    total = batches * rows
    ten: list[dict[str, Any]] = []
    one: list[dict[str, Any]] = []
    with start_postgres() as server, seaweedfs_endpoint() as endpoint:
        store = open_store(
            endpoint.url_for(f"bench-{uuid.uuid4().hex[:8]}"), endpoint.store_options()
        )
        locations = _upload(store, tables)
        _enqueue(store, locations[:8], [b"bench"] * 8)  # warm-up: first COPY, first GETs
        _run(store, server.url, tables[:8], None)
        for _ in range(rounds):
            _enqueue(store, locations, [b"bench"] * len(locations))
            one.append(_run(store, server.url, tables, None))
            prefix = f"bench_ten_{uuid.uuid4().hex[:8]}"
            _enqueue(store, locations, _payloads(len(locations), prefix))
            ten.append(_run(store, server.url, tables, prefix))
    ten_rate = statistics.median(r["rows_per_s"] for r in ten)
    one_rate = statistics.median(r["rows_per_s"] for r in one)
    return make_result(
        NAME,
        ratio=ten_rate / one_rate,
        target=TARGET,
        figures={
            "ten_tables_rows_per_s": ten_rate,
            "tables": TABLES,
            "batches": batches,
            "rows_per_batch": rows,
            "rows": total,
            "startup_s": statistics.median(r["startup_s"] for r in ten),
            "first_write_s": statistics.median(r["first_write_s"] for r in ten),
            "copies": statistics.median(r["copies"] for r in ten),
            "rounds": ten,
        },
        baseline={
            "one_table_rows_per_s": one_rate,
            "startup_s": statistics.median(r["startup_s"] for r in one),
            "first_write_s": statistics.median(r["first_write_s"] for r in one),
            "copies": statistics.median(r["copies"] for r in one),
            "rounds": one,
        },
        series=[
            plot_spec(
                "one queue -> PostgreSQL: ten tables vs one",
                "round",
                "rows/s",
                list(range(1, rounds + 1)),
                {
                    "ten tables": [r["rows_per_s"] for r in ten],
                    "one table": [r["rows_per_s"] for r in one],
                },
            )
        ],
        headline=(
            f"ten tables {ten_rate:,.0f} rows/s vs one table {one_rate:,.0f} rows/s "
            f"({total:,} rows)"
        ),
        notes=(
            "baseline: the same batch objects, naming no table, into the sink's own table; "
            "both sides' tables made before the timing"
        ),
    )
