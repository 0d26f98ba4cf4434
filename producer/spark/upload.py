"""Task side of a ``commit="job"`` write: Arrow record batches into uploaded batch objects.

A Spark task hands its Arrow record batches to a :class:`BatchUploader`. Each record batch
becomes one entry (an Arrow IPC stream, as ``Producer.produce_arrow`` makes them); entries are
packed into RFC v1 batch objects of at most ``flush_size_bytes`` and uploaded create-if-absent
under fresh ULID names while the task goes on encoding. The task appends nothing to the queue:
it returns the locations in its commit message and the driver appends those of the successful
attempts, all at once.

Nothing here touches a WAL: a failed task is simply retried by Spark, and what its failed
attempt uploaded is never referenced, so GC removes it once the grace period has passed.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import astuple, dataclass

import pyarrow as pa
from pyspark.sql.datasource import WriterCommitMessage

from millpond.common.clock import Clock, SystemClock
from millpond.common.retry import RetryPolicy
from millpond.common.ulids import UlidMinter, batch_location
from millpond.errors import (
    CommitStateUnknownError,
    ConflictError,
    InvalidInputError,
    NotFoundError,
    StorageError,
)
from millpond.formats.arrow import encode_ipc
from millpond.formats.batch import BATCH_FOOTER_SIZE, CompressionType, encode_batch
from millpond.formats.manifest import Metadata, PendingEntry
from millpond.formats.routing import with_table
from millpond.storage.store import ObjectStore

__all__ = ["BatchUploader", "TaskCommitMessage", "UploadStats", "UploadedBatch", "put_new_object"]

logger = logging.getLogger(__name__)

# Per record: the u32 length prefix (and per batch object its footer, BATCH_FOOTER_SIZE).
_RECORD_OVERHEAD = 4


@dataclass(frozen=True, slots=True)
class UploadStats:
    """What one task (or a whole job, summed) uploaded."""

    rows: int = 0
    """Rows written."""
    entries: int = 0
    """Entries (Arrow IPC streams) written."""
    batches: int = 0
    """Batch objects written."""
    bytes: int = 0
    """Bytes of batch objects written."""
    put_requests: int = 0
    """PUT requests sent for batch objects, retries included."""

    def __add__(self, other: UploadStats) -> UploadStats:
        return UploadStats(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass(frozen=True, slots=True)
class UploadedBatch:
    """One batch object a task uploaded, not yet in the queue."""

    location: str
    """``{data_path_prefix}/{ULID}.batch``."""
    ingestion_time_ms: int
    """Wall-clock milliseconds when the batch was sealed."""
    rows: int
    """Rows in the batch."""
    entries: int
    """Entries (Arrow IPC streams) in the batch."""
    table: str | None = None
    """The ``table`` option's table, named in the manifest entry (``None``: the consumer's)."""

    def pending_entry(self, payload: bytes) -> PendingEntry:
        """The manifest entry for this batch: one metadata item covering every entry. The
        driver's commit builds every entry, batch job and micro-batch alike, from here."""
        if self.table is not None:
            payload = with_table(payload, self.table)
        return PendingEntry(self.location, (Metadata(0, self.ingestion_time_ms, payload),))


@dataclass(frozen=True)
class TaskCommitMessage(WriterCommitMessage):
    """What a successful task attempt sends to the driver."""

    partition_id: int
    """The Spark partition the task wrote."""
    attempt: int
    """The task attempt number (0 for the first attempt)."""
    uploads: tuple[UploadedBatch, ...]
    """The batch objects the attempt uploaded, in upload order."""
    stats: UploadStats
    """Counts for the job summary."""
    sequences: tuple[int, ...] = ()
    """``commit="task"``: where the task's producer appended its entries (for ``await_sink``)."""


def put_new_object(
    store: ObjectStore, path: str, data: bytes, *, retry: RetryPolicy, clock: Clock
) -> int:
    """Create an object under a fresh, unique name, retrying transient failures.

    The name is a newly minted ULID, so an object already at ``path`` can only be our own
    earlier request that landed (obstore retries internally too); that is checked by size and
    taken as success.

    Returns:
        How many PUT requests were sent.

    Raises:
        StorageError: the retry budget ran out.
        InvalidInputError: something else sits at ``path`` (a reused name: a bug).
    """
    backoff = retry.start(clock)
    requests = 0
    while True:
        requests += 1
        try:
            store.put_if_absent(path, data)
        except ConflictError:
            if _is_ours(store, path, len(data)):
                return requests
            raise InvalidInputError(
                f"{path}: expected a fresh batch name, found an object of another size there"
            ) from None
        except (CommitStateUnknownError, StorageError) as err:
            if not backoff.sleep():
                raise StorageError(
                    f"{path}: upload gave up after {backoff.attempt} attempts: {err}"
                ) from err
            logger.info("upload of %s failed (%s); retrying", path, err)
            continue
        return requests


def _is_ours(store: ObjectStore, path: str, size: int) -> bool:
    try:
        return store.head(path).size == size
    except NotFoundError:
        return False


class BatchUploader:
    """Packs Arrow record batches into batch objects and uploads them in the background.

    Not thread-safe: one task feeds it from one thread. At most ``concurrency`` uploads are in
    flight, so a task holds at most ``concurrency + 1`` batches of ``flush_size_bytes`` in memory.
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        data_path_prefix: str,
        table: str | None = None,
        flush_size_bytes: int,
        compression: CompressionType,
        concurrency: int = 4,
        retry: RetryPolicy | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._store = store
        self._prefix = data_path_prefix
        self._table = table
        self._entry_limit = flush_size_bytes - _RECORD_OVERHEAD - BATCH_FOOTER_SIZE
        if self._entry_limit <= 0:
            raise InvalidInputError(
                f"flush_size_bytes: expected more than {_RECORD_OVERHEAD + BATCH_FOOTER_SIZE}, "
                f"found {flush_size_bytes}"
            )
        self._flush_size = flush_size_bytes
        self._compression = compression
        self._retry = retry or RetryPolicy()
        self._clock = clock or SystemClock()
        self._minter = UlidMinter(self._clock)
        self._pool = ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="millpond-upload")
        # Bounds the sealed batches waiting or uploading: memory stays bounded however fast
        # Spark feeds record batches.
        self._slots = threading.BoundedSemaphore(max(1, concurrency))
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._pending_rows = 0
        self._futures: list[Future[tuple[UploadedBatch, UploadStats]]] = []

    def add(self, batch: pa.RecordBatch) -> None:
        """Encode one record batch as an entry (or several, if it is too big for one object).

        Raises:
            InvalidInputError: a single row does not fit in ``flush_size_bytes``.
            StorageError: an earlier upload failed for good.
        """
        for entry, rows in self._encode(batch):
            size = len(entry) + _RECORD_OVERHEAD
            if self._pending and self._pending_bytes + size + BATCH_FOOTER_SIZE > self._flush_size:
                self._seal()
            self._pending.append(entry)
            self._pending_bytes += size
            self._pending_rows += rows

    def finish(self) -> tuple[tuple[UploadedBatch, ...], UploadStats]:
        """Upload what is left and wait for every upload.

        Returns:
            The uploaded batches in upload order and the summed counts.

        Raises:
            StorageError: an upload failed for good.
        """
        try:
            if self._pending:
                self._seal()
            results = [future.result() for future in self._futures]
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
        total = sum((stats for _upload, stats in results), UploadStats())
        return tuple(upload for upload, _stats in results), total

    def close(self) -> None:
        """Stop without waiting for pending uploads (after a failure)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _encode(self, batch: pa.RecordBatch) -> list[tuple[bytes, int]]:
        if batch.num_rows == 0:
            return []
        encoded = encode_ipc(batch)
        if len(encoded[0]) <= self._entry_limit:
            return [(encoded[0], batch.num_rows)]
        if batch.num_rows == 1:
            raise InvalidInputError(
                f"flush_size_bytes: one row encodes to {len(encoded[0])} bytes, more than a "
                f"batch object of {self._flush_size} bytes can hold"
            )
        half = batch.num_rows // 2
        return self._encode(batch.slice(0, half)) + self._encode(batch.slice(half))

    def _seal(self) -> None:
        # Surface a failed upload early instead of encoding the rest of the partition for
        # nothing.
        for future in self._futures:
            if future.done() and future.exception() is not None:
                future.result()
        records, rows = self._pending, self._pending_rows
        self._pending, self._pending_bytes, self._pending_rows = [], 0, 0
        # Minted when sealed, so names within a task sort in upload order.
        location = batch_location(self._prefix, self._minter.mint())
        self._slots.acquire()
        try:
            future = self._pool.submit(self._upload, location, records, rows, self._clock.now_ms())
        except BaseException:
            self._slots.release()
            raise
        self._futures.append(future)

    def _upload(
        self, location: str, records: list[bytes], rows: int, ingested_ms: int
    ) -> tuple[UploadedBatch, UploadStats]:
        try:
            data = encode_batch(records, self._compression)
            requests = put_new_object(
                self._store, location, data, retry=self._retry, clock=self._clock
            )
        finally:
            self._slots.release()
        upload = UploadedBatch(location, ingested_ms, rows, len(records), self._table)
        stats = UploadStats(
            rows=rows, entries=len(records), batches=1, bytes=len(data), put_requests=requests
        )
        logger.debug("uploaded %s: %s rows, %s bytes", location, rows, len(data))
        return upload, stats
