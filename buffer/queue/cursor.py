"""The queue in sequence order, read a little at a time: what the consumer delivers next.

A day-long backlog is a million entries: 82 MB in the manifest's wire format, about half a
gigabyte decoded. The consumer never needs more than the next few: :class:`QueueCursor` hands
them out in order from the backlog index's segments (one segment's bytes held at a time,
each entry decoded as it is taken) and then from the manifest's bytes as last read (the same
bytes the consumer keeps for its next dequeue), past what the index holds. Counts come from
sequences, which are contiguous, not from decoded entries.

The index and the manifest stay contiguous together (:mod:`millpond.queue.index`), so the
cursor's sequences are: the index's, from past ``dequeued_through`` to its end, then the
manifest's past that. An entry in both (a move that has not finished) is taken once, from the
index. Not thread-safe: the consumer calls it under its lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from millpond.errors import MillpondError
from millpond.formats.manifest import ManifestEntry, ManifestView
from millpond.queue.index import IndexHead, read_segment
from millpond.storage.store import ObjectStore

__all__ = ["QueueCursor"]


class QueueCursor:
    """Entries from a position on, in sequence order, decoded a few at a time."""

    def __init__(self, store: ObjectStore) -> None:
        self._store = store
        self._head: IndexHead | None = None
        self._manifest: ManifestView | None = None
        self._known = -1  # the last sequence the index or a manifest read showed
        self._next = 0  # the first sequence not decoded yet
        self._source: Iterator[ManifestEntry] | None = None
        self._source_last = -1  # the last sequence _source yields
        self._source_is_manifest = False
        # Decoded, not yet taken; entries put back first (a fetch to do again).
        self._ready: deque[ManifestEntry] = deque()
        self.reads = 0
        """Index segments read so far: a caller that checks the epoch after reading sees
        whether a read came after its check."""

    def reset(self, after: int) -> None:
        """Forget everything; the next entry handed out is ``after + 1``."""
        self._head = None
        self._manifest = None
        self._known = after
        self._next = after + 1
        self._drop_source()
        self._ready.clear()

    @property
    def known(self) -> int:
        """The last sequence known to be in the queue (the index's or the manifest's as last
        read; ``after`` of :meth:`reset` when none is)."""
        return self._known

    def __len__(self) -> int:
        """Entries known and not taken (decoded or not)."""
        return len(self._ready) + max(0, self._known - self._next + 1)

    def index_changed(self, head: IndexHead | None) -> None:
        """The index head as the consumer last claimed or wrote it. When a move took entries
        the cursor was reading from the manifest's bytes into the index, it reads them from
        the index from now on (the manifest's bytes it held can go)."""
        self._head = head
        if head is not None and head.segments:
            self._known = max(self._known, head.segments[-1].last)
        if self._source_is_manifest and head is not None and head.end >= self._next:
            self._drop_source()
        manifest = self._manifest
        if manifest is not None and head is not None and manifest.next_sequence - 1 <= head.end:
            self._manifest = None  # it holds nothing past the index: let its bytes go

    def manifest_read(self, manifest: ManifestView) -> None:
        """The manifest as last read: entries past the index's end and past what is known are
        new. Entries it no longer holds before ``known`` were taken into the index or
        dequeued: neither changes what the cursor hands out."""
        self._manifest = manifest
        if manifest.next_sequence - 1 > self._known:
            self._known = manifest.next_sequence - 1
        if self._source_is_manifest:
            self._drop_source()  # read the newer bytes from where it was

    def peek(self) -> ManifestEntry | None:
        """The next entry if it is decoded already (no IO), else ``None``."""
        return self._ready[0] if self._ready else None

    def decoded(self) -> int:
        """Entries decoded and not taken (:meth:`take` hands them out without IO)."""
        return len(self._ready)

    def fill(self, count: int) -> None:
        """Decode entries until ``count`` are ready or none is left: reads a segment of the
        index when the next entries are there.

        Raises:
            NotFoundError: a segment the head names is gone.
            FormatError: a segment or the manifest does not decode.
            StorageError: the store failed.
            MillpondError: the next sequence is neither in the index nor in the manifest.
        """
        while len(self._ready) < count and self._next <= self._known:
            source = self._source or self._open(self._next)
            entry = next(source, None)
            if entry is None:
                self._drop_source()
                if self._next <= self._source_last:
                    raise MillpondError(
                        f"queue: sequence {self._next} is missing from where the queue says it is"
                    )
                continue
            if entry.sequence < self._next:
                continue  # the manifest's copy of an entry taken from the index
            if entry.sequence != self._next:
                raise MillpondError(
                    f"queue: expected sequence {self._next}, found {entry.sequence}"
                )
            self._ready.append(entry)
            self._next += 1

    def take(self, count: int) -> list[ManifestEntry]:
        """Up to ``count`` decoded entries, in order (no IO)."""
        taken: list[ManifestEntry] = []
        while self._ready and len(taken) < count:
            taken.append(self._ready.popleft())
        return taken

    def put_back(self, entries: Iterable[ManifestEntry]) -> None:
        """Entries taken and not used (fetches to do again), in order, before the rest."""
        self._ready.extendleft(reversed(list(entries)))

    def _open(self, sequence: int) -> Iterator[ManifestEntry]:
        """A source of entries from ``sequence``: its index segment, else the manifest."""
        head = self._head
        segment = head.segment_of(sequence) if head is not None else None
        if segment is not None:
            self.reads += 1
            self._source = read_segment(self._store, segment).entries_from(sequence)
            self._source_last, self._source_is_manifest = segment.last, False
            return self._source
        manifest = self._manifest
        first = manifest.first_sequence if manifest is not None else None
        if manifest is None or first is None or not first <= sequence < manifest.next_sequence:
            raise MillpondError(
                f"queue: sequence {sequence} is neither in the backlog index nor in the "
                "manifest as last read"
            )
        self._source = manifest.entries_from(sequence)
        self._source_last, self._source_is_manifest = manifest.next_sequence - 1, True
        return self._source

    def _drop_source(self) -> None:
        self._source = None
        self._source_last = -1
        self._source_is_manifest = False
