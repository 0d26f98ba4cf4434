"""``millpond inspect STORE_URL``: the manifest's footer and oldest entry at a glance."""

from __future__ import annotations

import argparse
from typing import Any

from millpond.cli.common import add_store_arguments, emit, open_store_from_args, require_queue
from millpond.common.clock import SystemClock
from millpond.common.ulids import parse_batch_name, ulid_time_ms
from millpond.queue import read_manifest
from millpond.storage.store import ObjectStore

__all__ = ["add_arguments", "describe", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)


def describe(store: ObjectStore, manifest_path: str, now_ms: int) -> dict[str, Any]:
    """The inspect record for a manifest.

    Raises:
        NotFoundError: no manifest.
        FormatError: the manifest is corrupt.
        StorageError: the store failed.
    """
    snapshot = read_manifest(store, manifest_path)
    manifest = snapshot.manifest
    oldest = manifest.entries[0] if manifest.entries else None
    age: float | None = None
    if oldest is not None:
        ulid = parse_batch_name(oldest.location.rsplit("/", 1)[-1])
        if ulid is not None:
            age = max(0.0, (now_ms - ulid_time_ms(ulid)) / 1000)
        elif oldest.metadata:
            age = max(0.0, (now_ms - oldest.metadata[0].ingestion_time_ms) / 1000)
    return {
        "epoch": manifest.epoch,
        "next_sequence": manifest.next_sequence,
        "entry_count": manifest.footer.entry_count,
        "first_sequence": manifest.first_sequence,
        "manifest_bytes": snapshot.size,
        "oldest_location": oldest.location if oldest else None,
        "oldest_age_seconds": age,
    }


def run(args: argparse.Namespace) -> int:
    store = open_store_from_args(args)
    require_queue(store, args.manifest_path)
    record = describe(store, args.manifest_path, SystemClock().now_ms())
    age = record["oldest_age_seconds"]
    first = record["first_sequence"]
    text = [
        f"manifest        {store.url}/{args.manifest_path}",
        f"epoch           {record['epoch']}",
        f"next_sequence   {record['next_sequence']}",
        f"entry_count     {record['entry_count']}",
        f"first_sequence  {first if first is not None else '-'}",
        f"oldest entry    {record['oldest_location'] or '-'}"
        + (f" ({age:.1f} s old)" if age is not None else ""),
        f"manifest_bytes  {record['manifest_bytes']}",
    ]
    emit(args, record, text)
    return 0
