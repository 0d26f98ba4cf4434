"""The consumer's backlog index: the oldest entries' locations, moved out of the manifest.

Every append and dequeue rewrites the whole manifest, so a backlog of a million entries (a
database down for a day) makes every producer's append move tens of megabytes. With the index
switched on (``ConsumerConfig.backlog_index``), the single consumer moves the oldest entries
it has read out of the manifest into objects of its own, and delivers from them first; the
manifest keeps only what arrived since, and stays small for every producer (wal3's snapshot
idea). The manifest format is unchanged: an RFC peer sees a short queue whose first sequence
is past the moved entries, as if they had been dequeued.

Layout, under ``{data_path_prefix}/_millpond/index/``:

* ``head`` — JSON: the owning consumer's ``epoch``, ``dequeued_through`` (every sequence up to
  it is in the sink) and the ``segments`` in sequence order, each ``{path, first, last,
  oldest_ms}`` (``oldest_ms``, the oldest ULID time among its batch names, lets a collector
  find the queue's floor without reading it; a head without it is read as before);
* ``segments/{first}-{last}-e{epoch}`` — immutable, in the manifest's wire format (the entries
  with their own sequences, contiguous; the footer's epoch is the writer's). A move writes
  segments of ``backlog_index_threshold`` to twice that many entries, so whoever reads the
  index (the consumer delivering, ``status`` looking up the oldest entry) holds one segment
  at a time, whatever the backlog.

Protocol (only the consumer holding the manifest's epoch writes):

* **move**: write the segment, then the head (a conditional write), then remove the moved
  entries from the manifest (a conditional write). A crash between the last two leaves the
  entries in both: readers take each sequence once (:func:`queue_view`), the next consumer
  finishes the removal.
* **drain**: the head's ``dequeued_through`` is raised (and drained segments dropped) *before*
  the manifest is dequeued, so the index and the manifest together are always contiguous.
* **fencing**: every head write is conditional on the ETag this consumer last saw and carries
  its epoch. A consumer's ``initialize()`` bumps the manifest epoch, then claims the head (a
  conditional rewrite with its epoch, or an empty head created with it when there is none)
  before reading it: no older consumer can write the head after that, and an older one that
  finds a newer epoch there raises ``FencedError``. An older consumer's write can still land
  between the epoch bump and the claim (one request); it can only add entries that are still
  in the manifest too, or raise ``dequeued_through`` over entries its sink has already
  written. Once the claim has returned, no head write of an older consumer lands: each is
  conditional on an ETag (or an absence) the claim replaced.

Readers (GC, status) read the manifest first and the index after: an entry moved meanwhile is
in the index by then, and one gone from both was consumed. They count the queue from the
head's ranges and read at most the one segment holding the entry they look at.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from millpond.common.clock import Clock, SystemClock
from millpond.common.retry import RetryPolicy
from millpond.common.ulids import parse_batch_name, ulid_time_ms
from millpond.errors import (
    FencedError,
    FormatError,
    MillpondError,
    NotFoundError,
    StorageError,
)
from millpond.formats.manifest import (
    Footer,
    Manifest,
    ManifestEntry,
    ManifestView,
    PendingEntry,
    encode_entry,
    iter_locations,
    view_manifest,
)
from millpond.queue.claim import internal_path
from millpond.queue.fenced import FencedObject, Version
from millpond.storage.store import ObjectStore, get_or_none

__all__ = [
    "NO_BATCH_TIME",
    "BacklogIndex",
    "IndexHead",
    "Segment",
    "decode_head",
    "encode_segment",
    "head_path",
    "oldest_batch_ms",
    "queue_extent",
    "queue_view",
    "read_head",
    "read_indexed",
    "read_segment",
    "segment_oldest_ms",
]

logger = logging.getLogger(__name__)

_FORMAT = "millpond-backlog-index"
_VERSION = 1
_READ_ATTEMPTS = 5


def head_path(data_path_prefix: str) -> str:
    """Where the index head of the queue under ``data_path_prefix`` lives."""
    return internal_path(data_path_prefix, "index/head")


def _segment_path(data_path_prefix: str, first: int, last: int, epoch: int) -> str:
    return internal_path(data_path_prefix, f"index/segments/{first:020d}-{last:020d}-e{epoch}")


def _segment_epoch(path: str) -> int:
    """The epoch in a segment's name; a name that is not a segment's is never an orphan."""
    _, _, epoch = path.rpartition("-e")
    return int(epoch) if epoch.isascii() and epoch.isdigit() else 1 << 64  # not "²"


@dataclass(frozen=True, slots=True)
class Segment:
    """One immutable segment object and the sequences it holds."""

    path: str
    first: int
    last: int
    oldest_ms: int | None = None
    """The oldest ULID time among its batch names (:data:`NO_BATCH_TIME` when none is a
    ULID), so a collector finds the queue's floor without reading the segment; ``None`` in a
    head an older millpond wrote (the segment is read for it)."""

    def live(self, dequeued_through: int) -> int:
        """How many of its entries are past ``dequeued_through``."""
        return max(0, self.last - max(self.first, dequeued_through + 1) + 1)


@dataclass(frozen=True, slots=True)
class IndexHead:
    """The index head: who owns it, what is drained, where the entries are."""

    epoch: int
    dequeued_through: int = -1
    segments: tuple[Segment, ...] = ()

    @property
    def blank(self) -> bool:
        """Whether the head holds nothing at all: what a takeover leaves when it finds none
        (:meth:`BacklogIndex.claim`), as good as no head for every reader."""
        return not self.segments and self.dequeued_through < 0

    @property
    def end(self) -> int:
        """The last sequence the index has ever covered (-1: none): the manifest holds only
        entries past it, except for a move that crashed before its manifest write."""
        last = self.segments[-1].last if self.segments else -1
        return max(last, self.dequeued_through)

    @property
    def entries(self) -> int:
        """Entries the index holds past ``dequeued_through`` (counted, not read)."""
        return sum(segment.live(self.dequeued_through) for segment in self.segments)

    @property
    def first(self) -> int | None:
        """The first sequence it holds, or ``None`` when it holds none."""
        if not self.segments:
            return None
        return max(self.segments[0].first, self.dequeued_through + 1)

    def segment_of(self, sequence: int) -> Segment | None:
        """The segment holding ``sequence`` past ``dequeued_through``, if any."""
        if sequence <= self.dequeued_through:
            return None
        found = bisect.bisect_left(self.segments, sequence, key=lambda segment: segment.last)
        if found < len(self.segments) and self.segments[found].first <= sequence:
            return self.segments[found]
        return None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "format": _FORMAT,
                "version": _VERSION,
                "epoch": self.epoch,
                "dequeued_through": self.dequeued_through,
                "segments": [_encode_segment_ref(s) for s in self.segments],
            },
            separators=(",", ":"),
        ).encode()


def _encode_segment_ref(segment: Segment) -> dict[str, Any]:
    record: dict[str, Any] = {"path": segment.path, "first": segment.first, "last": segment.last}
    if segment.oldest_ms is not None:
        record["oldest_ms"] = segment.oldest_ms
    return record


def _decode_segment_ref(record: dict[str, Any]) -> Segment:
    oldest = record.get("oldest_ms")
    return Segment(
        str(record["path"]),
        int(record["first"]),
        int(record["last"]),
        None if oldest is None else int(oldest),
    )


def decode_head(data: bytes, *, name: str) -> IndexHead:
    """Decode and check an index head.

    Raises:
        FormatError: not a version-1 index head, or segments out of order.
    """
    try:
        record = json.loads(data)
        if record.get("format") != _FORMAT or record.get("version") != _VERSION:
            raise FormatError(
                f"{name}: expected a {_FORMAT} version {_VERSION}, found "
                f"{record.get('format')!r} version {record.get('version')!r}",
                field="format",
            )
        head = IndexHead(
            epoch=int(record["epoch"]),
            dequeued_through=int(record["dequeued_through"]),
            segments=tuple(_decode_segment_ref(s) for s in record["segments"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise FormatError(f"{name}: not a millpond index head: {err}", field="head") from err
    previous: int | None = None
    for segment in head.segments:
        if segment.first > segment.last or segment.last <= head.dequeued_through:
            raise FormatError(f"{name}: segment {segment.path}: bad range", field="segments")
        expected_first = head.dequeued_through + 1 if previous is None else previous + 1
        if segment.first > expected_first or (
            previous is not None and segment.first != expected_first
        ):
            raise FormatError(f"{name}: gap before segment {segment.path}", field="segments")
        previous = segment.last
    return head


def encode_segment(entries: Sequence[ManifestEntry], epoch: int) -> bytes:
    """Entries (contiguous sequences) in the manifest's wire format."""
    body = [encode_entry(e.sequence, PendingEntry(e.location, e.metadata)) for e in entries]
    footer = Footer(entry_count=len(entries), next_sequence=entries[-1].sequence + 1, epoch=epoch)
    return b"".join([*body, footer.encode()])


def read_segment(store: ObjectStore, segment: Segment) -> ManifestView:
    """One segment's entries, checked and decoded only as they are taken.

    Raises:
        NotFoundError: the segment is gone (drained since its head was read).
        FormatError: it is corrupt, or holds other sequences than its head says.
        StorageError: the store failed.
    """
    view = view_manifest(store.get(segment.path).data, name=segment.path)
    if (view.first_sequence, view.next_sequence - 1) != (segment.first, segment.last):
        raise FormatError(
            f"{segment.path}: expected sequences {segment.first}..{segment.last}, found "
            f"{view.first_sequence}..{view.next_sequence - 1}",
            field="segments",
        )
    return view


def segment_oldest_ms(store: ObjectStore, segment: Segment) -> int:
    """The oldest batch time of a segment: from its head entry, or (a head an older millpond
    wrote) from the segment itself.

    Raises:
        NotFoundError, FormatError, StorageError: as :func:`read_segment`.
    """
    if segment.oldest_ms is not None:
        return segment.oldest_ms
    view = read_segment(store, segment)
    return oldest_batch_ms(location for _sequence, location in iter_locations(view.raw))


def oldest_batch_ms(locations: Iterable[str]) -> int:
    """The oldest ULID time among ``locations``' batch names; :data:`NO_BATCH_TIME` when none
    is a ULID (nothing can then be older: a collector keeps everything)."""
    ulids = (parse_batch_name(location.rpartition("/")[2]) for location in locations)
    return min((ulid_time_ms(ulid) for ulid in ulids if ulid is not None), default=NO_BATCH_TIME)


NO_BATCH_TIME = -(1 << 63)
"""The oldest batch time of entries none of whose names is a ULID: nothing is older."""


def read_head(store: ObjectStore, data_path_prefix: str) -> IndexHead | None:
    """The index head, or ``None`` when there is none (no fencing; for GC, status, metrics).

    Raises:
        FormatError: the head is corrupt.
        StorageError: the store failed.
    """
    path = head_path(data_path_prefix)
    got = get_or_none(store, path)
    return None if got is None else decode_head(got.data, name=f"{store.url}/{path}")


def read_indexed(
    store: ObjectStore, data_path_prefix: str
) -> tuple[IndexHead | None, list[ManifestEntry]]:
    """The head and the live indexed entries, every segment decoded (for tests and tools: the
    consumer, GC and status read one segment at a time, or none; no fencing).

    Raises:
        FormatError: the head or a segment is corrupt.
        StorageError: the store failed, or segments kept vanishing under the read.
    """
    path = head_path(data_path_prefix)
    for _ in range(_READ_ATTEMPTS):
        head = read_head(store, data_path_prefix)
        if head is None:
            return None, []
        past = head.dequeued_through + 1
        try:
            return head, [
                e for s in head.segments for e in read_segment(store, s).entries_from(past)
            ]
        except NotFoundError:
            continue  # the consumer drained a segment meanwhile: read the newer head
    raise StorageError(f"{store.url}/{path}: segments kept vanishing while reading the index")


def queue_view(
    manifest: Manifest, head: IndexHead | None, indexed: Sequence[ManifestEntry]
) -> Manifest:
    """The queue as the consumer sees it: the indexed entries, then the manifest's past them."""
    if head is None:
        return manifest
    rest = [e for e in manifest.entries if e.sequence > head.end]
    entries = (*indexed, *rest)
    # A reader that read the manifest before a move of entries appended since sees them in
    # the index only: the queue then reaches past the manifest it read.
    next_sequence = max(manifest.next_sequence, entries[-1].sequence + 1 if entries else 0)
    footer = Footer(entry_count=len(entries), next_sequence=next_sequence, epoch=manifest.epoch)
    return Manifest(footer=footer, entries=entries)


def queue_extent(manifest: ManifestView | Manifest, head: IndexHead | None) -> tuple[int, int]:
    """The queue's first sequence (its ``next_sequence`` when it is empty) and its
    ``next_sequence``, from the index head and the manifest (read after it) alone: the index's
    entries past ``dequeued_through``, then the manifest's past the index's end."""
    head = IndexHead(epoch=0) if head is None else head  # no head: as good as a blank one
    last_indexed = head.segments[-1].last if head.segments else -1
    # A reader that read the manifest before a move of entries appended since sees them in
    # the index only: the queue then reaches past the manifest it read.
    next_sequence = max(manifest.next_sequence, last_indexed + 1)
    if head.first is not None:
        return head.first, next_sequence
    manifest_first = manifest.first_sequence
    if manifest_first is not None and manifest.next_sequence - 1 > head.end:
        return max(manifest_first, head.end + 1), next_sequence
    return next_sequence, next_sequence


class BacklogIndex:
    """The consumer's side of the index: claim, move entries in, drain, all under its epoch."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        data_path_prefix: str,
        epoch: int,
        retry: RetryPolicy | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._store = store
        self._prefix = data_path_prefix.strip("/")
        self._path = head_path(self._prefix)
        self._epoch = epoch
        self._retry = retry or RetryPolicy()
        self._clock = clock or SystemClock()
        self._head: IndexHead | None = None
        self._etag: str | None = None
        self._drained: list[str] = []  # segments drains dropped, not deleted yet
        self._object = FencedObject(
            store,
            self._path,
            decode=lambda data: decode_head(data, name=f"{store.url}/{self._path}"),
            encode=IndexHead.encode,
            check=self._check_epoch,
            retry=self._retry,
            clock=self._clock,
        )

    @property
    def end(self) -> int:
        """The last sequence the index covers, as this consumer last wrote or claimed it."""
        return self._head.end if self._head is not None else -1

    @property
    def head(self) -> IndexHead | None:
        """The head as this consumer last wrote or claimed it (``None``: there is none)."""
        return self._head

    @property
    def holds_anything(self) -> bool:
        """Whether the head, as last written or claimed, records anything (entries or a
        drain); a blank one is as good as none."""
        return self._head is not None and not self._head.blank

    @property
    def live(self) -> bool:
        """Whether the index holds entries not yet drained."""
        return self._head is not None and bool(self._head.segments)

    def claim(self) -> None:
        """Take the head over for this epoch (:attr:`head` is then what it holds).

        When there is no head, an empty one carrying this epoch is created: an older
        consumer that passed its epoch check just before the takeover and is about to create
        the head for its first move (``put_if_absent``) then finds it taken and is fenced,
        instead of landing a head nobody would rewrite (a consumer with the index off never
        writes it again, and GC and ``status`` would take its entries for the queue's
        oldest). Segments no head names (left by a move that lost its head write) are
        deleted. No segment is read: the consumer reads them one at a time as it delivers.

        Raises:
            FencedError: the head carries a newer epoch.
            FormatError: the head is corrupt.
            StorageError: the store failed past the retry budget.
        """
        self._update(lambda head: replace(head, epoch=self._epoch), create=True, read_first=True)
        if self.holds_anything:
            self._delete_orphans()

    def add(
        self,
        entries: Iterable[ManifestEntry],
        *,
        dequeued_through: int,
        segment_entries: int | None = None,
    ) -> None:
        """Move ``entries`` (contiguous, past the index's end) in; raise ``dequeued_through``.

        They are taken as they come, ``segment_entries`` at a time (default: all in one
        segment), each written as a segment; then one head write names them all. A segment
        is only as large as that: the consumer reads the index one segment at a time.

        Raises:
            FencedError: a newer consumer owns the head.
            StorageError: the store failed past the retry budget (the entries are still in the
                manifest; the index may or may not hold them).
            MillpondError: the entries are not contiguous, or would leave a gap after (or
                overlap part of) what the index holds; the head is not written.
        """
        written: list[Segment] = []
        source = iter(entries)
        while chunk := list(itertools.islice(source, segment_entries or None)):
            first, last = chunk[0].sequence, chunk[-1].sequence
            follows = not written or first == written[-1].last + 1
            if last - first + 1 != len(chunk) or not follows:
                raise MillpondError(f"{self._path}: entries {first}..{last} are not contiguous")
            written.append(self._write_segment(chunk))
        if not written:
            return
        first, last = written[0].first, written[-1].last

        def transform(head: IndexHead) -> IndexHead:
            segments = head.segments
            through = max(head.dequeued_through, dequeued_through)
            if head.end < last:
                # Index and manifest must stay contiguous: never a gap, never a half overlap.
                if head.end >= first or first > max(head.end, through) + 1:
                    raise MillpondError(
                        f"{self._path}: segment {first}..{last} does not follow the index "
                        f"(it ends at {head.end}, dequeued through {through})"
                    )
                segments = (*segments, *written)
            return self._drained_head(segments, through)

        self._update(transform, create=True)

    def _write_segment(self, entries: Sequence[ManifestEntry]) -> Segment:
        """Write one segment object (retried); the head does not name it yet."""
        first, last = entries[0].sequence, entries[-1].sequence
        segment = Segment(
            _segment_path(self._prefix, first, last, self._epoch),
            first,
            last,
            oldest_batch_ms(entry.location for entry in entries),
        )
        data = encode_segment(entries, self._epoch)
        backoff = self._retry.start(self._clock)
        while True:
            try:
                self._store.put(segment.path, data)
                return segment
            except StorageError as err:
                if not backoff.sleep():
                    raise StorageError(
                        f"{segment.path}: index segment write failed: {err}"
                    ) from err

    def drain(self, through: int) -> None:
        """Mark every sequence up to ``through`` as in the sink; the segments it drains are
        named no more, and deleted by :meth:`delete_drained`, not here: a drain is the last
        request of an ack, and a request after it would be a moment for a newer consumer to
        take over before the ack returns.

        Raises:
            FencedError, StorageError: as :meth:`add`.
        """
        if self._head is None or through <= self._head.dequeued_through:
            return

        def transform(head: IndexHead) -> IndexHead:
            return self._drained_head(
                head.segments, max(head.dequeued_through, min(through, head.end))
            )

        self._update(transform, create=False, later=True)

    def delete_drained(self) -> None:
        """Delete the segments drains left (they are named by no head: nobody reads them)."""
        paths, self._drained = self._drained, []
        self._delete(paths)

    # -- internals -------------------------------------------------------------------------

    def _drained_head(self, segments: Iterable[Segment], through: int) -> IndexHead:
        """A head of this epoch dequeued through ``through``, naming the segments past it."""
        return IndexHead(self._epoch, through, tuple(s for s in segments if s.last > through))

    def _update(
        self,
        transform: Callable[[IndexHead], IndexHead],
        *,
        create: bool,
        read_first: bool = False,
        later: bool = False,
    ) -> None:
        """Transform the head under this epoch (:class:`~millpond.queue.fenced.FencedObject`).
        Only this consumer writes the head once it has claimed it, so the head it last wrote
        is tried first. Segments the new head no longer names are deleted (``later``: by
        :meth:`delete_drained`)."""
        base: list[IndexHead | None] = [None]

        def prepare(current: IndexHead | None) -> IndexHead | None:
            base[0] = current
            if current is None and not create:
                return None
            new = transform(current if current is not None else IndexHead(epoch=self._epoch))
            return None if new == current else new

        stale = read_first or (self._head is not None and self._etag is None)
        done = self._object.update(
            prepare, what="index write", known=None if stale else Version(self._head, self._etag)
        )
        self._head, self._etag = done.version.value, done.version.etag
        current = base[0]
        if done.wrote and current is not None and self._head is not None:
            kept = {segment.path for segment in self._head.segments}
            gone = [s.path for s in current.segments if s.path not in kept]
            if later:
                self._drained.extend(gone)
            else:
                self._delete(gone)

    def _check_epoch(self, current: IndexHead) -> None:
        if current.epoch > self._epoch:
            raise FencedError(
                f"{self._store.url}/{self._path}: fenced: this consumer holds epoch "
                f"{self._epoch}, the backlog index has epoch {current.epoch}",
                expected_epoch=self._epoch,
                found_epoch=current.epoch,
            )

    def _delete_orphans(self) -> None:
        """Delete segments an older epoch wrote and no head names: a move whose head write
        lost (it cannot land once this consumer claimed the head). A newer epoch's segments
        are never touched: that consumer may be about to name them."""
        named = {s.path for s in self._head.segments} if self._head is not None else set()
        folder = internal_path(self._prefix, "index/segments")
        try:
            listing = self._store.list(folder)
        except StorageError as err:
            logger.warning("backlog index: could not list %s: %s", folder, err)
            return
        self._delete(
            [
                info.path
                for info in listing
                if info.path not in named and _segment_epoch(info.path) < self._epoch
            ]
        )

    def _delete(self, paths: list[str]) -> None:
        if not paths:
            return
        try:
            failures = self._store.delete_many(paths)
        except StorageError as err:
            logger.warning("backlog index: could not delete %s segments: %s", len(paths), err)
            return
        for failure in failures:
            logger.warning("backlog index: could not delete %s: %s", failure.path, failure.reason)
