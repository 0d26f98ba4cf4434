"""The consumer's dequeues sent through a ``millpond coordinator`` (``ConsumerConfig.coordinator``).

Why: :mod:`millpond.queue.coordinator_dequeue`. A dequeue is idempotent, so every answer but
``dequeued`` leaves it to the consumer's own compare-and-swap, which also decides what a
``fenced`` answer means (its read raises ``FencedError``). A coordinator that did not answer,
or did not take the consumer's token (a setting to fix, not a moment to wait out), is left
alone for a minute, one that refused for another reason for a few seconds, each time with a
warning naming it.

Before its takeover the consumer asks the coordinator for a pause (:meth:`make_way`): its epoch
bump is a read and then a write of its own, which a coordinator appending back to back would
otherwise keep out until one of its quiet pauses — every 10 s while a consumer dequeues through
it (:mod:`millpond.queue.coordinator`). Nothing depends on the answer: without one the
takeover races the rounds as it would without a coordinator.
"""

from __future__ import annotations

import logging

from millpond.common.clock import Clock
from millpond.common.metrics import Counters
from millpond.queue.coordinator_dequeue import (
    CLEAR,
    DEQUEUED,
    FENCED,
    FORBIDDEN,
    LOST,
    send_dequeue,
    send_make_way,
)

__all__ = ["CoordinatedDequeue"]

logger = logging.getLogger(__name__)

_TIMEOUT = 5.0  # seconds: the coordinator answers after at most a pause, a round and a write
_AFTER_LOST = 60.0  # seconds a coordinator that did not answer, or took no token, is left alone
_AFTER_REFUSED = 5.0  # seconds a coordinator that refused is left alone


class CoordinatedDequeue:
    """Sends dequeues to one coordinator while it answers."""

    def __init__(
        self, url: str, queue: str, counters: Counters, clock: Clock, *, token: str | None = None
    ) -> None:
        """``token``: sent with every request to a coordinator that wants one
        (:data:`~millpond.queue.coordinator_http.TOKEN_ENV`)."""
        self.url = url
        self._queue = queue
        self._token = token
        self._counters = counters
        self._clock = clock
        self._down_until = float("-inf")

    def dequeue(self, epoch: int, through: int) -> bool:
        """Whether the coordinator removed every entry through ``through`` for the consumer
        holding ``epoch``; ``False``: the caller dequeues directly."""
        if self._clock.monotonic() < self._down_until:
            return False
        status, reason = send_dequeue(
            self.url, self._queue, epoch, through, timeout=_TIMEOUT, token=self._token
        )
        if status == DEQUEUED:
            self._counters.add("coordinator_dequeues")
            return True
        self._counters.add("coordinator_dequeue_fallbacks")
        if status != FENCED:
            self._leave_alone(f"did not dequeue through {through}", status, reason)
        return False

    def make_way(self) -> None:
        """Ask the coordinator to leave the manifest alone for a moment, from now: the
        consumer's epoch bump comes next."""
        if self._clock.monotonic() < self._down_until:
            return
        status, reason = send_make_way(self.url, self._queue, timeout=_TIMEOUT, token=self._token)
        if status != CLEAR:
            self._leave_alone("made no way for the takeover", status, reason)

    def _leave_alone(self, what: str, status: str, reason: str) -> None:
        pause = _AFTER_LOST if status in (LOST, FORBIDDEN) else _AFTER_REFUSED
        self._down_until = self._clock.monotonic() + pause
        logger.warning(
            "coordinator %s %s (%s: %s); dequeuing directly for the next %.0f s",
            self.url,
            what,
            status,
            reason,
            pause,
        )
