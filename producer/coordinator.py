"""Appending through ``millpond coordinator``, and directly whenever it cannot help.

:class:`CoordinatedAppender` has the contract of :meth:`QueueProducer.append
<millpond.queue.append.QueueProducer.append>`: it returns once every entry is provably in the
queue, and raises ``CommitStateUnknownError`` saying what is known when it cannot tell. It sends
the entries to the first coordinator that answers (:mod:`millpond.queue.coordinator`, which
appends many writers' entries in one compare-and-swap per round) and falls back to the
producer's own compare-and-swap:

* **unreachable** (the connection could not be made): nothing was sent; append directly, and
  leave that coordinator alone for ``retry_after`` seconds;
* **not a coordinator of this queue** (asked with ``GET /v1/health`` before the first append
  and after every time it was down: something else answers there, a coordinator of another
  queue, or one whose rounds died): nothing is sent; append directly, and ask again in a
  minute;
* **refused** (overloaded, stopping, another queue): nothing of the request was or will be
  written; append directly;
* **unknown** (the coordinator's own write may or may not have landed): the coordinator sends
  no more writes for the request; what it knows is kept, and the direct append starts with the
  landed-check (:func:`~millpond.queue.landed.resolve_landing`) for the rest — never a new
  location, never a second entry for one that landed;
* **no reply** (the connection broke after the request was sent): ask the coordinator what
  became of the request (a request it never saw is then refused for good). When it cannot be
  asked, wait until the coordinator's promise has run out — no write containing a request is
  sent later than ``budget`` seconds after it arrived; ``grace`` covers its way there — and
  then do the landed-check as above. Only a write already in flight can land after that, and
  it carries the ETag it was read at: it lands before the check's read, or makes the direct
  compare-and-swap fail and be looked at again, or never lands. A request that arrives later
  than the grace allowed cannot double anything either: the coordinator writes only on a
  manifest it read or wrote itself, and drops entries it finds there from the client's
  ``X-Millpond-From`` on (``present_from`` of ``QueueProducer.append``). Nor can it lose
  anything: the request carries the append's deadline as a wall-clock time
  (``X-Millpond-Not-After``), and the coordinator writes nothing of it after that time and
  refuses it unwritten if it arrives later, when its batches may have been collected.

The lower bound the landed-check starts from is the highest ``next_sequence`` this writer has
seen before sending: the request cannot have landed below it.
"""

from __future__ import annotations

import http.client
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from millpond.common.clock import Clock
from millpond.common.metrics import Counters
from millpond.errors import CommitStateUnknownError, FormatError, StorageError
from millpond.formats.manifest import PendingEntry
from millpond.queue.append import QueueProducer
from millpond.queue.coordinator import (
    APPENDED,
    DEFAULT_BUDGET,
    REFUSED,
    UNKNOWN,
    Outcome,
    encode_entries,
)
from millpond.queue.coordinator_http import (
    APPEND_PATH,
    BUDGET_HEADER,
    FROM_HEADER,
    HEALTH_PATH,
    NOT_AFTER_HEADER,
    OUTCOME_PATH,
    QUEUE_HEADER,
    REQUEST_HEADER,
    parse_coordinator_urls,
)

__all__ = ["CoordinatedAppender", "CoordinatorOptions", "parse_coordinator_urls"]

logger = logging.getLogger(__name__)

_SENT = "sent"
_UNSENT = "unsent"
_LOST = "lost"
_RECHECK = 60.0  # seconds before asking again a URL where no coordinator of the queue answered


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorOptions:
    """How a producer talks to its coordinators."""

    budget: float = DEFAULT_BUDGET
    """Seconds after a request arrives during which a coordinator may write it. Default 2."""
    grace: float = 3.0
    """Seconds added to ``budget`` for the request's way to the coordinator before a writer
    that got no reply and cannot ask appends directly. Default 3. (Should a request take longer
    than that to arrive, the coordinator still never appends a location twice: a round that
    reads the manifest drops the entries it finds there.)"""
    connect_timeout: float = 1.0
    """Seconds to open a connection. Default 1."""
    retry_after: float = 5.0
    """Seconds a coordinator that could not be reached, or refused, is left alone. Default 5."""


class _Endpoint:
    """One coordinator: a keep-alive connection, and when to try it again."""

    def __init__(self, url: str, options: CoordinatorOptions) -> None:
        parts = urlsplit(url)
        assert parts.hostname is not None
        assert parts.port is not None
        self.url = url
        self._host = parts.hostname
        self._port = parts.port
        self._options = options
        self._conn: http.client.HTTPConnection | None = None
        self.down_until = float("-inf")
        self.identified = False
        """A live coordinator of the queue answered here since the endpoint was last down."""

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connect(self) -> http.client.HTTPConnection | None:
        if self._conn is not None and self._conn.sock is not None:
            return self._conn
        self.close()
        conn = http.client.HTTPConnection(
            self._host, self._port, timeout=self._options.connect_timeout
        )
        try:
            conn.connect()
        except OSError:
            conn.close()
            return None
        assert conn.sock is not None
        # A reply later than the coordinator's promise plus the grace is lost: ask instead.
        conn.sock.settimeout(self._options.budget + self._options.grace)
        self._conn = conn
        return conn

    def connected(self) -> bool:
        """Whether a keep-alive connection is open (the next request reuses it)."""
        return self._conn is not None and self._conn.sock is not None

    def mark_down(self, until: float) -> None:
        """Leave this coordinator alone until ``until``; ask who answers before using it again."""
        self.down_until = until
        self.identified = False

    def identify(self, queue: str) -> tuple[str, str | None]:
        """Ask ``GET /v1/health`` whether a live coordinator of ``queue`` answers here:
        ``(kind, why not)`` with ``kind`` as :meth:`call` gives it, ``why not`` None when
        one does. Nothing is appended by asking."""
        # A coordinator answers this at once (no round is waited for): one that does not in
        # the time a connection may take is frozen or swamped, and the appends go directly.
        kind, status, data = self._exchange(
            "GET", HEALTH_PATH, timeout=self._options.connect_timeout
        )
        if kind != _SENT:
            return kind, None if kind == _UNSENT else f"gave no answer to GET {HEALTH_PATH}"
        return _SENT, _not_serving(status, data, queue)

    def call(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[str, Outcome | None]:
        """``(kind, outcome)``: ``unsent`` (no connection), ``lost`` (sent, no usable reply)
        or ``sent`` with the outcome."""
        kind, _, data = self._exchange("POST", path, body, headers)
        if kind != _SENT:
            return kind, None
        try:
            return _SENT, Outcome.from_json(data)
        except FormatError:
            self.close()
            return _LOST, None

    def _exchange(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        *,
        timeout: float | None = None,
    ) -> tuple[str, int, bytes]:
        """One request on the keep-alive connection: ``(kind, status, body)``. ``timeout``
        replaces the reply timeout (the coordinator's promise plus the grace) for it alone."""
        conn = self._connect()
        if conn is None:
            return _UNSENT, 0, b""
        reply_timeout = self._options.budget + self._options.grace
        if timeout is not None and conn.sock is not None:
            conn.sock.settimeout(timeout)
        try:
            conn.request(method, path, body, headers or {})
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException):
            self.close()
            return _LOST, 0, b""
        if response.will_close:
            self.close()
        elif timeout is not None and conn.sock is not None:
            conn.sock.settimeout(reply_timeout)
        return _SENT, response.status, data


class CoordinatedAppender:
    """Appends through coordinators when they answer, directly otherwise (module docstring)."""

    def __init__(
        self,
        direct: QueueProducer,
        urls: Sequence[str],
        *,
        queue: str,
        clock: Clock,
        options: CoordinatorOptions | None = None,
    ) -> None:
        self._direct = direct
        self._queue = queue
        self._clock = clock
        self._options = options or CoordinatorOptions()
        self._endpoints = [_Endpoint(url, self._options) for url in urls]
        self._seen_next = 0

    @property
    def counters(self) -> Counters:
        return self._direct.counters

    @property
    def seen_next_sequence(self) -> int:
        return max(self._seen_next, self._direct.seen_next_sequence)

    def close(self) -> None:
        for endpoint in self._endpoints:
            endpoint.close()

    def in_doubt_from(self, sequence: int) -> None:
        self._direct.in_doubt_from(sequence)

    def append(
        self,
        entries: Sequence[PendingEntry],
        *,
        more: Callable[[], Sequence[PendingEntry]] | None = None,
        deadline: float | None = None,
    ) -> tuple[int, ...]:
        """Append ``entries`` in order; the contract of ``QueueProducer.append``.

        ``more`` is used by the direct appends only: a coordinator round loses no race.
        ``deadline`` (on this appender's clock): no write of these entries is sent after it,
        by this producer or by a coordinator on its behalf. A request to a coordinator whose
        promise (``budget`` plus ``grace``) would outlast it is not made: the entries go
        directly.

        Raises:
            InvalidInputError, FormatError, MillpondError: as ``QueueProducer.append``.
            CommitStateUnknownError: not known whether (all of) it landed; what is known is in
                ``sequences``.
            StorageError: nothing landed and the store failed past the retry budget.
        """
        lower = self.seen_next_sequence
        body: bytes | None = None
        for endpoint in self._endpoints:
            now = self._clock.monotonic()
            if now < endpoint.down_until:
                continue
            if not self._may_send(deadline):
                break  # a coordinator could write them after the deadline
            if not endpoint.identified and not self._identify(endpoint):
                continue
            if body is None:
                body = encode_entries(entries)
            outcome = self._through(endpoint, body, lower, deadline)
            if outcome is None:
                # No reply, nobody to ask, the coordinator's promise has run out: look first.
                self.counters.add("coordinator_lost")
                return self._direct.append(
                    entries,
                    maybe_landed_from=lower,
                    present_from=lower,
                    more=more,
                    deadline=deadline,
                )
            if outcome.status == APPENDED and (
                len(outcome.sequences) != len(entries) or None in outcome.sequences
            ):
                outcome = Outcome(UNKNOWN, reason=f"a reply that does not fit: {outcome}")
            if outcome.status == APPENDED:
                self.counters.add("coordinator_appends")
                if outcome.next_sequence is not None:
                    self._seen_next = max(self._seen_next, outcome.next_sequence)
                return tuple(s for s in outcome.sequences if s is not None)
            if outcome.status == REFUSED:
                self.counters.add("coordinator_refused")
                endpoint.mark_down(self._clock.monotonic() + self._options.retry_after)
                logger.info("coordinator %s refused an append: %s", endpoint.url, outcome.reason)
                continue
            self.counters.add("coordinator_unknown")
            return self._after_unknown(entries, outcome, lower, deadline)
        self.counters.add("direct_appends")
        # A refused request was never written; were a coordinator's write still in flight, it
        # carries an older ETag, and a manifest read since is searched for the entries anyway.
        return self._direct.append(entries, present_from=lower, more=more, deadline=deadline)

    def _identify(self, endpoint: _Endpoint) -> bool:
        """Whether a live coordinator of the queue answers at ``endpoint``; else it is left
        alone for a while (counted as a refusal) and the entries go elsewhere.

        Asked before the first append and after every time the endpoint was down: a URL
        where something else answers (a wrong port, another service) would otherwise take an
        append, give no usable reply, and hold it for the coordinator's whole promise before
        the landed-check, again after every ``retry_after``."""
        kind, why_not = endpoint.identify(self._queue)
        if kind == _SENT and why_not is None:
            endpoint.identified = True
            return True
        self.counters.add("coordinator_refused")
        pause = (
            self._options.retry_after if kind != _SENT else max(_RECHECK, self._options.retry_after)
        )
        endpoint.mark_down(self._clock.monotonic() + pause)
        logger.warning(
            "coordinator %s %s; appending directly, asking again in %g s",
            endpoint.url,
            "unreachable" if kind == _UNSENT else why_not,
            pause,
        )
        return False

    def _may_send(self, deadline: float | None) -> bool:
        """Whether a coordinator's promise for a request sent now ends before ``deadline``."""
        options = self._options
        return deadline is None or (
            self._clock.monotonic() + options.budget + options.grace < deadline
        )

    def _through(
        self,
        endpoint: _Endpoint,
        body: bytes,
        lower: int,
        deadline: float | None,
        *,
        again: bool = True,
    ) -> Outcome | None:
        """Send one request; its outcome, ``REFUSED`` when it was never sent, or ``None``
        when nobody could say (after waiting out the coordinator's promise)."""
        reused = endpoint.connected()
        request_id = uuid.uuid4().hex
        sent_at = self._clock.monotonic()
        headers = {
            QUEUE_HEADER: self._queue,
            REQUEST_HEADER: request_id,
            BUDGET_HEADER: f"{self._options.budget:g}",
            FROM_HEADER: str(lower),
            "Content-Type": "application/octet-stream",
        }
        if deadline is not None:
            # The deadline on the wall clock too: a request held up on its way past it is
            # refused on arrival, not written after our batches may have been collected.
            not_after = self._clock.now_ms() + int((deadline - sent_at) * 1000)
            headers[NOT_AFTER_HEADER] = str(not_after)
        kind, outcome = endpoint.call(APPEND_PATH, body, headers)
        if kind == _UNSENT:
            endpoint.mark_down(self._clock.monotonic() + self._options.retry_after)
            logger.warning(
                "coordinator %s unreachable; appending directly for %g s",
                endpoint.url,
                self._options.retry_after,
            )
            return Outcome(REFUSED, reason="unreachable")
        if kind == _SENT:
            return outcome
        # Sent, no reply: ask (a request the coordinator never saw is refused for good then).
        promise = sent_at + self._options.budget + self._options.grace
        ask = {REQUEST_HEADER: request_id, "Content-Length": "0"}
        while self._clock.monotonic() < promise:
            kind, outcome = endpoint.call(OUTCOME_PATH, b"", ask)
            if kind == _SENT and outcome is not None:
                if reused and again and outcome.status == REFUSED and self._may_send(deadline):
                    # Sent on a keep-alive connection the coordinator had closed (idle past its
                    # two minutes, or restarted): it never arrived, and that request id is now
                    # refused for good. Once more, as a new request on a fresh connection.
                    logger.info(
                        "coordinator %s: request lost on a closed connection (%s); sending it "
                        "again",
                        endpoint.url,
                        outcome.reason,
                    )
                    return self._through(endpoint, body, lower, deadline, again=False)
                logger.info("coordinator %s: lost reply recovered (%s)", endpoint.url, outcome)
                return outcome
            self._clock.sleep(min(0.2, max(0.0, promise - self._clock.monotonic())))
        endpoint.mark_down(self._clock.monotonic() + self._options.retry_after)
        logger.warning(
            "coordinator %s did not answer for an append (no reply, and no answer since); "
            "checking the manifest before appending directly",
            endpoint.url,
        )
        return None

    def _after_unknown(
        self,
        entries: Sequence[PendingEntry],
        outcome: Outcome,
        lower: int,
        deadline: float | None,
    ) -> tuple[int, ...]:
        known: list[int | None] = list(outcome.sequences) or [None] * len(entries)
        if len(known) != len(entries):
            known = [None] * len(entries)
        rest = [i for i, sequence in enumerate(known) if sequence is None]
        if not rest:
            return tuple(s for s in known if s is not None)
        start = max(lower, outcome.maybe_landed_from or 0)
        logger.warning(
            "coordinator append of %s entries may or may not have landed (%s); checking the "
            "manifest for %s of them",
            len(entries),
            outcome.reason,
            len(rest),
        )
        try:
            found = self._direct.append(
                [entries[i] for i in rest],
                maybe_landed_from=start,
                present_from=lower,
                deadline=deadline,
            )
        except CommitStateUnknownError as err:
            inner = err.sequences or (None,) * len(rest)
            for index, sequence in zip(rest, inner, strict=True):
                known[index] = sequence
            raise CommitStateUnknownError(
                str(err), sequences=tuple(known), maybe_landed_from=err.maybe_landed_from
            ) from err
        except StorageError as err:
            if len(rest) == len(entries):
                raise
            # A prefix is known to be in; the rest provably is not: say so.
            raise CommitStateUnknownError(
                str(err), sequences=tuple(known), maybe_landed_from=start
            ) from err
        for index, sequence in zip(rest, found, strict=True):
            known[index] = sequence
        return tuple(s for s in known if s is not None)


def _not_serving(status: int, data: bytes, queue: str) -> str | None:
    """Why a ``GET /v1/health`` reply is not a live coordinator of ``queue`` (None: it is)."""
    try:
        health = json.loads(data)
    except ValueError:
        health = None
    if status != 200 or not isinstance(health, dict) or "queue" not in health:
        return f"is not a millpond coordinator (GET {HEALTH_PATH}: HTTP {status}, {data[:60]!r})"
    if health["queue"] != queue:
        return f"serves {health['queue']!r}, not {queue!r}"
    if health.get("alive") is not True:
        return "has stopped appending (its rounds died)"
    return None
