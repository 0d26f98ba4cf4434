"""Consumer -> PostgreSQL rows/s upserting by key, against the same consumer appending.

Issue 46 target: upsert throughput into PostgreSQL >= 0.5x append mode on the same 2 million
rows, half of whose keys are already in the table.

Setup: a throwaway PostgreSQL (``fsync`` on) and a SeaweedFS S3 server on 127.0.0.1; a queue of
``batches`` batch objects of ``rows`` rows each (``id`` BIGINT key, a float, a short string, a
timestamp: the rows of ``bench_consumer_postgres``), every ``id`` once.

* **upsert** — ``millpond consume`` as the service runs it (``ConsumerService``, groups of up to
  64 batches per transaction) into a table with ``PRIMARY KEY (id)`` that already holds half of
  the queue's keys (the even ones) and as many other rows, with ``TableSettings("upsert",
  ("id",))``: per group, the rows are binary-COPYed into a temporary table and merged with one
  ``INSERT ... ON CONFLICT (id) DO UPDATE``, half of them updates.
* **append** (the baseline) — the same service, the same batches, into a table without a key
  that holds as many rows beforehand, appended (binary COPY into the table).

Rounds alternate the two on fresh tables; the ratio is median upsert rows/s over median append
rows/s. Each run's start-up is reported apart (``startup_s``), as in ``consumer_postgres``.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import uuid
from typing import Any

import pyarrow as pa

from bench.bench_consumer_postgres import _enqueue, _tables, _upload, _write_timer
from bench.common import make_result, plot_spec, seaweedfs_endpoint

logger = logging.getLogger(__name__)

NAME = "upsert_postgres"
TARGET = 0.5


def _prefill(pg_url: str, table: str, tables: list[pa.Table], *, keyed: bool) -> int:
    """Create ``table`` (``PRIMARY KEY (id)`` when ``keyed``) holding the even ids of
    ``tables`` (with other values) and as many rows of ids past them: half the queue's keys,
    and a table as big."""
    import adbc_driver_postgresql.dbapi as pg
    import pyarrow.compute as pc

    everything = pa.concat_tables(tables)
    present = everything.filter(pc.equal(pc.bit_wise_and(everything["id"], 1), 0))
    # Values the queue's rows replace: every update changes its row.
    present = present.set_column(1, "value", pc.negate(present["value"]))
    extra = present.set_column(
        0, "id", pc.add(present["id"], pa.scalar(everything.num_rows * 2, pa.int64()))
    )
    key = ", PRIMARY KEY (id)" if keyed else ""
    with pg.connect(pg_url) as conn, conn.cursor() as cur:
        cur.execute(
            f'CREATE TABLE "{table}" (id BIGINT NOT NULL, value DOUBLE PRECISION, label TEXT, '
            f"at TIMESTAMPTZ{key})"
        )
        for part in (present, extra):
            cur.adbc_ingest(table, part, mode="append")
        conn.commit()
        cur.execute(f'ANALYZE "{table}"')
        conn.commit()
    return present.num_rows + extra.num_rows


def _timed_sink() -> Any:
    """``PostgresSink``, summing the seconds of its COPYs and of its merges."""
    from millpond.consumer.sinks import PostgresSink

    class TimedSink(PostgresSink):
        copy_s = 0.0
        upsert_s = 0.0

        def _copy(self, *args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            try:
                super()._copy(*args, **kwargs)
            finally:
                self.copy_s += time.perf_counter() - start

        def _upsert(self, *args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            try:
                super()._upsert(*args, **kwargs)
            finally:
                self.upsert_s += time.perf_counter() - start

    return TimedSink


def _run(store: Any, pg_url: str, tables: list[pa.Table], *, upsert: bool) -> dict[str, Any]:
    """One drain of the queue by the service, into a prefilled table."""
    from millpond.consumer import Consumer, ConsumerConfig
    from millpond.consumer.app.service import ConsumerService
    from millpond.consumer.sinks import SinkTables, TableSettings

    suffix = uuid.uuid4().hex[:8]
    table = f"bench_{'upsert' if upsert else 'append'}_{suffix}"
    before = _prefill(pg_url, table, tables, keyed=upsert)
    settings = TableSettings("upsert", ("id",)) if upsert else TableSettings()
    sink = _timed_sink()(
        pg_url,
        table=table,
        progress_table=f"bench_progress_{suffix}",
        sequence_column=None,
        tables=SinkTables(default=settings),
    )
    consumer = Consumer(ConsumerConfig(store=store, gc_enabled=False))
    sink.last_sequence(consumer.queue)  # connect outside the timing
    spans = _write_timer(sink)
    started = time.perf_counter()
    ConsumerService(consumer, sink).run(threading.Event(), until_idle=True)
    seconds = time.perf_counter() - started
    rows = sum(t.num_rows for t in tables)
    sink.close()
    logger.info("%s: %s rows in %.2f s", sink.table, rows, seconds)
    if sink.rows_written != rows:
        raise RuntimeError(f"consumer wrote {sink.rows_written} rows, expected {rows}")
    _check(pg_url, table, before + (rows // 2 if upsert else rows), rows if upsert else None)
    return {
        "rows_per_s": round(rows / seconds),
        "seconds": round(seconds, 3),
        "copy_s": round(sink.copy_s, 3),
        # An upsert's COPYs (into its temporary tables) are inside its merges.
        "merge_s": round(sink.upsert_s - sink.copy_s, 3) if upsert else 0.0,
        "startup_s": round(spans[0][0] - started, 3) if spans else None,
        "transactions": len(spans),
        "table_rows_before": before,
    }


def _check(pg_url: str, table: str, expected: int, upserted: int | None) -> None:
    """``table`` holds ``expected`` rows; with ``upserted``, each of the queue's ids
    (``0 .. upserted - 1``) once, with the queue's value (``id * 0.5``), none the old one."""
    import adbc_driver_postgresql.dbapi as pg

    with pg.connect(pg_url) as conn, conn.cursor() as cur:
        cur.execute(f'SELECT count(*) FROM "{table}"')
        found = cur.fetchall()[0][0]
        if found != expected:
            raise RuntimeError(f"{table} holds {found} rows, expected {expected}")
        if upserted is None:
            return
        cur.execute(f'SELECT count(*) FROM "{table}" WHERE id < {upserted} AND value = id * 0.5')
        current = cur.fetchall()[0][0]
    if current != upserted:
        raise RuntimeError(f"{table}: {current} of the queue's {upserted} keys hold its values")


def _insert_floor(pg_url: str, tables: list[pa.Table]) -> float:
    """Seconds the server takes to insert the queue's rows, with keys none of which is
    present, into a keyed table prefilled as the upsert's (one ``INSERT ... SELECT`` from an
    unlogged copy of the rows, rolled back): what any merge of them writes, at least."""
    import adbc_driver_postgresql.dbapi as pg

    suffix = uuid.uuid4().hex[:8]
    table, stage = f"bench_floor_{suffix}", f"bench_floor_rows_{suffix}"
    _prefill(pg_url, table, tables, keyed=True)
    fresh = sum(t.num_rows for t in tables) * 4  # past every id the table holds
    with pg.connect(pg_url) as conn, conn.cursor() as cur:
        cur.execute(f'CREATE UNLOGGED TABLE "{stage}" AS SELECT * FROM "{table}" WITH NO DATA')
        cur.adbc_ingest(stage, pa.concat_tables(tables), mode="append")
        conn.commit()
        start = time.perf_counter()
        cur.execute(f'INSERT INTO "{table}" SELECT id + {fresh}, value, label, at FROM "{stage}"')
        seconds = time.perf_counter() - start
        conn.rollback()
        cur.execute(f'DROP TABLE "{stage}", "{table}"')
        conn.commit()
    return seconds


def run(quick: bool) -> dict[str, Any]:
    from millpond.localstack import start_postgres
    from millpond.storage import open_store

    batches, rows, rounds = (40, 5_000, 2) if quick else (400, 5_000, 5)
    tables = _tables(batches, rows)
    upserts: list[dict[str, Any]] = []
    appends: list[dict[str, Any]] = []
    with start_postgres() as server, seaweedfs_endpoint() as endpoint:
        store = open_store(
            endpoint.url_for(f"bench-{uuid.uuid4().hex[:8]}"), endpoint.store_options()
        )
        locations = _upload(store, tables)
        payloads = [b"bench"] * len(locations)
        _enqueue(store, locations[:8], payloads[:8])  # warm-up: first COPY, first GETs
        _run(store, server.url, tables[:8], upsert=False)
        for _ in range(rounds):
            for upsert, runs in ((False, appends), (True, upserts)):
                _enqueue(store, locations, payloads)
                runs.append(_run(store, server.url, tables, upsert=upsert))
        floors = [_insert_floor(server.url, tables) for _ in range(2 if quick else 3)]
    return _result(upserts, appends, floors, batches, rows)


def _result(
    upserts: list[dict[str, Any]],
    appends: list[dict[str, Any]],
    floors: list[float],
    batches: int,
    rows: int,
) -> dict[str, Any]:
    total = batches * rows
    upsert_rate = statistics.median(r["rows_per_s"] for r in upserts)
    append_rate = statistics.median(r["rows_per_s"] for r in appends)
    append_s, floor_s = total / append_rate, statistics.median(floors)
    merge_s = statistics.median(r["merge_s"] for r in upserts)
    bound = append_s / (append_s + floor_s)
    return make_result(
        NAME,
        ratio=upsert_rate / append_rate,
        target=TARGET,
        figures={
            "upsert_rows_per_s": upsert_rate,
            "batches": batches,
            "rows_per_batch": rows,
            "rows": total,
            "keys_already_present": total // 2,
            "upsert_copy_s": statistics.median(r["copy_s"] for r in upserts),
            "upsert_merge_s": merge_s,
            "insert_floor_s": round(floor_s, 3),
            "insert_floor_runs_s": [round(f, 3) for f in floors],
            "ratio_bound_from_floor": round(bound, 3),
            "rounds": upserts,
        },
        baseline={
            "append_rows_per_s": append_rate,
            "append_copy_s": statistics.median(r["copy_s"] for r in appends),
            "rounds": appends,
        },
        series=[
            plot_spec(
                "consumer -> PostgreSQL: upsert by key vs append",
                "round",
                "rows/s",
                list(range(1, len(upserts) + 1)),
                {
                    "upsert (half the keys present)": [r["rows_per_s"] for r in upserts],
                    "append": [r["rows_per_s"] for r in appends],
                },
            )
        ],
        headline=(
            f"upsert {upsert_rate:,.0f} rows/s vs append {append_rate:,.0f} rows/s "
            f"({total:,} rows, half of the keys present); merges {merge_s:.1f} s; inserting "
            f"the rows under fresh keys alone takes the server {floor_s:.1f} s: ratio <= "
            f"{bound:.2f}"
        ),
        notes=(
            "baseline: the same service appending the same batches into a table as big, "
            "without a key; insert_floor_s: the server inserting the same rows under keys "
            "none present into the keyed table (no conflicts, no updates), which bounds the "
            "ratio at append_s / (append_s + insert_floor_s)"
        ),
    )
