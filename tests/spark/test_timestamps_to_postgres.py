"""A Spark job with a ``timestamp`` column from a New York session into PostgreSQL: 1,000,000
rows in several batches, every value equal. Before the fix the consumer stopped after the first
batch (``timestamp[us, tz=America/New_York]`` against the table's ``timestamp[us, tz=UTC]``)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING

from millpond.localstack import PostgresServer, S3Endpoint
from tests.spark.spark_support import Queue

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ROWS = 1_000_000
BASE_US = 1_700_000_000_000_000  # 2023-11-14T22:13:20Z


def test_a_million_new_york_timestamps_arrive_equal(
    spark: SparkSession, moto_s3: S3Endpoint, postgres_server: PostgresServer
) -> None:
    queue = Queue(moto_s3)
    previous = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    began = time.monotonic()
    try:
        # Every value a distinct instant: id microseconds plus id seconds after BASE, so both
        # the second and the sub-second part vary (and cross New York's DST change is not
        # needed: instants are compared, not wall times).
        df = spark.range(0, ROWS, numPartitions=4).selectExpr(
            "id", f"timestamp_micros({BASE_US} + id * 1000001) AS ts"
        )
        df.write.format("millpond").options(**queue.options(flush_size_bytes=2_000_000)).mode(
            "append"
        ).save()
    finally:
        spark.conf.set("spark.sql.session.timeZone", previous)
    batches = len(queue.entries())
    assert batches >= 4
    table = f"ts_{uuid.uuid4().hex[:8]}"
    options = [f"--store-option={k}={v}" for k, v in moto_s3.store_options().items()]
    result = subprocess.run(
        [
            sys.executable, "-m", "millpond.cli", "consume", queue.url, *options,
            "--sink", postgres_server.url, "--table", table, "--progress-table", f"{table}_p",
            "--exit-when-idle", "--no-gc", "--quiet",
        ],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr

    import adbc_driver_postgresql.dbapi as pg

    with pg.connect(postgres_server.url) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
            f"WHERE attrelid = '{table}'::regclass AND attname = 'ts'"
        )
        assert cur.fetchall() == [("timestamp with time zone",)]
        # Every value compared in the database: the stored instant in microseconds since the
        # epoch must be exactly what the job computed from its id.
        cur.execute(
            "SELECT count(*), count(DISTINCT id), count(DISTINCT _millpond_sequence), "
            f"count(*) FILTER (WHERE (extract(epoch FROM ts) * 1000000)::bigint "
            f'<> {BASE_US} + id * 1000001) FROM "{table}"'
        )
        count, distinct, sequences, wrong = cur.fetchall()[0]
        conn.rollback()
    elapsed = time.monotonic() - began
    print(f"1,000,000 New York timestamps: {batches} batches, {elapsed:.1f} s job + consume")
    assert (count, distinct, wrong) == (ROWS, ROWS, 0)
    assert sequences == batches
