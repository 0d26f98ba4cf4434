"""Spark integration: the ``millpond`` data source, and producers inside executors.

Batch::

    from millpond.producer.spark import register
    register(spark)
    df.write.format("millpond").option("store", "s3://bucket").mode("append").save()

Streaming::

    (df.writeStream.format("millpond").option("store", "s3://bucket")
       .option("checkpointLocation", "/checkpoints/q1").start())

With the default ``commit="job"`` each task uploads batch objects (Arrow IPC entries, each object
at most ``flush_size_bytes``) and returns their locations to the driver, which appends all of
them in one compare-and-swap when Spark commits the job. A job's rows enter the queue exactly
once however many task attempts ran: only the attempts Spark commits reach the driver; the
uploads of the others are never referenced and GC removes them. Each micro-batch of a stream is
one append too, and a micro-batch Spark runs again after a driver restart is recognised and not
enqueued twice (``millpond.producer.spark.commit`` explains how, and the one window left).

``commit="task"`` makes every task publish through its worker's producer as it goes, with the
WAL in between (lower latency, no driver round trip). That is at least once: a task that fails
after publishing some batches publishes them again when Spark retries it.

Options are listed in ``millpond.producer.spark.options``; they are checked on the driver when
the write starts, so a bad one fails the job before any task runs, with the key named.
"""

from __future__ import annotations

from millpond.producer.spark.commit import JobReceipt, MicroBatchOutcome
from millpond.producer.spark.datasource import (
    MillpondBatchWriter,
    MillpondDataSource,
    MillpondStreamWriter,
    register,
)
from millpond.producer.spark.executor import (
    WRITE_RESULT_SCHEMA,
    close_executor_producers,
    executor_producer,
    partition_producer,
    write_arrow_partitions,
)
from millpond.producer.spark.options import SparkWriteSettings
from millpond.producer.spark.session import local_spark_session

__all__ = [
    "WRITE_RESULT_SCHEMA",
    "JobReceipt",
    "MicroBatchOutcome",
    "MillpondBatchWriter",
    "MillpondDataSource",
    "MillpondStreamWriter",
    "SparkWriteSettings",
    "close_executor_producers",
    "executor_producer",
    "local_spark_session",
    "partition_producer",
    "register",
    "write_arrow_partitions",
]
