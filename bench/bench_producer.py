"""Producer throughput with ``wal_sync="always"`` against raw obstore PUTs of the same bytes.

Both sides run against the same SeaweedFS S3 server, in alternating rounds:

* **producer**: ``produce()`` calls of 4 x 256 KiB entries until ``flush()`` returns: every
  entry fsynced in the local WAL, every batch (``flush_size_bytes`` = 16 MiB) PUT and appended to
  the manifest. ``upload_concurrency`` = 4.
* **raw**: the same number of bytes as 16 MiB objects, PUT with obstore directly
  (``obstore.put``, no millpond code on the path), 4 in parallel.

The figure is payload MB/s; ``ratio`` is the median of per-pair ratios producer/raw (target
>= 0.8, DESIGN.md). The producer pays for what the baseline skips: writing and fsyncing every
byte to the local disk the S3 server also writes to, encoding batches, and manifest CASes.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import make_result, plot_spec, seaweedfs_endpoint
from millpond.producer import Producer, ProducerConfig

NAME = "producer"
TARGET = 0.8
MB = 1_000_000
ENTRY_BYTES = 256 << 10
ENTRIES_PER_CALL = 4
FLUSH_SIZE = 16 << 20
CONCURRENCY = 4

logger = logging.getLogger(__name__)


def _raw_store(endpoint: Any, root: str) -> Any:
    """An obstore S3Store on the endpoint: the baseline uses obstore with nothing in between."""
    from obstore.store import S3Store

    options = endpoint.store_options()
    allow_http = options.pop("aws_allow_http", "true") == "true"
    return S3Store.from_url(
        endpoint.url_for(root),
        config=options,
        client_options={"allow_http": allow_http, "timeout": timedelta(seconds=120)},
    )


def _raw_round(endpoint: Any, total: int, payload: bytes) -> float:
    import obstore

    store = _raw_store(endpoint, f"raw-{uuid.uuid4().hex[:12]}")
    objects = total // len(payload)
    started = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="bench-raw-put") as pool:
        list(
            pool.map(
                lambda i: obstore.put(store, f"ingest/{i:06d}.bin", payload, use_multipart=False),
                range(objects),
            )
        )
    return time.perf_counter() - started


def _producer_round(
    endpoint: Any, wal_dir: Path, total: int, entries: list[bytes]
) -> tuple[float, dict[str, Any]]:
    config = ProducerConfig(
        store=endpoint.url_for(f"producer-{uuid.uuid4().hex[:12]}"),
        store_options=endpoint.store_options(),
        wal_dir=wal_dir,
        wal_sync="always",
        flush_size_bytes=FLUSH_SIZE,
        upload_concurrency=CONCURRENCY,
    )
    calls = total // (ENTRY_BYTES * ENTRIES_PER_CALL)
    with Producer(config) as producer:
        started = time.perf_counter()
        for _ in range(calls):
            producer.produce(entries)
        producer.flush()
        seconds = time.perf_counter() - started
        metrics = producer.metrics()
    keep = (
        "batches_committed",
        "manifest_appends",
        "wal_syncs",
        "put_retries",
        "cas_retries",
        "bytes_uploaded",
        "bytes_staged",
    )
    figures = {key: metrics[key] for key in keep}
    figures["fsync_p50_ms"] = round(metrics["fsync_latency"]["p50"] * 1000, 3)
    return seconds, figures


def run(quick: bool) -> dict[str, Any]:
    total = (256 if quick else 512) << 20
    pairs = 3 if quick else 7
    base = os.urandom(ENTRY_BYTES)
    entries = [base[i:] + base[:i] for i in range(1, ENTRIES_PER_CALL + 1)]
    payload = os.urandom(FLUSH_SIZE)
    root = Path(tempfile.mkdtemp(prefix="millpond-bench-producer-"))
    producer_times: list[float] = []
    raw_times: list[float] = []
    details: list[dict[str, Any]] = []
    try:
        with seaweedfs_endpoint() as endpoint:
            _raw_round(endpoint, 2 * FLUSH_SIZE, payload)  # warm the server and the client
            for i in range(pairs):
                for side in ("producer", "raw") if i % 2 == 0 else ("raw", "producer"):
                    if side == "raw":
                        raw_times.append(_raw_round(endpoint, total, payload))
                    else:
                        seconds, figures = _producer_round(
                            endpoint, root / f"wal-{i}", total, entries
                        )
                        shutil.rmtree(root / f"wal-{i}")
                        producer_times.append(seconds)
                        details.append(figures)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = [raw / mine for mine, raw in zip(producer_times, raw_times, strict=True)]
    producer_mb_s = total / statistics.median(producer_times) / MB
    raw_mb_s = total / statistics.median(raw_times) / MB
    return make_result(
        NAME,
        ratio=statistics.median(ratios),
        target=TARGET,
        figures={
            "producer_mb_s": round(producer_mb_s, 2),
            "bytes_per_round": total,
            "pairs": pairs,
            "pair_ratios": [round(r, 3) for r in ratios],
            "producer_seconds": [round(t, 3) for t in producer_times],
            "rounds": details,
            "entry_bytes": ENTRY_BYTES,
            "entries_per_call": ENTRIES_PER_CALL,
            "flush_size_bytes": FLUSH_SIZE,
            "upload_concurrency": CONCURRENCY,
            "wal_sync": "always",
        },
        baseline={
            "raw_put_mb_s": round(raw_mb_s, 2),
            "object_bytes": FLUSH_SIZE,
            "concurrency": CONCURRENCY,
            "raw_seconds": [round(t, 3) for t in raw_times],
        },
        series=[
            plot_spec(
                "Producer (WAL fsync on) vs raw obstore PUTs, SeaweedFS",
                "pair",
                "MB/s",
                list(range(pairs)),
                {
                    "producer": [total / t / MB for t in producer_times],
                    "raw PUT": [total / t / MB for t in raw_times],
                },
            )
        ],
        headline=f"producer {producer_mb_s:.0f} MB/s vs raw PUT {raw_mb_s:.0f} MB/s (SeaweedFS)",
        notes=(
            "Same bytes, same server, same PUT concurrency; the producer also writes and "
            "fsyncs every byte to the local WAL on the disk SeaweedFS uses."
        ),
    )
