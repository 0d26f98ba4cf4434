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
  it is in the sink) and the ``segments`` in sequence order, each ``{path, first, last}``;
* ``segments/{first}-{last}-e{epoch}`` — immutable, in the manifest's wire format (the entries
  with their own sequences, contiguous; the footer's epoch is the writer's).

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
in the index by then, and one gone from both was consumed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from millpond.common.clock import Clock, SystemClock
from millpond.common.retry import RetryPolicy
from millpond.errors import (
    CommitStateUnknownError,
    ConflictError,
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
    PendingEntry,
    decode_manifest,
    encode_entry,
)
from millpond.queue.claim import internal_path
from millpond.storage.store import ObjectStore

__all__ = [
    "BacklogIndex",
    "IndexHead",
    "Segment",
    "decode_head",
    "encode_segment",
    "head_path",
    "queue_view",
    "read_indexed",
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

    def encode(self) -> bytes:
        return json.dumps(
            {
                "format": _FORMAT,
                "version": _VERSION,
                "epoch": self.epoch,
                "dequeued_through": self.dequeued_through,
                "segments": [
                    {"path": s.path, "first": s.first, "last": s.last} for s in self.segments
                ],
            },
            separators=(",", ":"),
        ).encode()


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
            segments=tuple(
                Segment(str(s["path"]), int(s["first"]), int(s["last"])) for s in record["segments"]
            ),
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


def _load(store: ObjectStore, head: IndexHead) -> list[ManifestEntry]:
    """The entries past ``dequeued_through``, in order. Raises NotFoundError for a segment
    drained since the head was read."""
    out: list[ManifestEntry] = []
    for segment in head.segments:
        manifest = decode_manifest(store.get(segment.path).data, name=segment.path)
        out.extend(e for e in manifest.entries if e.sequence > head.dequeued_through)
    return out


def read_indexed(
    store: ObjectStore, data_path_prefix: str
) -> tuple[IndexHead | None, list[ManifestEntry]]:
    """The head and the live indexed entries (for GC and status; no fencing).

    Raises:
        FormatError: the head or a segment is corrupt.
        StorageError: the store failed, or segments kept vanishing under the read.
    """
    path = head_path(data_path_prefix)
    for _ in range(_READ_ATTEMPTS):
        try:
            got = store.get(path)
        except NotFoundError:
            return None, []
        head = decode_head(got.data, name=f"{store.url}/{path}")
        try:
            return head, _load(store, head)
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

    def claim(self) -> list[ManifestEntry]:
        """Take the head over for this epoch; returns the entries it holds, in order.

        When there is no head, an empty one carrying this epoch is created: an older
        consumer that passed its epoch check just before the takeover and is about to create
        the head for its first move (``put_if_absent``) then finds it taken and is fenced,
        instead of landing a head nobody would rewrite (a consumer with the index off never
        writes it again, and GC and ``status`` would take its entries for the queue's
        oldest). Segments no head names (left by a move that lost its head write) are
        deleted.

        Raises:
            FencedError: the head carries a newer epoch.
            FormatError: the head or a segment is corrupt.
            StorageError: the store failed past the retry budget.
        """
        self._update(
            lambda head: IndexHead(
                epoch=self._epoch,
                dequeued_through=head.dequeued_through,
                segments=head.segments,
            ),
            create=True,
            read_first=True,
        )
        if self._head is None or self._head.blank:
            return []
        self._delete_orphans()
        for _ in range(_READ_ATTEMPTS):
            try:
                return _load(self._store, self._head)
            except NotFoundError:
                self._read()  # cannot happen once claimed, but never trust a stale head
        raise StorageError(f"{self._store.url}/{self._path}: a segment named by the head is gone")

    def add(self, entries: Sequence[ManifestEntry], *, dequeued_through: int) -> None:
        """Move ``entries`` (contiguous, past the index's end) in; raise ``dequeued_through``.

        Raises:
            FencedError: a newer consumer owns the head.
            StorageError: the store failed past the retry budget (the entries are still in the
                manifest; the index may or may not hold them).
            MillpondError: the entries are not contiguous, or would leave a gap after (or
                overlap part of) what the index holds; the head is not written.
        """
        if not entries:
            return
        first, last = entries[0].sequence, entries[-1].sequence
        if last - first + 1 != len(entries):
            raise MillpondError(f"{self._path}: entries {first}..{last} are not contiguous")
        segment = Segment(_segment_path(self._prefix, first, last, self._epoch), first, last)
        backoff = self._retry.start(self._clock)
        while True:
            try:
                self._store.put(segment.path, encode_segment(entries, self._epoch))
                break
            except StorageError as err:
                if not backoff.sleep():
                    raise StorageError(
                        f"{segment.path}: index segment write failed: {err}"
                    ) from err

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
                segments = (*segments, segment)
            return IndexHead(
                epoch=self._epoch,
                dequeued_through=through,
                segments=tuple(s for s in segments if s.last > through),
            )

        self._update(transform, create=True)

    def drain(self, through: int) -> None:
        """Mark every sequence up to ``through`` as in the sink; drop drained segments.

        Raises:
            FencedError, StorageError: as :meth:`add`.
        """
        if self._head is None or through <= self._head.dequeued_through:
            return

        def transform(head: IndexHead) -> IndexHead:
            d = max(head.dequeued_through, min(through, head.end))
            return IndexHead(
                epoch=self._epoch,
                dequeued_through=d,
                segments=tuple(s for s in head.segments if s.last > d),
            )

        self._update(transform, create=False)

    # -- internals -------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            got = self._store.get(self._path)
        except NotFoundError:
            self._head, self._etag = None, None
            return
        self._head = decode_head(got.data, name=f"{self._store.url}/{self._path}")
        self._etag = got.etag

    def _update(
        self,
        transform: Callable[[IndexHead], IndexHead],
        *,
        create: bool,
        read_first: bool = False,
    ) -> None:
        """Check the epoch, transform, CAS; re-read on a lost race. Only this consumer
        writes the head once it has claimed it, so the head it last wrote is tried first."""
        backoff = self._retry.start(self._clock)
        stale = read_first or (self._head is not None and self._etag is None)
        while True:
            try:
                if stale:
                    self._read()
                    stale = False
                current = self._head
                if current is None and not create:
                    return
                self._check_epoch(current)
                new = transform(current if current is not None else IndexHead(epoch=self._epoch))
                if new == current:
                    return
                etag = self._write(current, new)
            except (ConflictError, CommitStateUnknownError) as err:
                stale = True  # someone else's write, or our own that landed: look again
                if not backoff.sleep(conflict=isinstance(err, ConflictError)):
                    raise StorageError(f"{self._path}: index write gave up: {err}") from err
                continue
            except FencedError:
                raise
            except StorageError as err:
                stale = True
                if not backoff.sleep():
                    raise StorageError(f"{self._path}: index write gave up: {err}") from err
                continue
            self._head, self._etag = new, etag  # no ETag: the next write reads first
            if current is not None:
                kept = {segment.path for segment in new.segments}
                self._delete([s.path for s in current.segments if s.path not in kept])
            return

    def _check_epoch(self, current: IndexHead | None) -> None:
        if current is not None and current.epoch > self._epoch:
            raise FencedError(
                f"{self._store.url}/{self._path}: fenced: this consumer holds epoch "
                f"{self._epoch}, the backlog index has epoch {current.epoch}",
                expected_epoch=self._epoch,
                found_epoch=current.epoch,
            )

    def _write(self, current: IndexHead | None, new: IndexHead) -> str | None:
        if current is None:
            return self._store.put_if_absent(self._path, new.encode())
        if self._etag is None:
            raise StorageError(f"{self._path}: the store returned no ETag; cannot compare-and-swap")
        return self._store.put_if_match(self._path, new.encode(), self._etag)

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
