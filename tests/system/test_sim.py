"""The simulated store keeps the timing assumption: a late manifest write never lands."""

from __future__ import annotations

import threading
import uuid

import pytest

from millpond.errors import CommitStateUnknownError
from millpond.formats.manifest import empty_manifest
from millpond.queue.peek import Peek
from millpond.storage import GetResult, open_store
from tests.system.runtime import Runtime
from tests.system.sim import Fault, Recorder, RoleStore, SimClock, inherit_clock_readings

MANIFEST = "q/manifest"
LIMIT = 30.0


def _world() -> tuple[SimClock, Recorder, str | None]:
    clock = SimClock()
    inner = open_store(f"memory://sim-{uuid.uuid4().hex}")
    recorder = Recorder(inner, clock, [MANIFEST], in_flight_limit=LIMIT)
    etag = recorder.put_if_absent(MANIFEST, empty_manifest())
    return clock, recorder, etag


def _store(recorder: Recorder, *, bounded: bool = True) -> RoleStore:
    return RoleStore(recorder, "p0", lambda: False, bounded=bounded)


@pytest.mark.parametrize(("moved", "lands"), [(LIMIT - 1, True), (LIMIT + 1, False)])
def test_a_manifest_write_lands_only_within_the_limit_of_the_reading_it_was_sent_on(
    moved: float, lands: bool
) -> None:
    clock, recorder, etag = _world()
    assert etag is not None
    store = _store(recorder)
    clock.monotonic()  # the sender checks its deadline
    clock.advance(moved)  # the schedule moves on while the sender is descheduled
    data = empty_manifest(next_sequence=5)
    if lands:
        store.put_if_match(MANIFEST, data, etag)
        assert recorder.late == []
    else:
        with pytest.raises(CommitStateUnknownError, match="outlived the timing assumption"):
            store.put_if_match(MANIFEST, data, etag)
        assert len(recorder.late) == 1
    assert (recorder.get(MANIFEST).data == data) is lands


def test_the_limit_counts_from_the_sending_threads_own_reading() -> None:
    clock, recorder, etag = _world()
    assert etag is not None
    store = _store(recorder)
    clock.monotonic()
    clock.advance(LIMIT + 1)
    other = threading.Thread(target=clock.monotonic)  # another thread's reading is not ours
    other.start()
    other.join()
    with pytest.raises(CommitStateUnknownError):
        store.put_if_match(MANIFEST, empty_manifest(next_sequence=1), etag)
    clock.monotonic()  # a fresh check: sent now, it lands
    store.put_if_match(MANIFEST, empty_manifest(next_sequence=1), etag)


def test_a_held_write_released_past_the_limit_never_lands() -> None:
    clock, recorder, etag = _world()
    assert etag is not None
    store = _store(recorder)
    store.arm(Fault("cas", "hold"))
    clock.monotonic()
    with pytest.raises(CommitStateUnknownError, match="held back"):
        store.put_if_match(MANIFEST, empty_manifest(next_sequence=7), etag)
    clock.advance(LIMIT + 1)
    recorder.release_held()
    assert recorder.get(MANIFEST).etag == etag
    assert len(recorder.late) == 1


def test_roles_without_a_deadline_and_batch_writes_are_not_bounded() -> None:
    clock, recorder, etag = _world()
    assert etag is not None
    clock.monotonic()
    clock.advance(LIMIT * 10)
    _store(recorder).put("q/data/x.batch", b"late but harmless")
    _store(recorder, bounded=False).put_if_match(MANIFEST, empty_manifest(next_sequence=2), etag)
    assert recorder.late == []


def test_a_write_sent_on_a_thread_peek_starts_counts_from_its_makers_reading() -> None:
    """``Peek.outrun`` sends a contended write on a thread of its own, right after the writer
    checked its deadline: that reading bounds it (seed 560703's unbounded writes)."""
    clock, recorder, etag = _world()
    assert etag is not None
    store = _store(recorder)
    runtime = Runtime(0, clock)
    runtime.spawn_hooks.append(inherit_clock_readings)
    with runtime:  # the threads Peek starts are the runtime's
        clock.monotonic()  # the writer checks its deadline
        clock.advance(LIMIT + 1)  # and is descheduled while the schedule moves on
        peek: Peek[GetResult] = Peek(lambda: None, 0.0)
        with pytest.raises(CommitStateUnknownError, match="outlived the timing assumption"):
            peek.outrun(
                lambda: store.put_if_match(MANIFEST, empty_manifest(next_sequence=3), etag),
                etag,
                lambda state: False,
            )
    assert recorder.get(MANIFEST).etag == etag
    assert len(recorder.late) == 1
