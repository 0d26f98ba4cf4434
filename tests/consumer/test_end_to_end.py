"""The real producer into the consumer service: Arrow rows and opaque entries land once."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
from consumer_support import FAST_RETRY, Database, numbered, open_target

from millpond.consumer import Consumer, ConsumerConfig
from millpond.consumer.app.service import ConsumerService
from millpond.producer import Producer, ProducerConfig


def _drain(target: Any, database: Database, **sink_options: Any) -> None:
    store = open_target(target)
    consumer = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=FAST_RETRY))
    with database.sink(**sink_options) as sink:
        ConsumerService(consumer, sink).run(threading.Event(), until_idle=True)


def test_produce_arrow_with_drift_lands_as_rows(
    shared_store_target: Any, database: Database, tmp_path: Path
) -> None:
    config = ProducerConfig(
        store=shared_store_target.url,
        store_options=dict(shared_store_target.options or {}),
        wal_dir=str(tmp_path / "wal"),
    )
    with Producer(config) as producer:
        handles = [
            producer.produce_arrow(numbered(i * 100, 100), metadata=b"source=a") for i in range(8)
        ]
        drifted = pa.table({"n": pa.array([800], pa.int64()), "extra": [1.5]})
        handles.append(producer.produce_arrow(drifted, metadata=b"source=b"))
        for handle in handles:
            handle.wait()
    _drain(shared_store_target, database)
    assert database.query(
        f'SELECT count(*), count(DISTINCT n), max(n) FROM "{database.table}"'
    ) == [(801, 801, 800)]
    assert database.query(f'SELECT extra FROM "{database.table}" WHERE n = 800') == [(1.5,)]


def test_opaque_entries_keep_their_metadata(
    shared_store_target: Any, database: Database, tmp_path: Path
) -> None:
    config = ProducerConfig(
        store=shared_store_target.url,
        store_options=dict(shared_store_target.options or {}),
        wal_dir=str(tmp_path / "wal"),
    )
    with Producer(config) as producer:
        first = producer.produce([b"a", b"b"], metadata=b"call-1")
        second = producer.produce([b"c"], metadata=b"call-2")
        first.wait()
        second.wait()
    _drain(shared_store_target, database, entry_format="opaque")
    rows = database.query(f'SELECT payload, metadata FROM "{database.table}" ORDER BY payload')
    assert [(bytes(p), bytes(m)) for p, m in rows] == [
        (b"a", b"call-1"),
        (b"b", b"call-1"),
        (b"c", b"call-2"),
    ]
