"""A batch write with speculation on, against a standalone cluster, as its own process.

``python speculation_job.py MASTER_URL OPTIONS_JSON ROWS``: the first attempt of partition 0
writes part of its rows, then stalls; Spark launches a speculative copy on the other worker,
which wins. Prints ``done`` when the job has committed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator

import pyarrow as pa

from millpond.producer.spark import local_spark_session

STALL_SECONDS = 60.0


def stall_first_attempt(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    from pyspark import TaskContext

    context = TaskContext.get()
    assert context is not None
    for index, batch in enumerate(batches):
        yield batch
        # After a few batches (50 KB each: enough to pass the worker's output buffer), the
        # first attempt of partition 0 stalls: a straggler whose uploads are never enqueued.
        if (context.partitionId(), context.attemptNumber(), index) == (0, 0, 5):
            time.sleep(STALL_SECONDS)


def main() -> None:
    master, options_json, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    spark = local_spark_session(
        master,
        app_name="millpond-speculation",
        conf={
            "spark.executor.cores": "1",
            "spark.executor.memory": "512m",
            "spark.cores.max": "2",
            "spark.speculation": "true",
            "spark.speculation.multiplier": "1.0",
            "spark.speculation.quantile": "0.5",
            "spark.speculation.minTaskRuntime": "100ms",
            "spark.speculation.interval": "100ms",
            "spark.sql.execution.arrow.maxRecordsPerBatch": "500",
            # The executors' JVMs take the suite's options for Spark's JVMs (tests/conftest.py).
            "spark.executor.extraJavaOptions": os.environ.get("SPARK_SUBMIT_OPTS", ""),
        },
    )
    try:
        # Both executors must be up before the job, or every task may start on one host.
        deadline = time.monotonic() + 120
        while spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() < 3:  # + driver
            if time.monotonic() > deadline:
                raise RuntimeError("the two executors did not register within 120 s")
            time.sleep(0.2)
        (
            spark.range(rows, numPartitions=4)
            .selectExpr("id", "repeat('x', 100) AS pad")
            .mapInArrow(stall_first_attempt, "id long, pad string")
            .write.format("millpond")
            .options(**json.loads(options_json))
            .mode("append")
            .save()
        )
        print("done", flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
