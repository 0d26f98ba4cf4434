"""Moving the backlog out of the manifest into the consumer's own index (issue 11).

While the sink is behind, every append and dequeue rewrites the whole manifest, so a backlog
in it slows every producer. With ``backlog_index`` on, once the manifest holds
``backlog_index_threshold`` entries this consumer has read, they move into the backlog index
(:mod:`millpond.queue.index`), fenced by the consumer's epoch; it drains the index first.

The index first, the manifest after: a crash between the two writes leaves the entries in
both, which every reader takes once and the next ``initialize()`` tidies up; a manifest write
that failed here is retried before anything else moves. Moving is only an optimisation: a move
that fails leaves the entries queued in the manifest and says so.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

from millpond.common.metrics import Counters
from millpond.consumer._config import ConsumerConfig
from millpond.errors import FencedError, MillpondError
from millpond.queue import BacklogIndex, IndexHead, QueueConsumer

__all__ = ["IndexMover"]

logger = logging.getLogger(__name__)


class IndexMover:
    """One consumer's moves into its backlog index; called under the consumer's lock."""

    def __init__(
        self,
        queue: QueueConsumer,
        config: ConsumerConfig,
        counters: Counters,
        *,
        guard: Callable[[Callable[[], Any]], Any],
        dequeued: Callable[[int], None],
    ) -> None:
        """Move for one consumer.

        Args:
            queue: the consumer's queue (its dequeues take the moved entries out).
            config: ``backlog_index`` and ``backlog_index_threshold`` decide when to move.
            counters: ``index_moves`` counts the moves.
            guard: runs a queue operation as the consumer's own (fencing is remembered).
            dequeued: told the sequence the consumer's acked entries are dequeued through
                once a move took them out with it.
        """
        self._queue = queue
        self._config = config
        self._counters = counters
        self._guard = guard
        self._dequeued = dequeued
        self.moved: Callable[[IndexHead | None], None] = lambda _head: None
        """Told the index head once a move wrote it (the read-ahead reads the moved entries
        from the index from then on)."""
        self.unfinished = False
        """Entries were moved into the index and are not out of the manifest yet."""

    def maybe_move(self, index: BacklogIndex, *, acked: int, dequeued: int, known: int) -> None:
        """Finish a move whose manifest write failed, then move what the manifest holds past
        ``dequeued`` through ``known`` (the last sequence read) once it holds too much.

        Raises:
            FencedError: another consumer took over; anything else is logged and left.
        """
        start = max(index.end, dequeued) + 1
        config = self._config
        try:
            if self.unfinished:
                # The manifest write of an earlier move failed: the entries are in both.
                self._guard(lambda: self._queue.dequeue(index.end))
                self.unfinished = False
            if config.backlog_index and known - start + 1 >= config.backlog_index_threshold:
                self._move(index, start, known, acked=acked, dequeued=dequeued)
        except FencedError:
            raise
        except MillpondError as err:
            # Only an optimisation: the entries are still queued in the manifest.
            logger.warning(
                "moving entries %s..%s into the backlog index failed: %s", start, known, err
            )

    def _move(
        self, index: BacklogIndex, start: int, end: int, *, acked: int, dequeued: int
    ) -> None:
        manifest = self._guard(self._queue.read_view)
        first = max(start, acked + 1)
        if manifest.first_sequence is None or end < first:
            return
        # Read from the manifest's bytes one entry at a time, written a segment at a time:
        # a long manifest (a consumer started on a day's backlog) is never held decoded.
        to_index = itertools.takewhile(
            lambda entry: entry.sequence <= end, manifest.entries_from(first)
        )
        # The index first, the manifest after (module doc).
        self._guard(
            lambda: index.add(
                to_index,
                dequeued_through=acked,
                segment_entries=segment_size(end - first + 1, self._config),
            )
        )
        self.moved(index.head)
        if acked > dequeued:
            self._dequeued(acked)
        self.unfinished = True
        self._guard(lambda: self._queue.dequeue(end))
        self.unfinished = False
        self._counters.add("index_moves")
        logger.info("moved entries %s..%s into the backlog index", first, end)


def segment_size(entries: int, config: ConsumerConfig) -> int:
    """Entries per segment when ``entries`` move at once: as even as can be, each between
    ``backlog_index_threshold`` and twice that (one segment when fewer move): the consumer
    holds one segment's bytes at a time."""
    threshold = config.backlog_index_threshold
    segments = max(1, entries // threshold)
    return -(-entries // segments)
