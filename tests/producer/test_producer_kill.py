"""The kill test: SIGKILL a producing process again and again; nothing staged is lost or doubled.

A child process (``kill_child.py``) produces a numbered stream and records every number whose
``wait_staged()`` returned. The parent kills it with SIGKILL at chosen moments — inside a batch
PUT (before and after the object landed), inside the manifest CAS (before and after it landed),
right after start-up (during WAL replay and its uploads) and after a random amount of progress —
and restarts it on the same WAL directory. At the end a last producer drains the WAL, and the
queue is read back: every recorded number is in it exactly once, no number is in it twice, and
the numbers are in increasing order (each restart publishes what the last one left before
anything new).
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from millpond import open_store
from millpond.producer import Producer, ProducerConfig
from tests.invariants import assert_exactly_once, assert_order_per_source
from tests.producer.producer_support import read_back
from tests.support import StoreTarget

CHILD = Path(__file__).with_name("kill_child.py")
KILL_POINTS = ["put-start", "put-landed", "cas-start", "cas-landed", "ready", "staged"]
ROUNDS = 24
_LINE_TIMEOUT = 60.0


class _Child:
    """One run of kill_child.py, with its stdout lines in a queue."""

    def __init__(self, target: StoreTarget, wal_dir: Path, record: Path, first: int) -> None:
        env = {
            **os.environ,
            "MILLPOND_KILL_PHASE_DELAY": "0.03",
            "MILLPOND_KILL_STORE_OPTIONS": json.dumps(target.options),
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), target.url, str(wal_dir), str(record), str(first)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode().strip())
        self.lines.put(None)

    def wait_for(self, prefix: str, times: int = 1) -> str:
        seen = 0
        while True:
            try:
                line = self.lines.get(timeout=_LINE_TIMEOUT)
            except queue.Empty:
                raise AssertionError(f"child printed no {prefix!r} in {_LINE_TIMEOUT} s") from None
            if line is None:
                stderr = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise AssertionError(f"child exited ({self.proc.wait()}): {stderr[-3000:]}")
            if line.startswith(prefix):
                seen += 1
                if seen == times:
                    return line

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        assert self.proc.returncode == -signal.SIGKILL
        self._reader.join()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.mark.slow
def test_sigkill_at_every_stage_loses_and_doubles_nothing(
    tmp_path: Path, shared_store_target: StoreTarget
) -> None:
    target = shared_store_target
    wal_dir = tmp_path / "wal"
    record = tmp_path / "staged.txt"
    rng = random.Random(20240601)
    hits: Counter[str] = Counter()
    replayed_rounds = 0
    for round_no in range(ROUNDS):
        point = KILL_POINTS[round_no % len(KILL_POINTS)]
        child = _Child(target, wal_dir, record, first=round_no * 1_000_000)
        try:
            ready = child.wait_for("ready")
            replayed_rounds += ready != "ready recovered=0"
            if point == "staged":
                child.wait_for("staged", times=rng.randint(10, 120))
            elif point != "ready":
                child.wait_for(f"phase {point}", times=rng.randint(2, 8))
        finally:
            child.kill()
        hits[point] += 1

    config = ProducerConfig(store=target.url, store_options=target.options, wal_dir=wal_dir)
    with Producer(config) as last:
        recovered = last.metrics()["records_recovered"]
    assert last.close().complete

    published = read_back(open_store(target.url, target.options))
    numbers = [int(entry) for batch in published for entry in batch.entries]
    staged = [int(line) for line in record.read_text().split()]
    print(  # shown with pytest -rP: how much the rounds exercised
        f"{target.kind}: {ROUNDS} kills {dict(hits)}, {len(staged)} numbers staged, "
        f"{len(numbers)} published in {len(published)} batches, "
        f"{replayed_rounds} restarts replayed data"
    )
    assert_exactly_once((b"%d" % n for n in numbers), (b"%d" % n for n in staged))
    assert_order_per_source([b"%d" % n for n in numbers], lambda record: ("kill", int(record)))
    assert all(item.payload == b"kill-test" for b in published for item in b.metadata)
    assert len(staged) > ROUNDS * 3
    assert set(hits) == set(KILL_POINTS)
    assert replayed_rounds + (recovered > 0) >= ROUNDS // 2, "restarts rarely had data to replay"
