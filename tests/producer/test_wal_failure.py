"""The WAL's disk fails: every call waiting on the producer is told, none waits forever.

A write that fails (here a real ``EFBIG``: the process's file-size limit, as a full disk would
give ``ENOSPC``) or an ``fdatasync`` that fails stops the producer. Before the fix the group of
calls the WAL writer (or syncer) was working on when it failed was in no list the failure
walked, so their ``wait()`` never returned. A producer started again on the directory
publishes what the WAL holds, each entry once.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from millpond.errors import ClosedError, StorageError
from millpond.producer import Producer
from tests.producer.producer_support import all_entries, config, fresh_memory

_CHILD = textwrap.dedent(
    """
    import json, resource, signal, sys, time, uuid
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    from millpond.producer import Producer, ProducerConfig
    from millpond.storage import open_store
    from tests.producer.producer_support import all_entries

    url = f"memory://wal-failure-{uuid.uuid4().hex}"
    wal_dir = sys.argv[1]
    producer = Producer(ProducerConfig(store=url, wal_dir=wal_dir, flush_interval=0.02))
    first = producer.produce([b"before"])
    first.wait(timeout=30)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.RLIM_INFINITY))
    handles = [producer.produce([b"%04d" % i + b"x" * 20_000]) for i in range(40)]
    outcomes = []
    deadline = time.monotonic() + 30
    for handle in handles:
        try:
            handle.wait(timeout=max(0.1, deadline - time.monotonic()))
            outcomes.append("durable")
        except TimeoutError:
            outcomes.append("timeout")
        except Exception as err:
            outcomes.append(f"{type(err).__name__}: {err}")
    try:
        producer.produce([b"after"])
        after = "accepted"
    except Exception as err:
        after = type(err).__name__
    try:
        producer.close(timeout=30)
    except Exception:
        pass
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    Producer(ProducerConfig(store=url, wal_dir=wal_dir, flush_interval=0.02)).close(timeout=30)
    entries = [e.decode()[:6] for e in all_entries(open_store(url))]
    print(json.dumps({"outcomes": outcomes, "after": after, "entries": entries}))
    """
)


def test_a_failed_wal_write_fails_every_waiting_call_and_a_restart_publishes_each_once(
    tmp_path: Path,
) -> None:
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "wal")],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=Path(__file__).parents[2],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    outcomes: list[str] = report["outcomes"]
    failed = [o for o in outcomes if o != "durable"]
    assert "timeout" not in outcomes, outcomes  # before the fix: every one of them
    assert failed, "the file-size limit never bit"
    for outcome in failed:
        assert outcome.startswith("StorageError: WAL "), outcome
        assert "write failed" in outcome, outcome
        assert "File too large" in outcome, outcome
    assert report["after"] == "ClosedError"
    counts = Counter(report["entries"])
    assert counts["before"] == 1
    assert all(count == 1 for count in counts.values()), counts  # nothing doubled
    durable = {f"{i:04d}xx" for i, o in enumerate(outcomes) if o == "durable"}
    assert durable <= set(counts), "an entry whose wait() returned was lost"


def test_a_failed_wal_sync_fails_the_groups_it_was_syncing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import millpond.wal as wal_module

    real = wal_module._fdatasync
    syncs = [0]

    def failing_in_the_syncer(fd: int) -> None:
        # Only the syncer's: the uploaders sync too (their own failure path is another).
        if threading.current_thread().name == "millpond-wal-syncer":
            syncs[0] += 1
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    store = fresh_memory()
    producer = Producer(config(store, tmp_path / "wal"))
    producer.produce([b"first"]).wait(timeout=30)
    monkeypatch.setattr(wal_module, "_fdatasync", failing_in_the_syncer)
    handles = [producer.produce([b"e%03d" % i]) for i in range(50)]
    deadline = time.monotonic() + 30
    for handle in handles:
        with pytest.raises(StorageError, match="fdatasync failed"):
            # Before the fix: TimeoutError for the group being synced.
            handle.wait(timeout=max(0.1, deadline - time.monotonic()))
    assert syncs[0] >= 1
    with pytest.raises(ClosedError):
        producer.produce([b"after"])
    with pytest.raises(StorageError):
        producer.close(timeout=30)
    monkeypatch.setattr(wal_module, "_fdatasync", real)
    Producer(config(store, tmp_path / "wal")).close(timeout=30)
    counts = Counter(all_entries(store))
    assert counts[b"first"] == 1
    assert all(count == 1 for count in counts.values()), counts


def _stopped_by_the_committer(producer: Producer, error: BaseException) -> None:
    """What the committer (or the sealer, an uploader, the releaser) does when it fails for
    good, called from the test's thread at a moment the test picks."""
    from millpond.producer._publisher import fail_fatal

    fail_fatal(producer._state, "committer")(error)


@pytest.mark.parametrize("stage", ["writing", "syncing"])
def test_a_stop_from_another_thread_settles_the_group_the_wal_threads_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """Another thread's permanent failure (a corrupt manifest stops the committer) while the
    WAL writer is writing a group, or the syncer syncing one: that group was in no list the
    failure walked, and it was handed on to a syncer already gone (writing) or staged after
    the failure into a producer that would never publish it (syncing). Seen in the
    whole-system checker: a ``produce()`` whose ``wait_staged()`` never returned. Its calls
    now fail with the producer's error; the WAL keeps the records for the next producer."""
    import millpond.wal as wal_module

    inside, go = threading.Event(), threading.Event()
    thread = {"writing": "millpond-wal-writer", "syncing": "millpond-wal-syncer"}[stage]
    blocking = [False]

    def held(call):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            if blocking[0] and threading.current_thread().name == thread:
                inside.set()
                assert go.wait(30)
            return call(*args, **kwargs)

        return run

    if stage == "writing":
        monkeypatch.setattr(wal_module.Wal, "append_data", held(wal_module.Wal.append_data))
    else:
        monkeypatch.setattr(wal_module, "_fdatasync", held(wal_module._fdatasync))
    store = fresh_memory()
    producer = Producer(config(store, tmp_path / "wal"))
    producer.produce([b"first"]).wait(timeout=30)
    blocking[0] = True
    handle = producer.produce([b"held"])
    assert inside.wait(30), f"the {thread} never took the call"
    error = StorageError("manifest is corrupt (injected)")
    _stopped_by_the_committer(producer, error)
    go.set()
    with pytest.raises(StorageError, match="corrupt"):
        handle.wait(timeout=10)  # before the fix: TimeoutError, the call never settled
    assert handle.done()
    if stage == "syncing":
        handle.wait_staged(timeout=0)  # synced into the WAL: staged, and never published here
    else:
        with pytest.raises(StorageError, match="corrupt"):
            handle.wait_staged(timeout=0)  # written, not synced: not staged
    blocking[0] = False
    with pytest.raises(ClosedError):
        producer.produce([b"after"])
    with pytest.raises(StorageError):
        producer.close(timeout=30)
    Producer(config(store, tmp_path / "wal")).close(timeout=30)
    counts = Counter(all_entries(store))
    assert counts[b"first"] == 1
    assert counts[b"held"] == 1  # in the WAL before the stop: the next producer publishes it
    assert all(count == 1 for count in counts.values()), counts
