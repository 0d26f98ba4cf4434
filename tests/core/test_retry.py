"""Retry pacing: the ``aging`` strategy retries old waiters sooner and gives no head start to
the last winner; store failures still back off; every loop stays bounded.

Time comes from a fake clock that only moves when something sleeps; a store request is
simulated by sleeping its duration, then ``slept`` is cleared to see only the pacer's pauses.
"""

from __future__ import annotations

import pytest

from millpond.common.retry import AgingPacer, Backoff, Pacer, RetryPolicy
from millpond.errors import ConfigError

from ._helpers import FakeClock

REQUEST = 0.05  # seconds one simulated store request takes
AGING = RetryPolicy(strategy="aging", max_elapsed=1e6)


def _request(clock: FakeClock, requests: int = 1) -> None:
    clock.sleep(REQUEST * requests)


def _measured_pacer(clock: FakeClock, policy: RetryPolicy = AGING) -> AgingPacer:
    """A pacer that has timed one uncontended cached write, then stayed idle for a while."""
    pacer = policy.pacer(clock)
    assert isinstance(pacer, AgingPacer)
    backoff = pacer.start(cached=True)
    _request(clock)
    pacer.won(backoff)
    assert pacer.slot == pytest.approx(REQUEST)
    clock.sleep(100 * REQUEST)  # idle: neither back to back nor recently contended
    clock.slept.clear()
    return pacer


def test_slot_is_measured_per_request() -> None:
    clock = FakeClock()
    pacer = _measured_pacer(clock)
    backoff = pacer.start(cached=False)  # read + write: two requests
    _request(clock, 2)
    assert backoff.sleep(conflict=True)
    _request(clock, 2)
    pacer.won(backoff)
    assert pacer.slot == pytest.approx(REQUEST)


def test_older_loops_wait_less_and_the_oldest_not_at_all() -> None:
    clock = FakeClock()
    pacer = _measured_pacer(clock)
    policy = AGING
    backoff = pacer.start(cached=False)
    ceilings = []
    delays = []
    for _ in range(40):
        _request(clock, 2)  # the attempt that lost
        waited = clock.monotonic() - backoff.started  # type: ignore[attr-defined]
        share = max(0.0, 1 - waited / (policy.aging_horizon * pacer.slot))
        ceilings.append(policy.conflict_spread * pacer.slot * share)
        delay = backoff.next_delay(conflict=True)
        assert delay is not None
        delays.append(delay)
        clock.sleep(delay)
    assert all(0 <= d <= c + 1e-12 for d, c in zip(delays, ceilings, strict=True))
    assert ceilings == sorted(ceilings, reverse=True)  # the ceiling only shrinks with age
    assert ceilings[0] > 0
    assert delays[-1] == 0.0  # past the horizon: retry at once


def test_the_last_winner_yields_before_its_next_append() -> None:
    clock = FakeClock()
    pacer = _measured_pacer(clock)
    # Idle writer: goes at once.
    pacer.take_turn()
    assert clock.slept == []
    # Back to back, no contention seen: a short yield, bounded by back_to_back_yield slots.
    backoff = pacer.start(cached=True)
    _request(clock)
    pacer.won(backoff)
    clock.slept.clear()
    yields = []
    for _ in range(50):
        pacer.take_turn()
        yields.append(sum(clock.slept))
        clock.slept.clear()
        backoff = pacer.start(cached=True)
        _request(clock)
        pacer.won(backoff)
        clock.slept.clear()
    assert all(0 <= y <= AGING.back_to_back_yield * pacer.slot for y in yields)
    assert max(yields) > 0
    # A win that needed a retry: contention is seen, the yield is the longer one.
    backoff = pacer.start(cached=True)
    _request(clock)
    assert backoff.sleep(conflict=True)
    _request(clock, 2)
    pacer.won(backoff)
    clock.slept.clear()
    contended = []
    for _ in range(50):
        pacer.take_turn()
        contended.append(sum(clock.slept))
        clock.slept.clear()
    assert all(0 <= y <= AGING.contended_yield * pacer.slot for y in contended)
    assert max(contended) > AGING.back_to_back_yield * pacer.slot


def test_store_failures_still_back_off_exponentially_and_count_attempts() -> None:
    clock = FakeClock()
    policy = RetryPolicy(
        strategy="aging", max_attempts=6, max_elapsed=1e6, base_delay=0.01, max_delay=0.04
    )
    pacer = _measured_pacer(clock, policy)
    backoff = pacer.start()
    delays = []
    while (delay := backoff.next_delay(conflict=False)) is not None:
        delays.append(delay)
    assert len(delays) == 5
    caps = [0.01, 0.02, 0.04, 0.04, 0.04]
    assert all(0 <= d <= cap for d, cap in zip(delays, caps, strict=True))


def test_lost_races_under_aging_are_bounded_by_time() -> None:
    clock = FakeClock()
    policy = RetryPolicy(strategy="aging", max_attempts=3, max_elapsed=2.0)
    pacer = policy.pacer(clock)
    backoff = pacer.start()
    attempts = 0
    while backoff.sleep(conflict=True):
        _request(clock, 2)
        attempts += 1
    assert attempts > 3  # conflicts are not counted against max_attempts ...
    assert clock.monotonic() <= 2.0 + 2 * REQUEST  # ... but the time budget holds


def test_exponential_pacer_changes_nothing() -> None:
    clock = FakeClock()
    pacer = RetryPolicy().pacer(clock)
    assert type(pacer) is Pacer
    backoff = pacer.start(cached=True)
    assert type(backoff) is Backoff
    pacer.won(backoff)
    pacer.take_turn()
    assert clock.slept == []


def test_strategy_and_aging_fields_are_validated() -> None:
    with pytest.raises(ConfigError) as info:
        RetryPolicy(strategy="fifo")
    assert info.value.key == "strategy"
    assert "exponential, aging" in str(info.value)
    with pytest.raises(ConfigError) as info:
        RetryPolicy(strategy="aging", contended_yield=-1.0)
    assert info.value.key == "contended_yield"
