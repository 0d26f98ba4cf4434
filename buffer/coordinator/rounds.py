"""The append coordinator: many writers' entries in one compare-and-swap per round.

At 50 ms a request the manifest takes about 15-20 compare-and-swaps a second, whoever writes
them, and a writer that just won keeps its ETag and wins again while the others need a read
and a write to get in (issue 11). The RFC's alternative is a small stateless service that
writers send their entries to and that appends them for everybody, one CAS per round on its
cached ETag: :class:`AppendCoordinator` is that service's core (``millpond coordinator`` serves
it over HTTP, :mod:`millpond.coordinator.server`; producers, the Spark driver and consumers
reach it through :mod:`millpond.coordinator.client`).

No new durability promise. The coordinator keeps nothing on disk: a writer waits for the
reply, and a writer that gets none looks in the manifest itself (the landed-check of
:mod:`millpond.queue.landed`) before appending the *same* locations directly. What makes that
safe is one promise per request, kept on the coordinator's own clock: **no write containing a
request's entries is sent later than ``budget`` seconds after the request arrived.** A writer
that waited longer than that (plus a grace for the request's transit) knows that only a write
already in flight can still land, and a write in flight carries the ETag it was read at, so it
lands only if the manifest has not changed since — before the writer's own look, which then
finds it. A request that never got into a round is answered ``refused``: nothing of it was or
will be written, and the writer appends it directly at once.

Two looks keep a location from being appended twice when the writer's view and the
coordinator's cross: a round that reads the manifest drops the entries it finds there from the
request's ``lower`` bound on (its writer stopped waiting and appended them itself —
``present_from`` of ``QueueProducer.append``), and the coordinator remembers the locations it
appended in the last ``_REMEMBER`` seconds and answers a request for them with their sequences
instead of writing them again (a writer that restarted before its old request's round landed;
rounds on the cached ETag read nothing, so only this memory sees them).

Fencing. Rounds carry the footer's epoch forward unchanged (``append_entries``), like any
producer. A writer on its cached ETag wins every race against one that must read first, so
back-to-back rounds would starve the consumer's dequeue and epoch bump (a read, then a write):
now and then the coordinator leaves the manifest alone for ``yield_slots`` store requests'
time, long enough for a read and a write of someone else to land. How often depends on
whether anyone else writes. While another writer has landed a write within ``busy_seconds``
(a round lost its compare-and-swap), it pauses after every ``yield_every`` back-to-back rounds;
while nobody has, once every ``quiet_yield_interval`` seconds of back-to-back rounds — enough
for a consumer arriving to get its first write in (it retries a lost race at once), and after
that write the coordinator is in the busy mode. Every pause delays the requests waiting behind
it, so pausing only when someone needs it keeps their latency down.

A consumer that sends its dequeues here needs no pause for them, and asks for one before its
takeover (:meth:`AppendCoordinator.make_way`, ``POST /v1/make-way``): while a consumer has
dequeued through the coordinator within the last minute, the quiet pause comes only every
``consumer_yield_interval`` seconds — left for writers that do not know the coordinator (a
producer appending directly, an operator's tool), which get in within that long and then put
the coordinator in the busy mode. At 50 ms a request and 16 producers, no quiet pause took the
producers' ``wait()`` p99 from 3.6x and 3.3x a lone producer's p50 to 3.3x and 3.0x (two paired
runs of ``bench/bench_wait_latency.py``). The write the pause was made for is expected: the
next round loses its race to it without the coordinator counting another writer.

Dequeues (``POST /v1/dequeue``, :func:`write_dequeues`). A consumer dequeuing on its own
waits for one of the coordinator's pauses, and each of its dequeues puts the coordinator into
pausing every few rounds (Fencing, above), which holds up every producer's requests. At 50 ms a
request and 16 producers that took the producers' ``wait()`` p99 from about 3.3x to about 3.9x
a lone producer's p50. A consumer that sends its dequeues to the coordinator instead has them
written between two rounds, on the manifest the coordinator last wrote: one write, no race, no
pause.

Safe whatever happens to a request. A dequeue is idempotent (removing the entries through
``through`` a second time removes nothing), so a consumer whose request was lost, refused or
not answered in time simply dequeues directly. The epoch decides as it does for the consumer's
own write: entries are removed only from a manifest whose epoch is the requesting consumer's,
in a write conditional on those very bytes, so a consumer fenced meanwhile (a newer
``initialize()`` landed) gets ``fenced`` and nothing is written for it. So ``dequeued`` proves
what the consumer's own dequeue proves — that it held the epoch during the call: it is said
only after such a write landed, or after a read made for the request (never the cached bytes
alone) found the epoch and nothing left to remove.

Several coordinators may serve one queue: they contend like producers do, each with its own
clients' entries.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from millpond.common.clock import Clock, SystemClock
from millpond.common.durations import check_count, check_duration
from millpond.common.metrics import Counters
from millpond.common.retry import RetryPolicy
from millpond.common.tasks import BackgroundTask
from millpond.common.ulids import parse_batch_name
from millpond.coordinator.wire import (
    APPENDED,
    DEFAULT_BUDGET,
    DEQUEUED,
    FENCED,
    REFUSED,
    UNKNOWN,
    Outcome,
)
from millpond.errors import (
    CommitStateUnknownError,
    FencedError,
    InvalidInputError,
    MillpondError,
    StorageError,
)
from millpond.formats.manifest import PendingEntry, decode_footer, remove_through
from millpond.queue.append import QueueProducer
from millpond.storage.store import ObjectStore

__all__ = ["AppendCoordinator", "DequeueTicket", "write_dequeues"]

logger = logging.getLogger(__name__)

_MIN_BUDGET = 0.05  # a request with less time left is refused rather than tried
_REMEMBER = 120.0  # seconds an answered request's outcome is kept for an outcome query
_MAX_ROUND_ENTRIES = 10_000
_MAX_PENDING_ENTRIES = 200_000
_SLOT_SMOOTHING = 0.2
_CONSUMER_KNOWN = 60.0  # seconds after a consumer's dequeue here it counts as knowing us
_COUNTERS = (
    "requests",
    "rounds",
    "entries_appended",
    "refused",
    "late_requests",
    "unknown",
    "yields",
    "manifest_reads",
    "manifest_writes",
    "cas_conflicts",
    "cas_retries",
    "fence_checks",
    "dequeues",
    "ways_made",
    "chained_requests",
)


@dataclass(eq=False)
class _Ticket:
    """One request, from arrival to its outcome."""

    request_id: str
    entries: list[PendingEntry]
    deadline: float
    lower: int = 0
    """The lowest sequence the client may have appended these entries at itself."""
    done: threading.Event = field(default_factory=threading.Event)
    outcome: Outcome | None = None
    started: bool = False
    settled_at: float = 0.0
    after: _Ticket | None = None
    """The same writer's request these entries must follow (``X-Millpond-After``)."""


@dataclass(slots=True)
class DequeueTicket:
    """One dequeue request, from arrival to its answer."""

    epoch: int
    through: int
    done: threading.Event = field(default_factory=threading.Event)
    status: str = ""
    """:data:`DEQUEUED`, :data:`FENCED` or :data:`REFUSED` once ``done`` is set."""
    reason: str = ""

    def answer(self, status: str, reason: str = "") -> None:
        self.status, self.reason = status, reason
        self.done.set()


def write_dequeues(queue: QueueProducer, tickets: Sequence[DequeueTicket]) -> None:
    """Remove what ``tickets`` ask for in at most one write, then answer each.

    The write goes through the fenced-object primitive with the consumers' epoch check
    (:meth:`QueueProducer.rewrite`): a manifest read at another epoch than the newest among
    the tickets fences every ticket and writes nothing. Of the tickets holding the manifest's
    epoch, the highest ``through`` below ``next_sequence`` is removed; older tickets are
    fenced. Any failure of the store answers every ticket ``refused`` (their consumers
    dequeue directly; a write that landed anyway makes theirs a no-op).
    """
    epoch = max(ticket.epoch for ticket in tickets)
    seen: dict[str, int] = {"epoch": epoch}

    def check(data: bytes) -> None:
        found = decode_footer(data, name=queue.path).epoch
        if found != epoch:
            raise FencedError(
                f"{queue.path} has epoch {found}, the consumer holds {epoch}",
                expected_epoch=epoch,
                found_epoch=found,
            )

    def change(data: bytes) -> bytes | None:
        footer = decode_footer(data, name=queue.path)
        seen["epoch"], seen["next"] = footer.epoch, footer.next_sequence
        through = max(
            (t.through for t in tickets if t.epoch == footer.epoch and t.through < seen["next"]),
            default=None,
        )
        if through is None:
            return None
        out, removed = remove_through(data, through)
        return out if removed else None

    try:
        queue.rewrite(change, check=check, what="dequeue for a consumer")
    except FencedError as err:
        for ticket in tickets:
            ticket.answer(FENCED, str(err))
        return
    except MillpondError as err:
        for ticket in tickets:
            ticket.answer(REFUSED, f"the dequeue was not written: {err}")
        return
    # Each ticket is answered from the manifest its dequeue was written on (or found done on).
    found, next_sequence = seen["epoch"], seen["next"]
    for ticket in tickets:
        if ticket.epoch != found:
            ticket.answer(
                FENCED, f"{queue.path} has epoch {found}, the consumer holds {ticket.epoch}"
            )
        elif ticket.through >= next_sequence:
            ticket.answer(
                REFUSED, f"through {ticket.through} is not below next_sequence {next_sequence}"
            )
        else:
            ticket.answer(DEQUEUED)


@dataclass(eq=False)
class _Pauses:
    """When the round thread leaves the manifest alone (module docstring, Fencing).

    The pacing arguments of :class:`AppendCoordinator` (of the same names), checked, and what
    the round thread has seen of the store and of the other writers. Round thread only, but
    for ``consumer_seen_at``, which request threads set holding the coordinator's lock.

    Raises:
        ConfigError: a pacing value that is not a finite number (``yield_every`` an
            integer >= 1; the rest >= 0).
    """

    clock: Clock
    yield_every: int
    yield_slots: float
    quiet_yield_interval: float
    busy_seconds: float
    consumer_yield_interval: float
    slot: float = 0.05
    """Seconds one store request takes, as measured on uncontended rounds."""
    consumer_seen_at: float = float("-inf")  # when a consumer last sent a dequeue here
    _back_to_back: int = 0
    _last_round_end: float = float("-inf")
    _manifest_free_at: float = float("-inf")  # when the last pause (or idle gap) began
    _foreign_write_at: float = float("-inf")  # when a round last lost to another writer
    _way_made: bool = False  # a pause was made on request: the next lost race is expected

    def __post_init__(self) -> None:
        check_count("yield_every", self.yield_every)
        check_duration("yield_slots", self.yield_slots, allow_zero=True, unit="store requests")
        check_duration("quiet_yield_interval", self.quiet_yield_interval, allow_zero=True)
        check_duration("busy_seconds", self.busy_seconds, allow_zero=True)
        check_duration("consumer_yield_interval", self.consumer_yield_interval, allow_zero=True)

    def due(self) -> float | None:
        """Seconds to leave the manifest alone before the next round, or ``None`` when no pause
        is due (or the manifest was left alone anyway, until now)."""
        gap = self.yield_slots * self.slot
        now = self.clock.monotonic()
        idle = now - self._last_round_end
        if idle >= gap:  # the manifest was left alone anyway, until now
            due = True
        elif now - self._foreign_write_at < self.busy_seconds:
            due = self._back_to_back >= self.yield_every
        else:
            known = now - self.consumer_seen_at < _CONSUMER_KNOWN
            interval = self.consumer_yield_interval if known else self.quiet_yield_interval
            due = now - self._manifest_free_at >= interval
        if not due:
            return None
        self._back_to_back = 0
        self._manifest_free_at = now
        return gap - idle if idle < gap else None

    def made_way(self) -> float:
        """Note a pause made on request (:meth:`AppendCoordinator.make_way`), and its seconds:
        its writer's read and write fit in it after the answer's way there (one store request
        more than a quiet pause)."""
        self._back_to_back = 0
        self._manifest_free_at = self.clock.monotonic()
        self._way_made = True
        return self.yield_slots * self.slot + self.slot

    def wrote(self, lost: int) -> None:
        """After a write of the round thread: ``lost`` races mean someone else wrote meanwhile,
        except the one write a pause was made for (:meth:`AppendCoordinator.make_way`)."""
        if lost > (1 if self._way_made else 0):
            self._foreign_write_at = self.clock.monotonic()
        self._way_made = False
        self._back_to_back += 1
        self._last_round_end = self.clock.monotonic()

    def measured(self, sample: float) -> None:
        """One store request of an uncontended round took ``sample`` seconds."""
        if sample > 0:
            self.slot += _SLOT_SMOOTHING * (sample - self.slot)


class AppendCoordinator:
    """Appends its clients' entries to one queue manifest, one CAS per round.

    Thread-safe: :meth:`submit` and :meth:`outcome` are called from request threads, the
    rounds run on one thread (``millpond-coordinator``) started by :meth:`start`.

    Args:
        store: the queue's store.
        manifest_path: the queue manifest.
        data_path_prefix: where the queue's batch objects live; entries elsewhere are
            refused.
        queue: this queue's identity (:func:`~millpond.queue.claim.queue_identity`);
            requests naming another queue are refused.
        retry: backoff of a round's compare-and-swap (default: 2 s, then the round gives
            up; a round never outlives its requests' budget anyway).
        clock: time source.
        yield_every: back-to-back rounds after which the coordinator leaves the manifest
            alone for ``yield_slots`` store requests' time (fencing and dequeues get in),
            while another writer has written within ``busy_seconds``.
        yield_slots: see ``yield_every``.
        quiet_yield_interval: seconds of back-to-back rounds between two such pauses while
            nobody else has written within ``busy_seconds``. Default 3 (1 before
            2026-11-27): a writer the coordinator does not know about waits up to that
            long for its first write, then the pauses come every ``yield_every`` rounds.
            At 50 ms a request and 16 producers, p99 of ``wait()`` through
            ``millpond coordinator`` was 3.05x, 3.21x and 3.08x a lone producer's p50 at
            3 s, against 3.55x and 4.14x at 1 s (paired runs, the same hour).
        busy_seconds: how long after another writer's write landed the coordinator
            pauses every ``yield_every`` rounds.
        consumer_yield_interval: ``quiet_yield_interval`` while a consumer sends its
            dequeues here (it asks for a pause before its takeover: :meth:`make_way`).
        max_round_entries: entries in one round at most; the rest wait for the next.
        max_pending_entries: entries waiting at most; requests beyond are refused.

    Raises:
        ConfigError: a bad retry policy, or a pacing value that is not a finite number
            (``yield_every`` an integer >= 1; the rest >= 0).
    """

    def __init__(
        self,
        store: ObjectStore,
        manifest_path: str = "ingest/manifest",
        *,
        data_path_prefix: str = "ingest",
        queue: str = "",
        retry: RetryPolicy | None = None,
        clock: Clock | None = None,
        yield_every: int = 3,
        yield_slots: float = 1.5,
        quiet_yield_interval: float = 3.0,
        busy_seconds: float = 10.0,
        consumer_yield_interval: float = 10.0,
        max_round_entries: int = _MAX_ROUND_ENTRIES,
        max_pending_entries: int = _MAX_PENDING_ENTRIES,
    ) -> None:
        """Set up; nothing is read or written until the first round (the arguments: the class
        docstring)."""
        self._clock: Clock = clock or SystemClock()
        self._pauses = _Pauses(
            self._clock,
            yield_every=yield_every,
            yield_slots=yield_slots,
            quiet_yield_interval=quiet_yield_interval,
            busy_seconds=busy_seconds,
            consumer_yield_interval=consumer_yield_interval,
        )
        self.queue = queue
        self.manifest_path = manifest_path
        self._prefix = data_path_prefix.strip("/")
        self._policy = retry or RetryPolicy(max_attempts=1000, max_elapsed=DEFAULT_BUDGET)
        self.counters = Counters(*_COUNTERS)
        self._queue = QueueProducer(
            store, manifest_path, retry=self._policy, clock=self._clock, counters=self.counters
        )
        self._max_round = max_round_entries
        self._max_pending = max_pending_entries
        self._lock = threading.Condition()
        self._pending: deque[_Ticket] = deque()
        self._dequeues: list[DequeueTicket] = []
        self._pending_entries = 0
        self._tickets: dict[str, _Ticket] = {}
        self._stopping = False
        self.dead: BaseException | None = None
        """Set when the round thread died of something unexpected: nothing more is written."""
        self._task = BackgroundTask("millpond-coordinator", self._rounds, on_error=self._died)
        self._way_waiters: list[threading.Event] = []  # make_way() calls waiting for a pause
        self._round: list[_Ticket] = []
        self._recent: dict[str, int] = {}
        self._recent_at: deque[tuple[float, str]] = deque()

    @property
    def slot(self) -> float:
        """Seconds one store request takes, as measured on uncontended rounds."""
        return self._pauses.slot

    @slot.setter
    def slot(self, seconds: float) -> None:
        self._pauses.slot = seconds

    # -- requests -------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        entries: list[PendingEntry],
        budget: float = DEFAULT_BUDGET,
        lower: int = 0,
        *,
        not_after_ms: int | None = None,
        after: str | None = None,
    ) -> _Ticket:
        """Queue a request for the next round; the ticket's ``done`` is set with its outcome.

        A request id seen before returns the earlier ticket (a request is never appended twice
        under one id). ``lower`` is the highest ``next_sequence`` the client had seen when it
        sent the request: should it stop waiting and append the entries itself, they land at
        or after it, and a round that reads the manifest looks for them there first.
        ``not_after_ms`` is the client's own deadline on the wall clock: the budget ends there
        at the latest, and a request arriving after it is refused. A request held up on its way
        for longer than its writer's deadline allows (its batches may be collected by now) is
        then never written, whatever its transit took; the clocks need only agree within the
        slack between the queue's GC grace period and the writer's ``reupload_after``.

        ``after`` names an earlier request of the same writer, still out, that these entries
        must follow in the queue (the writer sent them while waiting for its reply): they go
        in the same round behind it or in a later one, and only if it was appended. Refused,
        never written, when that request is not here, or was not (or may not have been)
        appended: the writer then appends them itself once it knows the earlier one's fate.

        Raises:
            InvalidInputError: no entries, duplicate locations, or a location outside the
                data prefix (nothing is queued).
        """
        self._check_entries(entries)
        now = self._clock.monotonic()
        budget = self._budget(budget, not_after_ms)
        with self._lock:
            self._forget(now)
            known = self._tickets.get(request_id)
            if known is not None:
                return known
            ticket = _Ticket(request_id, entries, now + budget, max(0, lower))
            self._tickets[request_id] = ticket
            self.counters.add("requests")
            behind = None if after is None else self._tickets.get(after)
            if after is not None:
                self.counters.add("chained_requests")
            refusal = self._refusal(ticket, after, behind, budget)
            if refusal is not None:
                self._settle(ticket, Outcome(REFUSED, reason=refusal))
            else:
                if behind is not None and behind.outcome is None:
                    ticket.after = behind
                self._pending.append(ticket)
                self._pending_entries += len(entries)
                self._lock.notify_all()
            return ticket

    def _check_entries(self, entries: list[PendingEntry]) -> None:
        """Refuse a request's entries unless they are distinct batch locations of this queue.

        Raises:
            InvalidInputError: no entries, duplicate locations, or a location outside the
                data prefix.
        """
        if not entries:
            raise InvalidInputError("entries: expected at least one entry, found none")
        if len({e.location for e in entries}) != len(entries):
            raise InvalidInputError("entries: expected distinct locations, found duplicates")
        for entry in entries:
            parent, _, name = entry.location.rpartition("/")
            if parent != self._prefix or parse_batch_name(name) is None:
                raise InvalidInputError(
                    f"entries: expected {self._prefix}/{{ULID}}.batch locations, found "
                    f"{entry.location!r}"
                )

    def _budget(self, budget: float, not_after_ms: int | None) -> float:
        """Seconds a request has from now: its ``budget``, capped, ending at its writer's
        deadline on the wall clock at the latest (negative once that has passed)."""
        budget = min(budget, DEFAULT_BUDGET * 30)
        if not_after_ms is not None:
            budget = min(budget, (not_after_ms - self._clock.now_ms()) / 1000)
        return budget

    def _refusal(
        self, ticket: _Ticket, after: str | None, behind: _Ticket | None, budget: float
    ) -> str | None:
        """Why a request is refused on arrival, or ``None`` when it waits for a round
        (holding the lock; a late request is counted)."""
        if after is not None and (behind is None or _not_appended(behind)):
            why = "was not appended" if behind is not None else "is not here"
            return f"request {after} it follows {why}"
        if self._stopping or self.dead is not None:
            return "the coordinator is stopping"
        if budget < _MIN_BUDGET:
            self.counters.add("late_requests")
            return (
                f"arrived {-budget:.1f} s after its writer's deadline"
                if budget <= 0
                else f"arrived {budget:.2f} s before its writer's deadline: too late to write"
            )
        if self._pending_entries + len(ticket.entries) > self._max_pending:
            return f"{self._pending_entries} entries already waiting"
        return None

    def outcome(self, request_id: str, wait: float) -> Outcome | None:
        """The outcome of a request, for a client whose reply was lost.

        A request still waiting for its round is withdrawn (``refused``); one inside a round is
        waited for up to ``wait`` seconds (``None`` if still running), and is ``unknown`` when
        the rounds died under it (nothing more will be written for it); an id never seen is
        remembered as refused, so the request, should it still arrive, is never appended.
        """
        now = self._clock.monotonic()
        with self._lock:
            ticket = self._tickets.get(request_id)
            if ticket is None:
                ticket = _Ticket(request_id, [], now)
                self._tickets[request_id] = ticket
                self._settle(ticket, Outcome(REFUSED, reason="request never arrived"))
            elif not ticket.started and ticket.outcome is None:
                self._pending.remove(ticket)
                self._pending_entries -= len(ticket.entries)
                self._settle(ticket, Outcome(REFUSED, reason="withdrawn before its round"))
        ticket.done.wait(wait)
        with self._lock:
            if ticket.outcome is None and self.dead is not None:
                return Outcome(
                    UNKNOWN,
                    (None,) * len(ticket.entries),
                    reason=f"the coordinator's rounds stopped: {self.dead!r}",
                )
            return ticket.outcome

    def dequeue(self, epoch: int, through: int) -> DequeueTicket:
        """Queue a consumer's dequeue for the round thread; the ticket's ``done`` is set with
        its answer (:func:`write_dequeues`)."""
        ticket = DequeueTicket(epoch, through)
        with self._lock:
            if self._stopping or self.dead is not None:
                ticket.answer(REFUSED, "the coordinator is stopping")
            else:
                self._dequeues.append(ticket)
                self._pauses.consumer_seen_at = self._clock.monotonic()
                self._lock.notify_all()
        return ticket

    def make_way(self, wait: float) -> bool:
        """Leave the manifest alone for a moment, from the end of the round under way: a
        consumer asks before its takeover (an epoch bump, a read and then a write, which would
        otherwise wait for a quiet pause). ``True`` once the moment has begun, or the
        coordinator has stopped writing; ``False`` when it did not begin within ``wait``
        seconds."""
        event = threading.Event()
        with self._lock:
            if self._stopping or self.dead is not None:
                return True  # nothing more is written
            self._way_waiters.append(event)
            self._lock.notify_all()
        return event.wait(wait)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            waiting = self._pending_entries
        return {
            **self.counters.snapshot(),
            "waiting_entries": waiting,
            "slot_ms": round(self.slot * 1000, 1),
        }

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._task.start()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse what has not started, finish the round under way, stop."""
        with self._lock:
            self._stopping = True
            self._refuse_waiting("the coordinator is stopping")
        self._task.join(timeout)

    # -- rounds ---------------------------------------------------------------------------

    def _rounds(self) -> None:
        while (round_ := self._next_round()) is not None:
            self._write_dequeues()
            self._append(round_)

    def _died(self, err: BaseException) -> None:
        """The rounds crashed: the requests of the round get no reply (their clients ask, hear
        "unknown", and look in the manifest themselves); what had not started is refused, and
        so is every later request. No thread writes for them any more."""
        with self._lock:
            self.dead = err
            for ticket in self._round:
                ticket.done.set()
            self._refuse_waiting("the coordinator stopped")
        # Not raised again: nothing above this thread could handle it, and the request
        # threads report the death to every client.
        logger.error("coordinator of %s stopped", self.manifest_path, exc_info=err)

    def _next_round(self) -> list[_Ticket] | None:
        with self._lock:
            while not self._pending and not self._dequeues and not self._way_waiters:
                if self._stopping:
                    return None
                self._lock.wait()
        self._pace()
        now = self._clock.monotonic()
        with self._lock:
            round_: list[_Ticket] = []
            size = 0
            locations: set[str] = set()
            while self._pending and (
                not round_ or size + len(self._pending[0].entries) <= (self._max_round)
            ):
                if any(e.location in locations for e in self._pending[0].entries):
                    # The same batch twice (a producer that restarted): the later request waits
                    # for the next round, which finds it appended (one append cannot hold both).
                    break
                behind = self._pending[0].after
                if behind is not None and behind.outcome is None and not behind.started:
                    break  # cannot happen (it is ahead in the line, or settled): wait for it
                ticket = self._pending.popleft()
                self._pending_entries -= len(ticket.entries)
                if behind is not None and _not_appended(behind):
                    reason = f"request {behind.request_id} it follows was not appended"
                    self._settle(ticket, Outcome(REFUSED, reason=reason))
                    continue
                if ticket.deadline - now < _MIN_BUDGET:
                    self._settle(ticket, Outcome(REFUSED, reason="its budget ran out waiting"))
                    continue
                ticket.started = True
                round_.append(ticket)
                size += len(ticket.entries)
                locations.update(e.location for e in ticket.entries)
            self._round = round_
            return round_

    def _pace(self) -> None:
        """Leave the manifest alone for the pause :meth:`make_way` asked for, if any
        (:meth:`_Pauses.made_way`), else now and then (module docstring, Fencing)."""
        with self._lock:
            waiters, self._way_waiters = self._way_waiters, []
            for event in waiters:
                event.set()
        if waiters:
            self.counters.add("ways_made")
            self._clock.sleep(self._pauses.made_way())
            return
        pause = self._pauses.due()
        if pause is not None:
            self.counters.add("yields")
            self._clock.sleep(pause)

    def _refuse_waiting(self, reason: str) -> None:
        """Refuse every request and dequeue still waiting and answer every :meth:`make_way`
        (holding the lock): nothing more is written."""
        while self._pending:
            self._settle(self._pending.popleft(), Outcome(REFUSED, reason=reason))
        for ticket in self._dequeues:
            ticket.answer(REFUSED, reason)
        for event in self._way_waiters:
            event.set()
        self._dequeues, self._way_waiters, self._pending_entries = [], [], 0
        self._lock.notify_all()

    def _write_dequeues(self) -> None:
        """Write the consumers' waiting dequeues, if any, in one write of their own."""
        with self._lock:
            tickets, self._dequeues = self._dequeues, []
        if not tickets:
            return
        conflicts = self.counters.get("cas_conflicts")
        write_dequeues(self._queue, tickets)
        self.counters.add("dequeues", len(tickets))
        self._pauses.wrote(lost=self.counters.get("cas_conflicts") - conflicts)

    def _append(self, round_: list[_Ticket]) -> None:
        if not round_:
            return
        entries = [entry for ticket in round_ for entry in ticket.entries]
        # Entries this coordinator appended itself a moment ago (a producer that restarted
        # before its old request's round landed sends them again): their sequences, unwritten.
        # A round on the cached ETag never reads the manifest, so only this memory finds them.
        known: list[int | None] = [self._recent.get(entry.location) for entry in entries]
        todo = [i for i, sequence in enumerate(known) if sequence is None]
        before = self.counters.snapshot()
        outcomes = self._write_round(round_, entries, known, todo, before)
        self.counters.add("rounds")
        self._pauses.wrote(lost=self.counters.get("cas_conflicts") - before.get("cas_conflicts", 0))
        with self._lock:
            for ticket, outcome in zip(round_, outcomes, strict=True):
                self._settle(ticket, outcome)

    def _write_round(
        self,
        round_: list[_Ticket],
        entries: list[PendingEntry],
        known: list[int | None],
        todo: list[int],
        before: dict[str, int],
    ) -> list[Outcome]:
        """Append the round's entries ``todo`` indexes (``known`` holds the others' sequences,
        and gets theirs); each request's outcome."""
        deadline = min(ticket.deadline for ticket in round_)
        started = self._clock.monotonic()
        try:
            if todo:
                sequences: tuple[int | None, ...] = self._queue.append(
                    [entries[i] for i in todo],
                    deadline=deadline,
                    present_from=min(t.lower for t in round_),
                )
                self._measure(started, before)
                self._remember([entries[i] for i in todo], sequences)
                _merge(known, todo, sequences)
            next_sequence = self._queue.seen_next_sequence
            self.counters.add("entries_appended", len(todo))
            return [Outcome(APPENDED, seqs, next_sequence) for seqs in _slices(known, round_)]
        except CommitStateUnknownError as err:
            _merge(known, todo, err.sequences or (None,) * len(todo))
            logger.warning(
                "round of %s entries from %s requests may or may not have landed: %s",
                len(todo),
                len(round_),
                err,
            )
            # A request whose every entry is known to be in is appended.
            return [
                Outcome(APPENDED, seqs, self._queue.seen_next_sequence)
                if all(s is not None for s in seqs)
                else Outcome(
                    UNKNOWN, seqs, maybe_landed_from=err.maybe_landed_from, reason=str(err)
                )
                for seqs in _slices(known, round_)
            ]
        except StorageError as err:
            # No write of the round can have landed: the clients append directly (what is
            # known to be in already is said, and the rest is looked for first).
            logger.warning("round of %s entries refused: %s", len(todo), err)
            return [
                Outcome(UNKNOWN, seqs, reason=str(err))
                if any(s is not None for s in seqs)
                else Outcome(REFUSED, reason=str(err))
                for seqs in _slices(known, round_)
            ]
        except MillpondError as err:
            logger.exception("round of %s entries failed", len(todo))
            return [Outcome(UNKNOWN, seqs, reason=str(err)) for seqs in _slices(known, round_)]

    def _measure(self, started: float, before: dict[str, int]) -> None:
        after = self.counters.snapshot()
        requests = sum(
            after.get(k, 0) - before.get(k, 0) for k in ("manifest_reads", "manifest_writes")
        )
        if requests == 1:  # an uncontended round on the cached ETag: one request
            self._pauses.measured(self._clock.monotonic() - started)

    def _remember(self, entries: Sequence[PendingEntry], sequences: Sequence[int | None]) -> None:
        """Keep the locations just appended for ``_REMEMBER`` seconds (round thread only)."""
        now = self._clock.monotonic()
        for entry, sequence in zip(entries, sequences, strict=True):
            if sequence is not None:
                self._recent[entry.location] = sequence
                self._recent_at.append((now, entry.location))
        while self._recent_at and (
            now - self._recent_at[0][0] > _REMEMBER or len(self._recent_at) > self._max_pending
        ):
            _, location = self._recent_at.popleft()
            self._recent.pop(location, None)

    def _settle(self, ticket: _Ticket, outcome: Outcome) -> None:
        """Record the outcome (holding the lock)."""
        ticket.outcome = outcome
        ticket.settled_at = self._clock.monotonic()
        if outcome.status == REFUSED:
            self.counters.add("refused")
        elif outcome.status == UNKNOWN:
            self.counters.add("unknown")
        ticket.done.set()

    def _forget(self, now: float) -> None:
        """Drop outcomes older than ``_REMEMBER`` (holding the lock)."""
        if len(self._tickets) < 1024:
            return
        stale = [
            rid
            for rid, t in self._tickets.items()
            if t.outcome is not None and now - t.settled_at > _REMEMBER
        ]
        for rid in stale:
            del self._tickets[rid]


def _not_appended(ticket: _Ticket) -> bool:
    """Whether a settled request is known not to be wholly in the queue."""
    return ticket.outcome is not None and ticket.outcome.status != APPENDED


def _merge(known: list[int | None], todo: list[int], sequences: Sequence[int | None]) -> None:
    for index, sequence in zip(todo, sequences, strict=True):
        known[index] = sequence


def _slices(sequences: Sequence[int | None], round_: list[_Ticket]) -> list[tuple[int | None, ...]]:
    """``sequences`` cut into each request's own, in the round's order."""
    rest = iter(sequences)
    return [tuple(islice(rest, len(ticket.entries))) for ticket in round_]
