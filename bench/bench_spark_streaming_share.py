"""Millpond's share of a Spark streaming micro-batch (issue 49).

Setup: a SeaweedFS S3 server and one Spark session (``local[2]``) on 127.0.0.1. The source is
a directory of Parquet files of ``rows`` rows each (id, string with nulls, timestamp,
decimal(18,4), double), read with ``maxFilesPerTrigger=1``: every micro-batch is one file.
Three queries run over the same files, one after the other, each with
``trigger(availableNow=True)`` (as fast as Spark goes) and a checkpoint of its own:

* **millpond** — ``writeStream.format("millpond")`` (``commit="job"``: the driver parses the
  options, the tasks upload batch objects, the driver appends them once per micro-batch
  through the stream's commit state);
* **empty** — ``foreachBatch(lambda df, batch_id: None)``: a micro-batch that reads nothing
  and writes nothing, Spark's own cost of running one (offsets, the checkpoint's logs);
* **noop** — ``writeStream.format("noop")``: reads every row and writes none (what reading
  the rows costs Spark);
* **python** — a Python data source whose stream writer does nothing: every task takes its
  rows as Arrow batches and drops them, the driver's commit returns. Spark runs it exactly as
  it runs ``millpond`` (the writer made on the driver, the rows sent to Python workers, the
  commit in a Python process of its own), so what ``millpond`` takes beyond it is Millpond's
  own work: parsing the options and probing the store, uploading, the commit.

Before each, a query of the same kind over one file warms Spark's Python processes (the
first micro-batch of the first Python data source of a session waits for Spark to start
them: seconds, whichever data source it is). Each micro-batch's ``triggerExecution`` comes
from the query's progress reports; the first micro-batch of each query is reported on its
own and left out of the medians. Millpond's share is ``(millpond - python) / millpond`` (target
<= 0.20). A side row gives the share over the empty ``foreachBatch``, ``(millpond - empty) /
millpond``, with the same target: that one also counts what Spark spends sending the rows to
Python, which no Python data source avoids. The queue is checked: every row once.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import make_result, plot_spec, seaweedfs_endpoint

logger = logging.getLogger(__name__)

NAME = "spark_streaming_share"
TARGET = 0.20
FULL = {"rows": 100_000, "files": 12}
QUICK = {"rows": 20_000, "files": 5}

COLUMNS = {
    "id": "id",
    "s": "CASE WHEN id % 10 = 3 THEN NULL ELSE concat('user-', id % 100000) END",
    "ts": "timestamp_micros(1767225600000000 + id * 1000)",
    "d": "CAST(id / 7 AS DECIMAL(18, 4))",
    "x": "CAST(id AS DOUBLE) / 7",
}


def _files(spark: Any, directory: Path, rows: int, files: int) -> None:
    """``files`` Parquet files of ``rows`` rows each, ids counting on from one to the next."""
    frame = spark.range(rows * files, numPartitions=files).selectExpr(
        *(f"{expr} AS {name}" for name, expr in COLUMNS.items())
    )
    frame.write.mode("overwrite").parquet(str(directory))


def _register_python_sink(spark: Any) -> None:
    """The ``bench_discard`` data source: a stream writer that drops its rows (defined here,
    in a function, so Spark's Python workers get it by value)."""
    from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, WriterCommitMessage

    class DiscardWriter(DataSourceStreamArrowWriter):
        def write(self, iterator: Any) -> WriterCommitMessage:
            for _batch in iterator:
                pass
            return WriterCommitMessage()

        def commit(self, messages: Any, batchId: int) -> None:
            pass

        def abort(self, messages: Any, batchId: int) -> None:
            pass

    class Discard(DataSource):
        @classmethod
        def name(cls) -> str:
            return "bench_discard"

        def streamWriter(self, schema: Any, overwrite: bool) -> DiscardWriter:
            return DiscardWriter()

    spark.dataSource.register(Discard)


def _durations(spark: Any, source: Path, checkpoint: Path, sink: str, **options: str) -> list:
    """Run one query over every file; each micro-batch's ``triggerExecution`` ms."""
    schema = spark.read.parquet(str(source)).schema
    stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(str(source))
    writer = stream.writeStream.option("checkpointLocation", str(checkpoint))
    if sink == "empty":
        writer = writer.foreachBatch(lambda _frame, _batch_id: None)
    else:
        writer = writer.format(sink).options(**options)
    query = writer.trigger(availableNow=True).start()
    query.awaitTermination()
    # Every micro-batch of an availableNow query has one report (the empty foreachBatch reads
    # no rows, so numInputRows says nothing there).
    return [p["durationMs"] for p in query.recentProgress if "addBatch" in p["durationMs"]]


def _queue_rows(store_url: str, options: dict[str, str]) -> int:
    from millpond.consumer import Consumer, ConsumerConfig

    consumer = Consumer(ConsumerConfig(store=store_url, store_options=options, gc_enabled=False))
    rows = 0
    try:
        consumer.initialize()
        while batches := consumer.next_batches(64):
            rows += sum(b.to_arrow().num_rows for b in batches)
            consumer.ack_through(batches[-1].sequence)
    finally:
        consumer.close()
    return rows


def run(quick: bool) -> dict[str, Any]:
    """Run the benchmark; see the module docstring."""
    from millpond.producer.spark import local_spark_session

    plan = QUICK if quick else FULL
    rows, files = plan["rows"], plan["files"]
    durations: dict[str, list[dict[str, int]]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="millpond-stream-") as scratch,
        seaweedfs_endpoint() as (endpoint),
    ):
        root = Path(scratch)
        options = endpoint.store_options()
        store_url = endpoint.url_for("bench-stream-share")
        spark = local_spark_session("local[2]", app_name="millpond-bench-stream-share")
        try:
            _files(spark, root / "source", rows, files)
            _files(spark, root / "warm", rows, 1)
            _register_python_sink(spark)
            for sink in ("noop", "empty", "bench_discard", "millpond"):
                sink_options = {"store": store_url, **options} if sink == "millpond" else {}
                # Warm-up: Spark's Python processes started, millpond imported in them.
                _durations(spark, root / "warm", root / f"warm-{sink}", sink, **sink_options)
                started = time.perf_counter()
                durations[sink] = _durations(
                    spark, root / "source", root / f"checkpoint-{sink}", sink, **sink_options
                )
                logger.info("%s: %s micro-batches in %.1f s", sink, len(durations[sink]),
                            time.perf_counter() - started)  # fmt: skip
        finally:
            spark.stop()
        found = _queue_rows(store_url, options)
    if found != rows * (files + 1):  # the warm-up's file too
        raise RuntimeError(f"the queue holds {found} rows, expected {rows * (files + 1)}")
    return _result(durations, rows=rows, files=files)


def _series(total: dict[str, list[int]], rows: int) -> dict[str, Any]:
    names = {
        "millpond": "format('millpond')",
        "bench_discard": "Python data source that drops its rows",
        "noop": "format('noop')",
        "empty": "empty foreachBatch",
    }
    return plot_spec(
        f"Spark streaming micro-batch of {rows:,} rows",
        x=list(range(1, len(total["millpond"]) + 1)),
        x_label="micro-batch",
        y_label="triggerExecution ms",
        lines={label: total[k] for k, label in names.items()},
        log_y=True,
    )


def _result(durations: dict[str, list[dict[str, int]]], *, rows: int, files: int) -> dict[str, Any]:
    total = {k: [d["triggerExecution"] for d in v] for k, v in durations.items()}
    warm = {k: statistics.median(v[1:] or v) for k, v in total.items()}
    share = (warm["millpond"] - warm["bench_discard"]) / warm["millpond"]
    over_empty = (warm["millpond"] - warm["empty"]) / warm["millpond"]
    parts = {
        k: {
            part: statistics.median(d.get(part, 0) for d in v[1:] or v)
            for part in sorted({p for d in v for p in d})
        }
        for k, v in durations.items()
    }
    return make_result(
        NAME,
        ratio=share,
        target=TARGET,
        target_op="<=",
        figures={
            "rows_per_micro_batch": rows,
            "micro_batches": files,
            "trigger_execution_ms": total,
            "median_warm_ms": warm,
            "first_micro_batch_ms": {k: v[0] for k, v in total.items()},
            "parts_median_warm_ms": parts,
            "share_over_empty_foreach_batch": round(over_empty, 3),
            "share_over_noop": round((warm["millpond"] - warm["noop"]) / warm["millpond"], 3),
            "what": "(millpond - a Python data source that drops its rows) / millpond, median "
            "triggerExecution of the warm micro-batches",
        },
        baseline={
            "what": "a Python stream writer that drops its rows, the same micro-batches (and "
            "an empty foreachBatch, and format('noop'))",
            "python_median_ms": warm["bench_discard"],
            "empty_foreach_batch_median_ms": warm["empty"],
            "noop_median_ms": warm["noop"],
        },
        series=[_series(total, rows)],
        headline=f"micro-batch of {rows:,} rows: millpond {warm['millpond']:.0f} ms, a Python "
        f"sink that drops the rows {warm['bench_discard']:.0f} ms: Millpond's share {share:.0%}"
        f" (first micro-batch {total['millpond'][0]} ms vs {total['bench_discard'][0]} ms)",
        side_rows=[
            {
                "name": "over_empty_foreach_batch",
                "ratio": round(over_empty, 4),
                "target": TARGET,
                "target_op": "<=",
                "headline": f"over an empty foreachBatch ({warm['empty']:.0f} ms): "
                f"{over_empty:.0%}, Spark's sending the rows to Python included",
            }
        ],
    )
