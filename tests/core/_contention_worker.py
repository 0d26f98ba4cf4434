"""A separate OS process that hammers one object with compare-and-swap writes.

Run as ``python _contention_worker.py MODE STORE_URL WORKER COUNT``; store options come as JSON
in ``MILLPOND_WORKER_OPTIONS``. The worker opens its store, prints ``ready``, blocks until a line
arrives on stdin (so all workers start at once), does its writes and prints one JSON line.

Modes:
    queue    ``COUNT`` single-entry appends through ``QueueProducer``; payload ``w{W}-{i}``.
    counter  ``COUNT`` increments of a decimal counter with ``put_if_match`` (raw store CAS).
"""

from __future__ import annotations

import json
import os
import sys
import time

from millpond.common.retry import RetryPolicy
from millpond.common.ulids import UlidMinter, batch_location
from millpond.errors import ConflictError
from millpond.formats.manifest import Metadata, PendingEntry
from millpond.queue import QueueProducer
from millpond.storage import ObjectStore, open_store

MANIFEST = "ingest/manifest"
COUNTER = "counter"


def run_queue(store: ObjectStore, worker: int, count: int) -> dict[str, object]:
    # MILLPOND_WORKER_STRATEGY picks the retry strategy (default: the policy's default).
    strategy = os.environ.get("MILLPOND_WORKER_STRATEGY")
    retry = RetryPolicy(strategy=strategy) if strategy else None
    producer = QueueProducer(store, MANIFEST, retry=retry)
    minter = UlidMinter()
    sequences = []
    for i in range(count):
        entry = PendingEntry(
            batch_location("ingest", minter.mint()),
            (Metadata(0, int(time.time() * 1000), f"w{worker}-{i}".encode()),),
        )
        sequences.append(producer.append([entry])[0])
    counters = producer.counters.snapshot()
    return {"sequences": sequences, **counters}


def run_counter(store: ObjectStore, worker: int, count: int) -> dict[str, object]:
    conflicts = 0
    done = 0
    while done < count:
        got = store.get(COUNTER)
        assert got.etag is not None
        try:
            store.put_if_match(COUNTER, str(int(got.data) + 1).encode(), got.etag)
        except ConflictError:
            conflicts += 1
            continue
        done += 1
    return {"cas_conflicts": conflicts, "worker": worker}


def main() -> int:
    mode, url, worker, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    options = json.loads(os.environ.get("MILLPOND_WORKER_OPTIONS", "{}"))
    store = open_store(url, options)
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.monotonic()
    result = (
        run_queue(store, worker, count) if mode == "queue" else run_counter(store, worker, count)
    )
    result["elapsed"] = time.monotonic() - started
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
