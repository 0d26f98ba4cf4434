"""``Producer.metrics()`` under the exported names, and ``register_metrics()`` into a
caller's ``CollectorRegistry``."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from millpond.common.exposition import CATALOG
from millpond.producer import Producer
from millpond.producer._metrics import PRODUCER_METRICS
from tests.producer.producer_support import config, fresh_memory
from tests.scrape import family, parse


def test_metrics_dict_has_the_exported_names(tmp_path: Path) -> None:
    with Producer(config(fresh_memory(), tmp_path)) as producer:
        for _ in range(5):
            producer.produce([b"abc", b"de"])
        producer.flush(timeout=10)
        metrics = producer.metrics()
    # The old keys stay ...
    assert metrics["entries_produced"] == 10
    assert metrics["batches_committed"] >= 1
    # ... and every exported metric is there under its own name, with the same figures.
    assert set(PRODUCER_METRICS) <= metrics.keys()
    assert metrics["millpond_producer_entries_total"] == 10
    assert metrics["millpond_producer_committed_entries_total"] == 10
    assert metrics["millpond_producer_batches_total"] == metrics["batches_committed"]
    assert metrics["millpond_producer_uploaded_bytes_total"] == metrics["bytes_uploaded"] > 0
    assert metrics["millpond_manifest_writes_total"] == metrics["manifest_writes"] >= 1
    assert metrics["millpond_manifest_conflicts_total"] == metrics["cas_conflicts"]
    appends = metrics["millpond_manifest_append_duration_seconds"]
    assert appends["count"] == metrics["manifest_appends"] >= 1
    assert appends["buckets"]["+Inf"] == appends["count"]
    fsyncs = metrics["millpond_producer_wal_fsync_duration_seconds"]
    assert fsyncs["count"] == metrics["fsync_latency"]["count"] >= 1
    assert metrics["millpond_producer_wal_bytes"] == metrics["wal_bytes"]


def test_register_into_a_callers_registry(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    producer = Producer(config(fresh_memory(), tmp_path / "a"))
    try:
        producer.register_metrics(registry, labels={"app": "ingest"})
        for i in range(20):
            producer.produce([b"%d" % i])
        producer.flush(timeout=10)
        values = parse(generate_latest(registry).decode())
        expected = producer.metrics()
        for name in PRODUCER_METRICS:
            assert values["#types"][family(name)] == CATALOG[name].kind.value, name
        assert values['millpond_producer_entries_total{app="ingest"}'] == 20
        assert (
            values['millpond_manifest_writes_total{app="ingest",role="producer"}']
            == expected["manifest_writes"]
        )
        assert (
            values['millpond_manifest_append_duration_seconds_count{app="ingest"}']
            == expected["manifest_appends"]
        )
        with pytest.raises(ValueError, match="already registered"):
            producer.register_metrics(registry)
        # A second producer cannot register the same names into the same registry.
        with (
            Producer(config(fresh_memory(), tmp_path / "b")) as other,
            pytest.raises(ValueError, match="Duplicated timeseries"),
        ):
            other.register_metrics(registry)
    finally:
        producer.close()
    # close() unregisters: the registry is free for the next producer.
    assert "millpond_producer_entries_total" not in generate_latest(registry).decode()
    with Producer(config(fresh_memory(), tmp_path / "c")) as successor:
        successor.register_metrics(registry)
        assert "millpond_producer_entries_total 0.0" in generate_latest(registry).decode()


def test_conflicts_are_counted_when_producers_race(tmp_path: Path) -> None:
    """Two producers appending to one manifest at once lose compare-and-swaps to each other."""
    store = fresh_memory()
    registries = [CollectorRegistry(), CollectorRegistry()]
    producers = [Producer(config(store, tmp_path / str(i), flush_interval=0.001)) for i in range(2)]
    try:
        for producer, registry in zip(producers, registries, strict=True):
            producer.register_metrics(registry)

        def conflicts() -> float:
            return sum(
                parse(generate_latest(registry).decode())[
                    'millpond_manifest_conflicts_total{role="producer"}'
                ]
                for registry in registries
            )

        for _round in range(200):

            def burst(producer: Producer) -> None:
                for i in range(5):
                    producer.produce([b"%d" % i]).wait(10)

            threads = [threading.Thread(target=burst, args=(p,)) for p in producers]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if conflicts() > 0:
                break
        assert conflicts() > 0
        total_writes = sum(p.metrics()["millpond_manifest_writes_total"] for p in producers)
        assert total_writes > sum(p.metrics()["manifest_appends"] for p in producers)
    finally:
        for producer in producers:
            producer.close()
