"""The S3 server goes away for seconds: produce() keeps accepting, everything arrives after.

The test starts its own moto server (module scope) because it stops and restarts it; the
session-wide servers other tests share must stay up.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from millpond import open_store
from millpond.common.retry import RetryPolicy
from millpond.localstack import MotoS3Server, start_moto
from millpond.producer import Producer, ProducerConfig, WriteHandle
from tests.producer.producer_support import read_back

OUTAGE_SECONDS = 3.0


@pytest.fixture(scope="module")
def own_moto() -> Iterator[MotoS3Server]:
    server = start_moto(bucket="outage")
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_outage_keeps_accepting_and_delivers_in_order(
    tmp_path: Path, own_moto: MotoS3Server
) -> None:
    endpoint = own_moto.endpoint
    url = endpoint.url_for(f"outage-{uuid.uuid4().hex[:8]}")
    options = endpoint.store_options()
    config = ProducerConfig(
        store=url,
        store_options=options,
        wal_dir=tmp_path / "wal",
        flush_interval=0.02,
        retry=RetryPolicy(max_attempts=10, max_elapsed=2.0, base_delay=0.01, max_delay=0.2),
    )
    handles: list[WriteHandle] = []
    number = 0

    def produce_some(count: int) -> None:
        nonlocal number
        for _ in range(count):
            handles.append(producer.produce([b"%d" % number], metadata=b"outage"))
            number += 1

    with Producer(config) as producer:
        produce_some(50)
        handles[-1].wait(30)
        own_moto.stop()
        during = len(handles)
        # The outage lasts OUTAGE_SECONDS of wall time, and produce() is called all through it.
        deadline = time.monotonic() + OUTAGE_SECONDS
        while time.monotonic() < deadline:
            produce_some(10)
            handles[-1].wait_staged(10)  # staged in the WAL although the store is gone
        assert len(handles) - during > 100
        assert not handles[-1].done()
        assert producer.metrics()["put_retries"] + producer.metrics()["cas_retries"] > 0
        own_moto.start()
        produce_some(50)
        producer.flush(timeout=60)
        assert all(h.done() and h.exception() is None for h in handles)
    numbers = [int(e) for b in read_back(open_store(url, options)) for e in b.entries]
    assert numbers == list(range(number))
