"""The fenced-object primitive every consumer-side write goes through: a write lands only over
the version checked under the holder's epoch; a newer holder's version fences, writing
nothing; a no-op answer can be required to come from a read in the same call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from millpond.common.clock import SystemClock
from millpond.common.retry import RetryPolicy
from millpond.errors import FencedError, StorageError
from millpond.queue import read_epoch_mark
from millpond.queue.epoch_mark import epoch_mark_path, write_epoch_mark
from millpond.queue.fenced import FencedObject, Version
from millpond.storage.file_store import FileStore

PATH = "q/_millpond/thing"


def _object(store: FileStore, epoch: int) -> FencedObject[int]:
    def check(found: int) -> None:
        if found > epoch:
            raise FencedError(f"epoch {found} > {epoch}", expected_epoch=epoch, found_epoch=found)

    return FencedObject(
        store,
        PATH,
        decode=lambda data: int(data),
        encode=lambda value: str(value).encode(),
        check=check,
        retry=RetryPolicy(max_attempts=5, base_delay=0.001, max_delay=0.001),
        clock=SystemClock(),
    )


def test_an_update_creates_then_replaces_only_the_version_it_read(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    holder = _object(store, 3)
    created = holder.update(lambda value: 3 if value is None else None, what="write")
    assert created.wrote
    assert created.version.value == 3
    # Someone else changes it: a write starting from the old version loses, reads, and
    # prepares again from what is there now.
    store.put(PATH, b"2")
    seen: list[int | None] = []

    def prepare(value: int | None) -> int:
        seen.append(value)
        return 3

    done = holder.update(prepare, what="write", known=created.version)
    assert seen == [3, 2]
    assert done.wrote
    assert int(store.get(PATH).data) == 3


def test_a_newer_holders_version_fences_and_nothing_is_written(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put(PATH, b"4")
    before = store.get(PATH)
    with pytest.raises(FencedError, match="epoch 4 > 3"):
        _object(store, 3).update(lambda value: 3, what="write")
    assert store.get(PATH).etag == before.etag


def test_a_no_op_from_an_old_version_is_proved_by_a_read_when_asked(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put(PATH, b"4")  # a newer holder, unseen by the version this one kept
    old = Version(3, "stale-etag")
    holder = _object(store, 3)
    assert not holder.update(lambda value: None, what="write", known=old).wrote  # not proved
    with pytest.raises(FencedError):
        holder.update(lambda value: None, what="write", known=old, prove=True)


def test_a_lost_race_past_the_budget_names_the_object(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put(PATH, b"1")
    others = iter(range(-100, 0))

    def prepare(value: int | None) -> int:
        store.put(PATH, str(next(others)).encode())  # another writer, every time
        return 2

    with pytest.raises(StorageError, match=r"q/_millpond/thing: write gave up after 5 attempts"):
        _object(store, 3).update(prepare, what="write")


def test_a_fenced_consumers_late_epoch_record_never_lowers_its_successors(
    tmp_path: Path,
) -> None:
    """Before the record went through the primitive it was a plain PUT: the older consumer's
    record, landing after its successor's, left the lower epoch there."""
    store = FileStore(tmp_path)
    write_epoch_mark(store, "ingest", "ingest/manifest", 6)
    write_epoch_mark(store, "ingest", "ingest/manifest", 5)  # the fenced one, late
    assert read_epoch_mark(store, "ingest") == 6
    write_epoch_mark(store, "ingest", "ingest/manifest", 7)
    record = json.loads(store.get(epoch_mark_path("ingest")).data)
    assert record == {"version": 1, "manifest_path": "ingest/manifest", "epoch": 7}
