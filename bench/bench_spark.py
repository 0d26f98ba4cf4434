"""Spark rows/s through ``format("millpond")`` against raw obstore PUTs from ``mapInArrow``.

Setup: a SeaweedFS S3 server and one Spark session (``local[2]``), both on 127.0.0.1. The same
generated DataFrame (an id, a user key, an event kind, an amount, a timestamp) is written
two ways, alternately, round after round:

* **millpond** — ``df.write.format("millpond").mode("append").save()`` with the default
  ``commit="job"``: the driver checks the store, every task encodes each Arrow record batch as
  an IPC stream, packs them into batch objects of at most ``flush_size_bytes`` and uploads them
  (create-if-absent, 4 in flight), and the driver appends every location to the queue manifest
  in one CAS when Spark commits the job.
* **baseline** — ``df.mapInArrow(put_raw).collect()``: every task encodes the same record
  batches as the same IPC streams, packs them into bodies of the same size and PUTs them with
  plain ``obstore.put`` (4 in flight) under fresh names: no queue, no commit, no checks.

Both are timed from the action's call to its return, so each pays Spark's planning, the
JVM-to-Python Arrow transfer and the uploads; millpond additionally pays its Python worker for
the writer's set-up and the store check, the commit round trip and the manifest CAS. The ratio
is median millpond rows/s over median baseline rows/s; target 0.8 (DESIGN.md's producer target).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from bench.common import make_result, plot_spec, seaweedfs_endpoint

logger = logging.getLogger(__name__)

NAME = "spark"
TARGET = 0.8
FLUSH_SIZE = 8 << 20
CONCURRENCY = 4
FULL = {"rows": 2_000_000, "partitions": 8, "rounds": 3}
QUICK = {"rows": 400_000, "partitions": 4, "rounds": 2}


def _frame(spark: Any, rows: int, partitions: int) -> Any:
    return spark.range(rows, numPartitions=partitions).selectExpr(
        "id",
        "concat('user-', id % 5000) AS user_id",
        "element_at(array('view', 'click', 'cart', 'purchase'), CAST(id % 4 AS INT) + 1) AS kind",
        "CAST(id % 10000 AS DOUBLE) / 100 AS amount",
        "1767225600000 + id * 7 AS event_ms",
    )


def raw_put_partitions(
    url: str, options: Mapping[str, str]
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The baseline's ``mapInArrow`` function: the same bytes, PUT with plain obstore."""
    # obstore takes allow_http as a client option, not as an S3 config key.
    config: Any = {k: v for k, v in options.items() if k != "aws_allow_http"}

    def put_raw(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import obstore
        from obstore.store import S3Store

        from millpond.formats.arrow import encode_ipc
        from millpond.formats.batch import encode_batch

        store = S3Store.from_url(url, config=config, client_options={"allow_http": True})
        prefix = f"raw/{uuid.uuid4().hex}"
        # At most CONCURRENCY bodies uploading, as the millpond uploader does.
        slots = threading.BoundedSemaphore(CONCURRENCY)
        pending: list[bytes] = []
        size = rows = 0
        futures: list[Future[Any]] = []

        def put(path: str, body: bytes) -> None:
            try:
                obstore.put(store, path, body)
            finally:
                slots.release()

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            for batch in batches:
                for entry in encode_ipc(batch):
                    if pending and size + len(entry) + 4 + 7 > FLUSH_SIZE:
                        slots.acquire()
                        futures.append(
                            pool.submit(put, f"{prefix}/{len(futures)}", encode_batch(pending))
                        )
                        pending, size = [], 0
                    pending.append(entry)
                    size += len(entry) + 4
                rows += batch.num_rows
            if pending:
                slots.acquire()
                futures.append(pool.submit(put, f"{prefix}/{len(futures)}", encode_batch(pending)))
            for future in futures:
                future.result()
        yield pa.record_batch({"rows": pa.array([rows], pa.int64())})

    return put_raw


def run(quick: bool) -> dict[str, Any]:
    """Run the benchmark; see the module docstring."""
    from millpond.producer.spark import local_spark_session
    from millpond.queue import read_manifest
    from millpond.storage import open_store

    plan = QUICK if quick else FULL
    rows, partitions, rounds = plan["rows"], plan["partitions"], plan["rounds"]
    with seaweedfs_endpoint() as endpoint:
        options = endpoint.store_options()
        spark = local_spark_session("local[2]", app_name="millpond-bench-spark")
        try:
            frame = _frame(spark, rows, partitions)

            def millpond_job(root: str) -> float:
                started = time.perf_counter()
                frame.write.format("millpond").options(
                    store=endpoint.url_for(root), **options, flush_size_bytes=str(FLUSH_SIZE)
                ).mode("append").save()
                return time.perf_counter() - started

            def baseline_job(root: str) -> float:
                started = time.perf_counter()
                result = frame.mapInArrow(
                    raw_put_partitions(endpoint.url_for(root), options), "rows long"
                ).collect()
                elapsed = time.perf_counter() - started
                assert sum(r.rows for r in result) == rows
                return elapsed

            # Warm-up: JIT, Python workers, connection pools.
            millpond_job(f"bench-spark-warm-{uuid.uuid4().hex[:8]}")
            baseline_job(f"bench-spark-warm-{uuid.uuid4().hex[:8]}")
            mine: list[float] = []
            base: list[float] = []
            batches = 0
            for index in range(rounds):
                root = f"bench-spark-{uuid.uuid4().hex[:8]}"
                # Alternate the order so neither always runs on a warmer machine.
                if index % 2 == 0:
                    base.append(baseline_job(root + "-raw"))
                    mine.append(millpond_job(root))
                else:
                    mine.append(millpond_job(root))
                    base.append(baseline_job(root + "-raw"))
                manifest = read_manifest(
                    open_store(endpoint.url_for(root), options), "ingest/manifest"
                ).manifest
                batches = len(manifest.entries)
                logger.info("round %s: millpond %.2f s, baseline %.2f s", index, mine[-1], base[-1])
        finally:
            spark.stop()
    mine_rate = [rows / s for s in mine]
    base_rate = [rows / s for s in base]
    ratio = statistics.median(mine_rate) / statistics.median(base_rate)
    return make_result(
        NAME,
        ratio=ratio,
        target=TARGET,
        figures={
            "rows": rows,
            "partitions": partitions,
            "flush_size_bytes": FLUSH_SIZE,
            "batch_objects_per_job": batches,
            "millpond_rows_per_s": round(statistics.median(mine_rate)),
            "millpond_seconds": [round(s, 3) for s in mine],
        },
        baseline={
            "what": "mapInArrow, same IPC bytes, plain obstore.put, 4 in flight, no queue",
            "rows_per_s": round(statistics.median(base_rate)),
            "seconds": [round(s, 3) for s in base],
        },
        series=[
            plot_spec(
                "Spark job rows/s",
                x=list(range(1, rounds + 1)),
                x_label="round",
                y_label="rows/s",
                lines={"millpond data source": mine_rate, "raw obstore PUT": base_rate},
            )
        ],
        headline=f"{statistics.median(mine_rate):,.0f} rows/s through format('millpond'), "
        f"{ratio:.2f}x raw PUTs from mapInArrow",
    )
