"""Conflict-aware group commit in the producer: an append that loses its compare-and-swap takes
the batches uploaded meanwhile into its next write, so they do not wait for another turn."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from millpond.common.ulids import UlidMinter, batch_location
from millpond.formats.batch import decode_batch
from millpond.formats.manifest import PendingEntry
from millpond.producer import Producer
from millpond.queue import QueueProducer, read_manifest
from millpond.storage.store import ObjectStore
from tests.producer.producer_support import (
    MANIFEST,
    PREFIX,
    ControlledStore,
    config,
    fresh_memory,
)


class _RivalFirst(ControlledStore):
    """The producer's first conditional manifest write waits for ``release``, then loses its
    race: another writer appends ``rival`` just before it reaches the store."""

    def __init__(self, inner: ObjectStore, rival: list[PendingEntry]) -> None:
        super().__init__(inner)
        self.rival = rival
        self.release = threading.Event()
        self._raced = False

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        if path == self.manifest_path and not self._raced:
            self._raced = True
            self.manifest_write_started.set()
            assert self.release.wait(30), "the test never released the first manifest write"
            QueueProducer(self.inner, MANIFEST).append(self.rival)
        return super().put_if_match(path, data, etag)


def _entries(n: int) -> list[PendingEntry]:
    minter = UlidMinter()
    return [PendingEntry(batch_location(PREFIX, minter.mint())) for _ in range(n)]


def test_batches_uploaded_while_an_append_lost_its_race_join_the_retry(tmp_path: Path) -> None:
    inner = fresh_memory()
    before, rival = _entries(1), _entries(2)
    QueueProducer(inner, MANIFEST).append(before)  # the producer reads, then writes on an ETag
    store = _RivalFirst(inner, rival)
    with Producer(config(store, tmp_path, flush_size_bytes=64)) as producer:
        first = producer.produce([b"first" * 20])
        assert store.manifest_write_started.wait(30)  # the first append is in flight...
        handles = [producer.produce([b"%03d" % i * 30]) for i in range(5)]
        deadline = time.monotonic() + 30
        while producer.metrics()["uploads"] < 6:  # ...while five more batches upload
            assert time.monotonic() < deadline, producer.metrics()
            handles[-1].wait_staged(10)
            threading.Event().wait(0.005)
        store.release.set()  # the first write now loses to the rival
        for handle in [first, *handles]:
            handle.wait(30)
        metrics = producer.metrics()
    assert metrics["cas_conflicts"] >= 1
    assert metrics["batches_committed"] == 6
    assert metrics["manifest_appends"] == 1  # the lost append's retry carried all six
    manifest = read_manifest(inner, MANIFEST).manifest
    locations = [entry.location for entry in manifest.entries]
    assert locations[:3] == [e.location for e in before + rival]  # the rival won the race
    assert [decode_batch(inner.get(loc).data, name=loc) for loc in locations[3:]] == [
        [b"first" * 20],
        *([b"%03d" % i * 30] for i in range(5)),
    ]
    assert manifest.next_sequence == 9
