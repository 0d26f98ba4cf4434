"""Talking to a coordinator: a producer's appends and a consumer's dequeues go through one while
it helps, and to the writer's own compare-and-swap whenever it cannot.

**Appends.** :class:`CoordinatedAppender` (producers and the Spark driver's commit) has the
contract of :meth:`QueueProducer.append <millpond.queue.append.QueueProducer.append>`: it
returns once every entry is provably in the queue, and raises ``CommitStateUnknownError``
saying what is known when it cannot tell. It sends the entries to the first coordinator that
answers (:mod:`millpond.coordinator.rounds`, which
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
  sent later than ``budget`` seconds after it arrived; ``grace`` covers its way there — and then
  do the landed-check as above. Only a write already in flight can land after that, and it
  carries the ETag it was read at: it lands before the check's read, or makes the direct
  compare-and-swap fail and be looked at again, or never lands. A coordinator known to be gone —
  a host coordinator whose process let go of its lock (``gone``) — starts no write any more, so
  its promise is not waited out: the landed-check runs at once. A request that arrives later
  than the grace allowed cannot double anything either: the coordinator writes only on a
  manifest it read or wrote itself, and drops entries it finds there from the client's
  ``X-Millpond-From`` on (``present_from`` of ``QueueProducer.append``). Nor can it lose
  anything: the request carries the append's deadline as a wall-clock time
  (``X-Millpond-Not-After``), and the coordinator writes nothing of it after that time and
  refuses it unwritten if it arrives later, when its batches may have been collected.

The lower bound the landed-check starts from is the highest ``next_sequence`` this writer has
seen before sending: the request cannot have landed below it.

**Chaining.** A producer has one append out at a time, and the batches uploaded while it is out
used to wait for its reply, then for the round under way, then for their own: at 50 ms a
request and 16 producers that was the largest part of a batch's wait after its upload. While
the reply is awaited, the batches uploaded meanwhile (``more``) are sent at once on a second
connection, as a request that must follow the one out (``X-Millpond-After``): the coordinator
appends them behind it, in its round or the next, and refuses them unwritten unless it was
appended. So the order of a producer's batches holds whatever happens: if the first request
was refused, its fate is unknown, or its reply is lost, the chained one was never written
without it, and both are recovered together as one append (the refused part is appended
afterwards, the rest looked for first, as above).

**Dequeues.** :class:`CoordinatedDequeue` sends a consumer's dequeues to a coordinator
(``ConsumerConfig.coordinator``; why: :mod:`millpond.coordinator.rounds`, Dequeues). A dequeue
is idempotent, so every answer but ``dequeued`` leaves it to the consumer's own
compare-and-swap, which also decides what a ``fenced`` answer means (its read raises
``FencedError``). A coordinator that did not answer, or did not take the consumer's token (a
setting to fix, not a moment to wait out), is left alone for a minute, one that refused for
another reason for a few seconds, each time with a warning naming it.

Before its takeover the consumer asks the coordinator for a pause (:meth:`make_way`): its epoch
bump is a read and then a write of its own, which a coordinator appending back to back would
otherwise keep out until one of its quiet pauses — every 10 s while a consumer dequeues through
it (:mod:`millpond.coordinator.rounds`). Nothing depends on the answer: without one the
takeover races the rounds as it would without a coordinator.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from functools import partial

from millpond.common.clock import Clock
from millpond.common.metrics import Counters
from millpond.coordinator.connection import (
    FORBIDDEN,
    LOST,
    SENT,
    UNSENT,
    CoordinatorOptions,
    Endpoint,
    send_dequeue,
    send_make_way,
)
from millpond.coordinator.wire import (
    AFTER_HEADER,
    APPEND_PATH,
    APPENDED,
    BUDGET_HEADER,
    CLEAR,
    DEQUEUED,
    FENCED,
    FROM_HEADER,
    NOT_AFTER_HEADER,
    OUTCOME_PATH,
    QUEUE_HEADER,
    REFUSED,
    REQUEST_HEADER,
    UNKNOWN,
    Outcome,
    encode_entries,
    token_from_env,
)
from millpond.errors import CommitStateUnknownError, StorageError
from millpond.formats.manifest import PendingEntry
from millpond.queue.append import QueueProducer
from millpond.queue.landed import Landings

__all__ = ["CoordinatedAppender", "CoordinatedDequeue"]

logger = logging.getLogger(__name__)

_RECHECK = 60.0  # seconds before asking again a URL where no coordinator of the queue answered
_TIMEOUT = 5.0  # seconds: the coordinator answers after at most a pause, a round and a write
_AFTER_LOST = 60.0  # seconds a coordinator that did not answer, or took no token, is left alone
_AFTER_REFUSED = 5.0  # seconds a coordinator that refused is left alone


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
        gone: Callable[[], bool] | None = None,
    ) -> None:
        """Set up; nothing is sent until the first append.

        Args:
            direct: appends directly, whenever no coordinator takes an append.
            urls: the coordinators, tried in order.
            queue: the queue's identity (a coordinator of another queue is not used).
            clock: time source.
            options: how to talk to the coordinators (default: ``CoordinatorOptions()`` with
                the token in :data:`~millpond.coordinator.wire.TOKEN_ENV`, if set).
            gone: whether the coordinators can start no write any more (their process is
                dead or closed): asked while a lost reply cannot be asked about, so the
                coordinator's promise is not waited out for nothing.

        Raises:
            ConfigError: that token has a character an HTTP header cannot carry.
        """
        self._direct = direct
        self._queue = queue
        self._clock = clock
        self._options = options or CoordinatorOptions(token=token_from_env())
        self._endpoints = [Endpoint(url, self._options) for url in urls]
        self._seen_next = 0
        self._gone = gone

    @property
    def counters(self) -> Counters:
        return self._direct.counters

    @property
    def seen_next_sequence(self) -> int:
        return max(self._seen_next, self._direct.seen_next_sequence)

    def close(self) -> None:
        for endpoint in self._endpoints:
            endpoint.close()

    def landings(self, *, recovered: bool = False) -> Landings:
        return self._direct.landings(recovered=recovered)

    def append(
        self,
        entries: Sequence[PendingEntry],
        *,
        more: Callable[[], Sequence[PendingEntry]] | None = None,
        deadline: float | None = None,
        in_doubt_from: int | None = None,
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
        self._direct.in_doubt_from(in_doubt_from)
        lower = self.seen_next_sequence
        body: bytes | None = None
        for endpoint in self._endpoints:
            if self._clock.monotonic() < endpoint.down_until:
                continue
            if not self._may_send(deadline):
                break  # a coordinator could write them after the deadline
            if not endpoint.identified and not self._identify(endpoint):
                continue
            if body is None:
                body = encode_entries(entries)
            chain = Chain(endpoint.spare(), more) if more and self._options.chain else None
            outcome = self._through(endpoint, body, lower, deadline, chain=chain)
            if chain is not None and chain.entries:
                return self._with_chain(endpoint, entries, outcome, chain, lower, deadline, more)
            if outcome is None:
                # No reply, nobody to ask, the coordinator's promise has run out: look first.
                return self._direct_append(entries, lower, more, deadline, lost=True)
            outcome = fitting(outcome, len(entries))
            assert outcome is not None
            if outcome.status == APPENDED:
                self.counters.add("coordinator_appends")
                return self._appended(outcome)
            if outcome.status == REFUSED:
                self._refused(endpoint)
                logger.info("coordinator %s refused an append: %s", endpoint.url, outcome.reason)
                continue
            self.counters.add("coordinator_unknown")
            return self._after_unknown(entries, outcome, lower, deadline)
        # A refused request was never written; were a coordinator's write still in flight, it
        # carries an older ETag, and a manifest read since is searched for the entries anyway.
        return self._direct_append(entries, lower, more, deadline)

    def _direct_append(
        self,
        entries: Sequence[PendingEntry],
        lower: int,
        more: Callable[[], Sequence[PendingEntry]] | None,
        deadline: float | None,
        *,
        lost: bool = False,
    ) -> tuple[int, ...]:
        """Append directly what no coordinator took (entries it finds from ``lower`` on count
        as in); ``lost``: what no coordinator could say anything of, looked for first from
        ``lower`` on."""
        self.counters.add("coordinator_lost" if lost else "direct_appends")
        return self._direct.append(
            entries,
            maybe_landed_from=lower if lost else None,
            present_from=lower,
            more=more,
            deadline=deadline,
        )

    def _refused(self, endpoint: Endpoint) -> None:
        """Leave a coordinator that refused an append alone for ``retry_after`` seconds."""
        self.counters.add("coordinator_refused")
        endpoint.mark_down(self._clock.monotonic() + self._options.retry_after)

    def _identify(self, endpoint: Endpoint) -> bool:
        """Whether a live coordinator of the queue answers at ``endpoint``; else it is left
        alone for a while (counted as a refusal) and the entries go elsewhere.

        Asked before the first append and after every time the endpoint was down: a URL
        where something else answers (a wrong port, another service) would otherwise take an
        append, give no usable reply, and hold it for the coordinator's whole promise before
        the landed-check, again after every ``retry_after``."""
        kind, why_not = endpoint.identify(self._queue)
        if kind == SENT and why_not is None:
            endpoint.identified = True
            return True
        self.counters.add("coordinator_refused")
        pause = (
            self._options.retry_after if kind != SENT else max(_RECHECK, self._options.retry_after)
        )
        endpoint.mark_down(self._clock.monotonic() + pause)
        logger.warning(
            "coordinator %s %s; appending directly, asking again in %g s",
            endpoint.url,
            "unreachable" if kind == UNSENT else why_not,
            pause,
        )
        return False

    def _may_send(self, deadline: float | None) -> bool:
        """Whether a coordinator's promise for a request sent now ends before ``deadline``."""
        return deadline is None or self._clock.monotonic() + self._options.promise < deadline

    def _through(
        self,
        endpoint: Endpoint,
        body: bytes,
        lower: int,
        deadline: float | None,
        *,
        again: bool = True,
        chain: Chain | None = None,
    ) -> Outcome | None:
        """Send one request; its outcome, ``REFUSED`` when it was never sent, or ``None``
        when nobody could say (after waiting out the coordinator's promise). While its reply
        is awaited, ``chain`` sends the batches uploaded meanwhile to follow it."""
        reused = endpoint.connected()
        request_id = uuid.uuid4().hex
        sent_at = self._clock.monotonic()
        headers = self._headers(request_id, lower, deadline, sent_at)
        while_waiting = None
        if chain is not None and not chain.sent:
            may_send = partial(self._may_send, deadline)
            while_waiting = partial(chain.poll, self._clock, may_send, request_id, headers)
        kind, outcome = endpoint.call(APPEND_PATH, body, headers, while_waiting=while_waiting)
        if kind == UNSENT:
            endpoint.mark_down(self._clock.monotonic() + self._options.retry_after)
            logger.warning(
                "coordinator %s unreachable; appending directly for %g s",
                endpoint.url,
                self._options.retry_after,
            )
            return Outcome(REFUSED, reason="unreachable")
        if kind == SENT:
            return outcome
        # Sent, no reply: ask (a request the coordinator never saw is refused for good then).
        outcome = self._ask(endpoint, request_id, sent_at)
        if outcome is not None:
            if reused and again and outcome.status == REFUSED and self._may_send(deadline):
                # Sent on a keep-alive connection the coordinator had closed (idle past its
                # two minutes, or restarted): it never arrived, and that request id is now
                # refused for good. Once more, as a new request on a fresh connection.
                logger.info(
                    "coordinator %s: request lost on a closed connection (%s); sending it again",
                    endpoint.url,
                    outcome.reason,
                )
                return self._through(endpoint, body, lower, deadline, again=False, chain=chain)
            logger.info("coordinator %s: lost reply recovered (%s)", endpoint.url, outcome)
            return outcome
        endpoint.mark_down(self._clock.monotonic() + self._options.retry_after)
        logger.warning(
            "coordinator %s did not answer for an append (no reply, and no answer since); "
            "checking the manifest before appending directly",
            endpoint.url,
        )
        return None

    def _headers(
        self, request_id: str, lower: int, deadline: float | None, sent_at: float
    ) -> dict[str, str]:
        """The headers of an append request sent at ``sent_at`` (on this appender's clock)."""
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
        return headers

    def _ask(self, endpoint: Endpoint, request_id: str, sent_at: float) -> Outcome | None:
        """What became of a request whose reply was lost, or ``None`` when the coordinator
        could not say before its promise for the request ran out."""
        promise = sent_at + self._options.promise
        ask = {REQUEST_HEADER: request_id, "Content-Length": "0"}
        while self._clock.monotonic() < promise:
            kind, outcome = endpoint.call(OUTCOME_PATH, b"", ask)
            if kind == SENT and outcome is not None:
                return outcome
            if self._gone is not None and self._gone():
                logger.info(
                    "coordinator %s is gone (its host let go of the lock): looking in the "
                    "manifest now, not after its promise",
                    endpoint.url,
                )
                return None
            self._clock.sleep(min(0.2, max(0.0, promise - self._clock.monotonic())))
        return None

    def _with_chain(
        self,
        endpoint: Endpoint,
        entries: Sequence[PendingEntry],
        first: Outcome | None,
        chain: Chain,
        lower: int,
        deadline: float | None,
        more: Callable[[], Sequence[PendingEntry]] | None,
    ) -> tuple[int, ...]:
        """Settle a request and the one chained behind it as one append of both (module
        docstring, Chaining)."""
        self.counters.add("coordinator_chained")
        second = chain.resolve(self._ask)
        first = fitting(first, len(entries))
        second = fitting(second, len(chain.entries))
        if first is not None and first.status == APPENDED:
            self.counters.add("coordinator_appends")
            head = self._appended(first)
            return head + self._behind(head, chain.entries, second, lower, deadline)
        # The first is not known to be in, so the second was never written without it.
        both = [*entries, *chain.entries]
        if first is None or (second is None and first.status == REFUSED):
            return self._direct_append(both, lower, more, deadline, lost=True)
        if first.status == REFUSED and second is not None and second.status == REFUSED:
            self._refused(endpoint)
            return self._direct_append(both, lower, more, deadline)
        self.counters.add("coordinator_unknown")
        sequences = known(first, len(entries)) + known(second, len(chain.entries))
        landed_from = first.maybe_landed_from if first.status == UNKNOWN else None
        return self._after_unknown(
            both,
            Outcome(UNKNOWN, sequences, maybe_landed_from=landed_from, reason=first.reason),
            lower,
            deadline,
        )

    def _behind(
        self,
        head: tuple[int, ...],
        entries: Sequence[PendingEntry],
        second: Outcome | None,
        lower: int,
        deadline: float | None,
    ) -> tuple[int, ...]:
        """The sequences of a chained request's ``entries``, whose outcome was ``second``,
        once the request ahead of it is in at ``head``.

        Raises:
            CommitStateUnknownError: not known whether (all of) them landed; ``sequences``
                covers both requests, ``head`` first.
        """
        if second is not None and second.status == APPENDED:
            return self._appended(second)
        # The first is in; the second follows it now, as an append of its own.
        try:
            if second is not None and second.status == REFUSED:
                return self.append(entries, deadline=deadline)
            self.counters.add("coordinator_unknown")
            return self._after_unknown(entries, second or Outcome(UNKNOWN), lower, deadline)
        except CommitStateUnknownError as err:
            behind = err.sequences or (None,) * len(entries)
            raise CommitStateUnknownError(
                str(err),
                sequences=head + tuple(behind),
                maybe_landed_from=err.maybe_landed_from,
            ) from err
        except StorageError as err:
            raise CommitStateUnknownError(
                str(err),
                sequences=head + (None,) * len(entries),
                maybe_landed_from=self.seen_next_sequence,
            ) from err

    def _appended(self, outcome: Outcome) -> tuple[int, ...]:
        """The sequences of an ``appended`` outcome (noting how far the queue has come)."""
        if outcome.next_sequence is not None:
            self._seen_next = max(self._seen_next, outcome.next_sequence)
        return tuple(s for s in outcome.sequences if s is not None)

    def _after_unknown(
        self,
        entries: Sequence[PendingEntry],
        outcome: Outcome,
        lower: int,
        deadline: float | None,
    ) -> tuple[int, ...]:
        sequences = list(known(outcome, len(entries)))
        rest = [i for i, sequence in enumerate(sequences) if sequence is None]
        if not rest:
            return tuple(s for s in sequences if s is not None)
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
                sequences[index] = sequence
            raise CommitStateUnknownError(
                str(err), sequences=tuple(sequences), maybe_landed_from=err.maybe_landed_from
            ) from err
        except StorageError as err:
            if len(rest) == len(entries):
                raise
            # A prefix is known to be in; the rest provably is not: say so.
            raise CommitStateUnknownError(
                str(err), sequences=tuple(sequences), maybe_landed_from=start
            ) from err
        for index, sequence in zip(rest, found, strict=True):
            sequences[index] = sequence
        return tuple(s for s in sequences if s is not None)


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


class CoordinatedDequeue:
    """Sends dequeues to one coordinator while it answers."""

    def __init__(
        self, url: str, queue: str, counters: Counters, clock: Clock, *, token: str | None = None
    ) -> None:
        """``token``: sent with every request to a coordinator that wants one
        (:data:`~millpond.coordinator.wire.TOKEN_ENV`)."""
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
