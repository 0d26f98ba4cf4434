"""Chained requests: the batches a producer uploads while its append is out at the coordinator
are sent at once, to follow it (``X-Millpond-After``), instead of waiting for its reply.

What must hold whatever happens to the first request: a producer's batches land in the order it
published them, each once. The chained request is written only behind the first, and only if
the first was appended; otherwise both are recovered together. Real SeaweedFS, a real
coordinator HTTP server on 127.0.0.1, real producers; stores that hold or fail the coordinator's
writes stand in for a slow or failing round.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from millpond.common.retry import RetryPolicy
from millpond.coordinator.rounds import AppendCoordinator
from millpond.coordinator.server import CoordinatorServer
from millpond.errors import CommitStateUnknownError, StorageError
from millpond.localstack import S3Endpoint
from millpond.producer import Producer
from millpond.queue import read_manifest
from millpond.queue.claim import queue_identity
from millpond.storage import ForwardingStore, ObjectStore, open_store
from tests.producer.producer_support import MANIFEST, PREFIX, all_entries, claim_queue, config
from tests.support import unique_root

DEADLINE = 120.0


class _HeldRound(ForwardingStore):
    """Holds the coordinator's first manifest write until ``release`` is set. Then, by
    ``then``: ``"write"`` it; ``"fail"`` it without writing (a store error: nothing landed);
    ``"land"`` it and report its outcome unknown (a timeout after the write landed). Later
    writes go through."""

    def __init__(self, inner: ObjectStore, *, then: str = "write") -> None:
        super().__init__(inner)
        self.held = threading.Event()
        self.release = threading.Event()
        self._then = then
        self._writes = 0

    def _write(self, call: Any) -> str | None:
        self._writes += 1
        if self._writes > 1:
            return call()  # type: ignore[no-any-return]
        self.held.set()
        self.release.wait(DEADLINE)
        if self._then == "fail":
            raise StorageError(f"{MANIFEST}: injected failure of the coordinator's write")
        etag = call()
        if self._then == "land":  # as the store reports a write whose outcome it cannot know
            raise CommitStateUnknownError(f"{MANIFEST}: injected timeout after the write landed")
        return etag  # type: ignore[no-any-return]

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        if path != MANIFEST:
            return self.inner.put_if_match(path, data, etag)
        return self._write(lambda: self.inner.put_if_match(path, data, etag))

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        if path != MANIFEST:
            return self.inner.put_if_absent(path, data)
        return self._write(lambda: self.inner.put_if_absent(path, data))


def _wait_for(condition: Any, what: str) -> None:
    end = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def _queue(seaweedfs_s3: S3Endpoint) -> ObjectStore:
    store = open_store(seaweedfs_s3.url_for(unique_root()), options=seaweedfs_s3.store_options())
    claim_queue(store)
    return store


def _serve(store: ObjectStore, queue: str) -> CoordinatorServer:
    # One attempt per round: a failed write fails its round, and the next round writes.
    coordinator = AppendCoordinator(
        store, MANIFEST, data_path_prefix=PREFIX, queue=queue, retry=RetryPolicy(max_attempts=1)
    )
    return CoordinatorServer(coordinator).start()


def _entries_in_order(store: ObjectStore) -> list[bytes]:
    return all_entries(store)


def _run(seaweedfs_s3: S3Endpoint, tmp_path: Path, *, then: str) -> tuple[Any, Any, Any]:
    """One producer: batch a0 goes out and its round is held; a batch of a1 and a2 is produced
    and uploaded meanwhile; then the round is let go (or failed)."""
    queue_store = _queue(seaweedfs_s3)
    held = _HeldRound(queue_store, then=then)
    server = _serve(held, queue_identity(queue_store.url, MANIFEST))
    try:
        with Producer(config(queue_store, tmp_path / "wal", coordinator=server.url)) as producer:
            first = producer.produce([b"a0"])
            _wait_for(held.held.is_set, "the first round's write")
            rest = [producer.produce([b"a1", b"a2"])]
            # Uploaded and sent behind the first request, whose reply has not come.
            _wait_for(
                lambda: server.coordinator.stats()["chained_requests"] == 1, "a chained request"
            )
            held.release.set()
            for handle in [first, *rest]:
                handle.wait(DEADLINE)
            metrics = producer.metrics()
        stats = server.coordinator.stats()
    finally:
        held.release.set()
        server.close()
    return queue_store, metrics, stats


def test_batches_uploaded_while_an_append_is_out_follow_it_without_waiting_for_its_reply(
    seaweedfs_s3: S3Endpoint, tmp_path: Path
) -> None:
    queue_store, metrics, stats = _run(seaweedfs_s3, tmp_path, then="write")
    assert metrics["coordinator_chained"] == 1, metrics
    assert metrics["coordinator_appends"] == 1, metrics  # the pair settled as one append
    assert metrics["manifest_writes"] == 0, metrics  # nothing written directly
    # The chained request went in the round after the held one, not after its reply.
    assert stats["rounds"] == 2, stats
    assert stats["refused"] == 0, stats
    assert _entries_in_order(queue_store) == [b"a0", b"a1", b"a2"]
    locations = [e.location for e in read_manifest(queue_store, MANIFEST).manifest.entries]
    assert locations == sorted(locations)  # publish (ULID) order


def test_a_chained_request_behind_a_failed_round_is_never_written_without_it(
    seaweedfs_s3: S3Endpoint, tmp_path: Path
) -> None:
    """The held round fails (nothing landed) and the next round could write: the first request
    is refused, so the chained one is refused unwritten too, and the producer appends both
    batches itself, in order, once."""
    queue_store, metrics, stats = _run(seaweedfs_s3, tmp_path, then="fail")
    assert metrics["coordinator_chained"] == 1, metrics
    assert stats["refused"] == 2, stats  # the failed round's request and the one behind it
    assert stats["entries_appended"] == 0, stats
    assert metrics["direct_appends"] >= 1, metrics
    assert _entries_in_order(queue_store) == [b"a0", b"a1", b"a2"]
    locations = [e.location for e in read_manifest(queue_store, MANIFEST).manifest.entries]
    assert len(locations) == len(set(locations)) == 2  # a0, then a1 and a2 in one batch


def test_a_chained_request_behind_a_round_that_may_have_landed_is_recovered_with_it(
    seaweedfs_s3: S3Endpoint, tmp_path: Path
) -> None:
    """The held round's write lands but its outcome is unknown: the first request's fate is
    unknown to the coordinator, so the chained one is refused unwritten, and the producer looks
    for both in the manifest before appending what is missing: a0 found, the rest appended
    behind it, each once."""
    queue_store, metrics, stats = _run(seaweedfs_s3, tmp_path, then="land")
    assert metrics["coordinator_chained"] == 1, metrics
    assert metrics["coordinator_unknown"] == 1, metrics
    assert stats["unknown"] == 1, stats
    assert stats["refused"] == 1, stats  # the chained request
    assert _entries_in_order(queue_store) == [b"a0", b"a1", b"a2"]
    locations = [e.location for e in read_manifest(queue_store, MANIFEST).manifest.entries]
    assert len(locations) == len(set(locations)) == 2


def test_a_chained_request_is_refused_unless_the_request_it_follows_was_appended(
    seaweedfs_s3: S3Endpoint,
) -> None:
    """Never seen, or withdrawn before its round (its writer asked for its outcome): the request
    chained behind it is refused, and nothing of it is written. Chained behind one waiting for
    the same round, it goes in that round, right behind it."""
    from tests.core._helpers import pending

    queue_store = _queue(seaweedfs_s3)
    coordinator = AppendCoordinator(queue_store, MANIFEST, data_path_prefix=PREFIX)
    orphan = coordinator.submit("orphan", pending(1, tag="o"), after="never-sent")
    assert orphan.outcome is not None
    assert orphan.outcome.status == "refused"
    assert "is not here" in orphan.outcome.reason
    withdrawn = coordinator.submit("w", pending(1, tag="w"))
    behind_withdrawn = coordinator.submit("bw", pending(1, tag="bw"), after="w")
    first = coordinator.submit("x", pending(2, tag="x"))
    second = coordinator.submit("y", pending(2, tag="y"), after="x")
    outcome = coordinator.outcome("w", 0)  # its writer lost the reply and asks: withdrawn
    assert outcome is not None
    assert outcome.status == "refused"
    assert withdrawn.outcome == outcome
    coordinator.start()
    try:
        for ticket in (behind_withdrawn, first, second):
            assert ticket.done.wait(DEADLINE)
    finally:
        coordinator.stop(10)
    assert behind_withdrawn.outcome is not None
    assert behind_withdrawn.outcome.status == "refused"
    assert "was not appended" in behind_withdrawn.outcome.reason
    assert first.outcome is not None
    assert second.outcome is not None
    assert first.outcome.status == second.outcome.status == "appended"
    assert first.outcome.sequences == (0, 1)
    assert second.outcome.sequences == (2, 3)
    stats = coordinator.stats()
    assert stats["rounds"] == 1, stats
    tags = [e.metadata[0].payload for e in read_manifest(queue_store, MANIFEST).manifest.entries]
    assert tags == [b"x-0", b"x-1", b"y-0", b"y-1"]


def test_nothing_is_chained_that_a_coordinator_could_write_after_the_appends_deadline() -> None:
    """A request's deadline leaves no room for a chained one's promise: the batches uploaded
    meanwhile are not taken from the producer (they wait for the next append)."""
    from millpond.coordinator.client import Chain
    from millpond.coordinator.connection import CoordinatorOptions, Endpoint
    from tests.core._helpers import pending
    from tests.support import ManualClock

    taken: list[int] = []

    def more() -> list[Any]:
        taken.append(1)
        return pending(1)

    chain = Chain(Endpoint("http://127.0.0.1:9", CoordinatorOptions()), more)
    assert chain.poll(ManualClock(), lambda: False, "x", {}) is True
    assert taken == []
    assert chain.entries == []
    assert not chain.sent
