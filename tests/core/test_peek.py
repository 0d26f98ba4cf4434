"""A contended writer reads the manifest alongside its write (``millpond.queue.peek``): a lost
race then costs one round trip, and the read is used only when it cannot mislead.

The dangerous orders are forced, not hoped for: the read is held until the write has been
answered (it then shows the state that beat the write, or the write itself when that landed
but reported failure), or answered before the rival's write (it then shows the very state the
write was conditional on, tells nothing, and must be dropped). Every store is real (the
``any_store_target`` servers).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import pytest

from millpond.common.retry import RetryPolicy
from millpond.errors import ConflictError, StorageError
from millpond.formats.manifest import PendingEntry
from millpond.queue import QueueProducer, read_manifest
from millpond.queue import append as append_module
from millpond.queue.cas import RawManifest
from millpond.queue.peek import Peek
from millpond.storage.store import ForwardingStore, GetResult, ObjectStore
from tests.support import StoreTarget

from ._helpers import FAST_RETRY, MANIFEST, FakeClock, FaultyStore, open_target, pending

# Never sitting a race out: these tests count the reads one lost race makes, and a loop that
# sits the next race out reads once more (tests/core/test_lost_race.py). One read alongside
# a write, but where the second read is the point.
AGING = RetryPolicy(
    strategy="aging",
    max_elapsed=60.0,
    base_delay=0.05,
    max_delay=1.0,
    sit_out_share=1.0,
    peek_again_lag=0.0,
)
_WAIT = 30.0  # seconds; a deadline for what the test waits on, never reached when it passes


@pytest.fixture
def store(any_store_target: StoreTarget) -> ObjectStore:
    return open_target(any_store_target)


class _HeldReads(ForwardingStore):
    """Manifest reads made on threads other than the test's wait for ``release``; each read
    answered sets ``answered``. ``rearm()`` answers every read held so far and holds the
    later ones afresh, so a read left over from an earlier append cannot stand in for the
    one the test is about."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.release = threading.Event()
        self.answered = threading.Event()
        self.own_reads = 0  # made by the writer's own thread: re-reads after a lost race
        self._main = threading.get_ident()
        self._held = 0
        self._entered = 0
        self._idle = threading.Condition()

    def get(self, path: str) -> GetResult:
        if threading.get_ident() == self._main:
            self.own_reads += 1
            return self.inner.get(path)
        release, answered = self.release, self.answered  # this read's gate
        with self._idle:
            self._held += 1
            self._entered += 1
            self._idle.notify_all()
        try:
            if not release.wait(_WAIT):
                raise AssertionError("the read alongside the write was never released")
            got = self.inner.get(path)
            answered.set()
            return got
        finally:
            with self._idle:
                self._held -= 1
                self._idle.notify_all()

    def rearm(self, sent: int) -> None:
        """Once ``sent`` side reads have arrived (a read's thread may still be on its way
        when the write it follows has returned), answer them all and hold later ones."""
        with self._idle:
            assert self._idle.wait_for(lambda: self._entered >= sent, _WAIT)
        self.release.set()
        with self._idle:
            assert self._idle.wait_for(lambda: self._held == 0, _WAIT)
        self.release, self.answered = threading.Event(), threading.Event()


def _rival(store: ObjectStore) -> QueueProducer:
    """Another writer on the plain store, whose appends beat ours."""
    return QueueProducer(store, MANIFEST, retry=FAST_RETRY, clock=FakeClock())


def _contended(
    store: ObjectStore, rival: QueueProducer, retry: RetryPolicy = AGING
) -> QueueProducer:
    """A writer on ``store`` that has just lost a race (so it reads alongside its writes)."""
    mine = QueueProducer(store, MANIFEST, retry=retry, clock=FakeClock())
    mine.append(pending(1, tag="first"))
    rival.append(pending(1, tag="rival-first"))
    mine.append(pending(1, tag="lost-once"))
    assert mine.counters.get("cas_conflicts") == 1
    if isinstance(store, ForwardingStore) and isinstance(store.inner, _HeldReads):
        # The retry above won, and a read was sent alongside it (the writer was contended
        # by then): answer it, so that it cannot stand in for the read the test is about.
        store.inner.rearm(sent=1)
    return mine


class _SideReadsInTurn(ForwardingStore):
    """Once armed, the n-th manifest read made off the test's thread waits for ``gates[n]``
    and sets ``answered[n]``; reads past the gates, and all before arming, go through."""

    def __init__(self, inner: ObjectStore, gates: int) -> None:
        super().__init__(inner)
        self.gates = [threading.Event() for _ in range(gates)]
        self.answered = [threading.Event() for _ in range(gates)]
        self.own_reads = 0
        self._main = threading.get_ident()
        self._entered = 0
        self._armed_from: int | None = None
        self._changed = threading.Condition()

    def arm(self, sent: int) -> None:
        """Gate the side reads after the first ``sent`` (those of earlier appends)."""
        with self._changed:
            assert self._changed.wait_for(lambda: self._entered >= sent, _WAIT)
            self._armed_from = self._entered

    def get(self, path: str) -> GetResult:
        if threading.get_ident() == self._main:
            self.own_reads += 1
            return self.inner.get(path)
        with self._changed:
            turn = self._entered - (self._armed_from or 0)
            self._entered += 1
            self._changed.notify_all()
        if self._armed_from is None or turn >= len(self.gates):
            return self.inner.get(path)
        if not self.gates[turn].wait(_WAIT):
            raise AssertionError(f"side read {turn} was never released")
        try:
            return self.inner.get(path)
        finally:
            self.answered[turn].set()


def test_a_second_read_tells_the_lost_race_the_first_read_was_too_early_for(
    store: ObjectStore,
) -> None:
    # The store serves the first read alongside our write before the rival's write (as
    # SeaweedFS does for about one in five): it shows nothing new. The second, a moment
    # later, shows the rival's state, and the next write goes out on it without a read of
    # the writer's own (a round trip at 50 ms a request).
    twice = dataclasses.replace(AGING, peek_lag=0.03, peek_again_lag=0.12)
    reads = _SideReadsInTurn(store, gates=2)
    faulty = FaultyStore(reads)
    rival = _rival(store)
    mine = _contended(faulty, rival, twice)
    reads.arm(sent=2)  # the two sent alongside the write that won in _contended
    theirs, group = pending(2, tag="theirs"), pending(2, tag="group")

    def first_read_then_rival_then_second() -> None:
        reads.gates[0].set()
        assert reads.answered[0].wait(_WAIT)
        rival.append(theirs)
        reads.gates[1].set()

    faulty.fail_next(land=True, error=None, before=first_read_then_rival_then_second)
    own_reads, conflicts = reads.own_reads, mine.counters.get("cas_conflicts")
    sequences = mine.append(group)
    assert mine.counters.get("cas_conflicts") == conflicts + 1
    assert reads.own_reads == own_reads  # told by the second read, not by a read of its own
    assert _locations(store)[-4:] == [e.location for e in theirs + group]
    assert len(set(_locations(store))) == len(_locations(store))
    assert sequences == (len(_locations(store)) - 2, len(_locations(store)) - 1)


def _answer_then_append(
    reads: _HeldReads, rival: QueueProducer, entries: list[PendingEntry]
) -> Callable[[], None]:
    """A hook for our write: the read alongside is answered first, on the state the write is
    conditional on; only then does the rival's append land, so the write loses."""

    def hook() -> None:
        reads.release.set()
        assert reads.answered.wait(_WAIT)
        rival.append(entries)

    return hook


def _locations(store: ObjectStore) -> list[str]:
    return [e.location for e in read_manifest(store, MANIFEST).manifest.entries]


def test_a_read_answered_after_the_lost_write_replaces_the_reread(store: ObjectStore) -> None:
    held = _HeldReads(store)
    faulty = FaultyStore(held)
    rival = _rival(store)
    mine = _contended(faulty, rival)
    theirs, group = pending(2, tag="theirs"), pending(2, tag="group")
    # The rival appends just before our write is sent, and only then is the read alongside
    # answered: it shows the state that beat our write.

    def rival_writes_then_read() -> None:
        rival.append(theirs)
        held.release.set()

    faulty.fail_next(land=True, error=None, before=rival_writes_then_read)
    reads, conflicts = held.own_reads, mine.counters.get("cas_conflicts")
    sequences = mine.append(group)
    assert mine.counters.get("cas_conflicts") == conflicts + 1
    # The lost race was answered by the read sent alongside: no re-read after it.
    assert held.own_reads == reads
    assert _locations(store)[-4:] == [e.location for e in theirs + group]
    assert sequences == (len(_locations(store)) - 2, len(_locations(store)) - 1)


def test_a_read_answered_before_the_rival_wrote_is_dropped(store: ObjectStore) -> None:
    held = _HeldReads(store)
    faulty = FaultyStore(held)
    rival = _rival(store)
    mine = _contended(faulty, rival)
    theirs, group = pending(2, tag="theirs"), pending(2, tag="group")
    faulty.fail_next(land=True, error=None, before=_answer_then_append(held, rival, theirs))
    reads = held.own_reads
    sequences = mine.append(group)
    assert mine.counters.get("cas_conflicts") == 2
    # The read alongside showed nothing new: it was dropped and the manifest read again
    # (more than once when the write's answer is slow: a late answer is looked past).
    assert held.own_reads > reads
    assert _locations(store)[-4:] == [e.location for e in theirs + group]
    assert len(set(_locations(store))) == len(_locations(store))
    assert sequences[-1] == len(_locations(store)) - 1


@pytest.mark.parametrize("read_first", [False, True], ids=["read-after", "read-before"])
def test_a_write_that_landed_but_reported_a_conflict_is_not_appended_twice(
    store: ObjectStore, read_first: bool
) -> None:
    # The write lands and then reports a precondition failure (a request obstore retried):
    # a read alongside answered after it shows our own entries; one answered before it shows
    # the state the write was conditional on and is dropped. Either way the look settles it.
    held = _HeldReads(store)
    faulty = FaultyStore(held)
    rival = _rival(store)
    mine = _contended(faulty, rival)
    group = pending(3, tag="group")
    if read_first:
        # Answered on the state before our write landed: it must not count as "not landed".
        def answer_first() -> None:
            held.release.set()
            assert held.answered.wait(_WAIT)

        faulty.fail_next(land=True, error=ConflictError, before=answer_first)
    else:
        faulty.fail_next(land=True, error=ConflictError, hook=held.release.set)
    writes = faulty.conditional_writes
    before = len(_locations(store))
    sequences = mine.append(group)
    assert faulty.conditional_writes == writes + 1  # settled by the look, never written again
    assert _locations(store)[before:] == [e.location for e in group]
    assert sequences == tuple(range(before, before + 3))


class _HeldWrite(ForwardingStore):
    """The next conditional write armed runs ``before`` (another actor's moves), then is held
    back until ``release`` (at most ``_HOLD`` seconds), as SeaweedFS holds a losing
    conditional write for a second, before it reaches the store; ``answered`` is set once it
    has been answered."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.release = threading.Event()
        self.answered = threading.Event()
        self._armed: Callable[[], None] | None = None

    def hold_next(self, before: Callable[[], None]) -> None:
        self._armed = before

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        before, self._armed = self._armed, None
        if before is None:
            return self.inner.put_if_match(path, data, etag)
        try:
            before()
            self.release.wait(_HOLD)
            return self.inner.put_if_match(path, data, etag)
        finally:
            self.answered.set()


_HOLD = 5.0  # seconds a held write waits for the test to release it


def test_a_write_the_read_behind_it_shows_lost_is_not_waited_for(store: ObjectStore) -> None:
    # The store holds our losing write back (SeaweedFS answers some 412s a second late);
    # the read sent behind it already shows the rival's state, so the write cannot land:
    # the append goes on without its answer.
    held = _HeldWrite(store)
    rival = _rival(store)
    mine = _contended(held, rival)
    theirs, group = pending(2, tag="theirs"), pending(2, tag="group")
    held.hold_next(lambda: rival.append(theirs))
    try:
        sequences = mine.append(group)
        assert not held.answered.is_set()  # returned while the lost write was still held
    finally:
        held.release.set()
        assert held.answered.wait(_WAIT)
    assert _locations(store)[-4:] == [e.location for e in theirs + group]
    assert len(set(_locations(store))) == len(_locations(store))
    assert sequences == (len(_locations(store)) - 2, len(_locations(store)) - 1)


def test_a_write_held_back_is_looked_past_by_a_later_read(store: ObjectStore) -> None:
    # The read behind the write is answered before anything happened (it shows the write's
    # own precondition state: nothing learnt); only then does the rival land, while the store
    # still holds our write. A read made while the answer is late shows the rival's state.
    reads = _HeldReads(store)
    held = _HeldWrite(reads)
    rival = _rival(store)
    mine = _contended(held, rival)
    theirs, group = pending(2, tag="theirs"), pending(2, tag="group")
    held.hold_next(_answer_then_append(reads, rival, theirs))
    own_reads = reads.own_reads
    try:
        mine.append(group)
        assert not held.answered.is_set()
    finally:
        held.release.set()
        assert held.answered.wait(_WAIT)
    assert reads.own_reads >= own_reads + 1  # the later look was the writer's own
    assert _locations(store)[-4:] == [e.location for e in theirs + group]
    assert len(set(_locations(store))) == len(_locations(store))


def test_a_write_the_read_behind_it_shows_landed_is_answered_as_a_win(
    store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Our write lands, and its answer comes only after the read behind it, which shows our
    # own state, has been weighed: that is no lost race; the append waits for the answer and
    # keeps the ETag.
    reads = _HeldReads(store)
    faulty = FaultyStore(reads)
    rival = _rival(store)
    mine = _contended(faulty, rival)
    weighed = threading.Event()
    is_written = append_module._is_written

    def watched(data: bytes, state: RawManifest) -> bool:
        try:
            return is_written(data, state)
        finally:
            weighed.set()

    monkeypatch.setattr(append_module, "_is_written", watched)

    def answer_the_read() -> None:
        reads.release.set()
        assert reads.answered.wait(_WAIT)
        weighed.wait(_HOLD)  # the writer has looked at what the read showed

    faulty.fail_next(land=True, error=None, hook=answer_the_read)
    conflicts, own_reads = mine.counters.get("cas_conflicts"), reads.own_reads
    group = pending(2, tag="group")
    mine.append(group)
    assert mine.counters.get("cas_conflicts") == conflicts
    assert reads.own_reads == own_reads
    reads.rearm(sent=1)
    mine.append(pending(1, tag="next"))  # on the ETag its win kept: no read first
    assert reads.own_reads == own_reads
    assert _locations(store)[-3:-1] == [e.location for e in group]


class _Tagged:
    def __init__(self, etag: str | None) -> None:
        self.etag = etag


def test_a_peek_tells_only_a_moved_state() -> None:
    assert Peek(lambda: _Tagged("e1"), 0.0).moved_from("e0") is not None
    assert Peek(lambda: _Tagged("e0"), 0.0).moved_from("e0") is None
    assert Peek(lambda: _Tagged(None), 0.0).moved_from("e0") is None
    assert Peek(lambda: None, 0.0).moved_from("e0") is None  # no manifest


def _in_turn(*etags: str) -> Callable[[], _Tagged]:
    """A read answering ``etags`` in turn, whichever thread asks."""
    answers = iter([_Tagged(etag) for etag in etags])
    lock = threading.Lock()

    def read() -> _Tagged:
        with lock:
            return next(answers)

    return read


def test_of_two_reads_the_one_that_shows_a_moved_state_tells() -> None:
    for first, second in (("e0", "e1"), ("e1", "e0")):
        moved = Peek(_in_turn(first, second), 0.0, again=0.01).moved_from("e0")
        assert moved is not None
        assert moved.etag == "e1"
    assert Peek(lambda: _Tagged("e0"), 0.0, again=0.01).moved_from("e0") is None


def test_a_failed_or_late_peek_tells_nothing() -> None:
    def failing() -> _Tagged:
        raise StorageError("manifest: injected")

    assert Peek(failing, 0.0).moved_from("e0") is None
    gate = threading.Event()

    def late() -> _Tagged:
        gate.wait(_WAIT)
        return _Tagged("e1")

    peek = Peek(late, 0.0)
    assert peek.moved_from("e0") is None  # not back within its wait: read again instead
    gate.set()
