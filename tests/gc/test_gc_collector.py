"""The garbage collector on real stores: passes, dry runs, failed deletes, load, crashes, CLI."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
from gc_support import (
    FAST_RETRY,
    MANIFEST,
    T0,
    FailingDeletes,
    OffsetClock,
    dequeue,
    enqueue,
    open_target,
    paths,
    put_batch,
    ulid_at,
)

from millpond.common.ulids import UlidMinter, batch_location, ulid_time_ms
from millpond.consumer import Consumer, ConsumerConfig
from millpond.errors import ConfigError, FormatError, InvalidInputError, NotFoundError
from millpond.formats.batch import encode_batch
from millpond.formats.manifest import Metadata, PendingEntry
from millpond.gc import GarbageCollector, GarbageCollectorConfig, KeepReason
from millpond.queue import QueueProducer
from millpond.storage.store import ObjectStore
from tests.support import ManualClock, TestClockStore

HOUR_MS = 3_600_000


@pytest.fixture
def store(store_target: Any) -> ObjectStore:
    return open_target(store_target)


def _collector(store: ObjectStore, clock: Any, **overrides: Any) -> GarbageCollector:
    # The store reports last-modified times on the test's clock (GC's last-modified rule).
    options: dict[str, Any] = {
        "store": TestClockStore(store, clock),
        "clock": clock,
        "gc_grace_period": 60.0,
    }
    options.update(overrides)
    return GarbageCollector(GarbageCollectorConfig(**options))


def _strangers(store: ObjectStore) -> set[str]:
    """Objects GC must never touch, all with ULID names far in the past."""
    old = T0 - HOUR_MS
    planted = {
        "ingest/notes.txt",
        f"ingest/{ulid_at(old)}.batch.tmp",
        f"ingest/{ulid_at(old).lower()}.batch",
        f"ingest/nested/{ulid_at(old)}.batch",
        f"ingest/other-queue/ingest/{ulid_at(old)}.batch",
        f"elsewhere/{ulid_at(old)}.batch",
    }
    for path in planted:
        store.put(path, b"not ours")
    return planted


def test_deletes_consumed_batches_once_the_grace_period_passed(store: ObjectStore) -> None:
    clock = ManualClock(T0)
    strangers = _strangers(store)
    consumed = [put_batch(store, T0 + i) for i in range(3)]
    queued = [put_batch(store, T0 + 10 + i) for i in range(2)]
    enqueue(store, *consumed, *queued)
    dequeue(store, 2)
    collector = _collector(store, clock)

    report = collector.run_once()  # all younger than the grace period
    assert report.deleted == ()
    # Only names below the queue's floor (its oldest entry's time) are listed: the consumed
    # batches and the one name that is not a batch but sorts there; nothing past it can go.
    assert report.queue_floor_ms == T0 + 10
    assert report.kept == {KeepReason.IN_GRACE_PERIOD: 3, KeepReason.NOT_A_BATCH: 1}

    clock.advance(61)
    report = collector.run_once()
    assert set(report.deleted) == set(consumed)
    assert report.failures == ()
    assert report.listed == 3 + 1
    assert report.kept == {KeepReason.NOT_A_BATCH: 1}
    assert paths(store) == {*queued, *strangers, MANIFEST}
    assert report.to_dict()["deleted"] == 3


def test_objects_newer_than_the_queue_are_kept_however_old(store: ObjectStore) -> None:
    clock = ManualClock(T0 + 10 * HOUR_MS)
    head = put_batch(store, T0)
    in_flight = put_batch(store, T0 + 5)  # written, not yet enqueued
    enqueue(store, head)
    report = _collector(store, clock).run_once()
    assert report.deleted == ()
    # Nothing sorts below the queue's floor: nothing is even listed.
    assert (report.listed, report.kept, report.queue_floor_ms) == (0, {}, T0)
    assert in_flight in paths(store)


def test_dry_run_reports_and_deletes_nothing(store: ObjectStore) -> None:
    clock = ManualClock(T0 + HOUR_MS)
    orphans = {put_batch(store, T0 + i) for i in range(4)}
    enqueue(store, put_batch(store, T0 + HOUR_MS - 1))
    report = _collector(store, clock, dry_run=True).run_once()
    assert report.dry_run
    assert set(report.deleted) == orphans
    assert orphans <= paths(store)


def test_no_manifest_deletes_nothing(store: ObjectStore) -> None:
    orphan = put_batch(store, T0)
    report = _collector(store, ManualClock(T0 + HOUR_MS)).run_once()
    assert report.deleted == ()
    assert report.kept == {KeepReason.NO_MANIFEST: 1}
    assert orphan in paths(store)


def test_corrupt_manifest_stops_the_pass_before_deleting(store: ObjectStore) -> None:
    orphan = put_batch(store, T0)
    store.put(MANIFEST, b"\x00" * 10)
    with pytest.raises(FormatError):
        _collector(store, ManualClock(T0 + HOUR_MS)).run_once()
    assert orphan in paths(store)


def test_a_manifest_restored_from_an_older_copy_stops_the_pass_before_deleting(
    store: ObjectStore,
) -> None:
    """Restored from a copy older than a consumer's takeover, the manifest no longer names
    what was appended since; before the fix GC deleted those batches as unreferenced."""
    first, appended_since = put_batch(store, T0), put_batch(store, T0 + 1)
    enqueue(store, first)
    older = store.get(MANIFEST).data  # epoch 0
    consumer = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=FAST_RETRY))
    consumer.initialize()  # epoch 1, recorded
    consumer.close()
    enqueue(store, appended_since)
    store.put(MANIFEST, older)
    with pytest.raises(InvalidInputError, match="held epoch 1"):
        _collector(store, ManualClock(T0 + HOUR_MS)).run_once()
    assert {first, appended_since} <= paths(store)


def test_failed_deletes_are_reported_and_retried_next_pass(store: ObjectStore) -> None:
    faulty = FailingDeletes(store)
    orphans = [put_batch(store, T0 + i) for i in range(3)]
    enqueue(store, put_batch(store, T0 + HOUR_MS))
    faulty.failing = {orphans[1]}
    collector = _collector(faulty, ManualClock(T0 + 2 * HOUR_MS))
    report = collector.run_once()
    assert set(report.deleted) == {orphans[0], orphans[2]}
    assert [f.path for f in report.failures] == [orphans[1]]
    faulty.failing.clear()
    report = collector.run_once()
    assert report.deleted == (orphans[1],)
    assert report.failures == ()
    assert collector.counters.snapshot()["failed_deletes"] == 1


def test_run_forever_repeats_until_stopped(store: ObjectStore) -> None:
    clock = ManualClock(T0 + HOUR_MS)
    enqueue(store, put_batch(store, T0 + HOUR_MS))
    reports = []
    stop = threading.Event()
    collector = _collector(store, clock, gc_interval=0.01)

    def on_report(report: Any) -> None:
        reports.append(report)
        if len(reports) == 3:
            put_batch(store, T0)  # an orphan appears between passes
        if len(reports) == 5:
            stop.set()

    collector.run_forever(stop, on_report=on_report)
    assert len(reports) == 5
    assert sum(len(r.deleted) for r in reports) == 1
    collector.start()
    collector.close()  # stops and joins the background thread
    collector.close()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"gc_interval": 0}, "gc_interval"),
        ({"gc_grace_period": -1}, "gc_grace_period"),
        ({"gc_grace_period": float("inf")}, "gc_grace_period"),
        ({"manifest_path": ""}, "manifest_path"),
        ({"store": ""}, "store"),
        ({"dry_run": 1}, "dry_run"),
    ],
)
def test_config_names_the_bad_key(overrides: dict[str, Any], key: str) -> None:
    options: dict[str, Any] = {"store": "memory://"}
    options.update(overrides)
    with pytest.raises(ConfigError) as info:
        GarbageCollectorConfig(**options)
    assert info.value.key == key


def test_gc_under_load_never_deletes_a_referenced_or_in_flight_batch(
    shared_store_target: Any,
) -> None:
    """Producers append while the consumer drains and GC runs with a 2 s grace period.

    GC passes run every 50 ms, deleting consumed batches while producers have uploads in
    flight. In flight means from minting the ULID to the append landing: typically tens of
    milliseconds, but a compare-and-swap on the local SeaweedFS under contention sometimes
    stalls for about a second, so a 1 s grace period would sit below the worst in-flight time,
    where the RFC's rules cannot protect anything. The clock is real time plus an offset the
    test moves at the end, so what was consumed is collected without waiting it out.
    """
    store = open_target(shared_store_target)
    clock = OffsetClock()
    grace = 2.0
    strangers = _strangers(store)
    stop_producers = threading.Event()
    stop_gc = threading.Event()
    appended: list[str] = []
    in_flight_ms: dict[str, int] = {}
    consumed: list[str] = []
    deleted: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def produce(seed: int) -> None:
        rng = random.Random(seed)
        minter = UlidMinter(clock)
        queue = QueueProducer(store, MANIFEST, retry=FAST_RETRY)
        try:
            while not stop_producers.is_set():
                location = batch_location("ingest", minter.mint())
                store.put_if_absent(location, encode_batch([location.encode()]))
                time.sleep(rng.uniform(0, 0.03))  # in flight: written, not yet enqueued
                queue.append([PendingEntry(location, (Metadata(0, clock.now_ms(), b""),))])
                with lock:
                    appended.append(location)
                    in_flight_ms[location] = clock.now_ms() - _ulid_ms(location)
                # A flush every few tens of milliseconds per producer: the safety argument
                # needs uploads to land in the manifest well within the grace period.
                time.sleep(rng.uniform(0.01, 0.04))
        except BaseException as err:
            errors.append(err)

    def collect() -> None:
        collector = _collector(store, clock, gc_grace_period=grace)
        try:
            while not stop_gc.is_set():
                report = collector.run_once()
                assert report.failures == ()
                with lock:
                    deleted.extend(report.deleted)
                stop_gc.wait(0.05)
        except BaseException as err:
            errors.append(err)

    producers = [threading.Thread(target=produce, args=(i,)) for i in range(3)]
    gc_thread = threading.Thread(target=collect)
    for thread in [*producers, gc_thread]:
        thread.start()
    consumer = Consumer(
        ConsumerConfig(store=store, gc_enabled=False, ack_batch_size=5, retry=FAST_RETRY)
    )
    consumer.initialize()
    deadline = time.monotonic() + 4.0
    try:
        while True:
            producing = time.monotonic() < deadline
            if not producing:
                stop_producers.set()
            # Producers that ended before this read have all their entries in the manifest.
            finished = not producing and not any(t.is_alive() for t in producers)
            try:
                batch = consumer.next_batch()
            except NotFoundError as err:
                raise AssertionError(
                    f"GC deleted a batch the queue still needed: {err}; in flight for "
                    f"{ {k: v for k, v in in_flight_ms.items() if k in str(err)} } ms "
                    f"(grace {grace * 1000:.0f} ms)"
                ) from err
            if batch is None:
                if finished:
                    break
                time.sleep(0.005)
                continue
            assert batch.entries == (batch.location.encode(),)
            consumed.append(batch.location)
            consumer.ack(batch.sequence)
        consumer.flush()
    finally:
        stop_producers.set()
        stop_gc.set()
        consumer.close()
    for thread in [*producers, gc_thread]:
        thread.join()
    assert errors == []
    assert len(consumed) > 20
    assert sorted(consumed) == sorted(appended)
    assert len(set(consumed)) == len(consumed)
    assert deleted, "GC deleted nothing while producers were running"
    assert set(deleted) <= set(consumed)
    # Once the grace period has passed, everything consumed goes, and nothing else.
    clock.advance(2 * grace)
    final = _collector(store, clock, gc_grace_period=grace).run_once()
    assert set(deleted) | set(final.deleted) == set(consumed)
    assert paths(store) == {*strangers, MANIFEST}


def _ulid_ms(location: str) -> int:
    return ulid_time_ms(location.rpartition("/")[2][:26])


PRODUCER_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from millpond.formats.batch import encode_batch
    from millpond.formats.manifest import Metadata, PendingEntry
    from millpond.queue import QueueProducer
    from millpond.storage import open_store
    from millpond.common.ulids import UlidMinter, batch_location, ulid_time_ms

    store = open_store(sys.argv[1], json.loads(sys.argv[2]))
    queue = QueueProducer(store, "ingest/manifest")
    minter = UlidMinter()
    def upload(i):
        location = batch_location("ingest", minter.mint())
        store.put_if_absent(location, encode_batch([b"row-%d" % i]))
        return location
    for i in range(5):
        location = upload(i)
        queue.append([PendingEntry(location, (Metadata(0, int(time.time() * 1000), b""),))])
        print("enqueued", location, flush=True)
    group = [upload(100 + i) for i in range(3)]
    for location in group:
        print("uploaded", location, flush=True)
    print("crash-point", flush=True)
    time.sleep(60)  # killed here: uploaded, never enqueued
    """
)


def test_orphans_of_a_killed_producer_go_after_the_grace_period(
    shared_store_target: Any,
) -> None:
    store = open_target(shared_store_target)
    strangers = _strangers(store)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            PRODUCER_SCRIPT,
            shared_store_target.url,
            json.dumps(dict(shared_store_target.options or {})),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    enqueued: list[str] = []
    orphans: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        kind, _, rest = line.strip().partition(" ")
        if kind == "enqueued":
            enqueued.append(rest)
        elif kind == "uploaded":
            orphans.append(rest)
        elif kind == "crash-point":
            break
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.stdout.close()
    assert len(enqueued) == 5
    assert len(orphans) == 3

    clock = ManualClock(int(time.time() * 1000))
    collector = _collector(store, clock, gc_grace_period=600.0)
    consumer = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=FAST_RETRY))
    consumer.initialize()
    got = []
    while (batch := consumer.next_batch()) is not None:
        got.append(batch.location)
        consumer.ack(batch.sequence)
    consumer.close()
    assert got == enqueued

    report = collector.run_once()  # within the grace period: the orphans stay
    assert report.deleted == ()
    assert set(orphans) <= paths(store)
    clock.advance(601)
    report = collector.run_once()
    assert set(report.deleted) == {*orphans, *enqueued}
    assert paths(store) == {*strangers, MANIFEST}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "millpond.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_gc_command_once_dry_run_and_interval(tmp_path: Any) -> None:
    url = (tmp_path / "store").as_uri()
    from millpond.storage import open_store

    store = open_store(url)
    old_ms = int(time.time() * 1000) - 2 * HOUR_MS
    orphans = {put_batch(store, old_ms + i) for i in range(2)}
    live = put_batch(store, old_ms + 10)
    enqueue(store, live)
    strangers = _strangers(store)
    for path in [*orphans, live]:  # written two hours ago, as their names say
        os.utime(tmp_path / "store" / path, (old_ms / 1000, old_ms / 1000))

    dry = _cli("gc", url, "--once", "--dry-run", "--output", "json")
    assert dry.returncode == 0, dry.stderr
    record = json.loads(dry.stdout)
    assert record["dry_run"] is True
    assert set(record["deleted_paths"]) == orphans
    assert orphans <= paths(store)

    done = _cli("gc", url, "--grace-period", "60", "--list-deleted")
    assert done.returncode == 0, done.stderr
    assert "deleted 2" in done.stdout
    assert paths(store) == {live, MANIFEST, *strangers}

    proc = subprocess.Popen(
        [sys.executable, "-m", "millpond.cli", "gc", url, "--interval", "0.1", "--output", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    assert first["deleted"] == 0
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


def test_gc_command_refuses_both_modes(tmp_path: Any) -> None:
    result = _cli("gc", (tmp_path / "s").as_uri(), "--once", "--interval", "5")
    assert result.returncode == 2
    assert "not allowed with" in result.stderr


def test_missing_object_error_is_not_found(store: ObjectStore) -> None:
    """The consumer meeting a GC'd object would see this; the load test asserts it never does."""
    location = put_batch(store, T0)
    enqueue(store, location)
    store.delete_many([location])
    consumer = Consumer(ConsumerConfig(store=store, gc_enabled=False))
    consumer.initialize()
    with pytest.raises(NotFoundError, match=location):
        consumer.next_batch()
    consumer.close()
