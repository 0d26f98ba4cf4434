"""``millpond inspect`` run as a real process: the console script and ``python -m millpond.cli``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from millpond.localstack import S3Endpoint
from millpond.queue import QueueConsumer, QueueProducer
from millpond.storage import open_store
from millpond.storage.file_store import FileStore

from ._helpers import MANIFEST, pending

CONSOLE_SCRIPT = Path(sys.executable).with_name("millpond")
JSON_KEYS = {"epoch", "next_sequence", "entry_count", "first_sequence", "manifest_bytes"}


def _commands() -> list[list[str]]:
    commands = [[sys.executable, "-m", "millpond.cli"]]
    if CONSOLE_SCRIPT.exists():
        commands.append([str(CONSOLE_SCRIPT)])
    return commands


@pytest.fixture(params=_commands(), ids=lambda c: "script" if len(c) == 1 else "module")
def millpond_cmd(request: pytest.FixtureRequest) -> list[str]:
    return list(request.param)


def _run(cmd: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MILLPOND_"))}
    return subprocess.run(
        [*cmd, "inspect", *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


@pytest.fixture
def queue_dir(tmp_path: Path) -> Path:
    """A file store whose manifest holds sequences 2..4 at epoch 1."""
    root = tmp_path / "store"
    store = FileStore(root)
    QueueProducer(store, MANIFEST).append(pending(5))
    consumer = QueueConsumer(store, MANIFEST)
    consumer.initialize()
    consumer.dequeue(1)
    return root


def test_inspect_json(millpond_cmd: list[str], queue_dir: Path) -> None:
    result = _run(millpond_cmd, queue_dir.as_uri(), "--output", "json")
    assert result.returncode == 0, result.stderr
    record: dict[str, Any] = json.loads(result.stdout)
    assert set(record) >= JSON_KEYS
    assert record["epoch"] == 1
    assert record["next_sequence"] == 5
    assert record["entry_count"] == 3
    assert record["first_sequence"] == 2
    assert record["manifest_bytes"] == (queue_dir / "ingest" / "manifest").stat().st_size
    assert record["oldest_location"].startswith("ingest/")
    assert record["oldest_age_seconds"] >= 0


def test_inspect_text(millpond_cmd: list[str], queue_dir: Path) -> None:
    result = _run(millpond_cmd, queue_dir.as_uri())
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(None, 1) for line in result.stdout.splitlines() if line.strip())
    assert lines["epoch"] == "1"
    assert lines["next_sequence"] == "5"
    assert lines["entry_count"] == "3"
    assert lines["first_sequence"] == "2"
    size = (queue_dir / "ingest" / "manifest").stat().st_size
    assert lines["manifest_bytes"] == str(size)


def test_inspect_empty_queue(millpond_cmd: list[str], tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    QueueConsumer(store, MANIFEST).initialize()
    result = _run(millpond_cmd, (tmp_path / "store").as_uri(), "--output", "json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["entry_count"] == 0
    assert record["first_sequence"] is None
    assert record["manifest_bytes"] == 22


def test_inspect_custom_manifest_path(millpond_cmd: list[str], tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    QueueProducer(store, "other/queue").append(pending(2))
    url = (tmp_path / "store").as_uri()
    result = _run(millpond_cmd, url, "--manifest-path", "other/queue", "--output", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["entry_count"] == 2


def _one_line_failure(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_inspect_missing_manifest(millpond_cmd: list[str], tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    line = _one_line_failure(_run(millpond_cmd, (tmp_path / "store").as_uri()))
    assert "no queue at" in line
    assert "no manifest at ingest/manifest" in line


def test_inspect_corrupt_manifest(millpond_cmd: list[str], tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    store.put(
        MANIFEST, b"\x00" * 30 + bytes.fromhex("0100000000000000000000000000000000000000ff00")
    )
    line = _one_line_failure(_run(millpond_cmd, (tmp_path / "store").as_uri(), "--output", "json"))
    assert "version" in line
    assert "ingest/manifest" in line


def test_inspect_truncated_manifest(millpond_cmd: list[str], tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    store.put(MANIFEST, b"\x01\x02\x03")
    line = _one_line_failure(_run(millpond_cmd, (tmp_path / "store").as_uri()))
    assert "footer" in line


def test_inspect_bad_store_url(millpond_cmd: list[str]) -> None:
    line = _one_line_failure(_run(millpond_cmd, "ftp://nowhere/x"))
    assert "store" in line


def test_inspect_s3_from_aws_variables(millpond_cmd: list[str], moto_s3: S3Endpoint) -> None:
    endpoint = moto_s3
    url = endpoint.url_for(f"inspect-{os.getpid()}-{len(millpond_cmd)}")
    QueueProducer(open_store(url, endpoint.store_options()), MANIFEST).append(pending(3))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MILLPOND_"))}
    result = subprocess.run(
        [*millpond_cmd, "inspect", url, "--output", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**env, **endpoint.env()},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["entry_count"] == 3
