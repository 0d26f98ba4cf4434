"""The demo (``python -m millpond.localstack.demo``) end to end, small, and its mismatch checks."""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from millpond.localstack.demo import DemoReport, _verify


@pytest.mark.slow
def test_the_demo_runs_end_to_end_and_reports(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "millpond.localstack.demo",
            "--rows",
            "30000",
            "--partitions",
            "3",
            "--flush-size",
            "256KiB",
            "--sink",
            f"sqlite:///{db}",
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["ok"] is True
    assert report["rows_written"] == report["rows_in_database"] == report["distinct_ids"] == 30000
    assert report["batches_consumed"] == report["batches_enqueued"] > 3
    assert report["gc_deleted"] == report["batches_enqueued"]
    assert report["objects_left"] == 0
    assert report["requests"]["spark"]["put"] == report["batches_enqueued"] + 2  # + CAS, receipt
    assert "[3/4] consumer wrote 30,000 rows" in run.stderr  # progress was shown


def _db_with(path: Path, ids: list[int], run_id: str) -> str:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (id INTEGER, run_id TEXT)")
        db.executemany("INSERT INTO t VALUES (?, ?)", [(i, run_id) for i in ids])
    return f"sqlite:///{path}"


@pytest.mark.parametrize(
    ("ids", "problem"),
    [
        ([0, 1, 2], "holds 3 rows of this run, expected 4"),
        ([0, 1, 2, 2], "1 rows are duplicates"),
        ([1, 2, 3, 4], "ids run from 1 to 4"),
    ],
)
def test_the_demo_flags_missing_duplicate_and_wrong_rows(
    tmp_path: Path, ids: list[int], problem: str
) -> None:
    sink = _db_with(tmp_path / "x.db", ids, "abc")
    report = DemoReport(rows_requested=4, store="s", sink=sink, table="t", run_id="abc")
    _verify(argparse.Namespace(rows=4, table="t"), sink, report)
    assert not report.ok
    assert any(problem in p for p in report.problems), report.problems
