"""The writer says where appends in doubt landed (``QueueProducer.landings``): one read of the
manifest, a verdict per group, and a write a crashed run may still have in flight kept in doubt.
"""

from __future__ import annotations

from pathlib import Path

from millpond.formats.manifest import PendingEntry, append_entries, empty_manifest, remove_through
from millpond.queue import LandingStatus, QueueProducer
from millpond.storage.file_store import FileStore

from ._helpers import FAST_RETRY, MANIFEST, FakeClock


def _entries(*names: str) -> list[PendingEntry]:
    return [PendingEntry(f"ingest/{name}") for name in names]


def test_landings_gives_each_verdict_from_one_read(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    writer = QueueProducer(store, MANIFEST, retry=FAST_RETRY, clock=FakeClock())
    none = writer.landings()  # no manifest yet: an empty one
    assert none.next_sequence == 0
    assert none.of(["ingest/a"]).status is LandingStatus.NOT_LANDED
    # x0 x1 a b y at 0..4; the consumer dequeued through 2 (x0, x1, a).
    raw, _ = append_entries(empty_manifest(), _entries("x0", "x1", "a", "b", "y"))
    store.put(MANIFEST, remove_through(raw, 2)[0])
    found = writer.landings(recovered=True)
    assert found.next_sequence == 5

    landed = found.of(["ingest/a", "ingest/b"], from_sequence=2)
    assert (landed.status, landed.sequences, landed.dequeued) == (
        LandingStatus.LANDED,
        (2, 3),
        frozenset({0}),
    )
    partial = found.of(["ingest/a", "ingest/b", "ingest/c"], from_sequence=2)
    assert (partial.status, partial.sequences, partial.missing) == (
        LandingStatus.PARTIAL,
        (2, 3, None),
        (2,),
    )
    assert found.of(["ingest/z"], from_sequence=3).status is LandingStatus.NOT_LANDED
    assert found.of(["ingest/z"], from_sequence=1).status is LandingStatus.UNKNOWN
    # One batch bound to several locations: the last one found wins.
    rebound = found.of_any(["ingest/old", "ingest/b", "ingest/new"])
    assert (rebound.status, rebound.sequences, rebound.location) == (
        LandingStatus.LANDED,
        (3,),
        "ingest/b",
    )
    assert found.of_any(["ingest/old", "ingest/new"]).status is LandingStatus.UNKNOWN

    # ``recovered``: the crashed run's write of c, conditional on the state read, lands after
    # the look; the writer's next append finds it there instead of appending it again.
    late, _ = append_entries(store.get(MANIFEST).data, _entries("c"))
    store.put(MANIFEST, late)
    assert writer.append(_entries("c")) == (5,)
    assert store.get(MANIFEST).data == late
