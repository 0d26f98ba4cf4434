"""Producer basics: produce → WAL → batch → manifest, read back, on every store backend."""

from __future__ import annotations

import mmap
import re
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from millpond import (
    ClosedError,
    CompressionType,
    ConfigError,
    InvalidInputError,
    ObjectStore,
    open_store,
)
from millpond.formats.arrow import decode_ipc
from millpond.formats.batch import BATCH_FOOTER_SIZE
from millpond.producer import Producer, WriteHandle
from millpond.wal import Wal
from tests.producer.producer_support import (
    ControlledStore,
    all_entries,
    config,
    fresh_memory,
    read_back,
)

_ULID_LOCATION = re.compile(r"^ingest/[0-7][0-9A-HJKMNP-TV-Z]{25}\.batch$")


@pytest.fixture
def store(store_target: Any) -> ObjectStore:
    """A store on each backend; one object, so what the producer writes can be read back."""
    if store_target.kind == "memory":
        return fresh_memory()
    return open_store(store_target.url, dict(store_target.options or {}))


def test_round_trip_on_every_backend(store: ObjectStore, tmp_path: Path) -> None:
    handles: list[WriteHandle] = []
    with Producer(config(store, tmp_path / "wal", flush_size_bytes=2048)) as producer:
        for i in range(200):
            entries = [f"call-{i}-entry-{j}".encode() for j in range(1 + i % 4)]
            handles.append(producer.produce(entries, metadata=f"m{i}".encode()))
        for handle in handles:
            handle.wait(timeout=30)
    published = read_back(store)
    assert len(published) > 1  # flush_size_bytes cut several batches
    expected = [f"call-{i}-entry-{j}".encode() for i in range(200) for j in range(1 + i % 4)]
    assert [e for p in published for e in p.entries] == expected
    # One metadata item per produce() call, start_index at its first entry, in order.
    calls = 0
    for batch in published:
        assert _ULID_LOCATION.match(batch.location)
        start = 0
        for item in batch.metadata:
            assert item.start_index == start
            assert item.payload == f"m{calls}".encode()
            assert item.ingestion_time_ms > 1_600_000_000_000
            start += 1 + calls % 4
            calls += 1
        assert start == len(batch.entries)
    assert calls == 200
    assert [p.location for p in published] == sorted(p.location for p in published)
    assert {h.location for h in handles} == {p.location for p in published}
    assert [h.sequence for h in handles] == sorted(h.sequence for h in handles)  # type: ignore[type-var]


def test_handles_track_staging_and_durability(tmp_path: Path) -> None:
    store = ControlledStore(fresh_memory())
    store.manifest_gate = threading.Event()
    with Producer(config(store, tmp_path)) as producer:
        handle = producer.produce([b"x"])
        handle.wait_staged(timeout=10)
        assert handle.staged()
        store.manifest_write_started.wait(10)
        assert not handle.done()
        assert handle.exception() is None
        with pytest.raises(TimeoutError):
            handle.wait(timeout=0.01)
        assert "staged" in repr(handle)
        store.manifest_gate.set()
        handle.wait(timeout=10)
        assert handle.done()
        assert handle.exception() is None
        assert handle.location is not None
        assert handle.sequence == 0
        assert "durable" in repr(handle)


def test_zstd_batches(store: ObjectStore, tmp_path: Path) -> None:
    with Producer(config(store, tmp_path, batch_compression="zstd")) as producer:
        producer.produce([b"a" * 1000, b"b" * 1000]).wait(10)
    [batch] = read_back(store)
    raw = store.get(batch.location).data
    assert raw[-BATCH_FOOTER_SIZE] == CompressionType.ZSTD
    assert len(raw) < 2000
    assert batch.entries == [b"a" * 1000, b"b" * 1000]


def test_produce_arrow_one_entry_per_record_batch(store: ObjectStore, tmp_path: Path) -> None:
    table = pa.concat_tables(
        [pa.table({"id": [1, 2], "name": ["a", "b"]}), pa.table({"id": [3], "name": ["c"]})]
    )
    with Producer(config(store, tmp_path)) as producer:
        producer.produce_arrow(table, metadata=b"arrow").wait(10)
        with pytest.raises(InvalidInputError, match="row"):
            producer.produce_arrow(table.slice(0, 0))
        with pytest.raises(InvalidInputError, match="RecordBatch"):
            producer.produce_arrow([1, 2, 3])  # type: ignore[arg-type]
    [batch] = read_back(store)
    assert len(batch.entries) == table.to_batches().__len__() == 2
    back = pa.concat_tables([decode_ipc(e) for e in batch.entries])
    assert back.equals(table)


def test_flush_publishes_before_the_interval(store: ObjectStore, tmp_path: Path) -> None:
    with Producer(config(store, tmp_path, flush_interval=3600.0)) as producer:
        handles = [producer.produce([b"%d" % i]) for i in range(10)]
        producer.flush(timeout=10)
        assert all(h.done() for h in handles)
        assert len(all_entries(store)) == 10


def test_close_is_idempotent_and_later_calls_fail(tmp_path: Path) -> None:
    producer = Producer(config(fresh_memory(), tmp_path))
    producer.produce([b"x"])
    report = producer.close()
    assert report.complete
    assert producer.close() is report
    with pytest.raises(ClosedError):
        producer.produce([b"y"])
    with pytest.raises(ClosedError):
        producer.flush()


def _started_since(before: set[threading.Thread]) -> set[threading.Thread]:
    """Threads started since ``before``, but for the request threads of a test HTTP server an
    earlier test of this worker left answering (socketserver's, named after their target)."""
    return {
        t for t in set(threading.enumerate()) - before if "process_request_thread" not in t.name
    }


def test_background_threads_are_named_and_joined(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    producer = Producer(config(fresh_memory(), tmp_path, upload_concurrency=3))
    names = {t.name for t in _started_since(before)}
    assert names == {
        "millpond-wal-writer",
        "millpond-wal-syncer",
        "millpond-sealer",
        "millpond-committer",
        "millpond-wal-releaser",
        "millpond-upload-0",
        "millpond-upload-1",
        "millpond-upload-2",
    }
    assert all(t.daemon for t in _started_since(before))
    producer.close()
    assert not {t for t in threading.enumerate() if t.name.startswith("millpond-")} - before


def test_a_slow_wal_release_does_not_hold_back_the_next_append(tmp_path: Path) -> None:
    """Freeing the WAL behind an append (a sidecar fsync, file deletes: tens of ms on a busy
    disk) runs beside the appends: while one release is held, the next batch is appended and
    its wait() returns. On the committer's own thread it held every next append back."""
    store = fresh_memory()
    producer = Producer(config(store, tmp_path))
    held = threading.Event()
    go_on = threading.Event()
    real_release = producer._wal.release

    def slow_release(released_seq: int) -> int:
        held.set()
        go_on.wait(60)
        return real_release(released_seq)

    producer._wal.release = slow_release  # type: ignore[method-assign]
    try:
        producer.produce([b"first"]).wait(60)
        assert held.wait(60), "no WAL release after the first append"
        producer.produce([b"second"]).wait(30)  # appended while the release is held
        assert sorted(all_entries(store)) == [b"first", b"second"]
    finally:
        go_on.set()
        producer.close()
    with Wal.open(tmp_path) as wal:
        assert wal.records == []  # every settled record released by the time close() returned


def test_one_live_producer_per_wal_dir(tmp_path: Path) -> None:
    with Producer(config(fresh_memory(), tmp_path)):
        with pytest.raises(ConfigError, match="locked") as info:
            Producer(config(fresh_memory(), tmp_path))
        assert info.value.key == "wal_dir"
    Producer(config(fresh_memory(), tmp_path)).close()


def test_counters_and_metrics(tmp_path: Path) -> None:
    store = fresh_memory()
    with Producer(config(store, tmp_path)) as producer:
        for _ in range(5):
            producer.produce([b"abc", b"de"])
        producer.flush(timeout=10)
        metrics = producer.metrics()
    assert metrics["produce_calls"] == 5
    assert metrics["entries_produced"] == 10
    assert metrics["bytes_produced"] == 25
    assert metrics["records_staged"] == 5
    assert metrics["bytes_staged"] > 25
    assert metrics["entries_committed"] == 10
    assert metrics["uploads"] == metrics["batches_committed"] >= 1
    assert metrics["entries_dropped"] == 0
    assert metrics["fsync_latency"]["count"] >= 1
    assert metrics["wal_bytes"] > 0
    for key in ("put_retries", "cas_retries", "cas_conflicts", "pending_bytes"):
        assert key in metrics


@pytest.mark.parametrize("mode", ["interval", "off"])
def test_other_sync_modes(tmp_path: Path, mode: str) -> None:
    store = fresh_memory()
    with Producer(config(store, tmp_path, wal_sync=mode, wal_sync_interval=0.01)) as producer:
        handles = [producer.produce([b"%d" % i]) for i in range(50)]
        for handle in handles:
            handle.wait_staged(10)
        producer.flush(10)
    assert len(all_entries(store)) == 50


def test_group_commit_appends_ready_batches_in_one_cas(tmp_path: Path) -> None:
    store = ControlledStore(fresh_memory())
    store.manifest_gate = threading.Event()
    with Producer(config(store, tmp_path, flush_size_bytes=64)) as producer:
        first = producer.produce([b"first" * 20])
        store.manifest_write_started.wait(10)  # the first append is in flight...
        handles = [producer.produce([b"%03d" % i * 30]) for i in range(20)]
        while producer.metrics()["uploads"] < 21:  # ...while 20 more batches upload
            handles[-1].wait_staged(10)
            threading.Event().wait(0.005)
        store.manifest_gate.set()
        first.wait(10)
        for handle in handles:
            handle.wait(10)
        metrics = producer.metrics()
    assert metrics["batches_committed"] == 21
    assert metrics["manifest_appends"] <= 3  # the first, then the rest together
    assert len(read_back(store)) == 21


# -- bad input -----------------------------------------------------------------------------


class _HugeBytes(bytes):
    """A bytes object that claims to be over the u32 limit without allocating it."""

    def __len__(self) -> int:
        return 1 << 32


@pytest.mark.parametrize(
    ("entries", "metadata", "match"),
    [
        ([], b"", "at least one entry"),
        ([b"ok", "not bytes"], b"", r"entries\[1\]: expected bytes"),
        ([b"ok", 42], b"", r"entries\[1\]: expected bytes"),
        (b"abc", b"", "single bytes"),
        ("abc", b"", "single str"),
        (None, b"", "list of byte strings"),
        ([_HugeBytes(b"x")], b"", r"entries\[0\]: expected at most 4294967295 bytes"),
        ([b"ok"], "text", "metadata: expected bytes"),
        ([b"ok"], _HugeBytes(b"x"), "metadata: expected at most"),
        ([b"x" * 40_000], b"", "must fit in the WAL"),
    ],
)
def test_bad_input_is_rejected_and_nothing_is_staged(
    tmp_path: Path, entries: Any, metadata: Any, match: str
) -> None:
    store = fresh_memory()
    producer = Producer(config(store, tmp_path / "wal", wal_max_bytes=128 << 10))
    with pytest.raises(InvalidInputError, match=match):
        producer.produce(entries, metadata)
    assert producer.metrics()["produce_calls"] == 0
    assert producer.close().complete
    with Wal.open(tmp_path / "wal") as wal:
        assert wal.records == []
    assert read_back(store) == []


def test_entry_over_the_u32_limit_is_rejected_without_copying(tmp_path: Path) -> None:
    # A 4 GiB + 1 sparse file mapped read-only: its memoryview reports the size, and nothing
    # is allocated unless someone copies it.
    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as out:
        out.truncate((1 << 32) + 1)
    with open(sparse, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            with Producer(config(fresh_memory(), tmp_path / "wal")) as producer:
                with pytest.raises(InvalidInputError, match="at most 4294967295"):
                    producer.produce([b"fine", view])
                assert producer.metrics()["records_staged"] == 0
        finally:
            view.release()
