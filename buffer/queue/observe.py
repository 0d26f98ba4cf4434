"""Looking at a queue without changing it: what waits, how old it is, how many bytes.

Shared by ``millpond status`` and the consumer's metrics. The manifest alone gives the count,
the sequences and the ages (one GET). Bytes need the batch objects' sizes, which the manifest
does not carry: :func:`referenced_bytes` takes them from one listing of the data prefix (one
request per 1000 objects, garbage not yet collected included) instead of one HEAD per entry.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from millpond.common.ulids import parse_batch_name, ulid_time_ms
from millpond.errors import NotFoundError
from millpond.formats.manifest import Manifest, ManifestEntry
from millpond.storage.store import ObjectStore

__all__ = [
    "Waiting",
    "WaitingEntry",
    "entry_time_ms",
    "list_sizes",
    "referenced_bytes",
    "waiting_after",
]

logger = logging.getLogger(__name__)


def entry_time_ms(entry: ManifestEntry) -> int | None:
    """When the entry's oldest record was produced: the earliest ingestion time among its
    metadata items, else the ULID time of its batch name; ``None`` when neither is known."""
    if entry.metadata:
        return min(item.ingestion_time_ms for item in entry.metadata)
    ulid = parse_batch_name(entry.location.rpartition("/")[2])
    return ulid_time_ms(ulid) if ulid is not None else None


@dataclass(frozen=True, slots=True)
class WaitingEntry:
    """What the gauges need of one manifest entry."""

    sequence: int
    location: str
    time_ms: int | None
    """:func:`entry_time_ms` of the entry."""


@dataclass(frozen=True, slots=True)
class Waiting:
    """The entries after a sequence, as of one manifest read."""

    entries: tuple[WaitingEntry, ...]

    def after(self, sequence: int | None) -> Waiting:
        """Only the entries past ``sequence`` (``None``: all of them)."""
        if sequence is None or not self.entries or self.entries[0].sequence > sequence:
            return self
        return Waiting(tuple(e for e in self.entries if e.sequence > sequence))

    @property
    def length(self) -> int:
        return len(self.entries)

    def lag_seconds(self, now_ms: int) -> float:
        """Now minus the oldest entry's time; 0 when nothing waits."""
        if not self.entries:
            return 0.0
        oldest = self.entries[0].time_ms
        return max(0.0, (now_ms - oldest) / 1000) if oldest is not None else 0.0

    def bytes_from(self, sizes: Mapping[str, int]) -> int:
        """Sum of the sizes of the referenced objects found in ``sizes`` (one per location)."""
        return sum(sizes.get(location, 0) for location in {e.location for e in self.entries})


def waiting_after(manifest: Manifest, sequence: int | None = None) -> Waiting:
    """The manifest's entries past ``sequence`` (``None``: every entry)."""
    return Waiting(
        tuple(
            WaitingEntry(entry.sequence, entry.location, entry_time_ms(entry))
            for entry in manifest.entries
            if sequence is None or entry.sequence > sequence
        )
    )


def list_sizes(store: ObjectStore, data_path_prefix: str) -> dict[str, int]:
    """The size of every object directly under ``data_path_prefix``, by path.

    Raises:
        StorageError: the listing failed.
    """
    prefix = data_path_prefix.strip("/")
    return {info.path: info.size for info in store.list(prefix, recursive=False)}


def referenced_bytes(
    store: ObjectStore, locations: Iterable[str], *, data_path_prefix: str
) -> tuple[int, int]:
    """Bytes of the objects at ``locations`` and how many of them are missing.

    One listing of the data prefix gives the sizes; a location outside the prefix (none is, in
    a queue millpond wrote) costs one HEAD.

    Returns:
        ``(bytes, missing)``; a location listed twice counts once.

    Raises:
        StorageError: the listing or a HEAD failed.
    """
    wanted = set(locations)
    if not wanted:
        return 0, 0
    sizes = list_sizes(store, data_path_prefix)
    total = missing = 0
    for location in wanted:
        size = sizes.get(location)
        if size is None and location.rpartition("/")[0] != data_path_prefix.strip("/"):
            try:
                size = store.head(location).size
            except NotFoundError:
                size = None
        if size is None:
            missing += 1
        else:
            total += size
    return total, missing
