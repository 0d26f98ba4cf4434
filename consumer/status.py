"""``millpond status STORE_URL``: how far behind is the consumer, at a glance.

Queue length, bytes referenced (the sum of the sizes of the batch objects the manifest points
at, one HEAD each on a bounded pool), the oldest entry's age (from its ULID), the epoch, and
the consumer lag (now minus the ingestion time of the oldest entry). Then what the consumer
service last reported (:mod:`millpond.consumer._report`): its state, rows/s, lag, the last
error, and a batch it is stopped on with the command that sets it aside. Reads the manifest
without fencing; changes nothing.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from millpond.cli.common import add_store_arguments, emit, open_store_from_args, require_queue
from millpond.common.clock import Clock, SystemClock
from millpond.common.ulids import parse_batch_name, ulid_time_ms
from millpond.consumer._report import status_section
from millpond.errors import NotFoundError
from millpond.formats.manifest import ManifestEntry
from millpond.queue import read_manifest
from millpond.storage.store import ObjectStore

__all__ = ["QueueStatus", "add_arguments", "queue_status", "run"]

_HEAD_CONCURRENCY = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueStatus:
    """One look at a queue."""

    manifest_path: str
    epoch: int
    """The epoch of the consumer in charge (0: no consumer ever initialized)."""
    queue_length: int
    """Entries waiting in the manifest."""
    first_sequence: int | None
    next_sequence: int
    manifest_bytes: int
    bytes_referenced: int | None
    """Sum of the sizes of the referenced batch objects; ``None`` when not measured."""
    missing_objects: int
    """Referenced batch objects that do not exist (a consumer will stop on the first)."""
    oldest_location: str | None
    oldest_entry_age_seconds: float | None
    """Now minus the ULID time of the oldest entry."""
    consumer_lag_seconds: float | None
    """Now minus the earliest ingestion time of the oldest entry; 0 with an empty queue."""


def queue_status(
    store: ObjectStore,
    manifest_path: str = "ingest/manifest",
    *,
    clock: Clock | None = None,
    measure_bytes: bool = True,
    concurrency: int = _HEAD_CONCURRENCY,
) -> QueueStatus:
    """Measure a queue.

    Raises:
        NotFoundError: no manifest at ``manifest_path``.
        FormatError: the manifest is corrupt.
        StorageError: the store failed.
    """
    snapshot = read_manifest(store, manifest_path)
    now_ms = (clock or SystemClock()).now_ms()
    manifest = snapshot.manifest
    entries = manifest.entries
    oldest = entries[0] if entries else None
    total: int | None = None
    missing = 0
    if measure_bytes and entries:
        sizes = _sizes(store, entries, concurrency)
        missing = sum(1 for size in sizes if size is None)
        total = sum(size for size in sizes if size is not None)
    elif measure_bytes:
        total = 0
    age: float | None = None
    lag: float | None = 0.0
    if oldest is not None:
        ulid = parse_batch_name(oldest.location.rpartition("/")[2])
        if ulid is not None:
            age = max(0.0, (now_ms - ulid_time_ms(ulid)) / 1000)
        times = [item.ingestion_time_ms for item in oldest.metadata]
        lag = max(0.0, (now_ms - min(times)) / 1000) if times else age
    return QueueStatus(
        manifest_path=manifest_path,
        epoch=manifest.epoch,
        queue_length=len(entries),
        first_sequence=manifest.first_sequence,
        next_sequence=manifest.next_sequence,
        manifest_bytes=snapshot.size,
        bytes_referenced=total,
        missing_objects=missing,
        oldest_location=oldest.location if oldest else None,
        oldest_entry_age_seconds=age,
        consumer_lag_seconds=lag,
    )


def _sizes(store: ObjectStore, entries: tuple[ManifestEntry, ...], limit: int) -> list[int | None]:
    # A location appended twice is one object: HEAD it once.
    locations = list(dict.fromkeys(entry.location for entry in entries))

    def size(location: str) -> int | None:
        try:
            return store.head(location).size
        except NotFoundError:
            return None

    with ThreadPoolExecutor(
        max(1, min(limit, len(locations))), thread_name_prefix="millpond-head"
    ) as pool:
        return list(pool.map(size, locations))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument(
        "--no-bytes",
        action="store_true",
        help="skip the HEAD of every referenced object (bytes referenced is then unknown)",
    )


def run(args: argparse.Namespace) -> int:
    store = open_store_from_args(args)
    require_queue(store, args.manifest_path)
    status = queue_status(store, args.manifest_path, measure_bytes=not args.no_bytes)

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} s"

    referenced = "-" if status.bytes_referenced is None else _human(status.bytes_referenced)
    if status.missing_objects:
        referenced += f" ({status.missing_objects} referenced objects MISSING)"
    text = [
        f"queue            {store.url}/{status.manifest_path}",
        f"epoch            {status.epoch}",
        f"queue length     {status.queue_length} entries "
        f"(sequences {status.first_sequence if status.first_sequence is not None else '-'}"
        f"..{status.next_sequence - 1})",
        f"bytes referenced {referenced}",
        f"oldest entry     {status.oldest_location or '-'} "
        f"({seconds(status.oldest_entry_age_seconds)} old)",
        f"consumer lag     {seconds(status.consumer_lag_seconds)}",
    ]
    # The consumer service's own report: rows/s, its lag, the last error, a batch it stops on.
    lines, report = status_section(
        store, args.data_prefix, now_ms=SystemClock().now_ms(), epoch=status.epoch
    )
    emit(args, {**asdict(status), "consumer": report}, text + lines)
    return 0


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit} ({size} B)"
        value /= 1024
    return f"{size} B"
