"""The Spark driver's one summary line per job and per micro-batch: batches, bytes, rows, CAS
conflicts. Driver-side code, called here as Spark's commit worker calls it."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest

from millpond.common.ulids import UlidMinter, batch_location
from millpond.formats.batch import encode_batch
from millpond.formats.manifest import PendingEntry
from millpond.producer.spark.commit import commit_job
from millpond.producer.spark.datasource import MillpondStreamWriter, _settings
from millpond.producer.spark.summary import SUMMARY_LOGGER
from millpond.producer.spark.upload import TaskCommitMessage, UploadedBatch, UploadStats
from millpond.queue import QueueProducer
from millpond.storage import ForwardingStore, ObjectStore, open_store

MANIFEST = "ingest/manifest"
_minter = UlidMinter()


class RacingStore(ForwardingStore):
    """Another producer appends just before each of the first ``races`` manifest writes."""

    def __init__(self, inner: ObjectStore, races: int) -> None:
        super().__init__(inner)
        self.races = races

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        if path == MANIFEST and self.races:
            self.races -= 1
            QueueProducer(self.inner, MANIFEST).append([PendingEntry(_upload(self.inner))])
        return self.inner.put_if_match(path, data, etag)


def _upload(store: ObjectStore) -> str:
    location = batch_location("ingest", _minter.mint())
    store.put_if_absent(location, encode_batch([b"row"]))
    return location


def _message(store: ObjectStore, partition: int) -> TaskCommitMessage:
    location = _upload(store)
    size = store.head(location).size
    return TaskCommitMessage(
        partition,
        0,
        (UploadedBatch(location, 1, 10, 1),),
        UploadStats(rows=10, entries=1, batches=1, bytes=size, put_requests=1),
    )


def test_a_job_logs_batches_bytes_rows_and_conflicts(caplog: pytest.LogCaptureFixture) -> None:
    inner = open_store(f"memory://{uuid.uuid4().hex}")
    QueueProducer(inner, MANIFEST).append([PendingEntry(_upload(inner))])  # sequence 0
    store = RacingStore(inner, races=2)
    messages = [_message(inner, 0), _message(inner, 1)]
    size = sum(m.stats.bytes for m in messages)
    with caplog.at_level(logging.INFO, logger=SUMMARY_LOGGER):
        commit_job(store, messages, job_id="j1", manifest_path=MANIFEST, gc_grace_period=600)
    lines = [r.getMessage() for r in caplog.records if r.name == SUMMARY_LOGGER]
    assert lines == [
        f"millpond job j1: 2 batches, {size} bytes, 20 rows appended at sequences 3..4 "
        "(2 CAS conflicts, 3 manifest writes)"
    ]


def test_a_micro_batch_logs_its_summary(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    url = tmp_path.as_uri()
    store = open_store(url)
    writer = MillpondStreamWriter(_settings({"store": url, "query_id": "q7"}, False))
    messages = [_message(store, 0), _message(store, 1)]
    size = sum(m.stats.bytes for m in messages)
    with caplog.at_level(logging.INFO, logger=SUMMARY_LOGGER):
        writer.commit(messages, 4)
        writer.commit(messages, 4)  # the same batch id again (a restarted driver): skipped
    lines = [r.getMessage() for r in caplog.records if r.name == SUMMARY_LOGGER]
    assert lines[0] == (
        f"millpond stream q7 batch 4: 2 batches, {size} bytes, 20 rows appended at sequences "
        "0..1 (0 CAS conflicts, 1 manifest writes)"
    )
    assert lines[1].startswith("millpond stream q7 batch 4: 2 batches")
    assert " skipped" in lines[1]
