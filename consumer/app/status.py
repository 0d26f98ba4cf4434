"""``millpond status STORE_URL``: how far behind is the consumer, at a glance.

Queue length, the oldest entry's age (from its ULID), the epoch, and the consumer lag (now
minus the ingestion time of the oldest entry): one GET of the manifest (checked, not decoded),
one of the consumer's backlog index head, and one of the index segment holding the oldest
entry when it is there, whatever the backlog: lengths are counted from sequences.
``--bytes`` adds the bytes referenced (the sum of the sizes of the batch objects the manifest
points at) from one listing of the data prefix. Then what the consumer service last reported
(:mod:`millpond.consumer.app._report`, one GET): its state, rows/s, lag, the last error, and a
batch it is stopped on with the command that sets it aside. ``--watch`` refreshes in place
(:mod:`millpond.consumer.app._watch`). Reads without fencing; changes nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from millpond.cli.common import add_store_arguments, emit, open_store_from_args, require_queue
from millpond.common.clock import Clock, SystemClock
from millpond.consumer.app._report import status_section
from millpond.consumer.app._sink_progress import ProgressReader, SinkProgress
from millpond.consumer.app._watch import watch
from millpond.consumer.sinks.postgres import redact
from millpond.errors import NotFoundError, StorageError
from millpond.formats.manifest import ManifestEntry
from millpond.queue import (
    EntryReader,
    QueueLook,
    batch_time_ms,
    entry_time_ms,
    is_replaced,
    look_at_queue,
    read_epoch_mark,
    referenced_bytes,
)
from millpond.storage.store import ObjectStore

__all__ = ["QueueStatus", "add_arguments", "queue_status", "run", "status_record"]


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueStatus:
    """One look at a queue."""

    manifest_path: str
    epoch: int
    """The epoch of the consumer in charge (0: no consumer ever initialized)."""
    queue_length: int
    """Entries waiting: in the manifest, and in the consumer's backlog index."""
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
    """Now minus the earliest ingestion time of the oldest unconsumed entry; 0 when none."""
    unconsumed_entries: int = 0
    """Entries past ``consumed_through`` (every entry when that is not known)."""
    indexed_entries: int = 0
    """Of ``queue_length``, the entries the consumer moved into its backlog index."""
    recorded_epoch: int | None = None
    """The epoch a consumer of this queue recorded when it took over
    (:mod:`millpond.queue.epoch_mark`); above ``epoch``, the manifest was replaced."""

    @property
    def replaced(self) -> bool:
        """The manifest's epoch is below one a consumer of this queue held: it was deleted
        and created again, or restored from an older copy (a consumer refuses it)."""
        return is_replaced(self.recorded_epoch, self.epoch)


def queue_status(
    store: ObjectStore,
    manifest_path: str = "ingest/manifest",
    *,
    clock: Clock | None = None,
    measure_bytes: bool = False,
    data_path_prefix: str = "ingest",
    consumed_through: int | None = None,
) -> QueueStatus:
    """Measure a queue: one GET of the manifest (checked, not decoded), one of the epoch a
    consumer recorded, one of the backlog index head, and one of the index segment holding the
    oldest entry when it is there; plus, with ``measure_bytes``, every entry's location (one
    segment at a time) and one listing of the data prefix (a request per 1000 objects).

    ``consumed_through`` is the last sequence the sink recorded, when known: entries up to it
    are in the database already (acknowledged, not yet dequeued) and count neither as
    unconsumed nor for the lag.

    Raises:
        NotFoundError: no manifest at ``manifest_path``.
        FormatError: the manifest is corrupt.
        StorageError: the store failed.
    """
    # Before the manifest: a takeover between the two reads then cannot look like a
    # replaced manifest.
    recorded = read_epoch_mark(store, data_path_prefix)
    look, oldest, lagging, (total, missing) = _look(
        store, manifest_path, data_path_prefix, consumed_through, measure_bytes=measure_bytes
    )
    now_ms = (clock or SystemClock()).now_ms()
    # The ULID time of its name, not its metadata's (oldest_entry_age_seconds).
    born_ms = batch_time_ms((), oldest.location) if oldest is not None else None
    lagging_ms = entry_time_ms(lagging) if lagging is not None else None
    return QueueStatus(
        manifest_path=manifest_path,
        epoch=look.manifest.epoch,
        queue_length=look.length,
        first_sequence=look.first if look.length else None,
        next_sequence=look.next_sequence,
        manifest_bytes=len(look.manifest.raw),
        bytes_referenced=total,
        missing_objects=missing,
        oldest_location=oldest.location if oldest else None,
        oldest_entry_age_seconds=None if born_ms is None else max(0.0, (now_ms - born_ms) / 1000),
        consumer_lag_seconds=(
            max(0.0, (now_ms - lagging_ms) / 1000) if lagging_ms is not None else 0.0
        ),
        unconsumed_entries=look.past(consumed_through),
        indexed_entries=look.indexed,
        recorded_epoch=recorded,
    )


_LOOKS = 5


def _look(
    store: ObjectStore,
    manifest_path: str,
    data_path_prefix: str,
    consumed_through: int | None,
    *,
    measure_bytes: bool,
) -> tuple[QueueLook, ManifestEntry | None, ManifestEntry | None, tuple[int | None, int]]:
    """A look at the queue, its oldest entry, the oldest not consumed, and (with
    ``measure_bytes``) the bytes referenced and the objects missing; looked at again when an
    index segment was drained meanwhile."""
    reader = EntryReader(store)
    for _ in range(_LOOKS):
        look = look_at_queue(store, manifest_path, data_path_prefix)
        try:
            oldest = reader.entry(look, look.first)
            past = look.first if consumed_through is None else max(look.first, consumed_through + 1)
            lagging = oldest if past == look.first else reader.entry(look, past)
            measured: tuple[int | None, int] = (None, 0)
            if measure_bytes:
                measured = referenced_bytes(
                    store, look.locations(store), data_path_prefix=data_path_prefix
                )
        except NotFoundError:
            continue  # an index segment drained meanwhile: look again
        return look, oldest, lagging, measured
    raise StorageError(f"{store.url}: index segments kept vanishing while status read them")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument(
        "--bytes",
        action="store_true",
        help="also sum the sizes of the referenced batch objects (one listing of the data "
        "prefix: a request per 1000 objects)",
    )
    # The default no longer measures bytes; kept so existing scripts do not break.
    parser.add_argument("--no-bytes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--watch",
        type=_interval,
        nargs="?",
        const=2.0,
        metavar="S",
        help="refresh every S seconds (default 2) until Ctrl-C, with append and dequeue "
        "rates (rows/s with --sink) and the last error",
    )
    parser.add_argument(
        "--sink",
        metavar="URL",
        help="also read the consumer's progress from its database (read-only): rows and "
        "batches written, the last sequence, the last commit; lag and length then count "
        "only what it has not written",
    )
    parser.add_argument("--table", default="millpond_rows", help="the sink's target table")
    parser.add_argument("--progress-table", default="millpond_progress")


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0.05 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0.05, found {text!r}")
    return value


def status_record(
    status: QueueStatus, progress: SinkProgress | None = None, *, now_ms: int | None = None
) -> dict[str, Any]:
    """The JSON record of ``status --output json``: the status's fields, the sink's progress
    (``sink``, with ``--sink``), and under ``metrics`` the same figures under the names the
    consumer exports them."""
    record: dict[str, Any] = asdict(status)
    record["replaced"] = status.replaced
    record["metrics"] = {
        "millpond_queue_length": status.unconsumed_entries,
        "millpond_queue_bytes": status.bytes_referenced,
        "millpond_consumer_lag_seconds": status.consumer_lag_seconds,
        "millpond_consumer_epoch": status.epoch,
    }
    if progress is not None:
        now = now_ms if now_ms is not None else SystemClock().now_ms()
        at = progress.last_commit_ms
        record["sink"] = {
            "rows": progress.rows,
            "batches": progress.batches,
            "last_sequence": progress.last_sequence,
            "last_commit_age_seconds": None if at is None else max(0.0, (now - at) / 1000),
        }
        record["metrics"] |= {
            "millpond_consumer_rows_total": progress.rows,
            "millpond_consumer_batches_total": progress.batches,
            "millpond_consumer_last_sequence": (
                -1 if progress.last_sequence is None else progress.last_sequence
            ),
        }
    return record


def run(args: argparse.Namespace) -> int:
    store = open_store_from_args(args)
    require_queue(store, args.manifest_path)
    measure = args.bytes and not args.no_bytes
    reader = None
    if args.sink:
        reader = ProgressReader(args.sink, table=args.table, progress_table=args.progress_table)

    service_lines: list[str] = []

    def look() -> dict[str, Any]:
        progress = None
        if reader is not None:
            try:
                progress = reader.read()
            except NotFoundError:  # nothing consumed into it yet
                progress = SinkProgress(rows=0, batches=0, last_sequence=None, last_commit_ms=None)
        status = queue_status(
            store,
            args.manifest_path,
            measure_bytes=measure,
            data_path_prefix=args.data_prefix,
            consumed_through=None if progress is None else progress.last_sequence,
        )
        record = status_record(status, progress)
        # The consumer service's own report: rows/s, its lag, the last error, a batch it
        # stops on.
        nonlocal service_lines
        service_lines, record["consumer"] = status_section(
            store, args.data_prefix, now_ms=SystemClock().now_ms(), epoch=status.epoch
        )
        return record

    def render(record: Mapping[str, Any]) -> list[str]:
        lines = _text(store.url, record)
        sink = record.get("sink")
        if sink is not None:
            age = sink["last_commit_age_seconds"]
            lines.append(
                f"sink             {redact(args.sink)}: {sink['rows']:,} rows in "
                f"{sink['batches']:,} batches, last sequence "
                f"{'-' if sink['last_sequence'] is None else sink['last_sequence']}, "
                f"last commit {'-' if age is None else f'{age:.1f} s ago'}; "
                f"{record['unconsumed_entries']} entries not yet written"
            )
        return lines + service_lines

    if args.watch is not None:
        return watch(args, look, render)
    record = look()
    emit(args, record, render(record))
    return 0


def _text(url: str, record: Mapping[str, Any]) -> list[str]:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} s"

    nbytes = record["bytes_referenced"]
    referenced = "- (--bytes measures it)" if nbytes is None else _human(nbytes)
    if record["missing_objects"]:
        referenced += f" ({record['missing_objects']} referenced objects MISSING)"
    first = record["first_sequence"]
    return [
        f"queue            {url}/{record['manifest_path']}",
        f"epoch            {record['epoch']}"
        + (
            f" (MANIFEST REPLACED: a consumer of this queue held epoch "
            f"{record['recorded_epoch']}; consumers refuse it: docs/guarantees.md, "
            "'A replaced manifest is refused')"
            if record.get("replaced")
            else ""
        ),
        f"queue length     {record['queue_length']} entries "
        f"(sequences {first if first is not None else '-'}..{record['next_sequence'] - 1}"
        + (
            f"; {record['indexed_entries']} in the consumer's backlog index)"
            if record.get("indexed_entries")
            else ")"
        ),
        f"bytes referenced {referenced}",
        f"oldest entry     {record['oldest_location'] or '-'} "
        f"({seconds(record['oldest_entry_age_seconds'])} old)",
        f"consumer lag     {seconds(record['consumer_lag_seconds'])}"
        + (
            ""
            if "sink" in record
            else " at most: the oldest entry not yet dequeued, which the consumer may have "
            "written already (--sink reads what the database holds)"
        ),
    ]


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit} ({size} B)"
        value /= 1024
    return f"{size} B"
