"""``millpond status STORE_URL``: how far behind is the consumer, at a glance.

Queue length, the oldest entry's age (from its ULID), the epoch, and the consumer lag (now
minus the ingestion time of the oldest entry): one GET of the manifest, whatever the backlog.
``--bytes`` adds the bytes referenced (the sum of the sizes of the batch objects the manifest
points at) from one listing of the data prefix. ``--watch`` refreshes in place
(:mod:`millpond.consumer._watch`). Reads without fencing; changes nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from millpond.cli.common import add_store_arguments, emit, open_store_from_args, require_queue
from millpond.common.clock import Clock, SystemClock
from millpond.common.ulids import parse_batch_name, ulid_time_ms
from millpond.consumer._watch import watch
from millpond.queue import read_manifest
from millpond.queue.observe import referenced_bytes, waiting_after
from millpond.storage.store import ObjectStore

__all__ = ["QueueStatus", "add_arguments", "queue_status", "run", "status_record"]


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
    measure_bytes: bool = False,
    data_path_prefix: str = "ingest",
) -> QueueStatus:
    """Measure a queue: one GET of the manifest, plus one listing of the data prefix (a
    request per 1000 objects) with ``measure_bytes``.

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
    if measure_bytes:
        total, missing = referenced_bytes(
            store, (entry.location for entry in entries), data_path_prefix=data_path_prefix
        )
    age: float | None = None
    if oldest is not None:
        ulid = parse_batch_name(oldest.location.rpartition("/")[2])
        if ulid is not None:
            age = max(0.0, (now_ms - ulid_time_ms(ulid)) / 1000)
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
        consumer_lag_seconds=waiting_after(manifest).lag_seconds(now_ms),
    )


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
        "rates and the last error",
    )


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0.05 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0.05, found {text!r}")
    return value


def status_record(status: QueueStatus) -> dict[str, Any]:
    """The JSON record of ``status --output json``: the status's fields, and under
    ``metrics`` the same figures under the names the consumer exports them."""
    record: dict[str, Any] = asdict(status)
    record["metrics"] = {
        "millpond_queue_length": status.queue_length,
        "millpond_queue_bytes": status.bytes_referenced,
        "millpond_consumer_lag_seconds": status.consumer_lag_seconds,
        "millpond_consumer_epoch": status.epoch,
    }
    return record


def run(args: argparse.Namespace) -> int:
    store = open_store_from_args(args)
    require_queue(store, args.manifest_path)
    measure = args.bytes and not args.no_bytes

    def look() -> dict[str, Any]:
        status = queue_status(
            store, args.manifest_path, measure_bytes=measure, data_path_prefix=args.data_prefix
        )
        return status_record(status)

    def render(record: Mapping[str, Any]) -> list[str]:
        return _text(store.url, record)

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
        f"epoch            {record['epoch']}",
        f"queue length     {record['queue_length']} entries "
        f"(sequences {first if first is not None else '-'}..{record['next_sequence'] - 1})",
        f"bytes referenced {referenced}",
        f"oldest entry     {record['oldest_location'] or '-'} "
        f"({seconds(record['oldest_entry_age_seconds'])} old)",
        f"consumer lag     {seconds(record['consumer_lag_seconds'])}",
    ]


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit} ({size} B)"
        value /= 1024
    return f"{size} B"
