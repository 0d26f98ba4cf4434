"""Looking at a queue without changing it: what waits, how old it is, how many bytes.

Shared by ``millpond status`` and the consumer's metrics. Whatever the backlog, a look costs
the manifest's bytes (checked, not decoded) and the backlog index head: sequences are
contiguous, so the queue's length and what waits past a sequence are counted from the index
head's segments and the manifest's footer, and the one entry a look needs (the oldest, or the
oldest past a sequence) is decoded alone, from the manifest or from the one index segment that
holds it. Bytes need the batch objects' sizes, which the manifest does not carry: they come
from a listing of the data prefix (one request per 1000 objects), streamed, never kept.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from millpond.common.ulids import parse_batch_name, ulid_time_ms, ulid_time_prefix
from millpond.errors import NotFoundError, StorageError
from millpond.formats.manifest import ManifestEntry, ManifestView, Metadata, view_manifest
from millpond.queue.index import IndexHead, decode_head, head_path, queue_extent, read_segment
from millpond.storage.store import ObjectStore, get_or_none

__all__ = [
    "EntryReader",
    "QueueLook",
    "batch_time_ms",
    "bytes_from",
    "entry_time_ms",
    "look_at_queue",
    "look_with_entry",
    "referenced_bytes",
]

logger = logging.getLogger(__name__)

_LOOKS = 5


def batch_time_ms(metadata: Iterable[Metadata], location: str) -> int | None:
    """When a batch's oldest record was produced: the earliest ingestion time among its
    metadata items, else the ULID time of its name; ``None`` when neither is known."""
    times = [item.ingestion_time_ms for item in metadata]
    if times:
        return min(times)
    ulid = parse_batch_name(location.rpartition("/")[2])
    return ulid_time_ms(ulid) if ulid is not None else None


def entry_time_ms(entry: ManifestEntry) -> int | None:
    """:func:`batch_time_ms` of a manifest entry."""
    return batch_time_ms(entry.metadata, entry.location)


@dataclass(frozen=True, slots=True)
class QueueLook:
    """The queue as one read saw it: the manifest (checked, not decoded) and the backlog index
    head read after it."""

    manifest: ManifestView
    head: IndexHead | None
    first: int
    """The first sequence waiting (``next_sequence`` when none is)."""
    next_sequence: int
    manifest_etag: str | None = None
    head_etag: str | None = None
    """The ETags the manifest and the head were read at (``None``: none, or no head)."""

    @property
    def length(self) -> int:
        """Entries waiting: in the index and in the manifest past it."""
        return self.next_sequence - self.first

    @property
    def indexed(self) -> int:
        """Of :attr:`length`, the entries in the consumer's backlog index."""
        return self.head.entries if self.head is not None else 0

    def past(self, sequence: int | None) -> int:
        """Entries waiting past ``sequence`` (``None``: all of them)."""
        start = self.first if sequence is None else max(self.first, sequence + 1)
        return max(0, self.next_sequence - start)

    def locations(self, store: ObjectStore) -> Iterator[str]:
        """Every waiting entry's location, in order, one index segment read at a time.

        Raises:
            NotFoundError: a segment was drained meanwhile.
            FormatError, StorageError: as :func:`~millpond.queue.index.read_segment`.
        """
        head = self.head
        for segment in head.segments if head is not None else ():
            for entry in read_segment(store, segment).entries_from(self.first):
                yield entry.location
        end = head.end if head is not None else -1
        for entry in self.manifest.entries_from(max(self.first, end + 1)):
            yield entry.location


def look_at_queue(store: ObjectStore, manifest_path: str, data_path_prefix: str) -> QueueLook:
    """Read the manifest, then the index head (an entry moved meanwhile is in the index by
    then); no entry is decoded, no segment read.

    Raises:
        NotFoundError: no manifest at ``manifest_path``.
        FormatError: the manifest or the head is corrupt.
        StorageError: the store failed.
    """
    got = store.get(manifest_path)
    manifest = view_manifest(got.data, name=manifest_path)
    path = head_path(data_path_prefix)
    read = get_or_none(store, path)
    head = None if read is None else decode_head(read.data, name=f"{store.url}/{path}")
    first, next_sequence = queue_extent(manifest, head)
    return QueueLook(
        manifest=manifest,
        head=head,
        first=first,
        next_sequence=next_sequence,
        manifest_etag=got.etag,
        head_etag=None if read is None else read.etag,
    )


class EntryReader:
    """Decodes single entries of a look, holding the last index segment it read."""

    def __init__(self, store: ObjectStore) -> None:
        self._store = store
        self._segment: tuple[str, ManifestView] | None = None

    def entry(self, look: QueueLook, sequence: int) -> ManifestEntry | None:
        """The entry ``sequence`` as ``look`` saw the queue, or ``None`` when it does not hold
        it.

        Raises:
            NotFoundError: its index segment was drained since the head was read.
            FormatError, StorageError: as :func:`~millpond.queue.index.read_segment`.
        """
        if not look.first <= sequence < look.next_sequence:
            return None
        segment = look.head.segment_of(sequence) if look.head is not None else None
        if segment is None:
            return look.manifest.entry(sequence)
        if self._segment is None or self._segment[0] != segment.path:
            self._segment = (segment.path, read_segment(self._store, segment))
        return self._segment[1].entry(sequence)


def look_with_entry(
    store: ObjectStore,
    manifest_path: str,
    data_path_prefix: str,
    reader: EntryReader,
    past: int | None,
) -> tuple[QueueLook, ManifestEntry | None]:
    """A look, and the first entry waiting past ``past`` (``None``: the queue's first); a
    segment drained between the head's read and the entry's is looked at again.

    Raises:
        NotFoundError: no manifest.
        FormatError: the manifest, the head or a segment is corrupt.
        StorageError: the store failed, or segments kept vanishing.
    """
    for _ in range(_LOOKS):
        look = look_at_queue(store, manifest_path, data_path_prefix)
        start = look.first if past is None else max(look.first, past + 1)
        try:
            return look, reader.entry(look, start)
        except NotFoundError:
            continue  # the consumer drained that segment meanwhile: look again
    raise StorageError(f"{store.url}: index segments kept vanishing while looking at the queue")


def bytes_from(
    store: ObjectStore,
    data_path_prefix: str,
    entry: ManifestEntry | None,
    *,
    until: ManifestEntry | None = None,
) -> int:
    """Bytes of the batch objects named at or after ``entry``'s batch time (``None``: no
    entry waits, 0) and, given ``until``, before that entry's: the backlog's objects (or its
    oldest part), from one listing that starts there (streamed, nothing kept). Objects named in
    that range that no entry references count too (uploaded, not yet appended; consumed, not
    yet collected): a gauge, not an inventory.

    Raises:
        StorageError: the listing failed.
    """
    if entry is None:
        return 0
    prefix = data_path_prefix.strip("/")
    start, end = _time_bound(prefix, entry), _time_bound(prefix, until)
    if start is not None and end is not None and end <= start:
        end = None  # names out of time order (minted before their append won): list it all
    return sum(
        info.size
        for info in store.list_range(prefix, start_after=start, end_before=end)
        if parse_batch_name(info.path.rpartition("/")[2]) is not None
    )


def _time_bound(prefix: str, entry: ManifestEntry | None) -> str | None:
    """Where names of ``entry``'s batch time begin in a listing (``None``: no bound)."""
    ulid = parse_batch_name(entry.location.rpartition("/")[2]) if entry is not None else None
    if ulid is None:
        return None
    return (f"{prefix}/" if prefix else "") + ulid_time_prefix(ulid_time_ms(ulid))


def referenced_bytes(
    store: ObjectStore, locations: Iterable[str], *, data_path_prefix: str
) -> tuple[int, int]:
    """Bytes of the objects at ``locations`` and how many of them are missing.

    One listing of the data prefix gives the sizes (streamed: only the set of locations is
    kept); a location outside the prefix (none is, in a queue millpond wrote) costs one HEAD.

    Returns:
        ``(bytes, missing)``; a location listed twice counts once.

    Raises:
        StorageError: the listing or a HEAD failed.
    """
    prefix = data_path_prefix.strip("/")
    wanted = set(locations)
    if not wanted:
        return 0, 0
    total = found = 0
    for info in store.list_range(prefix):
        if info.path in wanted:
            total += info.size
            found += 1
    for location in wanted:
        if location.rpartition("/")[0] != prefix:
            try:
                total += store.head(location).size
                found += 1
            except NotFoundError:
                pass
    return total, len(wanted) - found
