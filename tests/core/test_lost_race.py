"""A writer that loses a compare-and-swap: it takes what became ready meanwhile into its next
write (conflict-aware group commit), and under the ``aging`` strategy it writes again at once
when the race went to younger batches than its own, and lets older ones go first.

Every store here is real (the ``any_store_target`` servers); the lost race is a real
conditional write refused because another writer appended first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from millpond.common.retry import RetryPolicy
from millpond.common.ulids import UlidMinter
from millpond.errors import CommitStateUnknownError, InvalidInputError
from millpond.formats.manifest import PendingEntry
from millpond.queue import QueueProducer, read_manifest
from millpond.storage.store import ObjectStore
from tests.support import StoreTarget

from ._helpers import FAST_RETRY, MANIFEST, FakeClock, FaultyStore, open_target, pending

AGING = RetryPolicy(strategy="aging", max_elapsed=60.0, base_delay=0.05, max_delay=1.0)


@pytest.fixture
def store(any_store_target: StoreTarget) -> ObjectStore:
    return open_target(any_store_target)


def _locations(store: ObjectStore) -> list[str]:
    return [e.location for e in read_manifest(store, MANIFEST).manifest.entries]


class _Ready:
    """A ``more`` callback handing out prepared groups, one per call, and counting calls."""

    def __init__(self, *groups: list[PendingEntry]) -> None:
        self.groups = list(groups)
        self.calls = 0

    def __call__(self) -> list[PendingEntry]:
        self.calls += 1
        return self.groups.pop(0) if self.groups else []


def test_a_writer_that_lost_takes_what_became_ready_into_its_next_write(
    store: ObjectStore,
) -> None:
    mine = QueueProducer(store, MANIFEST, retry=FAST_RETRY, clock=FakeClock())
    rival = QueueProducer(store, MANIFEST, retry=FAST_RETRY, clock=FakeClock())
    mine.append(pending(1, tag="first"))  # caches the manifest it wrote
    theirs = pending(2, tag="theirs")
    rival.append(theirs)  # the cached manifest is now stale: the next write loses
    group, later = pending(2, tag="group"), pending(3, tag="later")
    ready = _Ready(later)
    sequences = mine.append(group, more=ready)
    assert ready.calls == 1
    assert sequences == (3, 4, 5, 6, 7)  # the group, then what became ready, contiguous
    assert _locations(store)[1:] == [e.location for e in theirs + group + later]
    assert mine.counters.get("cas_conflicts") == 1


def test_an_uncontended_write_does_not_ask_for_more(store: ObjectStore) -> None:
    mine = QueueProducer(store, MANIFEST, retry=FAST_RETRY, clock=FakeClock())
    ready = _Ready(pending(2, tag="later"))
    assert mine.append(pending(2), more=ready) == (0, 1)
    assert mine.append(pending(1), more=ready) == (2,)
    assert ready.calls == 0
    assert len(_locations(store)) == 3


def test_a_group_that_landed_after_all_is_not_grown(store: ObjectStore) -> None:
    # The "lost" write had landed (a timeout after the write): the group is settled by the
    # look, and nothing more is taken into a write that will not happen.
    faulty = FaultyStore(store)
    mine = QueueProducer(faulty, MANIFEST, retry=FAST_RETRY, clock=FakeClock())
    mine.append(pending(1))
    faulty.fail_next(land=True, error=CommitStateUnknownError)
    ready = _Ready(pending(2, tag="later"))
    group = pending(2, tag="group")
    assert mine.append(group, more=ready) == (1, 2)
    assert ready.calls == 0
    assert _locations(store)[1:] == [e.location for e in group]


def test_more_may_not_repeat_a_location(store: ObjectStore) -> None:
    mine = QueueProducer(store, MANIFEST, retry=FAST_RETRY, clock=FakeClock())
    rival = QueueProducer(store, MANIFEST, retry=FAST_RETRY, clock=FakeClock())
    mine.append(pending(1))
    rival.append(pending(1))
    group = pending(2)
    with pytest.raises(InvalidInputError, match="more: expected locations not in the group"):
        mine.append(group, more=_Ready([group[0]]))
    assert not set(_locations(store)) & {e.location for e in group}


def _pause_after_losing(
    store: ObjectStore,
    *,
    mine_minted: float,
    during_pause: Callable[[float], object] | None = None,
) -> float:
    """Seconds an aging writer sleeps in an append whose first write loses a race to a batch
    minted one second ago on the writer's clock; the writer's own batch was minted
    ``mine_minted`` seconds after that one (before it, when negative)."""
    clock = FakeClock()
    minter = UlidMinter(clock)
    mine = QueueProducer(store, MANIFEST, retry=AGING, clock=clock)
    mine.append(pending(1, tag="first"))
    clock.sleep(100.0)  # long idle: no back-to-back yield, no contention remembered
    if mine_minted < 0:
        group = pending(1, tag="mine", minter=minter)
        clock.sleep(-mine_minted)
        theirs = pending(1, tag="theirs", minter=minter)
    else:
        theirs = pending(1, tag="theirs", minter=minter)
        clock.sleep(mine_minted)
        group = pending(1, tag="mine", minter=minter)
        clock.sleep(1.0 - mine_minted)
    QueueProducer(store, MANIFEST, retry=FAST_RETRY, clock=FakeClock()).append(theirs)
    clock.slept.clear()
    if during_pause is not None:
        clock.on_sleep = during_pause
    mine.append(group)
    assert mine.counters.get("cas_conflicts") == 1
    return sum(clock.slept)


# Requests take no time on the fake clock, so the slot stays at base_delay, and the loop has
# just started: it waits 80-100 % of conflict_spread slots times how much younger its batch is
# than the winners', as a share of their age, or, past sit_out_share, sits the race out.
_SPREAD = AGING.conflict_spread * AGING.base_delay
_SIT_OUT = AGING.sit_out_lag * AGING.base_delay


def test_a_loser_writes_at_once_when_younger_batches_won(store: ObjectStore) -> None:
    assert _pause_after_losing(store, mine_minted=-0.5) == 0.0


def test_a_loser_minted_just_now_sits_the_next_race_out(store: ObjectStore) -> None:
    # It reads again a moment later instead of writing (a write that would lose to the
    # older writers' write): the older writer's write lands during that moment, and the
    # loser's write goes on top of it, with no second lost race.
    rival = QueueProducer(store, MANIFEST, retry=FAST_RETRY, clock=FakeClock())
    older = pending(1, tag="older")
    landed: list[tuple[int, ...]] = []

    def older_writer_lands(seconds: float) -> None:
        if seconds > 0 and not landed:  # the pause after the read, not the lost race's 0
            landed.append(rival.append(older))

    pause = _pause_after_losing(store, mine_minted=1.0, during_pause=older_writer_lands)
    assert pause == pytest.approx(_SIT_OUT)
    assert landed  # the older write landed while the loser sat the race out
    locations = _locations(store)
    assert len(locations) == 4  # first, theirs, the older writer's, then the loser's
    assert locations[2] == older[0].location


def test_a_loser_that_does_not_sit_out_lets_older_batches_go_first(store: ObjectStore) -> None:
    never = dataclasses.replace(AGING, sit_out_share=1.0)
    clock = FakeClock()
    minter = UlidMinter(clock)
    mine = QueueProducer(store, MANIFEST, retry=never, clock=clock)
    mine.append(pending(1, tag="first"))
    clock.sleep(100.0)
    theirs = pending(1, tag="theirs", minter=minter)
    clock.sleep(1.0)
    group = pending(1, tag="mine", minter=minter)
    QueueProducer(store, MANIFEST, retry=FAST_RETRY, clock=FakeClock()).append(theirs)
    clock.slept.clear()
    mine.append(group)
    spread = never.conflict_spread * never.base_delay
    assert 0.8 * spread <= sum(clock.slept) <= spread


def test_a_loser_nearly_as_old_as_the_winners_lets_them_go_first_only_for_a_moment(
    store: ObjectStore,
) -> None:
    # Minted 100 ms after batches one second old: a tenth of the pause of a fresh batch, so
    # the writers line up by age instead of the ones that happen to read first going first.
    pause = _pause_after_losing(store, mine_minted=0.1)
    assert 0.8 * 0.1 * _SPREAD - 1e-12 <= pause <= 0.1 * _SPREAD + 1e-12


def test_what_became_ready_while_a_writer_let_others_go_first_joins_its_write(
    store: ObjectStore,
) -> None:
    clock = FakeClock()
    mine = QueueProducer(store, MANIFEST, retry=AGING, clock=clock)
    mine.append(pending(1, tag="first"))
    QueueProducer(store, MANIFEST, retry=FAST_RETRY, clock=FakeClock()).append(pending(1))
    mine.append(pending(1, tag="lost-once"))  # loses one race: this writer is contended now
    conflicts = mine.counters.get("cas_conflicts")
    clock.slept.clear()
    group, later = pending(2, tag="group"), pending(2, tag="later")
    ready = _Ready(later)
    assert mine.append(group, more=ready) == (3, 4, 5, 6)
    assert sum(clock.slept) > 0  # it yielded before its first write ...
    assert ready.calls == 1  # ... and took what became ready meanwhile into that write
    assert mine.counters.get("cas_conflicts") == conflicts
    assert _locations(store)[3:] == [e.location for e in group + later]
