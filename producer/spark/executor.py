"""One ``Producer`` per Spark Python worker, for ``foreachPartition`` and ``mapInArrow`` users.

A Python worker runs many tasks one after another (``spark.python.worker.reuse``), so it keeps
one producer per queue and reuses it. Each producer owns a *WAL slot*: a directory
``{root}/{queue key}/slot-NNN/wal`` under the executor's local directories, held with an
exclusive ``flock`` on ``slot-NNN.lock`` for as long as the worker lives. A worker takes the
lowest free slot, so when a worker dies (its lock goes with it), the next worker to start takes
its slot and the producer there replays and publishes whatever the dead one had staged.

The slot root is the ``wal_dir`` option when given, else ``millpond-wal`` next to Spark's block
manager directory (the first of ``SPARK_LOCAL_DIRS``, which Spark sets for Python workers, i.e.
in ``spark.local.dir``), else the system temp directory. The queue key is a hash of the store
URL and manifest path, so two queues never share a WAL.

:func:`partition_producer` flushes at the end of a partition and waits until everything the
partition produced is in the manifest; :func:`write_arrow_partitions` wraps that for
``mapInArrow``. Delivery is at least once: a task that fails after some of its batches were
enqueued enqueues them again when Spark retries it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from millpond.errors import ClosedError, ConfigError, MillpondError
from millpond.producer.spark.commit import spark_payload
from millpond.producer.spark.options import EXECUTOR_WAL_DIR, SparkWriteSettings

if TYPE_CHECKING:
    from millpond.producer import Producer

__all__ = [
    "WRITE_RESULT_SCHEMA",
    "close_executor_producers",
    "executor_producer",
    "partition_producer",
    "write_arrow_partitions",
]

logger = logging.getLogger(__name__)

MAX_SLOTS = 1024
"""Slots tried per queue before giving up (one per concurrently running Python worker)."""
_CLOSE_TIMEOUT = 30.0

WRITE_RESULT_SCHEMA = "partition INT, attempt INT, rows BIGINT, produce_calls BIGINT"
"""The schema of what :func:`write_arrow_partitions` yields, for ``mapInArrow``."""


@dataclass(slots=True)
class _Slot:
    producer: Producer
    lock_fd: int
    path: Path
    pid: int


_guard = threading.Lock()
_slots: dict[str, _Slot] = {}


def executor_producer(options: Mapping[str, str]) -> Producer:
    """This process's producer for the queue ``options`` name, opened on first use.

    ``options`` are the data source's (``store``, ``aws_*``, ``flush_size_bytes``, ...); check
    them once on the driver with ``SparkWriteSettings.from_options`` so a bad one fails early.

    Raises:
        ConfigError: a bad option, or no free WAL slot.
    """
    settings = SparkWriteSettings.from_options(options)
    key = _queue_key(settings)
    with _guard:
        slot = _slots.get(key)
        if slot is not None and slot.pid != os.getpid():
            # Inherited through fork: the producer's threads did not come along.
            slot = None
        if slot is None:
            slot = _open_slot(settings, key)
            _slots[key] = slot
        return slot.producer


@contextlib.contextmanager
def partition_producer(options: Mapping[str, str]) -> Iterator[Producer]:
    """This process's producer for one partition; flushed and settled when the block ends.

    On a clean exit, blocks until every entry produced in the block is in the manifest (or
    raises the first failure, which fails the task). On an exception the block's entries stay
    staged and are published by the producer's background flushes.

    Raises:
        ConfigError: a bad option.
        MillpondError: an entry could not be published.
    """
    producer = executor_producer(options)
    try:
        yield producer
        producer.flush()
    except ClosedError:
        # The producer stopped after a permanent failure: drop it, so the task's retry opens
        # a fresh one on the same slot, which replays what this one had staged.
        _discard(producer)
        raise


def write_arrow_partitions(
    options: Mapping[str, str],
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function that produces every record batch to the queue.

    ``df.mapInArrow(write_arrow_partitions(options), WRITE_RESULT_SCHEMA)`` writes each
    partition through :func:`partition_producer` and yields one row per partition: its id, the
    task attempt, the rows written and the ``produce_arrow`` calls made.

    Raises:
        ConfigError: a bad option (checked here, on the driver).
    """
    checked = dict(options)
    table = SparkWriteSettings.from_options(checked).table

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context else -1
        attempt = context.attemptNumber() if context else 0
        payload = spark_payload(partition=partition, attempt=attempt)
        rows, calls, _sequences = produce_partition(checked, batches, payload, table)
        yield pa.record_batch(
            [
                pa.array([partition], pa.int32()),
                pa.array([attempt], pa.int32()),
                pa.array([rows], pa.int64()),
                pa.array([calls], pa.int64()),
            ],
            names=["partition", "attempt", "rows", "produce_calls"],
        )

    return write


def produce_partition(
    options: Mapping[str, str],
    batches: Iterator[pa.RecordBatch],
    metadata: bytes,
    table: str | None,
) -> tuple[int, int, tuple[int, ...]]:
    """Produce every non-empty record batch through :func:`partition_producer` and wait for
    each one's entries.

    Returns:
        The rows, the ``produce_arrow`` calls, and the sequences the entries got.

    Raises:
        As :func:`partition_producer`.
    """
    rows = calls = 0
    with partition_producer(options) as producer:
        handles = []
        for batch in batches:
            if batch.num_rows:
                handles.append(producer.produce_arrow(batch, metadata=metadata, table=table))
                rows += batch.num_rows
                calls += 1
    for handle in handles:
        handle.wait()
    return rows, calls, tuple(h.sequence for h in handles if h.sequence is not None)


def close_executor_producers(timeout: float = _CLOSE_TIMEOUT) -> None:
    """Close every producer this process opened and release their slots.

    Runs at interpreter exit. Python workers that Spark kills skip it; their slots are
    recovered by the next worker.
    """
    with _guard:
        slots = [slot for slot in _slots.values() if slot.pid == os.getpid()]
        _slots.clear()
    _close(slots, timeout, "producer")


atexit.register(close_executor_producers)


def _discard(producer: Producer) -> None:
    with _guard:
        found = [key for key, slot in _slots.items() if slot.producer is producer]
        slots = [_slots.pop(key) for key in found]
    _close(slots, 0, "failed producer")


def _close(slots: list[_Slot], timeout: float, what: str) -> None:
    """Close the producers of ``slots``, releasing each slot's lock even when its close fails."""
    for slot in slots:
        try:
            slot.producer.close(timeout=timeout)
        except MillpondError as err:
            logger.warning("closing the %s of %s: %s", what, slot.path, err)
        finally:
            os.close(slot.lock_fd)


def _forget_after_fork() -> None:
    # A forked child shares the parent's lock file descriptions; it must not use or release
    # them, and the producer's threads do not exist in the child.
    _slots.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _queue_key(settings: SparkWriteSettings) -> str:
    identity = f"{settings.store_url}\0{settings.manifest_path}\0{settings.data_path_prefix}"
    return sha256(identity.encode()).hexdigest()[:16]


def slot_root(settings: SparkWriteSettings) -> Path:
    """The directory holding the WAL slots of every queue on this executor."""
    configured = settings.producer_options.get("wal_dir", EXECUTOR_WAL_DIR)
    if configured != EXECUTOR_WAL_DIR:
        return Path(configured)
    local_dirs = [d for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d]
    if local_dirs:
        # SPARK_LOCAL_DIRS names this application's block manager directory; its parent is
        # the configured spark.local.dir, which outlives the application.
        return Path(local_dirs[0]).parent / "millpond-wal"
    return Path(tempfile.gettempdir()) / "millpond-wal"


def _open_slot(settings: SparkWriteSettings, key: str) -> _Slot:
    from millpond.producer import Producer, ProducerConfig

    base = slot_root(settings) / key
    base.mkdir(parents=True, exist_ok=True)
    for number in range(MAX_SLOTS):
        lock_path = base / f"slot-{number:03d}.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        path = base / f"slot-{number:03d}" / "wal"
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            config = ProducerConfig.from_options(
                {**settings.producer_options, "wal_dir": str(path)}
            )
            producer = Producer(config)
        except BaseException:
            os.close(fd)
            raise
        logger.info("pid %s took WAL slot %s", os.getpid(), path)
        return _Slot(producer, fd, path, os.getpid())
    raise ConfigError(
        "wal_dir", f"all {MAX_SLOTS} WAL slots under {base} are held by live processes"
    )
