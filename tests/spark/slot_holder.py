"""A process that takes a WAL slot, stages rows it cannot publish, and waits to be killed.

Run as ``python slot_holder.py OPTIONS_JSON ROWS``; prints ``staged <wal dir>`` once every row
is fsynced in its slot's WAL. Its store endpoint is meant to be unreachable, so the rows stay
staged until a later process takes the slot and replays them.
"""

from __future__ import annotations

import json
import sys
import time

import pyarrow as pa

from millpond.producer.spark import executor_producer


def main() -> None:
    options = json.loads(sys.argv[1])
    rows = int(sys.argv[2])
    producer = executor_producer(options)
    handle = producer.produce_arrow(pa.record_batch({"id": pa.array(range(rows), pa.int64())}))
    handle.wait_staged()
    print("staged", producer.config.wal_dir, flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
