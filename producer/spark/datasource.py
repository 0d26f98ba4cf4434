"""The ``millpond`` data source: Spark's Python Data Source API writers for batch and streaming.

Tasks upload batch objects (``upload``); the driver appends them to the queue (``commit``). The
package docstring (``millpond.producer.spark``) explains the commit modes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    DataSourceStreamWriter,
    DataSourceWriter,
    WriterCommitMessage,
)

from millpond.common.metrics import Counters
from millpond.errors import CommitStateUnknownError, ConfigError, StorageError
from millpond.producer.spark.commit import (
    JobReceipt,
    commit_job,
    commit_micro_batch,
    spark_payload,
    sum_stats,
    task_entries,
    write_state_path,
)
from millpond.producer.spark.commit_state import COMMITTED, read_state
from millpond.producer.spark.executor import produce_partition
from millpond.producer.spark.options import SparkWriteSettings
from millpond.producer.spark.schema import refuse_unwritable
from millpond.producer.spark.summary import ensure_summary_output, log_summary
from millpond.producer.spark.summary import logger as summary_logger
from millpond.producer.spark.upload import (
    BatchUploader,
    TaskCommitMessage,
    UploadStats,
)
from millpond.queue import SinkWatch, queue_identity

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

__all__ = ["MillpondBatchWriter", "MillpondDataSource", "MillpondStreamWriter", "register"]

logger = logging.getLogger(__name__)


def register(spark: SparkSession) -> None:
    """Make ``format("millpond")`` available in ``spark``."""
    spark.dataSource.register(MillpondDataSource)


class MillpondDataSource(DataSource):
    """The ``millpond`` data source: batch and streaming writes into a millpond queue."""

    @classmethod
    def name(cls) -> str:
        return "millpond"

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        """Check the options and the store on the driver; the job fails here if either is bad.

        Raises:
            ConfigError: a bad option, or a mode other than append.
            InvalidInputError: a column of a type Arrow cannot carry (``refuse_unwritable``).
            StorageError: the store is unreachable (``check_store``).
            FormatError: the manifest is corrupt (``check_store``).
        """
        refuse_unwritable(schema)
        settings = _settings(self.options, overwrite)
        job_id = uuid.uuid4().hex
        logger.info(
            "millpond write %s to %s (commit=%s)", job_id, settings.store_url, settings.commit
        )
        return MillpondBatchWriter(
            settings, job_id, probe_gets=int(settings.check_store), landed=_landed(settings)
        )

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        """Check the options and the store; see :meth:`writer`.

        Raises:
            ConfigError: a bad option, or no ``checkpointLocation`` and no ``query_id``.
            InvalidInputError: a column of a type Arrow cannot carry (``refuse_unwritable``).
            StorageError: the store is unreachable (``check_store``).
        """
        refuse_unwritable(schema)
        settings = _settings(self.options, overwrite, recheck_after=STREAM_PROBE_INTERVAL)
        if settings.commit == "job" and not settings.query_id and not settings.checkpoint_location:
            settings.stream_id()  # raises the ConfigError naming checkpointLocation
        return MillpondStreamWriter(settings)


def _landed(settings: SparkWriteSettings) -> tuple[int, ...] | None:
    """Where an earlier run of this job put its rows, when its ``write_id`` is known to have
    landed before this job starts (its state committed); ``None`` when it has no write id, or
    its write id is not committed (yet). Its tasks then upload nothing: the commit enqueues
    nothing whatever they send, and their uploads would only be garbage."""
    if settings.commit != "job" or settings.write_id is None:
        return None
    path = write_state_path(settings.data_path_prefix, settings.write_id)
    state, _etag, _data = read_state(settings.open_store(), path)
    if state is None or state.status != COMMITTED:
        return None
    return state.sequences or ()


STREAM_PROBE_INTERVAL = 60.0
"""Seconds a stream's store check holds in one process. Spark makes the stream writer again
for every micro-batch, twice (once to plan it, once to commit it): the first checks the store
and the queue's claim, and the others in the next minute take its outcome (issue 49: four
requests and two S3 clients a micro-batch)."""

_probed: dict[tuple[object, ...], tuple[float, float]] = {}
_probed_guard = threading.Lock()


def _settings(
    options: Mapping[str, str], overwrite: bool, *, recheck_after: float = 0.0
) -> SparkWriteSettings:
    """The checked options; with ``check_store``, the store probed (a probe of the same queue
    less than ``recheck_after`` seconds ago in this process stands).

    Raises:
        ConfigError, StorageError, FormatError: as :meth:`MillpondDataSource.writer`.
    """
    if overwrite:
        raise ConfigError(
            "mode", "expected append: a millpond queue is append-only, found overwrite"
        )
    settings = SparkWriteSettings.from_options(options)
    if settings.host_coordinator and settings.commit != "task":
        raise ConfigError(
            "host_coordinator",
            "expected only with commit=task, where the tasks append and those on one machine "
            "share a coordinator; with commit=job the driver appends once per job or "
            "micro-batch (use coordinator=http://host:port for a shared one)",
        )
    settings.open_store()  # checks the URL and the obstore options; no request yet
    if settings.check_store:
        settings = _probe(settings, recheck_after)
    return settings


def _probe(settings: SparkWriteSettings, recheck_after: float) -> SparkWriteSettings:
    """``settings.probe()``, or what a probe of the same queue found less than
    ``recheck_after`` seconds ago in this process (its grace period)."""
    key = (
        os.getpid(),
        settings.store_url,
        tuple(sorted(settings.store_options.items())),
        settings.manifest_path,
        settings.data_path_prefix,
        settings.gc_grace_period,
    )
    now = time.monotonic()
    with _probed_guard:
        found = _probed.get(key)
    if found is not None and now - found[0] < recheck_after:
        return dataclasses.replace(settings, gc_grace_period=found[1])
    probed = settings.probe()
    with _probed_guard:
        if len(_probed) >= 64:
            _probed.clear()
        _probed[key] = (now, probed.gc_grace_period)
    return probed


class MillpondBatchWriter(DataSourceArrowWriter):
    """Task side uploads, driver side one append. Pickled to every task."""

    def __init__(
        self,
        settings: SparkWriteSettings,
        job_id: str,
        *,
        probe_gets: int = 0,
        landed: tuple[int, ...] | None = None,
    ) -> None:
        self.settings = settings
        self.job_id = job_id
        # Where the write id's earlier run put its rows, when it had landed before this job.
        self.landed = landed
        # GETs the driver sent before the job (the store check), for the receipt.
        self.probe_gets = probe_gets
        # What commit() knows about the append, for abort() to report truthfully.
        self.outcome = "not committed"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        if self.landed is not None:  # its write id landed: nothing to upload
            for _ in iterator:
                pass
            return TaskCommitMessage(0, 0, (), UploadStats())
        return _write_task(self.settings, iterator, job=self.job_id)

    def commit(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        """Append every batch of the job in one CAS (``commit="job"``) and write the receipt.

        Raises:
            NotFoundError: uploads GC already removed (a job longer than the grace period).
            CommitStateUnknownError: the append gave up not knowing whether it landed.
            StorageError: the store failed before anything could be enqueued.
        """
        settings = self.settings
        ensure_summary_output()
        store = settings.open_store()
        task_messages = [m if isinstance(m, TaskCommitMessage) else None for m in messages]
        if settings.commit == "job":
            try:
                receipt = commit_job(
                    store,
                    task_messages,
                    job_id=self.job_id,
                    manifest_path=settings.manifest_path,
                    data_path_prefix=settings.data_path_prefix,
                    gc_grace_period=settings.gc_grace_period,
                    write_id=settings.write_id,
                    extra_payload=settings.payload_fields(),
                    retry=settings.retry,
                    coordinator=settings.coordinator,
                )
            except CommitStateUnknownError:
                self.outcome = "unknown"
                raise
            self.outcome = receipt.status
        else:
            tasks = [m for m in task_messages if m is not None]
            sequences = tuple(s for m in tasks for s in m.sequences)
            receipt = JobReceipt(
                self.job_id, None, None, len(task_messages), sum_stats(tasks), sequences=sequences
            )
            self.outcome = "published by the tasks"
        if settings.receipt_path:
            requests = {
                # The batch objects, the manifest CAS, and the receipt itself.
                "put": receipt.stats.put_requests + receipt.manifest.get("manifest_writes", 0) + 1,
                "get": self.probe_gets + receipt.manifest.get("manifest_reads", 0),
            }
            receipt = dataclasses.replace(receipt, requests=requests)
            try:
                store.put(settings.receipt_path, json.dumps(receipt.to_json()).encode())
            except StorageError as err:
                # The rows are enqueued: failing the job now would invite a rerun, and a rerun
                # without a write id would enqueue them twice.
                logger.error(  # noqa: TRY400 - the message is the point
                    "job %s: enqueued, but the receipt %s could not be written: %s",
                    self.job_id,
                    settings.receipt_path,
                    err,
                )
        if receipt.status == "skipped":
            self._say_skipped(receipt)
        named = f" (write_id {settings.write_id!r})" if settings.write_id else ""
        await_sink(settings, receipt.sequences, what=f"millpond job {self.job_id}{named}")

    def _say_skipped(self, receipt: JobReceipt) -> None:
        """A rerun of a write id that landed succeeds: say, where the job's output goes, that
        it enqueued nothing (and, when that was known before it started, uploaded nothing)."""
        sequences = receipt.sequences or self.landed or ()
        where = f" at sequences {sequences[0]}..{sequences[-1]}" if sequences else ""
        summary_logger.warning(
            "millpond job %s: write_id %r was enqueued by an earlier run%s; this run enqueued "
            "nothing%s (give a new write_id to enqueue the rows again)",
            self.job_id,
            self.settings.write_id,
            where,
            " and uploaded nothing" if self.landed is not None else "",
        )

    def abort(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        uploaded = sum(len(m.uploads) for m in messages if isinstance(m, TaskCommitMessage))
        write_id = self.settings.write_id
        if self.outcome == "unknown":
            advice = (
                f"rerun with the same write_id ({write_id!r}): it enqueues only what did not land"
                if write_id
                else "a rerun may enqueue its rows twice; give it a write_id next time"
            )
            logger.error(
                "millpond write %s aborted: whether its %s batches were enqueued is UNKNOWN; %s",
                self.job_id,
                uploaded,
                advice,
            )
            return
        if self.outcome in ("appended", "reappended", "skipped", "published by the tasks"):
            logger.warning(
                "millpond write %s aborted after its commit (%s); its rows are in the queue",
                self.job_id,
                self.outcome,
            )
            return
        logger.warning(
            "millpond write %s aborted: nothing enqueued; %s uploaded batch objects are left to GC",
            self.job_id,
            uploaded,
        )


class MillpondStreamWriter(DataSourceStreamArrowWriter):
    """Task side uploads, driver side one append per micro-batch, once per batch id."""

    def __init__(self, settings: SparkWriteSettings) -> None:
        self.settings = settings

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        return _write_task(self.settings, iterator)

    def commit(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:
        """Enqueue the micro-batch unless this batch id is already enqueued.

        Raises:
            MillpondError: the batch id cannot be resolved (see ``commit_micro_batch``).
            StorageError: the store failed past the retry budget.
        """
        settings = self.settings
        task_messages = [m for m in messages if isinstance(m, TaskCommitMessage)]
        if settings.commit == "task":
            sequences = tuple(s for m in task_messages for s in m.sequences)
            await_sink(settings, sequences, what=f"micro-batch {batchId}")
            return
        stream_id = settings.stream_id()
        entries = task_entries(
            task_messages, query=stream_id, batch=batchId, **settings.payload_fields()
        )
        ensure_summary_output()
        counters = Counters()
        outcome = commit_micro_batch(
            settings.open_store(),
            entries,
            stream_id=stream_id,
            batch_id=batchId,
            manifest_path=settings.manifest_path,
            data_path_prefix=settings.data_path_prefix,
            gc_grace_period=settings.gc_grace_period,
            retry=settings.retry,
            counters=counters,
            coordinator=settings.coordinator,
        )
        log_summary(
            f"stream {stream_id} batch {batchId}",
            stats=sum_stats(task_messages),
            status=outcome.status,
            sequences=outcome.sequences or (),
            manifest=counters.snapshot(),
        )
        # A micro-batch run again after a failed wait is skipped, and waits for where the
        # first run enqueued it.
        await_sink(settings, outcome.sequences or (), what=f"stream {stream_id} batch {batchId}")

    def abort(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:
        logger.warning(
            "millpond micro-batch %s aborted; if its commit had begun, its state object "
            "resolves it when Spark runs the batch again (nothing is enqueued twice)",
            batchId,
        )


def _write_task(
    settings: SparkWriteSettings, batches: Iterator[pa.RecordBatch], **fields: object
) -> TaskCommitMessage:
    """The task's batches uploaded (``commit="job"``), or produced through its worker's
    producer (``commit="task"``, with the payload of ``fields`` and the task)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    partition = context.partitionId() if context else 0
    attempt = context.attemptNumber() if context else 0
    if settings.commit == "task":
        payload = spark_payload(partition=partition, attempt=attempt, **fields)
        rows, entries, sequences = produce_partition(
            settings.producer_options, batches, payload, settings.table
        )
        stats = UploadStats(rows=rows, entries=entries)
        return TaskCommitMessage(partition, attempt, (), stats, sequences)
    uploader = BatchUploader(
        settings.open_store(),
        data_path_prefix=settings.data_path_prefix,
        table=settings.table,
        flush_size_bytes=settings.flush_size_bytes,
        compression=settings.compression,
        concurrency=settings.upload_concurrency,
        retry=settings.retry,
    )
    try:
        for batch in batches:
            uploader.add(batch)
        uploads, stats = uploader.finish()
    except BaseException:
        uploader.close()
        raise
    return TaskCommitMessage(partition, attempt, uploads, stats)


def await_sink(settings: SparkWriteSettings, sequences: Collection[int], *, what: str) -> None:
    """With the ``await_sink`` option: wait until the consumer service has written
    ``sequences`` into its database (none: nothing to wait for).

    Raises:
        SinkWaitTimeoutError: not written within ``await_sink`` seconds; the message names
            what the consumer is doing. The rows stay in the queue.
        SinkWaitError: the consumer set some of them aside (quarantined) instead.
    """
    if settings.await_sink <= 0 or not sequences:
        return
    store = settings.open_store()
    watch = SinkWatch(
        store,
        data_path_prefix=settings.data_path_prefix,
        queue=queue_identity(store.url, settings.manifest_path),
    )
    started = time.monotonic()
    first, last = min(sequences), max(sequences)
    watch.wait(sequences, timeout=settings.await_sink, what=f"{what}, sequences {first}..{last}")
    logger.info(
        "%s: the consumer wrote sequences %s..%s into its database (waited %.2f s)",
        what,
        first,
        last,
        time.monotonic() - started,
    )
