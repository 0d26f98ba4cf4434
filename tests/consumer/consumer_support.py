"""Helpers for the consumer and GC tests: a queue writer built on the core, clocks, stores."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import pyarrow as pa

from millpond.common.retry import RetryPolicy
from millpond.common.ulids import UlidMinter, batch_location
from millpond.consumer import ConsumedBatch, Consumer, ConsumerConfig
from millpond.consumer.sinks import AdbcSink, open_sink
from millpond.formats.arrow import encode_ipc
from millpond.formats.batch import CompressionType, encode_batch
from millpond.formats.manifest import Metadata, PendingEntry
from millpond.queue import QueueProducer
from millpond.storage import (
    DeleteFailure,
    ForwardingStore,
    GetResult,
    ObjectInfo,
    ObjectStore,
    open_store,
)

MANIFEST = "ingest/manifest"
PREFIX = "ingest"
FAST_RETRY = RetryPolicy(max_attempts=1000, max_elapsed=120.0, base_delay=0.001, max_delay=0.05)


def quiet_consumer(store: ObjectStore, **overrides: Any) -> Consumer:
    """A consumer on ``store`` with GC off and fast retries; ``overrides`` are config fields."""
    options: dict[str, Any] = {"store": store, "gc_enabled": False, "retry": FAST_RETRY}
    options.update(overrides)
    return Consumer(ConsumerConfig(**options))


def open_target(target: Any) -> ObjectStore:
    """The store a ``StoreTarget`` (kind, url, options) names."""
    return open_store(target.url, dict(target.options or {}))


class ScaledClock:
    """Wall clock running ``speed`` times faster than real time (for GC grace periods)."""

    def __init__(self, speed: float, start_ms: int = 1_700_000_000_000) -> None:
        self._speed = speed
        self._start_ms = start_ms
        self._origin = time.monotonic()

    def now_ms(self) -> int:
        return self._start_ms + round((time.monotonic() - self._origin) * self._speed * 1000)

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class QueueWriter:
    """Produces with the core: ``encode_batch`` + ``put_if_absent`` + ``QueueProducer.append``."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        prefix: str = PREFIX,
        manifest_path: str = MANIFEST,
        clock: Any = None,
        compression: CompressionType = CompressionType.NONE,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.minter = UlidMinter(clock)
        self.clock = clock
        self.compression = compression
        self.queue = QueueProducer(store, manifest_path, retry=FAST_RETRY)

    def upload(self, records: Sequence[bytes]) -> str:
        """Write a batch object only (not enqueued: an orphan, or in flight)."""
        location = batch_location(self.prefix, self.minter.mint())
        self.store.put_if_absent(location, encode_batch(records, self.compression))
        return location

    def enqueue(self, location: str, metadata: Iterable[Metadata] = ()) -> int:
        sequences = self.queue.append([PendingEntry(location, tuple(metadata))])
        return sequences[0]

    def append(
        self, records: Sequence[bytes], *, payload: bytes = b"", ingestion_ms: int | None = None
    ) -> tuple[int, str]:
        """Upload and enqueue one batch; returns ``(sequence, location)``."""
        location = self.upload(records)
        now = ingestion_ms if ingestion_ms is not None else _now_ms(self.clock)
        return self.enqueue(location, [Metadata(0, now, payload)]), location

    def append_arrow(self, table: pa.Table, *, payload: bytes = b"") -> tuple[int, str]:
        """One batch whose entries are the table's record batches as IPC streams."""
        return self.append(encode_ipc(table), payload=payload)

    def append_arrow_all(self, tables: Sequence[pa.Table]) -> tuple[int, ...]:
        """One batch per table, all enqueued in one append (one compare-and-swap); returns
        their sequences."""
        locations = [self.upload(encode_ipc(table)) for table in tables]
        now = _now_ms(self.clock)
        return self.queue.append(
            [PendingEntry(location, (Metadata(0, now, b""),)) for location in locations]
        )


def numbered(start: int, count: int) -> pa.Table:
    """Rows ``n = start .. start + count - 1`` with a text column."""
    values = list(range(start, start + count))
    return pa.table(
        {"n": pa.array(values, pa.int64()), "label": pa.array([f"row-{v}" for v in values])}
    )


def arrow_batch(sequence: int, table: pa.Table, location: str | None = None) -> ConsumedBatch:
    """A consumed batch of ``table`` (its Arrow IPC entries), at ``ingest/{sequence}.batch``
    unless ``location`` says otherwise."""
    return ConsumedBatch(
        entries=tuple(encode_ipc(table)),
        sequence=sequence,
        location=location or f"ingest/{sequence:026d}.batch",
        metadata=(Metadata(0, 1_000 + sequence, b"meta"),),
    )


def _now_ms(clock: Any) -> int:
    return clock.now_ms() if clock is not None else time.time_ns() // 1_000_000


class RecordingStore(ForwardingStore):
    """Delegates to a real store, counting calls; optional per-call delay and delete faults."""

    def __init__(self, inner: ObjectStore, *, get_delay: float = 0.0) -> None:
        super().__init__(inner)
        self.get_delay = get_delay
        self._lock = threading.Lock()
        self.calls: dict[str, int] = {}
        self.active_gets = 0
        self.max_active_gets = 0
        self.fail_deletes: set[str] = set()
        self.deleted: list[str] = []

    def _count(self, name: str) -> None:
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1

    def get(self, path: str) -> GetResult:
        self._count(f"get:{path}" if path.endswith("manifest") else "get")
        # Concurrency is counted for batch objects only: read-ahead is what it measures.
        batch = path.endswith(".batch")
        with self._lock:
            self.active_gets += batch
            self.max_active_gets = max(self.max_active_gets, self.active_gets)
        try:
            if self.get_delay:
                time.sleep(self.get_delay)
            return self.inner.get(path)
        finally:
            with self._lock:
                self.active_gets -= batch

    def get_if_changed(self, path: str, etag: str | None) -> GetResult | None:
        self._count("get_if_changed")
        return self.inner.get_if_changed(path, etag)

    def head(self, path: str) -> ObjectInfo:
        self._count("head")
        return self.inner.head(path)

    def list(self, prefix: str = "", *, recursive: bool = True) -> list[ObjectInfo]:
        self._count("list")
        return self.inner.list(prefix, recursive=recursive)

    def delete_many(self, paths: Iterable[str]) -> list[DeleteFailure]:
        wanted = list(paths)
        failing = [p for p in wanted if p in self.fail_deletes]
        passing = [p for p in wanted if p not in self.fail_deletes]
        failures = self.inner.delete_many(passing)
        with self._lock:
            self.deleted.extend(p for p in passing if p not in {f.path for f in failures})
        return failures + [DeleteFailure(path=p, reason="injected failure") for p in failing]


class Database:
    """A sink's database (fresh table names per test) and a plain query helper."""

    def __init__(self, kind: str, url: str) -> None:
        self.kind = kind
        self.url = url
        suffix = uuid.uuid4().hex[:8]
        self.table = f"rows_{suffix}"
        self.progress = f"progress_{suffix}"

    def sink(self, **options: Any) -> AdbcSink:
        options.setdefault("table", self.table)
        options.setdefault("progress_table", self.progress)
        return open_sink(self.url, **options)

    def sink_arguments(self) -> list[str]:
        """The ``millpond consume`` options naming this database and its tables."""
        return ["--sink", self.url, "--table", self.table, "--progress-table", self.progress]

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        if self.kind == "sqlite":
            path = self.url.removeprefix("sqlite://")
            with contextlib.closing(sqlite3.connect(path, timeout=30)) as conn:
                return conn.execute(sql).fetchall()
        return _postgres_query(self.url, sql)

    def count(self) -> int:
        """Rows in the target table (0 before it exists)."""
        try:
            return int(self.query(f'SELECT count(*) FROM "{self.table}"')[0][0])
        except Exception:  # the table does not exist yet
            return 0

    def last_recorded(self) -> int | None:
        """The highest sequence in the progress table (``None`` before it exists: a service
        killed early in its first start-up has not made it)."""
        try:
            return self.query(f'SELECT max(sequence) FROM "{self.progress}"')[0][0]
        except Exception:  # the table does not exist yet
            return None


_query_connections: dict[str, Any] = {}
_query_lock = threading.Lock()


def _postgres_query(url: str, sql: str) -> list[tuple[Any, ...]]:
    """``sql``'s rows, on a connection kept per database for the process.

    Opening an ADBC PostgreSQL connection costs about 50 ms of CPU (the driver loads the
    server's types), and tests query in loops. Each query ends its transaction (no snapshot or
    lock is held between queries); a kept connection the server dropped (a restart, a
    terminated backend) is replaced once.
    """
    import adbc_driver_postgresql.dbapi as pg

    with _query_lock:
        for attempt in range(2):
            conn = _query_connections.get(url)
            kept = conn is not None
            if conn is None:
                conn = _query_connections[url] = pg.connect(url)
            try:
                with conn.cursor() as cur:
                    cur.execute(sql)
                    rows: list[tuple[Any, ...]] = cur.fetchall()
                conn.rollback()
                return rows
            except pg.Error:
                try:
                    conn.rollback()
                except pg.Error:  # the connection is gone: open another
                    del _query_connections[url]
                    with contextlib.suppress(pg.Error):
                        conn.close()
                    if kept and attempt == 0:
                        continue
                raise
    raise AssertionError("unreachable")


class ForwardingSink:
    """Passes a sink's calls to ``inner``; subclass it to watch or hold chosen calls."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def rows_written(self) -> int:
        return int(self.inner.rows_written)

    def last_sequence(self, queue: str) -> int | None:
        result: int | None = self.inner.last_sequence(queue)
        return result

    def write(self, batch: ConsumedBatch) -> bool:
        return bool(self.write_many([batch])[0])

    def write_many(self, batches: Sequence[ConsumedBatch]) -> list[bool]:
        return list(self.inner.write_many(batches))

    def close(self) -> None:
        self.inner.close()
