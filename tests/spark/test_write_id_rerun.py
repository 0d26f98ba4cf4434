"""A rerun of a Spark job whose ``write_id`` landed before it started (issue 47): it succeeds,
says so where the job's output goes, and uploads nothing (its uploads were garbage).

The data source's driver and task sides are called in this process, as Spark calls them (no
JVM): ``writer()`` on the driver, ``write()`` in each task, ``commit()`` on the driver."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StructField, StructType

from millpond.producer.spark.datasource import MillpondDataSource
from millpond.producer.spark.summary import SUMMARY_LOGGER
from millpond.storage import open_store

SCHEMA = StructType([StructField("id", LongType())])


def _batches(url: str) -> list[str]:
    return [i.path for i in open_store(url).list("ingest/") if i.path.endswith(".batch")]


def test_a_rerun_of_a_landed_write_id_says_so_and_uploads_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = (tmp_path / "queue").as_uri()
    first = MillpondDataSource({"store": url, "write_id": "load-1"}).writer(SCHEMA, False)
    first.commit([first.write(iter([pa.record_batch({"id": [1, 2, 3]})]))])
    uploaded = _batches(url)
    assert len(uploaded) == 1
    caplog.set_level(logging.INFO, logger=SUMMARY_LOGGER)

    rerun = MillpondDataSource({"store": url, "write_id": "load-1"}).writer(SCHEMA, False)
    message = rerun.write(iter([pa.record_batch({"id": [1, 2, 3]})]))
    assert message.uploads == ()  # type: ignore[attr-defined]
    rerun.commit([message])
    assert _batches(url) == uploaded  # nothing uploaded to become garbage
    said = [
        r.getMessage()
        for r in caplog.records
        if r.name == SUMMARY_LOGGER and r.levelno == logging.WARNING
    ]
    assert len(said) == 1, said
    assert "write_id 'load-1' was enqueued by an earlier run at sequences 0..0" in said[0]
    assert "this run enqueued nothing and uploaded nothing" in said[0]
    assert "give a new write_id to enqueue the rows again" in said[0]

    another = MillpondDataSource({"store": url, "write_id": "load-2"}).writer(SCHEMA, False)
    another.commit([another.write(iter([pa.record_batch({"id": [4]})]))])
    assert len(_batches(url)) == 2  # a new write id uploads and enqueues as ever
