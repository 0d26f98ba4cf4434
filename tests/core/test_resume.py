"""A lost race looks only at what the winners appended (``resume_after``), with the same answer.

After a lost compare-and-swap the writer looks for its own entries (did the write land after
all?) and reads the winners' batch names. Both used to walk every entry of the manifest, so a
lost race cost CPU in proportion to the backlog (2.2 ms at 2,000 entries, 20 ms at 20,000, for
every loser of every round). They now start where the state the write was conditional on
ended, when the later state still begins with all of its bytes. These tests hold the answers
to those of a whole walk, over random histories of appends, dequeues and epoch bumps, and
check that a resume point is refused whenever the earlier entries are not all still there.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from millpond.errors import MillpondError
from millpond.formats.manifest import (
    Metadata,
    PendingEntry,
    append_entries,
    decode_footer,
    empty_manifest,
    find_locations,
    locations_from,
    remove_through,
    resume_after,
    with_epoch,
)
from millpond.queue.landed import resolve_landing

# One step of another writer between the earlier state and the later one.
_STEP = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 4)),
    st.tuples(st.just("dequeue"), st.integers(0, 6)),
    st.tuples(st.just("epoch"), st.just(0)),
)


def _entries(tag: str, n: int) -> list[PendingEntry]:
    return [
        PendingEntry(f"ingest/{tag}-{i}.batch", (Metadata(0, 1_700_000_000_000, tag.encode()),))
        for i in range(n)
    ]


def _apply(raw: bytes, step: tuple[str, int], tag: str) -> bytes:
    kind, amount = step
    if kind == "append":
        return append_entries(raw, _entries(tag, amount))[0]
    if kind == "epoch":
        return with_epoch(raw, decode_footer(raw).epoch + 1)
    first = decode_footer(raw).next_sequence - decode_footer(raw).entry_count
    through = min(first + amount - 1, decode_footer(raw).next_sequence - 1)
    return remove_through(raw, through)[0] if through >= first else raw


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 12),
    st.lists(_STEP, max_size=4),
    st.integers(1, 3),
    st.booleans(),
    st.integers(-2, 2),
)
def test_resumed_walks_answer_as_whole_walks(
    backlog: int, before: list[tuple[str, int]], mine: int, landed: bool, shift: int
) -> None:
    earlier = append_entries(empty_manifest(), _entries("old", backlog))[0]
    own = _entries("own", mine)
    later = earlier
    if landed:  # our write landed after all, then the others went on
        later = append_entries(later, own)[0]
    for i, step in enumerate(before):
        later = _apply(later, step, f"w{i}")
    resume = resume_after(earlier, later)
    if resume is not None:
        # The earlier state's entries are all still there, byte for byte.
        assert later.startswith(earlier[: len(earlier) - 22])
        assert resume.next_sequence == decode_footer(earlier).next_sequence
    from_sequence = max(0, decode_footer(earlier).next_sequence + shift)
    wanted = {e.location for e in own}
    assert find_locations(later, wanted, from_sequence=from_sequence, resume=resume) == (
        find_locations(later, wanted, from_sequence=from_sequence)
    )
    assert locations_from(later, from_sequence, resume=resume) == locations_from(
        later, from_sequence
    )
    locations = [e.location for e in own]
    assert _outcome(
        lambda: resolve_landing(later, locations, from_sequence=from_sequence, resume=resume)
    ) == _outcome(lambda: resolve_landing(later, locations, from_sequence=from_sequence))


def _outcome(call: Callable[[], object]) -> object:
    """What ``call`` returns, or the type and message of what it raises."""
    try:
        return call()
    except MillpondError as err:
        return (type(err), str(err))


def test_a_resume_point_is_refused_once_an_entry_is_dequeued() -> None:
    earlier = append_entries(empty_manifest(), _entries("old", 3))[0]
    appended = append_entries(earlier, _entries("new", 2))[0]
    assert resume_after(earlier, appended) is not None
    assert resume_after(earlier, remove_through(appended, 0)[0]) is None
    # An epoch bump rewrites only the footer: every entry is still where it was.
    bumped = with_epoch(appended, 7)
    resume = resume_after(earlier, bumped)
    assert resume is not None
    assert locations_from(bumped, 3, resume=resume) == ["ingest/new-0.batch", "ingest/new-1.batch"]
    # The earlier state itself, unchanged: nothing after it.
    assert locations_from(earlier, 3, resume=resume_after(earlier, earlier)) == []
