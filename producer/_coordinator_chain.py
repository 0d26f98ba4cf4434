"""A chained request: the batches a producer uploads while its append is out at a coordinator,
sent at once to follow it (:mod:`millpond.producer.coordinator`, Chaining)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

from millpond.common.clock import Clock
from millpond.formats.manifest import PendingEntry
from millpond.producer._coordinator_endpoint import SENT, UNSENT, Endpoint
from millpond.queue.coordinator import APPENDED, REFUSED, UNKNOWN, Outcome, encode_entries
from millpond.queue.coordinator_http import AFTER_HEADER, APPEND_PATH, REQUEST_HEADER

__all__ = ["Chain", "fitting", "known"]


class Chain:
    """The batches uploaded while a request is out, sent to follow it (module docstring,
    Chaining): at most one chained request per append."""

    def __init__(self, endpoint: Endpoint, more: Callable[[], Sequence[PendingEntry]]) -> None:
        self._endpoint = endpoint
        self._more = more
        self.entries: list[PendingEntry] = []
        self.sent = False
        self._request_id = ""
        self._sent_at = 0.0
        self._kind = UNSENT

    def poll(
        self, clock: Clock, may_send: Callable[[], bool], after: str, headers: dict[str, str]
    ) -> bool:
        """Send what was uploaded since the request ``after`` went out, if anything; ``True``
        once sent, or once ``may_send()`` says a request sent now could be written after the
        append's deadline (nothing more to do while the reply is awaited)."""
        if self.sent or not may_send():
            return True
        entries = list(self._more())
        if not entries:
            return False
        self.entries, self.sent = entries, True
        self._request_id = uuid.uuid4().hex
        self._sent_at = clock.monotonic()
        chained = {**headers, REQUEST_HEADER: self._request_id, AFTER_HEADER: after}
        self._kind = self._endpoint.send(APPEND_PATH, encode_entries(entries), chained)
        return True

    def resolve(self, ask: Callable[[Endpoint, str, float], Outcome | None]) -> Outcome | None:
        """What became of the chained request (``None``: nobody could say); a lost reply is
        asked for with ``ask(endpoint, request_id, sent_at)``."""
        if self._kind == UNSENT:
            return Outcome(REFUSED, reason="not sent: no connection")
        if self._kind == SENT:
            kind, outcome = self._endpoint.receive()
            if kind == SENT and outcome is not None:
                return outcome
        return ask(self._endpoint, self._request_id, self._sent_at)


def fitting(outcome: Outcome | None, count: int) -> Outcome | None:
    """An ``appended`` reply whose sequences do not fit the request is taken as ``unknown``."""
    if (
        outcome is not None
        and outcome.status == APPENDED
        and (len(outcome.sequences) != count or None in outcome.sequences)
    ):
        return Outcome(UNKNOWN, reason=f"a reply that does not fit: {outcome}")
    return outcome


def known(outcome: Outcome | None, count: int) -> tuple[int | None, ...]:
    """Per entry, its sequence as far as ``outcome`` knows it."""
    if outcome is None or len(outcome.sequences) != count:
        return (None,) * count
    return tuple(outcome.sequences)
