"""Issue 44, case 2: the public path, end to end, on Azure Blob (Azurite), GCS (fake-gcs-server)
and S3 (moto).

The consumer failed on Azure Blob at its first ``next_batch()``: its fence check read the
manifest's footer with a suffix range, which obstore refuses there. The store and queue suites
ran on the emulators, but only the queue's own calls; this runs what a user runs, on each
backend: a real ``Producer``; ``Consumer.initialize()``, ``next_batch()``,
``next_batches(...)``, ``ack()``; then ``millpond status``, ``consume``, ``gc``, ``status``
again and ``doctor`` as real processes, configured from the backend's standard variables.

Every server binds 127.0.0.1. The processes get no cloud credentials but the emulator's, and
``AWS_METADATA_ENDPOINT`` names a closed loopback port, so nothing asks 169.254.169.254.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from millpond.consumer import ConsumedBatch, Consumer, ConsumerConfig
from millpond.localstack._process import free_ports
from millpond.producer import Producer, ProducerConfig
from millpond.storage import ObjectStore, open_store
from tests.support import DOCTOR_CHECKS, run_cli, unique_root

_ENDPOINTS = {"azurite": "azurite_blob", "gcs": "fake_gcs", "moto": "moto_s3"}
_PREFIX = "ingest"
_GRACE = 4.0
"""Seconds: the GC grace period the queue is claimed with (the first role to open it, the
in-process consumer, writes the claim), so ``millpond gc`` may delete the consumed batch
objects within the test. Producers re-upload a batch not appended within half of it, and a GC
pass deletes only within half the delete window (a quarter of it) from its start: 0.5 s, where
a pass on fake-gcs-server takes about 0.3 s."""


def _env(kind: str, endpoint: Any) -> dict[str, str]:
    """This process's environment without any cloud settings, plus the backend's own."""
    clouds = ("AWS_", "AZURE_", "AZURITE_", "GOOGLE_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(clouds)}
    env["AWS_METADATA_ENDPOINT"] = f"http://127.0.0.1:{free_ports(1)[0]}"
    # Azurite as its users reach it: the emulator switch (the well-known account).
    extra: dict[str, str] = endpoint.emulator_env() if kind == "azurite" else endpoint.env()
    return {**env, **extra}


def _millpond(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    result = run_cli(*args, env=env)
    assert result.returncode == 0, f"millpond {args[0]}: {result.stdout}{result.stderr}"
    return result


def _batch_objects(store: ObjectStore) -> set[str]:
    return {i.path for i in store.list(_PREFIX, recursive=False) if i.path.endswith(".batch")}


def _records(tag: str, count: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(count)]


def _produce(producer: Producer, records: list[bytes], per_call: int) -> None:
    # One call waited for before the next: each is a batch of its own.
    for start in range(0, len(records), per_call):
        producer.produce(records[start : start + per_call], metadata=b"e2e").wait(60)


def _consume_in_process(consumer: Consumer, expected: int) -> list[ConsumedBatch]:
    """``next_batch()`` and ``ack()`` once, then ``next_batches()`` with ``ack()`` until every
    produced record came back."""
    first = consumer.next_batch()
    assert first is not None, "next_batch() found nothing the producer had appended"
    consumer.ack(first.sequence)
    batches = [first]
    for _ in range(50):
        if sum(len(b.entries) for b in batches) >= expected:
            break
        more = consumer.next_batches(8)
        assert more, "next_batches() found nothing while appended batches remained"
        for batch in more:
            consumer.ack(batch.sequence)
        batches += more
    return batches


@pytest.mark.parametrize("kind", list(_ENDPOINTS))
def test_case2_the_public_path_runs_end_to_end_on_azure_gcs_and_s3(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    endpoint = request.getfixturevalue(_ENDPOINTS[kind])
    url = endpoint.url_for(unique_root())
    options = endpoint.store_options()
    env = _env(kind, endpoint)
    store = open_store(url, options)
    sink = f"sqlite://{tmp_path / 'sink.db'}"

    # 1. The library: a consumer takes the (new) queue, a producer fills it, the consumer
    #    reads and acknowledges everything, each record once, in order.
    consumer = Consumer(
        ConsumerConfig(store=url, store_options=options, gc_grace_period=_GRACE, gc_interval=3600.0)
    )
    first_records = _records("library", 10)
    try:
        consumer.initialize()  # before the producer opens the queue: it claims it
        with Producer(
            ProducerConfig(store=url, store_options=options, wal_dir=str(tmp_path / "wal"))
        ) as producer:
            _produce(producer, first_records, per_call=3)  # 4 batches
            consumed = _consume_in_process(consumer, len(first_records))
            consumer.close()  # dequeues what was acked
            # 2. More for the service to take.
            service_records = _records("service", 12)
            _produce(producer, service_records, per_call=4)  # 3 batches
    finally:
        consumer.close()
    assert [e for b in consumed for e in b.entries] == first_records
    assert [b.sequence for b in consumed] == list(range(len(consumed)))
    assert len(consumed) == 4
    epoch = consumer.epoch
    assert epoch is not None

    # 3. `millpond status --bytes`: the three batches waiting, their bytes measured.
    batches = _batch_objects(store)
    assert {b.location for b in consumed} < batches
    waiting = batches - {b.location for b in consumed}
    sizes = {i.path: i.size for i in store.list(_PREFIX, recursive=False)}
    before = json.loads(_millpond(env, "status", url, "--bytes", "--output", "json").stdout)
    assert before["epoch"] == epoch
    assert (before["queue_length"], before["first_sequence"], before["next_sequence"]) == (3, 4, 7)
    assert before["bytes_referenced"] == sum(sizes[p] for p in waiting)
    assert before["missing_objects"] == 0

    # 4. `millpond consume` into SQLite until the queue is drained.
    _millpond(env, "consume", url, "--sink", sink, "--exit-when-idle", "--quiet")
    with sqlite3.connect(tmp_path / "sink.db") as db:
        rows = db.execute("SELECT payload, metadata FROM millpond_rows").fetchall()
    payloads = sorted(bytes(payload) for payload, _ in rows)
    assert payloads == sorted(service_records)  # each once, and nothing the library took
    assert {bytes(metadata) for _, metadata in rows} == {b"e2e"}

    # 5. `millpond gc`: every batch object was consumed and dequeued; once past the grace
    #    period (by its name's time and by the store's last-modified time) each is deleted.
    deleted = _collect_until_deleted(env, url, batches)
    assert sorted(deleted) == sorted(batches)  # each deleted once
    assert _batch_objects(store) == set()

    # 6. `millpond status` with the sink: nothing waits, the sink has the service's batches.
    after = json.loads(
        _millpond(env, "status", url, "--bytes", "--sink", sink, "--output", "json").stdout
    )
    assert (after["queue_length"], after["next_sequence"], after["bytes_referenced"]) == (0, 7, 0)
    assert after["epoch"] == epoch + 1  # the service took over from the library's consumer
    assert after["sink"]["rows"] == len(service_records)
    assert (after["sink"]["batches"], after["sink"]["last_sequence"]) == (3, 6)
    assert after["consumer"]["epoch"] == epoch + 1  # the service's own report, read back
    text = _millpond(env, "status", url, "--sink", sink).stdout
    assert f"epoch            {epoch + 1}" in text
    assert "queue length     0 entries" in text
    assert "12 rows in 3 batches, last sequence 6" in text

    # 7. `millpond doctor` with the sink: every check passes, and it reads the manifest.
    report = json.loads(_millpond(env, "doctor", url, "--sink", sink, "--output", "json").stdout)
    assert report["ok"] is True
    assert [c["name"] for c in report["checks"]] == DOCTOR_CHECKS
    assert {c["status"] for c in report["checks"]} == {"pass"}, report
    manifest = next(c for c in report["checks"] if c["name"] == "manifest")
    assert f"0 entries, epoch {epoch + 1}, next sequence 7" in manifest["detail"]


def _collect_until_deleted(env: dict[str, str], url: str, batches: set[str]) -> list[str]:
    """Run ``millpond gc --once`` until it has deleted every one of ``batches``.

    The condition waited for is the grace period's end as GC itself judges it (each object's
    name time and its last-modified time, 1 s resolution, against the store's clock); each
    pass is a process of its own, and reports what it kept and why."""
    deleted: list[str] = []
    deadline = time.monotonic() + 30 + _GRACE
    while True:
        out = _millpond(
            env, "gc", url, "--once", "--grace-period", str(_GRACE), "--output", "json"
        ).stdout
        report = json.loads(out)
        assert report["failures"] == [], report
        assert report["dry_run"] is False
        deleted += report["deleted_paths"]
        kept = report["kept"]
        # Only the manifest and the batch objects are directly under the prefix; a batch
        # object is kept only while young, or when the pass ran out of its delete window.
        young = {"in_grace_period", "recently_written", "out_of_time"}
        assert set(kept) <= {"not_a_batch", *young}, report
        assert kept["not_a_batch"] == 1, report  # the manifest
        assert report["listed"] == 1 + len(batches) - len(deleted) + report["deleted"], report
        if set(deleted) >= batches:
            return deleted
        assert time.monotonic() < deadline, f"gc kept {kept} past the grace period"
