"""A conditional write held back in the network lands later, under its own precondition: a
writer must keep it in doubt until the manifest has left the state it was conditional on.

Found by the whole-system checker (seed 538, 1 run in ~30: "a location twice in one
manifest"): a write held back and reported as a timeout; the look right after it still saw
the manifest at the write's ETag (nothing had landed yet), so the writer wrote the group
again; that write failed before it was sent (the store was down), the held write landed
meanwhile, and the writer — sure that nothing of its own could be in the manifest after a
write that was never sent — appended the same location a second time.

Every store here is real (the ``any_store_target`` servers); only the timing of one request
is arranged.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from millpond.common.retry import RetryPolicy
from millpond.errors import CommitStateUnknownError, StorageError
from millpond.formats.manifest import PendingEntry
from millpond.queue import QueueProducer, read_manifest
from millpond.storage.store import ForwardingStore, ObjectStore
from tests.support import StoreTarget

from ._helpers import FAST_RETRY, MANIFEST, FakeClock, open_target, pending


@pytest.fixture
def store(any_store_target: StoreTarget) -> ObjectStore:
    return open_target(any_store_target)


class _Holding(ForwardingStore):
    """Conditional manifest writes, as a network can treat them: ``hold`` holds the next one
    back (the writer sees a timeout) until ``land_held()`` sends it, still conditional on its
    ETag; ``unsent`` fails the next ones before they are sent, running ``on_unsent`` first."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.hold = False
        self.held: Callable[[], str | None] | None = None
        self.unsent = 0
        self.on_unsent: Callable[[], object] | None = None

    def land_held(self) -> None:
        assert self.held is not None, "no write was held back"
        self.held()

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        if self.hold:
            self.hold = False
            self.held = lambda: self.inner.put_if_match(path, data, etag)
            raise CommitStateUnknownError(f"{path}: injected timeout (request held back)")
        if self.unsent:
            self.unsent -= 1
            if self.on_unsent is not None:
                self.on_unsent()
            raise StorageError(f"{path}: injected failure before sending")
        return self.inner.put_if_match(path, data, etag)


def _locations(store: ObjectStore) -> list[str]:
    return [e.location for e in read_manifest(store, MANIFEST).manifest.entries]


def test_a_held_write_landing_while_the_retry_was_not_sent_is_not_appended_twice(
    store: ObjectStore,
) -> None:
    holding = _Holding(store)
    mine = QueueProducer(holding, MANIFEST, retry=FAST_RETRY, clock=FakeClock())
    mine.append(pending(1, tag="first"))
    group = pending(1, tag="group")
    holding.hold = True  # the first write of the group is held back ...
    holding.unsent = 1  # ... and the retry fails unsent, while the held one lands
    holding.on_unsent = holding.land_held
    sequences = mine.append(group)
    assert _locations(store) == [_locations(store)[0], group[0].location]
    assert sequences == (1,)


def test_an_append_that_gives_up_with_a_write_held_back_does_not_say_nothing_landed(
    store: ObjectStore,
) -> None:
    holding = _Holding(store)
    retry = RetryPolicy(max_attempts=2, max_elapsed=3600.0, base_delay=0.001, max_delay=0.01)
    mine = QueueProducer(holding, MANIFEST, retry=retry, clock=FakeClock())
    mine.append(pending(1, tag="first"))
    group = pending(2, tag="group")
    holding.hold = True
    holding.unsent = 1  # the retry is never sent, and the budget runs out
    with pytest.raises(CommitStateUnknownError) as raised:
        mine.append(group)
    # The held write can still land: the caller must look before appending again.
    assert raised.value.maybe_landed_from == 1
    holding.land_held()
    assert mine.append(group) == (1, 2)  # settled by the look, not written again
    assert _locations(store)[1:] == [e.location for e in group]


def test_a_held_write_landing_before_the_next_call_is_found_by_it(store: ObjectStore) -> None:
    # The first call stops at its deadline after the held write (the look still saw the
    # manifest at its ETag); the caller appends the same group again in a new call, and the
    # held write lands just before that call's first write, which is never sent.
    holding = _Holding(store)
    clock = FakeClock()
    mine = QueueProducer(holding, MANIFEST, retry=FAST_RETRY, clock=clock)
    mine.append(pending(1, tag="first"))
    group = pending(2, tag="group")
    holding.hold = True
    with pytest.raises(CommitStateUnknownError):
        mine.append(group, deadline=clock.monotonic() + 1e-9)
    assert _locations(store)[1:] == []  # nothing of the group is in yet
    holding.unsent = 1
    holding.on_unsent = holding.land_held
    assert mine.append(group) == (1, 2)
    assert _locations(store)[1:] == [e.location for e in group]


def _died_with_a_write_held_back(store: ObjectStore) -> tuple[_Holding, list[PendingEntry]]:
    """A run appended one entry, then died with its write of a two-entry group held back."""
    holding = _Holding(store)
    dead = QueueProducer(holding, MANIFEST, retry=FAST_RETRY, clock=FakeClock())
    dead.append(pending(1, tag="first"))
    group = pending(2, tag="group")
    holding.hold = True
    with pytest.raises(CommitStateUnknownError):
        dead.append(group, deadline=FakeClock().monotonic() + 1e-9)
    return holding, group


@pytest.mark.parametrize("told", [True, False], ids=["told", "not-told"])
def test_a_write_of_a_run_that_died_lands_after_the_next_run_looked(
    store: ObjectStore, told: bool
) -> None:
    # The first run's write is held back and the run dies. The next run looks (nothing of the
    # group is in: the manifest is still at the held write's ETag) and appends the group; its
    # first write is never sent, and the held write lands meanwhile. Told what its look saw
    # (``in_doubt_from``, as the producer's committer does for replayed batches), the next
    # run finds the group; not told, it cannot know and writes it twice — which is why the
    # committer tells it.
    holding, group = _died_with_a_write_held_back(store)
    looked = read_manifest(store, MANIFEST).manifest
    assert looked.next_sequence == 1
    again = QueueProducer(holding, MANIFEST, retry=FAST_RETRY, clock=FakeClock())
    if told:
        again.in_doubt_from(looked.next_sequence)
    holding.unsent = 1
    holding.on_unsent = holding.land_held
    sequences = again.append(group)
    if told:
        assert sequences == (1, 2)
        assert _locations(store)[1:] == [e.location for e in group]
    else:
        assert _locations(store)[1:] == [e.location for e in group + group]


def test_a_run_in_doubt_looks_again_before_each_call_not_only_the_first(
    store: ObjectStore,
) -> None:
    # Whole-system seed 51017 (under load, 4 of 4 replays): the dead run's held write of two
    # batches landed during the next run's first call, which appended only the first of them
    # (the second was still being uploaded again) and found it landed. The second call wrote
    # on the manifest the first call had read, which it kept without looking: the second batch
    # was in it already, and went in twice.
    holding, group = _died_with_a_write_held_back(store)
    again = QueueProducer(holding, MANIFEST, retry=FAST_RETRY, clock=FakeClock())
    again.in_doubt_from(read_manifest(store, MANIFEST).manifest.next_sequence)
    holding.land_held()
    assert again.append(group[:1]) == (1,)  # found by the look, not written
    assert again.append(group[1:]) == (2,)
    assert _locations(store)[1:] == [e.location for e in group]


class _LosesFirst(ForwardingStore):
    """The first conditional manifest write loses its race: ``rival`` lands just before it."""

    def __init__(self, inner: ObjectStore, rival: Callable[[], object]) -> None:
        super().__init__(inner)
        self.rival: Callable[[], object] | None = rival

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        rival, self.rival = self.rival, None
        if rival is not None:
            rival()
        return self.inner.put_if_match(path, data, etag)


def test_batches_a_run_in_doubt_takes_in_after_a_lost_race_are_looked_for_too(
    store: ObjectStore,
) -> None:
    # The dead run's write of batch B landed; the next run appends batch A, loses a race, and
    # takes B (ready meanwhile) into its next write: B is in the manifest already.
    dead = QueueProducer(store, MANIFEST, retry=FAST_RETRY, clock=FakeClock())
    dead.append(pending(1, tag="first"))
    looked = read_manifest(store, MANIFEST).manifest.next_sequence
    b = pending(1, tag="b")
    dead.append(b)  # the dead run's write, landed after the next run's look
    a = pending(1, tag="a")
    rival = QueueProducer(store, MANIFEST, retry=FAST_RETRY, clock=FakeClock())
    c = pending(1, tag="c")
    again = QueueProducer(
        _LosesFirst(store, lambda: rival.append(c)), MANIFEST, retry=FAST_RETRY, clock=FakeClock()
    )
    again.in_doubt_from(looked)
    assert again.append(a, more=lambda: b) == (3, 1)
    assert _locations(store)[1:] == [e.location for e in b + c + a]


def test_entries_another_writer_appended_are_not_written_again_on_a_cached_state(
    store: ObjectStore,
) -> None:
    """``present_from`` (a coordinator's client may have appended its entries directly):
    an entry already in the queue from that sequence on is not written again — also when the
    manifest is not read for the call, because the writer writes on the state it wrote last.

    Found by the whole-system checker (seed 550989, about 1 run in 10: "a location twice in
    one manifest"): a producer's own write, held back in the network, landed just before the
    coordinator hosted by the other producer created the manifest; the coordinator read it,
    wrote its round on top, and kept that state. The producer then sent the same location
    through the coordinator, which wrote its next round on the state it kept — the location
    in it since its read, looked for only in states it read."""
    other = QueueProducer(store, MANIFEST, retry=FAST_RETRY)
    writer = QueueProducer(store, MANIFEST, retry=FAST_RETRY)
    first, second, third = pending(3)
    assert other.append([first]) == (0,)
    assert writer.append([second]) == (1,)  # reads the manifest, keeps what it wrote
    assert writer.append([first, third], present_from=0) == (0, 2)
    assert _locations(store) == [first.location, second.location, third.location]
