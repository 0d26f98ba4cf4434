"""Backpressure (buffer and WAL cap) and drop_oldest with an exact loss count."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import millpond.wal
from millpond import BackpressureError
from millpond.common.retry import RetryPolicy
from millpond.producer import Producer, WriteHandle
from tests.producer.producer_support import ControlledStore, all_entries, config, fresh_memory


class _Disk:
    """Once armed, the WAL's fdatasync waits for ``gate``: a disk that stopped answering."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.gate = threading.Event()


@pytest.fixture
def stalled_fsync(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Disk]:
    disk = _Disk()
    real = millpond.wal._fdatasync

    def stalled(fd: int) -> None:
        if disk.armed.is_set():
            disk.entered.set()
            disk.gate.wait()
        real(fd)

    monkeypatch.setattr(millpond.wal, "_fdatasync", stalled)
    yield disk
    disk.gate.set()


def test_max_buffered_inputs_blocks_then_raises(tmp_path: Path, stalled_fsync: _Disk) -> None:
    entered, gate = stalled_fsync.entered, stalled_fsync.gate
    store = fresh_memory()
    producer = Producer(config(store, tmp_path, max_buffered_inputs=1))
    stalled_fsync.armed.set()
    try:
        first = producer.produce([b"first"])
        assert entered.wait(10)  # the syncer waits for the disk with "first"
        # The pipeline holds one more group written behind the sync, and one call in the
        # buffer; then produce() pushes back.
        second = producer.produce([b"second"], timeout=10)
        third = producer.produce([b"third"], timeout=10)
        with pytest.raises(BackpressureError, match="max_buffered_inputs"):
            producer.produce([b"fourth"], timeout=0.05)
        with pytest.raises(TimeoutError):
            first.wait_staged(timeout=0.01)  # not acknowledged before it is durable
        assert not second.staged()
        assert producer.metrics()["backpressure_waits"] >= 1
        gate.set()
        fourth = producer.produce([b"fourth"], timeout=10)
        for handle in (first, second, third, fourth):
            handle.wait(10)
    finally:
        gate.set()
        producer.close()
    assert all_entries(store) == [b"first", b"second", b"third", b"fourth"]


def test_many_threads_through_one_buffer_slot(tmp_path: Path) -> None:
    store = fresh_memory()
    handles: list[WriteHandle] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        for i in range(50):
            handle = producer.produce([b"%d-%d" % (n, i)], timeout=30)
            with lock:
                handles.append(handle)

    with Producer(config(store, tmp_path, max_buffered_inputs=1)) as producer:
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    got = all_entries(store)
    assert sorted(got) == sorted(b"%d-%d" % (n, i) for n in range(8) for i in range(50))
    for n in range(8):  # each thread's calls stay in order
        mine = [e for e in got if e.startswith(b"%d-" % n)]
        assert mine == [b"%d-%d" % (n, i) for i in range(50)]
    assert all(h.done() and h.exception() is None for h in handles)


_CAP = 64 << 10
_RECORD = 1000  # bytes per entry; each produce() call is one entry


def _fill(producer: Producer, count: int, timeout: float | None = None) -> list[WriteHandle]:
    return [
        producer.produce([b"%06d" % i + b"." * (_RECORD - 6)], timeout=timeout)
        for i in range(count)
    ]


def test_full_wal_blocks_produce_then_raises_and_loses_nothing(tmp_path: Path) -> None:
    store = ControlledStore(fresh_memory())
    store.fail_puts = True  # nothing can be published: the WAL only fills
    producer = Producer(
        config(store, tmp_path, wal_max_bytes=_CAP, max_buffered_inputs=1, flush_size_bytes=4096)
    )
    accepted: list[WriteHandle] = []
    try:
        refused: BackpressureError | None = None
        for payload in _payloads(10 * _CAP // _RECORD):
            try:
                accepted.append(producer.produce([payload], timeout=0.3))
            except BackpressureError as err:
                refused = err
                break
        assert refused is not None, "produce() never pushed back"
        metrics = producer.metrics()
        assert metrics["wal_bytes"] <= _CAP
        assert metrics["wal_bytes"] > _CAP - 4 * _RECORD - 8192  # it did fill up
        assert metrics["entries_dropped"] == 0
        assert len(accepted) < 2 * _CAP // _RECORD
        store.fail_puts = False  # the store comes back: everything accepted gets through
        for handle in accepted:
            handle.wait(30)
    finally:
        store.fail_puts = False
        producer.close()
    assert all_entries(store) == [h for h in _payloads(len(accepted))]


def _payloads(count: int, start: int = 0) -> list[bytes]:
    return [b"%06d" % i + b"." * (_RECORD - 6) for i in range(start, count)]


def test_drop_oldest_drops_the_oldest_and_counts_exactly(tmp_path: Path) -> None:
    store = ControlledStore(fresh_memory())
    store.fail_puts = True
    total = 6 * _CAP // _RECORD
    producer = Producer(
        config(
            store,
            tmp_path,
            wal_max_bytes=_CAP,
            size_cap_policy="drop_oldest",
            flush_size_bytes=4096,
        )
    )
    try:
        handles = _fill(producer, total, timeout=10)  # never blocks for long: it drops
        for handle in handles:
            handle.wait_staged(10)
        store.fail_puts = False
        producer.flush(timeout=30)
        metrics = producer.metrics()
    finally:
        store.fail_puts = False
        producer.close()
    dropped = [i for i, h in enumerate(handles) if isinstance(h.exception(), BackpressureError)]
    delivered = all_entries(store)
    assert dropped, "the WAL never filled"
    assert metrics["entries_dropped"] == metrics["records_dropped"] == len(dropped)
    assert len(delivered) + len(dropped) == total
    # The oldest went: what is left is exactly the newest, in order.
    assert dropped == list(range(len(dropped)))
    assert delivered == _payloads(total, start=len(dropped))
    assert metrics["wal_bytes"] <= _CAP


@pytest.mark.parametrize("landed", [False, True], ids=["never-landed", "landed"])
def test_drop_oldest_with_ambiguous_appends_counts_exactly(tmp_path: Path, landed: bool) -> None:
    """Batches dropped while their manifest append was ambiguous are settled by a later look:
    counted as dropped only if the manifest does not have them."""
    store = ControlledStore(fresh_memory())
    if landed:
        store.land_then_fail = 1_000_000  # every append lands, then reports a failure
    else:
        store.fail_manifest = True
    one_try = RetryPolicy(max_attempts=1, max_elapsed=1.0, base_delay=0.001, max_delay=0.005)
    total = 6 * _CAP // _RECORD
    producer = Producer(
        config(
            store,
            tmp_path,
            wal_max_bytes=_CAP,
            size_cap_policy="drop_oldest",
            flush_size_bytes=4096,
            retry=one_try,
        )
    )
    try:
        handles = _fill(producer, total, timeout=10)
        for handle in handles:
            handle.wait_staged(10)
        store.fail_manifest = False
        store.land_then_fail = 0
        producer.flush(timeout=30)
        metrics = producer.metrics()
    finally:
        store.fail_manifest = False
        store.land_then_fail = 0
        producer.close()
    dropped = [i for i, h in enumerate(handles) if isinstance(h.exception(), BackpressureError)]
    delivered = all_entries(store)
    assert metrics["entries_dropped"] == len(dropped)
    assert len(delivered) + len(dropped) == total
    assert len(set(delivered)) == len(delivered)
    assert sorted(delivered) == delivered
    assert set(delivered) | {_payloads(total)[i] for i in dropped} == set(_payloads(total))
    assert all(h.exception() is None for i, h in enumerate(handles) if i not in set(dropped))
