"""Spark -> millpond -> PostgreSQL rows/s, every Spark type, against Spark's own JDBC writer.

DESIGN.md "Performance": Spark -> Millpond -> PostgreSQL rows/s with every Spark type, baseline
Spark's JDBC writer into the same PostgreSQL, warm, in the same run; target >= 1.0 (then 2.0).

Setup: a throwaway PostgreSQL (``fsync`` on), a SeaweedFS S3 server and one Spark session
(``local[2]``, PostgreSQL's JDBC driver on its class path), all on 127.0.0.1. One generated
DataFrame with a column of every Spark SQL type (boolean, the four integer widths, float,
double, decimal(38,10), string, binary, date, timestamp, timestamp_ntz, time, interval day to
second, array, map, struct, variant) is written two ways, alternately, round after round, each
into a fresh table:

* **millpond** — ``df.write.format("millpond").mode("append").save()`` (the default
  ``commit="job"``: tasks upload batch objects, the driver appends their locations in one
  compare-and-swap), then the consumer service as ``millpond consume --exit-when-idle`` runs it
  (start-up, epoch, read-ahead GETs, decode, one transaction per group of batches with its
  progress rows, the final dequeue) into a table it creates. Timed from the write's call until
  the consumer has committed every row: the rows are in the database, exactly once.
* **jdbc** — ``df.write.jdbc(...)`` with Spark's PostgreSQL dialect, ``mode("append")`` into a
  fresh table (Spark creates it), as tuned as a user would: the driver's
  ``reWriteBatchedInserts=true`` (multi-row ``INSERT``) and ``batchsize`` 10,000. JDBC cannot
  write an interval, a time, a map, a struct or a variant, so those columns go as text
  (``CAST(... AS STRING)``, ``to_json``), what a user of the JDBC writer has to do. The plain
  writer (default ``batchsize``, no rewrite) is timed once for reference.

Both write the same rows from the same plan (8 partitions, 2 cores). The ratio is median
millpond rows/s over median tuned-JDBC rows/s; ``spark_job_vs_jdbc`` compares the Spark jobs
alone (the JDBC job's seconds over the millpond write's: how much sooner the job is done, the
database loaded behind it). After every round each table is checked: the
row count, ``sum(id)`` and the number of distinct ids.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
import uuid
from typing import Any

from bench.common import make_result, plot_spec, seaweedfs_endpoint

logger = logging.getLogger(__name__)

NAME = "spark_postgres"
TARGET = 1.0
FLUSH_SIZE = 8 << 20
JDBC_JAR_ENV = "MILLPOND_BENCH_JDBC_JAR"
JDBC_JARS = ("/usr/share/java/postgresql.jar",)
FULL = {"rows": 1_000_000, "partitions": 8, "rounds": 3}
QUICK = {"rows": 200_000, "partitions": 4, "rounds": 2}

# One column of every Spark SQL type, computed in the JVM from the row's id.
COLUMNS = {
    "id": "id",
    "b": "id % 2 = 0",
    "i8": "CAST(id % 128 AS TINYINT)",
    "i16": "CAST(id % 32768 AS SMALLINT)",
    "i32": "CAST(id % 2147483647 AS INT)",
    "i64": "id * 7919",
    "f32": "CAST(id AS FLOAT) / 3",
    "f64": "CAST(id AS DOUBLE) / 7",
    "d38": "CAST(id / 3 AS DECIMAL(38, 10))",
    "s": "concat('user-', id % 5000)",
    "bin": "CAST(concat('b', id) AS BINARY)",
    "d": "date_add(DATE'2020-01-01', CAST(id % 3650 AS INT))",
    "ts": "timestamp_micros(1767225600000000 + id * 1000)",
    "tsntz": "CAST(timestamp_micros(1767225600000000 + id * 1000) AS TIMESTAMP_NTZ)",
    "t": "CAST(concat('12:34:', lpad(CAST(id % 60 AS STRING), 2, '0')) AS TIME)",
    "dti": "make_dt_interval(0, 0, 0, CAST(id % 86400 AS DECIMAL(18, 6)))",
    "arr": "array(CAST(id % 100 AS INT), CAST(id % 7 AS INT))",
    "m": "map('k', CAST(id % 100 AS INT))",
    "st": "named_struct('x', id, 'y', concat('v', id % 100))",
    "v": "parse_json(concat('{\"n\":', CAST(id AS STRING), '}'))",
}
# What the JDBC writer cannot take, as the text a user would write instead.
JDBC_AS_TEXT = {
    "t": "CAST(t AS STRING)",
    "dti": "CAST(dti AS STRING)",
    "m": "to_json(m)",
    "st": "to_json(st)",
    "v": "to_json(v)",
}


def jdbc_jar() -> str:
    """PostgreSQL's JDBC driver jar (Debian's ``libpostgresql-jdbc-java``; ``make bench``
    installs it), or ``MILLPOND_BENCH_JDBC_JAR``.

    Raises:
        RuntimeError: no jar found.
    """
    candidates = [os.environ[JDBC_JAR_ENV]] if os.environ.get(JDBC_JAR_ENV) else list(JDBC_JARS)
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise RuntimeError(
        f"PostgreSQL's JDBC driver not found at {', '.join(candidates)}: install Debian's "
        f"libpostgresql-jdbc-java (make bench does) or set {JDBC_JAR_ENV}"
    )


def _jdbc_url(pg_url: str, *, tuned: bool) -> str:
    # postgresql://user@host:port/db -> jdbc:postgresql://host:port/db?user=user
    rest = pg_url.removeprefix("postgresql://")
    user, _, location = rest.partition("@")
    url = f"jdbc:postgresql://{location}?user={user}"
    return url + "&reWriteBatchedInserts=true" if tuned else url


def _check_table(pg_url: str, table: str, rows: int) -> None:
    import adbc_driver_postgresql.dbapi as pg

    with pg.connect(pg_url) as conn, conn.cursor() as cur:
        cur.execute(f'SELECT count(*), sum(id), count(DISTINCT id) FROM "{table}"')
        found = cur.fetchone()
    expected = (rows, rows * (rows - 1) // 2, rows)
    if found is None or tuple(int(v) for v in found) != expected:
        raise RuntimeError(
            f"table {table}: (count, sum(id), distinct ids) {found}, expected {expected}"
        )


def _consume(store_url: str, options: dict[str, str], pg_url: str, table: str) -> int:
    """The consumer service until the queue is drained; the rows it wrote."""
    from millpond.consumer import Consumer, ConsumerConfig
    from millpond.consumer.app.service import ConsumerService
    from millpond.consumer.sinks import PostgresSink

    sink = PostgresSink(pg_url, table=table, progress_table=f"{table}_progress")
    consumer = Consumer(ConsumerConfig(store=store_url, store_options=options, gc_enabled=False))
    try:
        ConsumerService(consumer, sink).run(threading.Event(), until_idle=True)
        return sink.rows_written
    finally:
        consumer.close()
        sink.close()


def run(quick: bool) -> dict[str, Any]:
    """Run the benchmark; see the module docstring."""
    from millpond.localstack import start_postgres
    from millpond.producer.spark import local_spark_session

    plan = QUICK if quick else FULL
    rows, partitions, rounds = plan["rows"], plan["partitions"], plan["rounds"]
    jar = jdbc_jar()
    with start_postgres() as server, seaweedfs_endpoint() as endpoint:
        options = endpoint.store_options()
        spark = local_spark_session(
            "local[2]",
            app_name="millpond-bench-spark-postgres",
            # TIME is opt-in in Spark 4.
            conf={"spark.jars": jar, "spark.sql.timeType.enabled": "true"},
        )
        try:
            frame = spark.range(rows, numPartitions=partitions).selectExpr(
                *(f"{expr} AS {name}" for name, expr in COLUMNS.items())
            )
            jdbc_frame = frame.selectExpr(
                *(f"{JDBC_AS_TEXT.get(name, name)} AS {name}" for name in COLUMNS)
            )

            phases: list[tuple[float, float]] = []  # (write, consume) seconds of each round

            def millpond_round(tag: str) -> float:
                root = f"bench-spark-pg-{tag}"
                store_url = endpoint.url_for(root)
                table = f"mp_{tag}"
                started = time.perf_counter()
                frame.write.format("millpond").options(
                    store=store_url, **options, flush_size_bytes=str(FLUSH_SIZE)
                ).mode("append").save()
                wrote = time.perf_counter()
                written = _consume(store_url, options, server.url, table)
                elapsed = time.perf_counter() - started
                phases.append((wrote - started, elapsed - (wrote - started)))
                if written != rows:
                    raise RuntimeError(f"the consumer wrote {written} rows, expected {rows}")
                _check_table(server.url, table, rows)
                return elapsed

            def jdbc_round(tag: str, *, tuned: bool = True) -> float:
                table = f"jdbc_{tag}"
                writer = jdbc_frame.write.mode("append").option("driver", "org.postgresql.Driver")
                if tuned:
                    writer = writer.option("batchsize", "10000")
                started = time.perf_counter()
                writer.jdbc(_jdbc_url(server.url, tuned=tuned), table)
                elapsed = time.perf_counter() - started
                _check_table(server.url, table, rows)
                return elapsed

            # Warm-up: JIT, Python workers, connection pools, the first COPY and INSERTs.
            millpond_round(f"warm_{uuid.uuid4().hex[:8]}")
            jdbc_round(f"warm_{uuid.uuid4().hex[:8]}")
            plain = jdbc_round(f"plain_{uuid.uuid4().hex[:8]}", tuned=False)
            mine: list[float] = []
            base: list[float] = []
            for index in range(rounds):
                tag = uuid.uuid4().hex[:8]
                # Alternate the order so neither always runs on a warmer machine.
                if index % 2 == 0:
                    base.append(jdbc_round(tag))
                    mine.append(millpond_round(tag))
                else:
                    mine.append(millpond_round(tag))
                    base.append(jdbc_round(tag))
                logger.info("round %s: millpond %.2f s, jdbc %.2f s", index, mine[-1], base[-1])
        finally:
            spark.stop()
    mine_rate = [rows / s for s in mine]
    base_rate = [rows / s for s in base]
    ratio = statistics.median(mine_rate) / statistics.median(base_rate)
    job = statistics.median(w for w, _ in phases[1:])  # the Spark job alone (warm-up left out)
    return make_result(
        NAME,
        ratio=ratio,
        target=TARGET,
        figures={
            "rows": rows,
            "partitions": partitions,
            "columns": list(COLUMNS),
            "flush_size_bytes": FLUSH_SIZE,
            "millpond_rows_per_s": round(statistics.median(mine_rate)),
            "millpond_seconds": [round(s, 3) for s in mine],
            "spark_write_seconds": [round(w, 3) for w, _ in phases[1:]],
            "spark_job_vs_jdbc": round(statistics.median(base) / job, 2),
            "consumer_seconds": [round(c, 3) for _, c in phases[1:]],
            "what": "write with format('millpond') + consumer service until every row is "
            "committed in PostgreSQL",
        },
        baseline={
            "what": "df.write.jdbc, reWriteBatchedInserts=true, batchsize 10000; interval, "
            "time, map, struct and variant columns as text",
            "rows_per_s": round(statistics.median(base_rate)),
            "seconds": [round(s, 3) for s in base],
            "plain_jdbc_rows_per_s": round(rows / plain),
            "ratio_vs_plain_jdbc": round(statistics.median(mine_rate) / (rows / plain), 3),
        },
        series=[
            plot_spec(
                "Spark -> PostgreSQL rows/s, every Spark type",
                x=list(range(1, rounds + 1)),
                x_label="round",
                y_label="rows/s",
                lines={
                    "millpond (write + consumer, committed)": mine_rate,
                    "Spark JDBC writer (tuned)": base_rate,
                },
            )
        ],
        headline=f"{statistics.median(mine_rate):,.0f} rows/s Spark -> millpond -> PostgreSQL "
        f"({len(COLUMNS)} columns, every Spark type), {ratio:.2f}x Spark's JDBC writer "
        f"(tuned; {statistics.median(mine_rate) / (rows / plain):.2f}x its defaults); the Spark "
        f"job alone {statistics.median(base) / job:.1f}x faster",
    )
