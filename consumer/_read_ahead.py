"""The consumer's read-ahead (:class:`ReadAhead`): batch objects fetched and decoded on a thread
pool ahead of delivery, handed out strictly in sequence order; and how many
(:class:`ReadAheadWindow`): a window that grows with the store's latency, within a memory budget.

A fixed read-ahead caps the consumer at ``read_ahead`` objects per store round trip: 4 objects
per 50 ms GET is 80 objects/s, however fast the database is. The window therefore starts at
``read_ahead`` and doubles, up to ``read_ahead_max``, each time the fetches, not the caller,
were the bottleneck:

* a delivery has to wait for an object that was already being fetched when the previous
  delivery returned (a fetch that was only started by the waiting call — a queue that was
  idle, the first delivery — says nothing about the window);
* a caller that takes several batches at once (``next_batches(limit)``) gets fewer than it
  asked for while the next one is still being fetched.

A caller that takes what is queued, all of it fetched, does not grow it: a trickle of batches
on an idle queue keeps the window where it started.

Memory. The objects in the window are held decoded until they are delivered, so the window
never holds more than about ``read_ahead_bytes``: its size is capped at that budget over the
average decoded size of the batches delivered so far (never below ``read_ahead``, which the
caller asked for explicitly).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from millpond.common.metrics import Counters, LatencySummary
from millpond.common.ulids import parse_batch_name
from millpond.consumer._batch import ConsumedBatch
from millpond.consumer._config import ConsumerConfig
from millpond.errors import (
    BatchNotFoundError,
    CorruptBatchError,
    FormatError,
    MillpondError,
    NotFoundError,
)
from millpond.formats.batch import decode_batch
from millpond.formats.manifest import ManifestEntry
from millpond.queue import QueueCursor
from millpond.storage.store import ObjectStore

__all__ = ["ReadAhead", "ReadAheadWindow"]

# Weight of the newest batch in the running average of batch sizes: a few batches move it, one
# odd batch does not.
_SIZE_WEIGHT = 0.2


class ReadAheadWindow:
    """The number of batch objects to keep in flight ahead of delivery.

    Not thread-safe: the consumer calls it under its lock.
    """

    def __init__(self, *, least: int, most: int, max_bytes: int) -> None:
        """``least``: the configured ``read_ahead``; ``most``: ``read_ahead_max`` (taken as
        ``least`` when below it); ``max_bytes``: ``read_ahead_bytes``."""
        self._least = least
        self._most = max(least, most)
        self._max_bytes = max_bytes
        self._size = least
        self._batch_bytes: float | None = None

    @property
    def most(self) -> int:
        """The largest the window can become (threads the fetch pool needs)."""
        return self._most

    @property
    def size(self) -> int:
        """Objects to keep in flight now: the grown size within the memory budget."""
        if self._batch_bytes is None or self._size <= self._least:
            return self._size
        fits = int(self._max_bytes // max(1.0, self._batch_bytes))
        return max(self._least, min(self._size, fits))

    def grow(self) -> None:
        """Fetch further ahead: a delivery waited for an object already in flight, or returned
        fewer batches than asked while more were in flight."""
        # Not past the memory budget: a window it caps would only grow on paper.
        if self._size < self._most and self.size == self._size:
            self._size = min(self._most, self._size * 2)

    def delivered(self, decoded_bytes: int) -> None:
        """Note one delivered batch's decoded size (the running average bounds the window)."""
        if self._batch_bytes is None:
            self._batch_bytes = float(decoded_bytes)
        else:
            self._batch_bytes += _SIZE_WEIGHT * (decoded_bytes - self._batch_bytes)


class ReadAhead:
    """The entries not yet delivered, in sequence order: those still to be fetched, read from
    the queue a few at a time (:class:`~millpond.queue.QueueCursor`: an index segment or the
    manifest's bytes, never the whole backlog decoded), and the fetches in flight ahead of
    delivery (at most the window's size), on a thread pool.

    Not thread-safe: the consumer calls it under its lock.
    """

    def __init__(
        self,
        store: ObjectStore,
        config: ConsumerConfig,
        *,
        queue: str,
        counters: Counters,
        fetch_latency: LatencySummary,
    ) -> None:
        self._store = store
        self._config = config
        self._prefix = config.data_path_prefix.strip("/")
        self._queue = queue
        self._counters = counters
        self._fetch_latency = fetch_latency
        self._pool: ThreadPoolExecutor | None = None
        # The entries not yet submitted for fetching: the queue from the next one on.
        self._cursor = QueueCursor(store)
        # Submitted fetches, in sequence order; the head is delivered next.
        self._inflight: deque[tuple[ManifestEntry, Future[ConsumedBatch]]] = deque()
        self._window: ReadAheadWindow  # by start()
        # Fetches in flight when the last delivery returned: the head of the next delivery
        # was among them if any (a wait for it then means the window is too small).
        self._ahead_at_return = 0

    def start(self) -> None:
        """A fresh window and the fetch threads (after :meth:`reset`)."""
        config = self._config
        self._window = ReadAheadWindow(
            least=config.read_ahead, most=config.read_ahead_max, max_bytes=config.read_ahead_bytes
        )
        self._pool = ThreadPoolExecutor(self._window.most, thread_name_prefix="millpond-read")

    @property
    def cursor(self) -> QueueCursor:
        """Where the entries still to fetch come from: told of index moves and manifest
        reads."""
        return self._cursor

    @property
    def known(self) -> int:
        """The last sequence known to be in the queue."""
        return self._cursor.known

    @property
    def empty(self) -> bool:
        """Nothing is waiting or in flight."""
        return not self._cursor and not self._inflight

    @property
    def waiting(self) -> int:
        """Entries not yet submitted for fetching."""
        return len(self._cursor)

    def __len__(self) -> int:
        return len(self._inflight) + len(self._cursor)

    def held(self) -> int:
        """Entries held decoded: in flight, and read from the queue but not yet submitted
        (bounded by the window, whatever the backlog)."""
        return len(self._inflight) + self._cursor.decoded()

    def head(self) -> ManifestEntry | None:
        """The entry delivered next if it is read already, else ``None`` (no IO)."""
        if self._inflight:
            return self._inflight[0][0]
        return self._cursor.peek()

    def top_up(self) -> None:
        """Read the next entries from the queue (an index segment when they are there), submit
        them until the window is full, and keep a window's worth more read: deliveries refill
        the window from those, without IO, until the next call.

        Raises:
            NotFoundError, FormatError, StorageError, MillpondError: reading the queue failed
                (:meth:`QueueCursor.fill`); nothing delivered or submitted is lost.
        """
        size = self._window.size
        self._cursor.fill(max(0, 2 * size - len(self._inflight)))
        self.submit()

    def submit(self) -> None:
        """Submit entries already read until the window is full (no IO)."""
        pool = self._pool
        assert pool is not None
        while len(self._inflight) < self._window.size:
            taken = self._cursor.take(1)
            if not taken:
                return
            entry = taken[0]
            problem = self._location_problem(entry.location)
            if problem is None:
                future = pool.submit(self._fetch, entry)
            else:
                future = Future()
                future.set_exception(
                    CorruptBatchError(
                        f"{self._config.manifest_path}: sequence {entry.sequence}: location "
                        f"{entry.location!r} {problem}",
                        sequence=entry.sequence,
                        location=entry.location,
                        field="location",
                    )
                )
            self._inflight.append((entry, future))

    def deliver(self, limit: int) -> list[ConsumedBatch]:
        """The head of the read-ahead and what is fetched behind it, up to ``limit``.

        Raises:
            MillpondError: fetching the head failed; every submitted entry is put back to be
                fetched again, and the next call starts with the same entry.
        """
        batches: list[ConsumedBatch] = []
        while self._inflight and len(batches) < max(1, limit):
            _entry, future = self._inflight[0]
            if not _ready(future):
                if batches:
                    break
                if self._ahead_at_return:
                    self._window.grow()  # in flight since the last delivery, still not here
            try:
                batch = future.result()
            except MillpondError:
                if batches:
                    break  # the ones before it are delivered; it fails on the next call
                self._rewind()
                raise
            self._inflight.popleft()
            self._counters.add("batches")
            self._counters.add("entries", len(batch.entries))
            self._window.delivered(sum(map(len, batch.entries)))
            self.submit()  # what is read already: no IO between two deliveries
            batches.append(batch)
        if len(batches) < limit and self._inflight and not _ready(self._inflight[0][1]):
            # The caller wanted more than was fetched: fetch further ahead.
            self._window.grow()
        self._ahead_at_return = len(self._inflight)
        return batches

    def skip_head(self) -> ManifestEntry:
        """Drop the entry delivered next without delivering it (its batch cannot be read and
        the caller has recorded it elsewhere); returns it."""
        if self._inflight:
            entry, future = self._inflight.popleft()
            future.cancel()
        else:
            entry = self._cursor.take(1)[0]
        self.submit()
        return entry

    def has_ready(self) -> bool:
        """Whether the head is fetched and decoded (delivering it needs no IO)."""
        if not self._inflight:
            return False
        future = self._inflight[0][1]
        return _ready(future) and future.exception() is None

    def reset(self, after: int = -1) -> None:
        """Forget every entry and stop the fetch threads; the next entry is ``after + 1``."""
        self.close()
        self._cursor.reset(after)
        self._ahead_at_return = 0

    def close(self) -> None:
        """Cancel the fetches in flight and stop the fetch threads."""
        for _entry, future in self._inflight:
            future.cancel()
        self._inflight.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _rewind(self) -> None:
        """Put every submitted entry back in front of the waiting ones, to be fetched again."""
        for _entry, future in self._inflight:
            future.cancel()
        self._cursor.put_back(entry for entry, _future in self._inflight)
        self._inflight.clear()
        self._ahead_at_return = 0

    def _location_problem(self, location: str) -> str | None:
        parent, _, name = location.rpartition("/")
        if parent != self._prefix:
            return f"is outside the data prefix {self._prefix!r}"
        if parse_batch_name(name) is None:
            return "is not named {ULID}.batch"
        return None

    def _fetch(self, entry: ManifestEntry) -> ConsumedBatch:
        location = entry.location
        with self._fetch_latency.time():
            try:
                got = self._store.get(location)
            except NotFoundError as err:
                raise BatchNotFoundError(
                    f"{self._config.manifest_path}: sequence {entry.sequence}: batch object "
                    f"{location} is missing",
                    sequence=entry.sequence,
                    location=location,
                ) from err
            try:
                records = decode_batch(got.data, name=location)
            except FormatError as err:
                raise CorruptBatchError(
                    f"sequence {entry.sequence}: {err}",
                    sequence=entry.sequence,
                    location=location,
                    field=err.field,
                    offset=err.offset,
                ) from err
            self._counters.add("bytes", len(got.data))
            return ConsumedBatch(
                entries=tuple(records),
                sequence=entry.sequence,
                location=location,
                metadata=entry.metadata,
                queue=self._queue,
            )


def _ready(future: Future[ConsumedBatch]) -> bool:
    """Whether a fetch finished (successfully or not) without waiting for it."""
    return future.done() and not future.cancelled()
