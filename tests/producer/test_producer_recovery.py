"""Replaying the WAL on start: every crash window between BIND, PUT, CAS and release.

Each test builds the WAL (and the store) exactly as a producer that died at one point would
have left them, then starts a producer on it and checks that the data is published once.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from millpond import ClosedError, FormatError, ObjectStore
from millpond.common.clock import SystemClock
from millpond.common.retry import RetryPolicy
from millpond.common.ulids import UlidMinter, batch_location
from millpond.formats.batch import encode_batch
from millpond.formats.manifest import Metadata, PendingEntry
from millpond.formats.wal import BindBody
from millpond.producer import Producer
from millpond.queue import QueueProducer
from millpond.wal import Wal
from tests.producer.producer_support import (
    MANIFEST,
    PREFIX,
    ControlledStore,
    all_entries,
    claim_queue,
    config,
    fresh_memory,
    read_back,
)
from tests.support import TestClockStore

_CALLS = [(1_700_000_000_000 + i, b"m%d" % i, [b"e%d-a" % i, b"e%d-b" % i]) for i in range(3)]


class _OldClock:
    """A wall clock an hour behind, to mint ULIDs that look stale."""

    def now_ms(self) -> int:
        import time

        return time.time_ns() // 1_000_000 - 3_600_000

    def monotonic(self) -> float:
        import time

        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        threading.Event().wait(seconds)


def _stage(wal_dir: Path, *, bind: bool, count: int | None = None, stale: bool = False) -> str:
    """A WAL holding three produce() calls, bound to one location when ``bind``."""
    minter = UlidMinter(_OldClock() if stale else None)
    location = batch_location(PREFIX, minter.mint())
    with Wal.open(wal_dir) as wal:
        wal.append_data(_CALLS)
        if bind:
            wal.append_bind(BindBody(0, 2, 3 if count is None else count, location))
        wal.sync()
    return location


def _batch_bytes() -> bytes:
    return encode_batch([e for _, _, entries in _CALLS for e in entries])


def _entry(location: str) -> PendingEntry:
    items = tuple(Metadata(2 * i, when, meta) for i, (when, meta, _) in enumerate(_CALLS))
    return PendingEntry(location, items)


def _expected_entries() -> list[bytes]:
    return [e for _, _, entries in _CALLS for e in entries]


def _wal_is_empty(wal_dir: Path) -> bool:
    with Wal.open(wal_dir) as wal:
        return wal.records == []


def test_crash_after_the_manifest_append_does_not_enqueue_twice(tmp_path: Path) -> None:
    store = fresh_memory()
    location = _stage(tmp_path / "wal", bind=True)
    store.put_if_absent(location, _batch_bytes())
    QueueProducer(store, MANIFEST).append([_entry(location)])  # landed; the WAL never knew
    with Producer(config(store, tmp_path / "wal")) as producer:
        assert producer.metrics()["records_recovered"] == 3
        producer.flush(timeout=10)
        metrics = producer.metrics()
    published = read_back(store)
    assert [p.location for p in published] == [location]
    assert metrics["uploads"] == 0
    assert metrics["manifest_appends"] == 0
    assert metrics["batches_committed"] == 1
    assert _wal_is_empty(tmp_path / "wal")


def test_crash_after_the_put_reuses_the_location(tmp_path: Path) -> None:
    store = fresh_memory()
    location = _stage(tmp_path / "wal", bind=True)
    store.put_if_absent(location, _batch_bytes())
    with Producer(config(store, tmp_path / "wal")) as producer:
        producer.flush(timeout=10)
    [published] = read_back(store)
    assert published.location == location
    assert published.entries == _expected_entries()
    assert published.metadata == _entry(location).metadata
    assert _wal_is_empty(tmp_path / "wal")


def test_crash_after_bind_before_put_uses_the_bound_location(tmp_path: Path) -> None:
    store = fresh_memory()
    location = _stage(tmp_path / "wal", bind=True)
    with Producer(config(store, tmp_path / "wal")) as producer:
        producer.flush(timeout=10)
    assert [p.location for p in read_back(store)] == [location]


def test_stale_binding_is_written_again_under_its_name(tmp_path: Path) -> None:
    store = TestClockStore(fresh_memory(), SystemClock())
    claim_queue(store, delete_window=0.2)
    location = _stage(tmp_path / "wal", bind=True, stale=True)
    store.put_if_absent(location, _batch_bytes())
    store.backdate(location, 3600)  # uploaded an hour ago: GC could take it any moment
    with Producer(config(store, tmp_path / "wal")) as producer:
        producer.flush(timeout=10)
        assert producer.metrics()["batches_refreshed"] == 1
    [published] = read_back(store)
    # The same name, so a sink that wrote it before the crash recognises it; written again,
    # so its last-modified time protects it from GC until the append.
    assert published.location == location
    assert published.entries == _expected_entries()
    assert store.head(location).last_modified > store.written_before(60)


def test_stale_binding_already_in_the_manifest_is_not_written_again(tmp_path: Path) -> None:
    store = fresh_memory()
    claim_queue(store, delete_window=0.2)
    location = _stage(tmp_path / "wal", bind=True, stale=True)
    store.put_if_absent(location, _batch_bytes())
    QueueProducer(store, MANIFEST).append([_entry(location)])
    with Producer(config(store, tmp_path / "wal")) as producer:
        producer.flush(timeout=10)
        assert producer.metrics()["batches_refreshed"] == 0
        assert producer.metrics()["uploads"] == 0
    assert [p.location for p in read_back(store)] == [location]


def test_binding_with_lost_records_keeps_its_location(tmp_path: Path) -> None:
    store = fresh_memory()
    # The BIND counted 4 records but only 3 survived. The batch keeps its name (the sink may
    # know it); with no object there, the survivors are what gets uploaded.
    location = _stage(tmp_path / "wal", bind=True, count=4)
    with Producer(config(store, tmp_path / "wal")) as producer:
        producer.flush(timeout=10)
    [published] = read_back(store)
    assert published.location == location
    assert published.entries == _expected_entries()


def test_binding_with_lost_records_keeps_the_whole_object(tmp_path: Path) -> None:
    store = TestClockStore(fresh_memory(), SystemClock())
    claim_queue(store, delete_window=0.2)
    location = _stage(tmp_path / "wal", bind=True, count=4, stale=True)
    # The object that landed before the crash holds all four records: it is written back as
    # it is, never replaced by the three the WAL still has.
    whole = encode_batch([*_expected_entries(), b"lost-from-the-wal"])
    store.put_if_absent(location, whole)
    store.backdate(location, 3600)
    with Producer(config(store, tmp_path / "wal")) as producer:
        producer.flush(timeout=10)
        assert producer.metrics()["batches_refreshed"] == 1
    [published] = read_back(store)
    assert published.location == location
    assert published.entries == [*_expected_entries(), b"lost-from-the-wal"]


def test_unbound_records_are_batched_afresh(tmp_path: Path) -> None:
    store = fresh_memory()
    _stage(tmp_path / "wal", bind=False)
    with Producer(config(store, tmp_path / "wal")) as producer:
        producer.produce([b"new"]).wait(10)
    published = read_back(store)
    assert [e for p in published for e in p.entries] == [*_expected_entries(), b"new"]
    assert published[0].metadata[0].ingestion_time_ms == _CALLS[0][0]


def test_close_with_timeout_leaves_data_for_the_next_producer(tmp_path: Path) -> None:
    store = ControlledStore(fresh_memory())
    store.fail_puts = True
    producer = Producer(config(store, tmp_path / "wal"))
    handles = [producer.produce([b"%d" % i], metadata=b"x") for i in range(20)]
    for handle in handles:
        handle.wait_staged(10)
    report = producer.close(timeout=0.2)
    assert not report.complete
    assert report.staged_records == 20
    assert report.staged_entries == 20
    assert report.unstaged_records == 0
    for handle in handles:
        with pytest.raises(ClosedError, match="remain staged"):
            handle.wait(0)
    store.fail_puts = False
    with Producer(config(store, tmp_path / "wal")) as again:
        assert again.metrics()["records_recovered"] == 20
        again.produce([b"after"])
    assert all_entries(store) == [b"%d" % i for i in range(20)] + [b"after"]
    assert _wal_is_empty(tmp_path / "wal")


def test_ambiguous_append_that_landed_is_not_repeated(tmp_path: Path) -> None:
    store = ControlledStore(fresh_memory())
    store.land_then_fail = 1
    one_try = RetryPolicy(max_attempts=1, max_elapsed=1.0, base_delay=0.001, max_delay=0.01)
    with Producer(config(store, tmp_path / "wal", retry=one_try)) as producer:
        handle = producer.produce([b"once"])
        handle.wait(10)
    assert all_entries(store) == [b"once"]
    assert handle.sequence == 0


def test_ambiguous_append_that_did_not_land_is_retried(tmp_path: Path) -> None:
    store = ControlledStore(fresh_memory())
    store.fail_manifest = True
    with Producer(config(store, tmp_path / "wal")) as producer:
        handle = producer.produce([b"later"])
        while store.calls["manifest_write"] < 8:  # several rounds, each re-checked
            handle.wait_staged(10)
            threading.Event().wait(0.01)
        assert not handle.done()
        store.fail_manifest = False
        handle.wait(10)
        assert producer.metrics()["cas_retries"] > 0
    assert all_entries(store) == [b"later"]


def test_failed_puts_are_retried_until_they_land(tmp_path: Path) -> None:
    store = ControlledStore(fresh_memory())
    store.fail_puts = True
    with Producer(config(store, tmp_path / "wal")) as producer:
        handle = producer.produce([b"eventually"])
        while store.calls["batch_put"] < 8:
            threading.Event().wait(0.01)
        store.fail_puts = False
        handle.wait(10)
        assert producer.metrics()["put_retries"] >= 7
    assert all_entries(store) == [b"eventually"]


def test_corrupt_manifest_stops_the_producer_and_keeps_the_data(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store: ObjectStore = fresh_memory()
    store.put(MANIFEST, b"not a manifest at all, certainly not one")
    producer = Producer(config(store, tmp_path / "wal"))
    handle = producer.produce([b"kept"])
    with pytest.raises(FormatError):
        handle.wait(10)
    with pytest.raises(ClosedError, match="failure"):
        producer.produce([b"more"])
    with caplog.at_level(logging.ERROR), pytest.raises(FormatError):
        producer.close()
    with Wal.open(tmp_path / "wal") as wal:
        assert len(wal.records) >= 1  # still staged for the next producer


def test_recovery_report_is_exposed_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _stage(tmp_path / "wal", bind=False)
    wal_file = sorted((tmp_path / "wal").glob("*.wal"))[0]
    raw = bytearray(wal_file.read_bytes())
    raw[60] ^= 0xFF  # inside the first record
    wal_file.write_bytes(bytes(raw))
    store = fresh_memory()
    with caplog.at_level(logging.WARNING, logger="millpond"):
        producer = Producer(config(store, tmp_path / "wal"))
    report = producer.recovery_report
    assert not report.clean
    assert report.lost_seqs == (range(0, 1),)
    assert any("LOST" in r.getMessage() for r in caplog.records)
    assert producer.metrics()["recovery"]["quarantined"] == 1
    producer.close()
    assert all_entries(store) == _expected_entries()[2:]
