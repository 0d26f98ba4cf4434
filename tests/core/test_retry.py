"""Retry pacing: the ``aging`` strategy retries old waiters sooner and gives no head start to
the last winner; store failures still back off; every loop stays bounded.

Time comes from a fake clock that only moves when something sleeps; a store request is
simulated by sleeping its duration, then ``slept`` is cleared to see only the pacer's pauses.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from millpond.common.retry import AgingPacer, Backoff, Pacer, RetryPolicy, Turn
from millpond.common.ulids import UlidMinter
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


def test_a_pause_before_a_write_is_not_counted_as_store_time() -> None:
    clock = FakeClock()
    pacer = _measured_pacer(clock)
    minter = UlidMinter(clock)
    winners = minter.mint()
    clock.sleep(10 * REQUEST)
    mine = minter.mint()  # younger than the winners': lets them go first
    backoff = pacer.start(cached=True)
    _request(clock)  # the write that lost
    assert backoff.next_delay(conflict=True) == 0.0
    _request(clock)  # the read of the winners' manifest
    turn = backoff.before_write(lambda: (mine, winners))
    assert turn.pause > 0
    assert turn.sit_out
    clock.sleep(turn.pause)
    _request(clock)  # the read of the race it sat out
    _request(clock)  # the write that wins
    pacer.won(backoff)
    assert pacer.slot == pytest.approx(REQUEST)


def test_a_lost_race_reads_at_once_and_older_loops_wait_less_before_writing() -> None:
    clock = FakeClock()
    # Never sitting out: every younger loop waits its share of the spread.
    policy = dataclasses.replace(AGING, sit_out_share=1.0)
    pacer = _measured_pacer(clock, policy)
    minter = UlidMinter(clock)
    oldest = minter.mint()
    backoff = pacer.start(cached=False)
    ceilings = []
    pauses = []
    for _ in range(40):
        _request(clock, 2)  # the attempt that lost
        assert backoff.next_delay(conflict=True) == 0.0  # read the winners' manifest at once
        _request(clock)
        younger = minter.mint()
        # Lost to younger batches (or to none named by a ULID): write at once.
        assert backoff.before_write(lambda: (oldest, younger)) == Turn()  # noqa: B023
        assert backoff.before_write(lambda: (oldest, None)) == Turn()
        waited = clock.monotonic() - backoff.started  # type: ignore[attr-defined]
        share = max(0.0, 1 - waited / (policy.aging_horizon * pacer.slot))
        ceilings.append(policy.conflict_spread * pacer.slot * share)
        # Lost to older batches with one minted just now: let them go first, the whole spread.
        turn = backoff.before_write(lambda: (younger, oldest))  # noqa: B023
        assert not turn.sit_out
        pauses.append(turn.pause)
        clock.sleep(turn.pause)
    assert all(0.8 * c - 1e-12 <= p <= c + 1e-12 for p, c in zip(pauses, ceilings, strict=True))
    assert ceilings == sorted(ceilings, reverse=True)  # the ceiling only shrinks with age
    assert ceilings[0] > 0
    assert pauses[-1] == 0.0  # past the horizon: write at once whoever won


def test_a_loop_much_younger_than_the_winners_sits_the_next_race_out() -> None:
    clock = FakeClock()
    pacer = _measured_pacer(clock)
    minter = UlidMinter(clock)
    oldest = minter.mint()
    clock.sleep(1.0)
    backoff = pacer.start(cached=False)
    turns = []
    for _ in range(40):
        _request(clock, 2)  # the attempt that lost
        assert backoff.next_delay(conflict=True) == 0.0
        _request(clock)
        younger = minter.mint()  # minted now: younger than the winners by their whole age
        waited = clock.monotonic() - backoff.started  # type: ignore[attr-defined]
        share = max(0.0, 1 - waited / (AGING.aging_horizon * pacer.slot))
        slot = pacer.slot
        turn = backoff.before_write(lambda: (younger, oldest))  # noqa: B023
        turns.append((share, slot, turn))
        clock.sleep(turn.pause)
        if turn.sit_out:
            _request(clock)  # the read again
    sat_out = [(slot, turn) for share, slot, turn in turns if share > AGING.sit_out_share]
    stayed = [(share, slot, turn) for share, slot, turn in turns if share <= AGING.sit_out_share]
    # The share shrinks as the loop ages: it sits out, then stays in.
    assert sat_out
    assert stayed
    # Sitting out: a read sent a moment later, not a pause as long as its share of the spread.
    for slot, turn in sat_out:
        assert turn.sit_out
        assert turn.pause == pytest.approx(AGING.sit_out_lag * slot)
    for share, slot, turn in stayed:
        assert not turn.sit_out
        assert 0.8 * AGING.conflict_spread * slot * share - 1e-12 <= turn.pause
        assert turn.pause <= AGING.conflict_spread * slot * share + 1e-12


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
    for _ in range(5):  # 5 yields of about 1.5 slots: still within the 16-slot memory
        pacer.take_turn()
        contended.append(sum(clock.slept))
        clock.slept.clear()
    slot = pacer.slot
    assert all(0.9 * AGING.contended_yield * slot <= y <= 1.1 * AGING.contended_yield * slot
               for y in contended)  # fmt: skip
    assert min(contended) > AGING.back_to_back_yield * slot


def test_a_winner_makes_win_streak_appends_in_a_row_before_it_yields() -> None:
    clock = FakeClock()
    pacer = _measured_pacer(clock, dataclasses.replace(AGING, win_streak=2))

    def won(*, lost_first: bool = False) -> None:
        backoff = pacer.start(cached=True)
        _request(clock)
        if lost_first:
            assert backoff.sleep(conflict=True)
            _request(clock, 2)
        pacer.won(backoff)
        clock.slept.clear()

    won(lost_first=True)  # contention seen
    turns = []
    for _ in range(6):
        pacer.take_turn()
        turns.append(sum(clock.slept))
        clock.slept.clear()
        won()
    # The winner's next append goes at once (on its ETag), then it yields about
    # contended_yield slots so a loser that is reading gets its write in.
    assert turns[0::2] == [0.0, 0.0, 0.0]
    slot = pacer.slot
    assert all(0.9 * AGING.contended_yield * slot <= y <= 1.1 * AGING.contended_yield * slot
               for y in turns[1::2])  # fmt: skip
    # A lost race ends the streak: the next win starts one afresh.
    pacer.take_turn()
    assert clock.slept == []
    won(lost_first=True)
    pacer.take_turn()
    assert clock.slept == []


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


def test_only_a_writer_that_lost_lately_sends_a_read_peek_lag_slots_behind_its_write() -> None:
    clock = FakeClock()
    policy = RetryPolicy(strategy="aging", peek_lag=0.2)
    pacer = policy.pacer(clock)
    assert isinstance(pacer, AgingPacer)
    assert pacer.peek_lag() is None  # no contention seen: no read
    pacer.lost(clock.monotonic())
    assert pacer.peek_lag() == pytest.approx(0.2 * pacer.slot)
    clock.sleep(policy.aging_horizon * pacer.slot)
    assert pacer.peek_lag() is None  # the lost race is too long ago
    assert RetryPolicy().pacer(clock).peek_lag() is None  # exponential: never


def test_a_second_read_follows_only_under_contention_and_can_be_switched_off() -> None:
    clock = FakeClock()
    pacer = RetryPolicy(strategy="aging", peek_again_lag=0.3).pacer(clock)
    assert pacer.peek_again_lag() is None  # no contention seen: no read
    pacer.lost(clock.monotonic())
    assert pacer.peek_again_lag() == pytest.approx(0.3 * pacer.slot)
    off = RetryPolicy(strategy="aging", peek_again_lag=0.0).pacer(clock)
    off.lost(clock.monotonic())
    assert off.peek_again_lag() is None
    assert RetryPolicy().pacer(clock).peek_again_lag() is None  # exponential: never


def test_strategy_and_aging_fields_are_validated() -> None:
    with pytest.raises(ConfigError) as info:
        RetryPolicy(strategy="fifo")
    assert info.value.key == "strategy"
    assert "exponential, aging" in str(info.value)
    with pytest.raises(ConfigError) as info:
        RetryPolicy(strategy="aging", contended_yield=-1.0)
    assert info.value.key == "contended_yield"
    for streak in (0, 1.5):
        with pytest.raises(ConfigError) as info:
            RetryPolicy(strategy="aging", win_streak=streak)  # type: ignore[arg-type]
        assert info.value.key == "win_streak"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_elapsed", math.nan),  # no deadline: lost races retried for ever
        ("max_elapsed", math.inf),
        ("contended_yield", math.inf),  # sleep(inf) raises OverflowError in the writer
        ("conflict_spread", math.nan),
        ("sit_out_share", -0.5),
        ("sit_out_lag", math.inf),
        ("peek_lag", math.inf),  # the read alongside a write would never be sent
        ("peek_again_lag", math.nan),
    ],
)
def test_a_time_that_is_not_a_finite_number_is_refused(field: str, value: float) -> None:
    with pytest.raises(ConfigError) as info:
        RetryPolicy(strategy="aging", **{field: value})
    assert info.value.key == field
    assert "finite" in str(info.value)
