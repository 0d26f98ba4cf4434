"""Speculative execution: two attempts of one task both upload, the database gets every row
once. Needs two Spark hosts (see ``standalone.py``), so the job runs in its own process."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from millpond.localstack import S3Endpoint
from tests.spark.spark_support import Queue, sqlite_url
from tests.spark.standalone import standalone_cluster

ROWS = 20_000


@pytest.mark.slow
def test_a_speculative_attempt_that_wins_leaves_every_row_once(
    moto_s3: S3Endpoint, tmp_path: Path
) -> None:
    queue = Queue(moto_s3)
    options = json.dumps(queue.options(flush_size_bytes="64KiB"))
    with standalone_cluster(tmp_path) as master:
        job = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).with_name("speculation_job.py")),
                master,
                options,
                str(ROWS),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    assert job.returncode == 0, job.stderr[-3000:]
    assert "done" in job.stdout
    attempts = {}
    for entry in queue.entries():
        fields = json.loads(entry.metadata[0].payload)["spark"]
        attempts[fields["partition"]] = fields["attempt"]
    assert attempts[0] >= 1, attempts  # partition 0 was committed from its speculative copy
    batches = [path for path in queue.objects() if path.endswith(".batch")]
    assert len(batches) > len(queue.entries())  # the straggler's uploads: never enqueued
    db = tmp_path / "rows.db"
    assert queue.consume_into(sqlite_url(db)) == ROWS
    with sqlite3.connect(db) as conn:
        ids = [row[0] for row in conn.execute('SELECT id FROM "rows" ORDER BY id')]
    assert ids == list(range(ROWS))
