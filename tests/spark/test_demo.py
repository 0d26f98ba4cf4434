"""The demo (``python -m millpond.localstack.demo``) end to end, small, and its mismatch checks."""

from __future__ import annotations

import argparse
import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from millpond.localstack.demo import DemoReport, _verify

# What the JVM prints at start-up (and logs) when nobody keeps it out of the console.
_JVM_NOISE = ("WARNING: Using incubator", "Setting default log level", "log4j", " WARN ", "INFO ")


def _demo(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The demo as a fresh process whose temporary directory is ``tmp`` (``TMPDIR``)."""
    tmp.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "millpond.localstack.demo", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "TMPDIR": str(tmp)},
    )


@pytest.mark.slow
def test_the_demo_runs_end_to_end_and_reports(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    run = _demo(
        tmp, "--rows", "30000", "--partitions", "4", "--flush-size", "256KiB", "--output", "json"
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
    # Task progress as Spark made it: it changed while the job ran (tasks started, or some
    # were done while others were still to come), and never went back. How far it got
    # between two samples depends on the machine: on a busy one all four tasks can finish
    # between samples, so no particular count is required.
    states = [
        (int(done), int(running))
        for done, running in re.findall(r"(\d+)/4 tasks done, (\d+) running", run.stderr)
    ]
    assert [done for done, _ in states] == sorted(done for done, _ in states), run.stderr
    assert len(set(states)) >= 2, run.stderr
    assert any(done < 4 and (done > 0 or running > 0) for done, running in states), run.stderr
    assert "enqueued in one append at sequences 0.." in run.stderr
    assert "(0 CAS conflicts)" in run.stderr
    # The JVM kept quiet: none of its start-up lines or logs in the demo's output.
    for noise in _JVM_NOISE:
        assert noise not in run.stderr, (noise, run.stderr)
    # It removed what it made: the default database, Spark's scratch files, the JVM's log.
    database = Path(report["sink"].removeprefix("sqlite:///"))
    assert database.is_relative_to(tmp)
    assert not database.exists()
    assert list(tmp.iterdir()) == []
    # And says so: it printed the database's path, then deleted it (issue 47).
    work = database.parent
    lines = run.stderr.splitlines()
    assert lines[1] == f"  that database is in {work}, deleted at the end (--keep keeps it)"
    assert f"deleted {work} (the database, Spark's log); run with --keep to keep it" in lines


@pytest.mark.slow
def test_the_demo_keeps_its_files_with_keep(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    run = _demo(tmp, "--rows", "2000", "--partitions", "1", "--keep")
    assert run.returncode == 0, run.stderr[-3000:]
    kept = re.search(r"^kept (\S+) ", run.stderr, re.M)
    assert kept, run.stderr
    assert "deleted at the end" not in run.stderr
    assert "run with --keep" not in run.stderr
    work = Path(kept.group(1))
    assert work.parent == tmp
    with sqlite3.connect(work / "millpond-demo.db") as db:
        assert db.execute("SELECT count(*) FROM millpond_demo").fetchone() == (2000,)
    log = (work / "spark.log").read_text()
    # The driver's one line per job went to Spark's log with the rest of the JVM's output.
    assert re.search(r"millpond job \w+: \d+ batches, \d+ bytes, 2000 rows appended", log), log


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
