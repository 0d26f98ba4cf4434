"""Helpers for the Spark tests: options for a test's own queue, and reading the queue back."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa

from millpond.formats.arrow import decode_ipc, unify_tables
from millpond.formats.batch import decode_batch
from millpond.formats.manifest import ManifestEntry
from millpond.localstack import S3Endpoint
from millpond.queue import read_manifest
from millpond.storage import ObjectStore, open_store


class Queue:
    """One test's queue: its own root in the bucket."""

    def __init__(self, endpoint: S3Endpoint, root: str | None = None) -> None:
        self.endpoint = endpoint
        self.root = root or f"t-{uuid.uuid4().hex[:12]}"
        self.url = endpoint.url_for(self.root)

    def options(self, **extra: Any) -> dict[str, str]:
        """Data source options: the store, the endpoint and credentials, then ``extra``."""
        return {
            "store": self.url,
            **self.endpoint.store_options(),
            **{key: str(value) for key, value in extra.items()},
        }

    def store(self) -> ObjectStore:
        return open_store(self.url, self.endpoint.store_options())

    def entries(self) -> list[ManifestEntry]:
        """The manifest's entries; none when there is no manifest."""
        store = self.store()
        try:
            return list(read_manifest(store, "ingest/manifest").manifest.entries)
        except FileNotFoundError:
            return []

    def table(self) -> pa.Table:
        """Every row the queue holds, in sequence order."""
        store = self.store()
        tables = [
            decode_ipc(record)
            for entry in self.entries()
            for record in decode_batch(store.get(entry.location).data)
        ]
        return unify_tables(tables)

    def objects(self) -> list[str]:
        """Every object path under the root."""
        return sorted(info.path for info in self.store().list(""))

    def consume_into(self, sink_url: str, *, table: str = "rows") -> int:
        """Run a consumer into ``sink_url`` until the queue is drained; returns rows written."""
        from millpond.consumer import Consumer, ConsumerConfig
        from millpond.consumer.sinks import open_sink

        config = ConsumerConfig(
            store=self.url, store_options=self.endpoint.store_options(), gc_enabled=False
        )
        with open_sink(sink_url, table=table) as sink, Consumer(config) as consumer:
            consumer.initialize(last_acked_sequence=sink.last_sequence(consumer.queue))
            while (batch := consumer.next_batch()) is not None:
                sink.write(batch)
                consumer.ack(batch.sequence)
            consumer.flush()
            return sink.rows_written


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path.resolve()}"


def consume_with_cli(queue: Queue, sink: str, table: str) -> None:
    """``millpond consume`` (the real CLI process) drains ``queue`` into ``table`` of ``sink``."""
    options = [f"--store-option={k}={v}" for k, v in queue.endpoint.store_options().items()]
    result = subprocess.run(
        [
            sys.executable, "-m", "millpond.cli", "consume", queue.url, *options,
            "--sink", sink, "--table", table, "--progress-table", f"{table}_progress",
            "--exit-when-idle", "--no-gc", "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
