"""Issue 50: a producer that recovers stale batches appended one per delete window.

A batch still not appended ``reupload_after`` after its upload may be collected any moment, so
it is written again under its name and appended only after the collectors' delete window, once
a HEAD has found it. The committer used to do that for the head of the line only: a producer
restarted on a WAL of batches whose re-uploads then waited out a store outage (the crash
campaign: S3 killed twice, grace period 30 s) wrote them again one at a time, one delete window
each, and everything produced after them waited behind — 50 batches, 50 windows.

Everything runs on a simulated clock that moves only when the test moves it (while the store is
idle: the producer waits for time to pass, not for a request); every time below
is simulated.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from millpond.common.ulids import UlidMinter, batch_location
from millpond.errors import StorageError
from millpond.formats.batch import encode_batch
from millpond.formats.manifest import decode_manifest
from millpond.formats.wal import BindBody
from millpond.producer import Producer
from millpond.producer.handle import WriteHandle
from millpond.storage.store import ForwardingStore, GetResult, ObjectInfo, ObjectStore
from millpond.wal import Wal
from tests.producer.producer_support import (
    MANIFEST,
    PREFIX,
    claim_queue,
    config,
    fresh_memory,
    read_back,
)

GRACE = 30.0  # the crash campaign's queue: a delete window of 7.5 s
DELETE_WINDOW = 7.5
REUPLOAD_AFTER = 10.0
FLUSH_INTERVAL = 1.0
STEP = 0.01
"""Simulated seconds the clock moves for each real millisecond the store sees no request."""


class _SimulatedClock:
    """Simulated time: it stands still until the test moves it. ``sleep`` (the producer's
    retry backoff) returns once the clock has moved that far."""

    def __init__(self) -> None:
        self._moved = threading.Condition()
        self._now = 0.0
        self._start_ms = time.time_ns() // 1_000_000  # agrees with the memory store's clock

    def now_ms(self) -> int:
        with self._moved:
            return self._start_ms + round(self._now * 1000)

    def monotonic(self) -> float:
        with self._moved:
            return self._now

    def sleep(self, seconds: float) -> None:
        with self._moved:
            until = self._now + seconds
            while self._now < until:
                self._moved.wait()

    def advance(self, seconds: float) -> None:
        with self._moved:
            self._now += seconds
            self._moved.notify_all()


class _HourAgo(_SimulatedClock):
    """The clock of the producer that died an hour ago, to name its batches."""

    def __init__(self, clock: _SimulatedClock) -> None:
        super().__init__()
        self._clock = clock

    def now_ms(self) -> int:
        return self._clock.now_ms() - 3_600_000


class _Store(ForwardingStore):
    """The real store, with an outage switch; logs, on the simulated clock, every batch write,
    HEAD and manifest write that lands."""

    def __init__(self, inner: ObjectStore, clock: _SimulatedClock) -> None:
        super().__init__(inner)
        self.clock = clock
        self.down = False
        self.manifest_down = False
        self.refused = threading.Event()
        self.busy = threading.Event()
        """Set by every request: time stands still while the producer is at work."""
        self.log: list[tuple[float, str, tuple[str, ...]]] = []
        self._logged = threading.Condition()

    def _up(self, path: str) -> None:
        self.busy.set()
        if self.down or (self.manifest_down and path == MANIFEST):
            self.refused.set()
            raise StorageError(f"{path}: the store is down (injected)")

    def _record(self, kind: str, paths: tuple[str, ...]) -> None:
        with self._logged:
            self.log.append((self.clock.monotonic(), kind, paths))
            self._logged.notify_all()

    def wait_for_puts(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` batch objects have been written."""
        with self._logged:
            return self._logged.wait_for(lambda: len(self._events("put")) >= count, timeout)

    def _written(self, path: str, data: bytes) -> None:
        if path == MANIFEST:
            self._record("append", tuple(e.location for e in decode_manifest(data).entries))
        elif path.endswith(".batch"):
            self._record("put", (path,))

    def events(self, kind: str) -> list[tuple[float, tuple[str, ...]]]:
        with self._logged:
            return self._events(kind)

    def _events(self, kind: str) -> list[tuple[float, tuple[str, ...]]]:
        return [(at, paths) for at, k, paths in self.log if k == kind]

    def get(self, path: str) -> GetResult:
        self._up(path)
        return self.inner.get(path)

    def get_tail(self, path: str, length: int, etag: str | None = None) -> GetResult | None:
        self._up(path)
        return self.inner.get_tail(path, length, etag)

    def head(self, path: str) -> ObjectInfo:
        self._up(path)
        info = self.inner.head(path)
        self._record("head", (path,))
        return info

    def put(self, path: str, data: bytes) -> str | None:
        self._up(path)
        etag = self.inner.put(path, data)
        self._written(path, data)
        return etag

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        self._up(path)
        etag = self.inner.put_if_absent(path, data)
        self._written(path, data)
        return etag

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        self._up(path)
        new = self.inner.put_if_match(path, data, etag)
        self._written(path, data)
        return new


def _stale_wal(wal_dir: Path, store: _Store, count: int) -> list[str]:
    """The WAL of a producer killed an hour ago: ``count`` produce() calls, each bound to a
    batch it uploaded (the objects are there) but never appended."""
    clock = store.clock
    minter = UlidMinter(_HourAgo(clock))
    locations = []
    with Wal.open(wal_dir) as wal:
        for i in range(count):
            [(seq, _)] = wal.append_data([(clock.now_ms() - 3_600_000, b"", [b"old-%d" % i])])
            location = batch_location(PREFIX, minter.mint())
            wal.append_bind(BindBody(seq, seq, 1, location))
            store.inner.put_if_absent(location, encode_batch([b"old-%d" % i]))
            locations.append(location)
        wal.sync()
    return locations


def _run_clock(store: _Store, until: Callable[[], bool], limit: float = float("inf")) -> None:
    """Move the clock on by ``STEP`` for every real millisecond the store sees no request (the
    producer waits for time to pass), until ``until()`` holds or the clock reaches ``limit``
    (or a real minute has passed)."""
    clock = store.clock
    deadline = time.monotonic() + 60
    while not until() and clock.monotonic() < limit and time.monotonic() < deadline:
        if store.busy.wait(0.001):
            store.busy.clear()  # a request: the producer is at work, not waiting for time
        else:
            clock.advance(STEP)


def _close(producer: Producer, store: _Store, timeout: float) -> Any:
    """``producer.close(timeout)`` with the clock running (its threads wait on it)."""
    outcome: list[Any] = []
    closer = threading.Thread(target=lambda: outcome.append(producer.close(timeout)))
    closer.start()
    _run_clock(store, lambda: not closer.is_alive())
    closer.join(timeout=60)
    return outcome[0] if outcome else None


def _open(tmp_path: Path) -> tuple[_SimulatedClock, _Store]:
    clock = _SimulatedClock()
    store = _Store(fresh_memory(), clock)
    claim_queue(store, grace=GRACE, delete_window=DELETE_WINDOW)
    return clock, store


def _producer(tmp_path: Path, store: _Store, **options: Any) -> Producer:
    options.setdefault("reupload_after", REUPLOAD_AFTER)
    options.setdefault("flush_interval", FLUSH_INTERVAL)
    return Producer(config(store, tmp_path / "wal", clock=store.clock, **options))


def _start(tmp_path: Path, count: int) -> tuple[_SimulatedClock, _Store, list[str], Producer]:
    """A producer restarted on a WAL of ``count`` stale batches; returns once it has written
    them all again (on start: their names say they may be old enough for GC)."""
    clock, store = _open(tmp_path)
    locations = _stale_wal(tmp_path / "wal", store, count)
    producer = _producer(tmp_path, store)
    assert store.wait_for_puts(count, timeout=60), store.log
    return clock, store, locations, producer


def _appended_at(store: _Store, location: str) -> float:
    return next(at for at, paths in store.events("append") if location in paths)


def test_fifty_stale_batches_recover_after_one_delete_window(tmp_path: Path) -> None:
    clock, store, old, producer = _start(tmp_path, 50)
    try:
        # Written again on start; then the store is killed a second time, for longer than
        # reupload_after: every one of those writes is stale before it could be appended.
        store.down = True
        clock.advance(REUPLOAD_AFTER + 1)
        assert store.refused.wait(timeout=60)
        store.down = False
        back = clock.monotonic()
        new: list[WriteHandle] = [producer.produce([b"new-%d" % i]) for i in range(3)]
        refreshing = [0]

        def recovered() -> bool:
            waiting = producer.metrics().get("batches_awaiting_refresh", 0)
            refreshing[0] = max(refreshing[0], waiting)
            return all(handle.done() for handle in new)

        _run_clock(store, recovered, back + 4 * DELETE_WINDOW)
        appends = store.events("append")
        assert all(handle.done() for handle in new), (
            f"{len([a for a in appends if set(old) & set(a[1])])} appends in "
            f"{clock.monotonic() - back:.1f} s after the store came back took "
            f"{len({loc for _, paths in appends for loc in paths} & set(old))} of the 50 "
            "stale batches; the new calls are still waiting behind them"
        )
        recovered_at = max(_appended_at(store, location) for location in old)
        print(f"50 stale batches recovered {recovered_at - back:.2f} s after the store came back")
        # All of them after one delete window (not one window each), in one or a few appends.
        assert DELETE_WINDOW <= recovered_at - back < 2 * DELETE_WINDOW
        assert len({_appended_at(store, location) for location in old}) <= 3
        assert refreshing[0] == 50  # the gauge showed all of them waiting for their refresh
        # What was produced behind them followed within one more flush interval, in order.
        for handle in new:
            assert handle.location is not None
            assert _appended_at(store, handle.location) <= recovered_at + FLUSH_INTERVAL
        published = read_back(store)
        assert [p.location for p in published][:50] == old
        assert [e for p in published for e in p.entries] == [
            *(b"old-%d" % i for i in range(50)),
            *(b"new-%d" % i for i in range(3)),
        ]
        _assert_each_confirmed_after_its_window(store, old)
    finally:
        _close(producer, store, timeout=5)


def _assert_each_confirmed_after_its_window(store: _Store, locations: list[str]) -> None:
    """The safety argument, batch by batch: its last write landed at least one delete window
    before its append, and a HEAD found it in between."""
    for location in locations:
        appended = _appended_at(store, location)
        written = max(at for at, paths in store.events("put") if location in paths)
        assert written + DELETE_WINDOW <= appended, location
        heads = [at for at, paths in store.events("head") if location in paths]
        assert any(written + DELETE_WINDOW <= at <= appended for at in heads), location


def test_batches_uploaded_during_a_manifest_outage_are_written_again_together(
    tmp_path: Path,
) -> None:
    """A live producer whose uploads landed while its appends could not (the manifest out of
    reach for longer than reupload_after): the same, without a restart."""
    clock, store = _open(tmp_path)
    producer = _producer(tmp_path, store, flush_size_bytes=1)  # a batch per call
    try:
        store.manifest_down = True
        handles = [producer.produce([b"e-%d" % i]) for i in range(20)]
        assert store.wait_for_puts(20, timeout=60), store.log
        clock.advance(REUPLOAD_AFTER + 1)
        store.manifest_down = False
        back = clock.monotonic()
        _run_clock(store, lambda: all(h.done() for h in handles), back + 4 * DELETE_WINDOW)
        assert all(h.done() for h in handles), f"{sum(h.done() for h in handles)} of 20 appended"
        locations = [h.location for h in handles if h.location is not None]
        recovered_at = max(_appended_at(store, location) for location in locations)
        print(f"20 batches recovered {recovered_at - back:.2f} s after the manifest came back")
        assert DELETE_WINDOW <= recovered_at - back < 2 * DELETE_WINDOW
        assert len({_appended_at(store, location) for location in locations}) <= 3
        assert [e for p in read_back(store) for e in p.entries] == [b"e-%d" % i for i in range(20)]
        _assert_each_confirmed_after_its_window(store, locations)
    finally:
        _close(producer, store, timeout=5)


def test_close_says_what_it_waits_for_when_its_timeout_runs_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, store, _, producer = _start(tmp_path, 5)
    assert producer.metrics()["millpond_producer_refreshing_batches"] == 5
    with caplog.at_level(logging.ERROR, logger="millpond.producer.producer"):
        report = _close(producer, store, timeout=1.0)
    assert not report.complete
    assert "5 batches waiting for the delete window until " in report.waiting_for
    assert report.waiting_for.endswith("(refresh of stale batches)")
    assert any(
        "close(): its timeout (1.0 s) ran out while waiting for: 5 batches waiting for the "
        "delete window until " in record.getMessage()
        for record in caplog.records
    )
