"""How many batch objects the consumer fetches ahead of delivery: a window that grows with the
store's latency, within a memory budget.

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

__all__ = ["ReadAheadWindow"]

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

    def starved(self) -> None:
        """A delivery waited for an object that was already in flight: fetch further ahead."""
        self._grow()

    def short(self) -> None:
        """A delivery returned fewer batches than asked while more were in flight."""
        self._grow()

    def _grow(self) -> None:
        # Not past the memory budget: a window it caps would only grow on paper.
        if self._size < self._most and self.size == self._size:
            self._size = min(self._most, self._size * 2)

    def delivered(self, decoded_bytes: int) -> None:
        """Note one delivered batch's decoded size (the running average bounds the window)."""
        if self._batch_bytes is None:
            self._batch_bytes = float(decoded_bytes)
        else:
            self._batch_bytes += _SIZE_WEIGHT * (decoded_bytes - self._batch_bytes)
