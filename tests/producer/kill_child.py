"""The process the kill test SIGKILLs: produces a numbered stream and records what was staged.

Run as ``python kill_child.py STORE_URL WAL_DIR RECORD_FILE FIRST_NUMBER`` (S3 options as JSON
in ``MILLPOND_KILL_STORE_OPTIONS``). Each number is one
entry (``b"<n>"``); once ``wait_staged()`` returned for a call, its numbers are appended to
RECORD_FILE with one ``write`` on an ``O_APPEND`` descriptor (the page cache outlives a killed
process, so no fsync is needed for SIGKILL).

The store is wrapped so that every batch PUT and manifest write pauses for
``MILLPOND_KILL_PHASE_DELAY`` seconds (default 0.03) both before and after the real write,
announcing each phase on stdout (``phase put-start``, ``phase put-landed``, ``phase
cas-start``, ``phase cas-landed``): the parent kills on those lines to land inside each window
reliably. ``staged <n>`` lines report progress.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from millpond.common.retry import RetryPolicy
from millpond.producer import Producer, ProducerConfig, WriteHandle
from millpond.storage import ForwardingStore, ObjectStore, open_store

_T = TypeVar("_T")
MANIFEST = "ingest/manifest"
_print_lock = threading.Lock()


def say(line: str) -> None:
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class PhaseStore(ForwardingStore):
    """Announces and stretches the PUT and CAS windows."""

    def __init__(self, inner: ObjectStore, delay: float) -> None:
        super().__init__(inner)
        self.delay = delay

    def _around(self, kind: str, write: Callable[[], _T]) -> _T:
        say(f"phase {kind}-start")
        time.sleep(self.delay)
        result = write()
        say(f"phase {kind}-landed")
        time.sleep(self.delay)
        return result

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        kind = "cas" if path == MANIFEST else "put"
        return self._around(kind, lambda: self.inner.put_if_absent(path, data))

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        return self._around("cas", lambda: self.inner.put_if_match(path, data, etag))


def main() -> None:
    store_url, wal_dir, record_file, first = sys.argv[1:5]
    delay = float(os.environ.get("MILLPOND_KILL_PHASE_DELAY", "0.03"))
    options = json.loads(os.environ.get("MILLPOND_KILL_STORE_OPTIONS", "{}"))
    store = PhaseStore(open_store(store_url, options), delay)
    config = ProducerConfig(
        store=store,
        wal_dir=wal_dir,
        flush_interval=0.01,
        flush_size_bytes=256,
        upload_concurrency=2,
        retry=RetryPolicy(max_attempts=20, max_elapsed=5.0, base_delay=0.001, max_delay=0.05),
    )
    producer = Producer(config)
    say(f"ready recovered={producer.metrics()['records_recovered']}")
    record = os.open(record_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    number = int(first)
    in_flight = []
    published: deque[WriteHandle] = deque()
    while True:
        for _ in range(4):
            numbers = list(range(number, number + 3))
            number += 3
            handle = producer.produce([b"%d" % n for n in numbers], metadata=b"kill-test")
            in_flight.append((handle, numbers))
        for handle, numbers in in_flight:
            handle.wait_staged()
            os.write(record, "".join(f"{n}\n" for n in numbers).encode())
            say(f"staged {numbers[-1]}")
            published.append(handle)
        in_flight.clear()
        # Stay at most ~40 calls ahead of the manifest, so that most numbers go through
        # batches (and kills) during the rounds rather than all at the final drain.
        while len(published) > 40:
            published.popleft().wait()


if __name__ == "__main__":
    main()
