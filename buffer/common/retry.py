"""Retry pacing: capped, jittered exponential backoff, and a fair pacer for contended CAS.

Every retry loop is bounded by attempts and by total time (:class:`RetryPolicy`). Two
strategies decide how a loop that lost a compare-and-swap waits:

* ``"exponential"`` (the default): full jitter in ``[0, cap]``, the cap doubling from
  ``base_delay`` to ``max_delay``. Every loop backs off the same way, so the longer a writer
  has lost, the *longer* it waits; and a writer that just won keeps the manifest it wrote and
  tries again at once with its ETag, one request against the losers' two (read, then write).
  At 50 ms a request that writer wins again and again while the others starve (issue 11).
* ``"aging"`` (issue 11): the oldest batches go first. A lost race reads the manifest at
  once, and the batch names the winners appended (ULIDs carry their mint time) decide the next
  write: a writer whose oldest batch is older than all of theirs was passed over and writes
  at once; one that lost to older batches lets them go first. How much younger its batch is
  than the winners', as a part of their age, is its *share* (it shrinks as the loop ages, to
  nothing after ``aging_horizon`` slots). Up to ``sit_out_share``, the loop waits that share
  of ``conflict_spread`` *slots* (the measured duration of one store request) before it
  writes, so the writers still in the race line up by age; past it, the loop sits the next
  race out: it reads the manifest again ``sit_out_lag`` slots later, once the older writers'
  write has landed, instead of sending a write that would lose to theirs, and writes on
  what it read. Its next write then leaves in step with the writers it lost to, where a
  pause as long as a young batch's share would leave it behind them; and the gaps between
  stragglers' writes are what the manifest waits for between two appends. A
  writer that just won does not go first either: when it has lost a race lately it makes
  ``win_streak`` appends in a row (one by default), then waits ``contended_yield`` slots
  (by then a loser that read alongside its lost write has its next write on the way); when
  it has not, it waits a random part of ``back_to_back_yield`` slots between appends back
  to back.
  Store failures (not conflicts) still back off exponentially, so an outage is never
  hammered. Writers whose clocks disagree by more than a round trip get a share of turns
  skewed towards the slower clock, never a lost or doubled entry: the compare-and-swap
  decides, the pacing only orders the attempts.

A :class:`Pacer` carries what one writer learns across its retry loops (slot length, when it
last won, when it last lost); :meth:`RetryPolicy.pacer` makes one per writer.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from millpond.common.clock import Clock, SystemClock
from millpond.common.durations import check_duration
from millpond.common.ulids import ulid_time_ms
from millpond.errors import ConfigError

__all__ = [
    "STRATEGIES",
    "AgingPacer",
    "Backoff",
    "Pacer",
    "RetryPolicy",
    "Turn",
]

STRATEGIES = ("exponential", "aging")
"""Every value of :attr:`RetryPolicy.strategy`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How long a retry loop may keep going, and how it waits."""

    max_attempts: int = 100
    """Attempts in all, the first included. Default 100. Under ``"aging"``, lost races are
    bounded by ``max_elapsed`` only: each attempt already takes a store round trip or two."""
    max_elapsed: float = 60.0
    """Seconds from the first attempt after which no new attempt starts. Default 60."""
    base_delay: float = 0.01
    """Seconds; the cap of the first backoff. Default 0.01."""
    max_delay: float = 1.0
    """Seconds; no single backoff is longer. Default 1.0."""
    strategy: str = "exponential"
    """How a lost compare-and-swap waits: ``"exponential"`` or ``"aging"`` (module docstring).
    Default ``"exponential"``."""
    aging_horizon: float = 16.0
    """``"aging"``: slots; a loop that has waited this long retries a lost race at once, and a
    writer that lost a race within this long counts as contended. Default 16."""
    conflict_spread: float = 0.2
    """``"aging"``: slots; after a lost race to batches older than its own, a loop whose
    share (module docstring) is within ``sit_out_share`` waits that share of this many slots
    before writing again, so the writers with older batches get their writes in first.
    Default 0.2; 0.7 before ``sit_out_share`` existed, when every younger loop paused (a
    0.2 spread alone then took the p99 of ``wait()`` of eight and sixteen producers at 50 ms
    a request from 6.8x and 17x the lone producer's p50 to 9.4x and 41x)."""
    sit_out_share: float = 0.5
    """``"aging"``: a loop that lost to batches older than its own by more than this share
    (module docstring) sits the next race out: it reads again instead of writing. Default
    0.5; 1 or more: never (every younger loop waits its share of ``conflict_spread``).
    Against a 0.7-slot spread for every younger loop, the default before, with eight bare
    append loops at 50 ms a request: 0.84x-0.94x a lone writer's appends a second in seven
    runs (median 0.91x) against 0.76x-0.87x in seven, the p99 of ``wait()`` of eight and
    sixteen producers appending directly 1.1-1.5 s and 2.8-3.6 s against 1.0-1.4 s and
    2.1-3.0 s (2026-11-28; ``bench/bench_contended_appends.py``,
    ``bench/bench_wait_latency.py``)."""
    sit_out_lag: float = 0.06
    """``"aging"``: slots; how long after deciding to sit a race out a loop sends its read,
    so that the store serves it after the older writers' write (sent at once). Default
    0.06."""
    contended_yield: float = 0.5
    """``"aging"``: slots; how long a writer that has seen contention lately waits before its
    next append, so a loser that is reading gets its write in first. Default 0.5 (1.5 until
    2026-11-28). A per-request trace of eight bare append loops 50 ms from SeaweedFS showed
    where appends are lost: a hand-over is quick when other losers' reads reach the store
    just after the winning write, slow (20-50 ms) when the winner was alone in its phase and
    no read was on its way; 5-20 % of hand-overs were slow, 0.25-1.5 s of a 15 s run. A
    winner back after half a slot gets its next write in itself when no loser has yet (its
    write on the ETag it kept is the one on the current state), and loses at no cost when
    one has. In paired runs (``bench/bench_contended_appends.py``, N = 8) 0.5 made
    0.936x-0.967x a lone writer's appends/s in nine (median 0.957x, p99 2.4x-4.2x its p50)
    against 0.874x-0.969x for 1.5 in seventeen (median 0.944x, p99 3.0x-7.7x), at about 14
    requests per committed append instead of 13; six more runs of 0.5 alone, 0.957x-0.969x.
    Sixteen producers appending directly had a ``wait()`` p99 of 16x a lone producer's p50
    in the full run after the change (27x before); in two paired runs 45x and 32x for 0.5
    against 19x and 53x for 1.5: that tail varies more from run to run than between the two."""
    back_to_back_yield: float = 0.25
    """``"aging"``: slots; the longest a writer whose previous append ended less than a slot
    ago waits before the next one, contention seen or not: a writer that always wins at once
    cannot see the others starve. Default 0.25."""
    peek_lag: float = 0.1
    """``"aging"``: slots; how long after a contended write its read of the manifest is sent
    (:mod:`millpond.queue.peek`), so that the store serves the read after the write. Too
    short, and the read is served while the store is still applying the write: it shows the
    old state, tells nothing, and the lost race costs a second round trip; too long, and
    every hand-over waits for it. Default 0.1. With eight bare append loops 50 ms from
    SeaweedFS the reads found the old state in about 20 % of lost races at 0.03, 10 % at
    0.06, 1-2 % at 0.1 and 0.1 % at 0.15. Before losers sat races out, 0.1 gave no more
    appends a second than 0.03 (0.76x and 0.74x a lone writer against 0.78x and 0.81x);
    since, in seven runs measuring both in one run, 0.1 made 0.919x-0.95x (median 0.934x)
    against 0.868x-0.954x (median 0.922x) for 0.03 with a second read at 0.12
    (``peek_again_lag``), at 13 requests per committed append instead of 18-19; and 0.03
    alone 0.87x-0.94x (2026-11-28, ``bench/bench_contended_appends.py``). But the tail is
    longer at 0.1 (p99 3.0x-9.8x its p50 in twelve runs, fairness index 0.85-0.99, against
    2.1x-5.0x with the second read), and four later runs made 0.84x-0.98x: which default
    serves a contended manifest better is not settled."""
    peek_again_lag: float = 0.0
    """``"aging"``: slots; how long after a contended write a second read of the manifest is
    sent, used when the first (``peek_lag``) still shows the state the write was conditional
    on; 0 (the default): none. For a store that applies writes slowly against its round
    trip, an early first read and a later second keep most hand-overs short at one request
    more per contended attempt. With ``peek_lag`` 0.03, a second read at 0.12 took eight
    bare append loops 50 ms from SeaweedFS from a median 0.91x to 0.93x a lone writer's
    appends/s; a single read at 0.1 did as well with a third fewer requests, and sixteen
    producers appending directly had a longer ``wait()`` tail with the second read (p99 24x
    and 31x a lone producer's p50 against 22x and 26x in two paired runs)."""
    win_streak: int = 1
    """``"aging"``: appends a writer that has lost a race lately makes in a row before it
    yields ``contended_yield`` slots (a lost race ends the streak). Default 1. A hand-over
    costs a loser's read and write where a winner's next append costs one write, so more
    appends go through a second at 2, at the others' expense: with eight bare append loops
    50 ms from the store, committed appends/s went from 0.80-0.86x a lone writer to
    0.91-0.96x, but the p99 append latency from 2-4x its p50 to 5.7x-13.7x (p99 2.1-3.1 s), and
    ``wait()`` of producers appending directly from p99 7.2x / 18.6x a lone producer's p50 at
    N = 8 / 16 to 9.9x / 28.9x; at 3 the bare p99 went past 40x its p50
    (``bench/bench_contended_appends.py``, ``bench/bench_wait_latency.py``)."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError("max_attempts", f"expected >= 1, found {self.max_attempts}")
        # A NaN or infinite time budget would let a loop of lost races go on for ever.
        check_duration("max_elapsed", self.max_elapsed, allow_zero=False)
        if not 0 < self.base_delay <= self.max_delay:
            raise ConfigError(
                "base_delay",
                f"expected 0 < base_delay <= max_delay ({self.max_delay}), found {self.base_delay}",
            )
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                "strategy", f"expected one of {', '.join(STRATEGIES)}, found {self.strategy!r}"
            )
        for name in (
            "aging_horizon",
            "conflict_spread",
            "sit_out_share",
            "sit_out_lag",
            "contended_yield",
            "back_to_back_yield",
            "peek_lag",
            "peek_again_lag",
        ):
            check_duration(name, getattr(self, name), allow_zero=True, unit="slots")
        if not isinstance(self.win_streak, int) or self.win_streak < 1:
            raise ConfigError("win_streak", f"expected an int >= 1, found {self.win_streak!r}")

    def start(self, clock: Clock | None = None) -> Backoff:
        """A fresh backoff state for one retry loop (exponential, whatever the strategy)."""
        return Backoff(self, clock or SystemClock())

    def pacer(self, clock: Clock | None = None) -> Pacer:
        """A pacer for one writer's successive retry loops on one contended object."""
        if self.strategy == "aging":
            return AgingPacer(self, clock or SystemClock())
        return Pacer(self, clock or SystemClock())


@dataclass(frozen=True, slots=True)
class Turn:
    """What a loop that lost a race does before it writes again (:meth:`Backoff.before_write`)."""

    pause: float = 0.0
    """Seconds to wait first."""
    sit_out: bool = False
    """Whether to read the manifest again after the pause and write on what it shows
    (sitting the race out) rather than write on the manifest already read."""


class Backoff:
    """The state of one retry loop: ``attempt`` so far and the deadline."""

    def __init__(self, policy: RetryPolicy, clock: Clock) -> None:
        self._policy = policy
        self._clock = clock
        self._deadline = clock.monotonic() + policy.max_elapsed
        self.attempt = 1

    def next_delay(self, *, conflict: bool = False) -> float | None:
        """The pause before the next attempt, or ``None`` when the budget is spent.

        Full jitter (uniform in ``[0, cap]``) spreads contending writers apart so a crowd
        of producers losing the same CAS does not retry in lockstep.

        Args:
            conflict: the attempt lost a compare-and-swap (rather than failing on the store);
                the exponential strategy treats both alike.
        """
        if self.attempt >= self._policy.max_attempts:
            return None
        remaining = self._deadline - self._clock.monotonic()
        if remaining <= 0:
            return None
        cap = min(
            self._policy.max_delay, self._policy.base_delay * (2 ** min(self.attempt - 1, 30))
        )
        self.attempt += 1
        return min(random.uniform(0, cap), remaining)

    def before_write(self, oldest: Callable[[], tuple[str, str | None] | None]) -> Turn:
        """What to do before writing on a manifest read after a lost race (write at once here).

        Args:
            oldest: the ULIDs of this loop's oldest batch and of the oldest batch the winners
                of the race appended (``None`` when none of theirs is named by one), or
                ``None`` when this loop's batch names do not tell; called only by a strategy
                that orders writers by age (it reads the winners' entries).
        """
        del oldest
        return Turn()

    def again(self) -> bool:
        """Count an attempt that goes at once; ``False`` when the time budget is spent.

        For a lost race that must not wait (another writer's write landed; reading and writing
        again at once is the only way in past a writer that pauses only for a moment). Bounded
        by ``max_elapsed``, not ``max_attempts``: each such attempt takes a round trip or two.
        """
        if self._clock.monotonic() >= self._deadline:
            return False
        self.attempt += 1
        return True

    def read_ahead(self) -> None:
        """The next attempt writes on a read already made (alongside the last write): one
        request, not a read and a write."""

    def sleep(self, *, conflict: bool = False) -> bool:
        """Sleep before the next attempt; ``False`` when the budget is spent.

        Args:
            conflict: as in :meth:`next_delay`.
        """
        delay = self.next_delay(conflict=conflict)
        if delay is None:
            return False
        self._clock.sleep(delay)
        return True


class Pacer:
    """Paces one writer's retry loops on one contended object; this one changes nothing.

    A CAS loop calls :meth:`take_turn` before its first attempt, :meth:`start` for its
    backoff, and :meth:`won` when its write landed.
    """

    def __init__(self, policy: RetryPolicy, clock: Clock) -> None:
        self._policy = policy
        self._clock = clock
        self.slot = policy.base_delay
        """Seconds one store request takes: ``base_delay`` here; measured by a pacer that
        learns it."""

    def take_turn(self) -> bool:
        """Wait, if this writer should let others go first; whether it waited. Never here."""
        return False

    def start(self, *, cached: bool = False) -> Backoff:
        """The backoff of one loop.

        Args:
            cached: the first attempt writes with a cached ETag (one request, not two).
        """
        del cached
        return Backoff(self._policy, self._clock)

    def won(self, backoff: Backoff) -> None:
        """The loop's write landed."""

    def peek_lag(self) -> float | None:
        """Seconds after a write to send a read alongside it (:mod:`millpond.queue.peek`), or
        ``None`` for no read: only a writer that lost a race lately, whose next write is
        likely to lose too, pays for one. Never here."""
        return None

    def peek_again_lag(self) -> float | None:
        """Seconds after a write to send a second read alongside it, or ``None`` for none:
        used when the first still shows the state the write was on. Never here."""
        return None


class _AgingBackoff(Backoff):
    """Lost races wait less the longer the loop has waited; store failures back off."""

    def __init__(self, pacer: AgingPacer, *, cached: bool) -> None:
        super().__init__(pacer._policy, pacer._clock)
        self._pacer = pacer
        self.started = self._clock.monotonic()
        self.attempt_started = self.started
        self.attempt_requests = 1 if cached else 2

    def next_delay(self, *, conflict: bool = False) -> float | None:
        now = self._clock.monotonic()
        # Either way the next attempt re-reads before it writes: two requests.
        requests, self.attempt_requests = self.attempt_requests, 2
        delay = self._conflict_delay(now, requests) if conflict else super().next_delay()
        if delay is not None:
            self.attempt_started = now + delay
        return delay

    def read_ahead(self) -> None:
        self.attempt_requests = 1

    def _conflict_delay(self, now: float, requests: int) -> float | None:
        remaining = self._deadline - now
        if remaining <= 0:
            return None
        self._pacer.observe(now - self.attempt_started, requests)
        self._pacer.lost(now)
        self.attempt += 1
        return 0.0  # read at once: what the winners appended decides the pause (before_write)

    def before_write(self, oldest: Callable[[], tuple[str, str | None] | None]) -> Turn:
        ulids = oldest()
        if ulids is not None and (ulids[1] is None or ulids[0] < ulids[1]):
            return Turn()  # passed over by younger batches: write at once
        now = self._clock.monotonic()
        policy, slot = self._policy, self._pacer.slot
        waited = (now - self.started) / slot
        share = max(0.0, 1.0 - waited / policy.aging_horizon) if policy.aging_horizon else 0.0
        if ulids is not None and ulids[1] is not None:
            share *= _younger_by(ulids[0], ulids[1], self._clock.now_ms())
        sit_out = share > policy.sit_out_share
        if sit_out:
            delay = policy.sit_out_lag * slot
            self.attempt_requests += 1  # the read before the write
        else:
            delay = policy.conflict_spread * slot * share * random.uniform(0.8, 1.0)
        delay = max(0.0, min(delay, self._deadline - now))
        # The pause is the caller's, not the store's: the slot measures requests only.
        self.attempt_started += delay
        return Turn(delay, sit_out)


def _younger_by(mine: str, theirs: str, now_ms: int) -> float:
    """How much younger batch ``mine`` is than ``theirs``, as a share of their age (0 to 1).

    Writers' clocks may disagree, and mint times are only as good as them: the share is kept
    within bounds, and only orders the attempts (the compare-and-swap decides)."""
    theirs_ms = ulid_time_ms(theirs)
    age = now_ms - theirs_ms
    if age <= 0:
        return 1.0
    return min(1.0, max(0.0, (ulid_time_ms(mine) - theirs_ms) / age))


class AgingPacer(Pacer):
    """The ``"aging"`` strategy (module docstring): age-first retries, no head start for the
    last winner."""

    _SMOOTHING = 0.2  # weight of a new measurement in the slot's moving average

    def __init__(self, policy: RetryPolicy, clock: Clock) -> None:
        super().__init__(policy, clock)
        self._measured = False
        self._last_win = float("-inf")
        self._last_loss = float("-inf")
        self._at_once = 0  # turns taken at once since the last lost race or yield

    def take_turn(self) -> bool:
        now = self._clock.monotonic()
        policy = self._policy
        if self._contended(now):
            if self._at_once < policy.win_streak - 1:
                self._at_once += 1
                return False  # the winner's next append, on its ETag: one request
            self._at_once = 0
            self._clock.sleep(policy.contended_yield * self.slot * random.uniform(0.9, 1.1))
            return True
        if now - self._last_win < self.slot:
            self._clock.sleep(random.uniform(0.0, policy.back_to_back_yield * self.slot))
            return True
        return False

    def _contended(self, now: float) -> bool:
        return now - self._last_loss < self._policy.aging_horizon * self.slot

    def peek_lag(self) -> float | None:
        if not self._contended(self._clock.monotonic()):
            return None
        return self._policy.peek_lag * self.slot

    def peek_again_lag(self) -> float | None:
        if not self._policy.peek_again_lag or not self._contended(self._clock.monotonic()):
            return None
        return self._policy.peek_again_lag * self.slot

    def start(self, *, cached: bool = False) -> Backoff:
        return _AgingBackoff(self, cached=cached)

    def won(self, backoff: Backoff) -> None:
        now = self._clock.monotonic()
        if isinstance(backoff, _AgingBackoff):
            self.observe(now - backoff.attempt_started, backoff.attempt_requests)
            if backoff.attempt > 1:
                self._last_loss = now
        self._last_win = now

    def lost(self, now: float) -> None:
        """A race of this writer's was lost at ``now``."""
        self._last_loss = now
        self._at_once = 0

    def observe(self, seconds: float, requests: int) -> None:
        """Fold one attempt's duration (``requests`` store requests) into :attr:`slot`."""
        if seconds <= 0 or requests < 1:
            return
        sample = seconds / requests
        if not self._measured:
            self.slot, self._measured = sample, True
        else:
            self.slot += self._SMOOTHING * (sample - self.slot)
