"""``WriteHandle.wait_written()`` on the producer's side, with the consumer's written-through
mark written by hand (the service itself: ``tests/consumer/test_await_sink.py``): it waits for
the manifest first, then for the mark; it names what held it up."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from millpond import InvalidInputError, SinkWaitTimeoutError
from millpond.producer import Producer, WriteHandle
from millpond.queue import WrittenMark, queue_identity, written_path
from millpond.storage import ObjectStore
from tests.producer.producer_support import MANIFEST, ControlledStore, config, fresh_memory


def publish(store: ObjectStore, written_through: int) -> None:
    mark = WrittenMark(
        queue=queue_identity(store.url, MANIFEST),
        epoch=1,
        written_through=written_through,
        state="running",
        updated_ms=0,
    )
    store.put(written_path("ingest"), mark.to_json())


def test_it_returns_once_the_consumer_marks_the_batch_written(tmp_path: Path) -> None:
    store = fresh_memory()
    with Producer(config(store, tmp_path / "wal")) as producer:
        first = producer.produce([b"a"])
        first.wait(30)
        assert first.sequence == 0
        with pytest.raises(SinkWaitTimeoutError, match="no consumer has said") as info:
            first.wait_written(0.2)
        assert info.value.reason == "no_consumer"
        publish(store, 0)
        first.wait_written(5)
        second = producer.produce([b"b"])
        waiting = threading.Thread(target=second.wait_written, args=(30,))
        waiting.start()
        second.wait(30)
        publish(store, 1)
        waiting.join(30)
        assert not waiting.is_alive()


def test_a_batch_not_in_the_queue_yet_times_out_as_such(tmp_path: Path) -> None:
    store = ControlledStore(fresh_memory())
    with Producer(config(store, tmp_path / "wal")) as producer:
        store.fail_manifest = True
        handle = producer.produce([b"a"])
        with pytest.raises(SinkWaitTimeoutError, match="not in the queue after") as info:
            handle.wait_written(0.3)
        assert (info.value.reason, info.value.waiting_for) == ("not_durable", None)
        store.fail_manifest = False
        handle.wait(30)


def test_a_handle_of_no_producer_cannot_wait_for_the_database() -> None:
    with pytest.raises(InvalidInputError, match="belongs to no producer"):
        WriteHandle(1).wait_written(1)
