"""``millpond doctor`` as an operator runs it: a real process, real servers, real databases.

All checks pass on moto, SeaweedFS, Azurite and fake-gcs-server with SQLite and PostgreSQL
sinks; a failure exits 1 with the check's line and its fix (missing credentials, a missing
bucket, an unreachable database).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from consumer_support import Database

from millpond.localstack import S3Endpoint
from millpond.localstack._process import free_ports
from tests.support import DOCTOR_CHECKS, unique_root

_ENDPOINTS = {
    "moto": "moto_s3",
    "seaweedfs": "seaweedfs_s3",
    "azurite": "azurite_blob",
    "gcs": "fake_gcs",
}


def _doctor(
    *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "millpond.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    return result, time.monotonic() - began


def _options(endpoint: Any) -> list[str]:
    return [f"--store-option={k}={v}" for k, v in endpoint.store_options().items()]


@pytest.mark.parametrize(
    ("kind", "db"),
    [("moto", "sqlite"), ("seaweedfs", "postgres"), ("azurite", "sqlite"), ("gcs", "postgres")],
)
def test_doctor_passes_every_check(
    kind: str, db: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # Every server and both databases, in pairs: each run is a process of its own.
    endpoint = request.getfixturevalue(_ENDPOINTS[kind])
    if db == "sqlite":
        database = Database("sqlite", f"sqlite://{tmp_path / 'sink.db'}")
    else:
        database = Database("postgres", request.getfixturevalue("postgres_server").url)
    url = endpoint.url_for(unique_root())
    result, _ = _doctor(url, *_options(endpoint), *database.sink_arguments(), "--output", "json")
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads(result.stdout)
    assert record["ok"] is True
    assert [c["name"] for c in record["checks"]] == DOCTOR_CHECKS
    assert {c["status"] for c in record["checks"]} == {"pass"}, record
    secret = endpoint.store_options()
    for value in secret.values():
        if "key" in value.lower() or len(value) > 40:  # keys, never printed
            assert value not in result.stdout


def test_doctor_text_output_and_no_sink(moto_s3: S3Endpoint) -> None:
    result, _ = _doctor(moto_s3.url_for(unique_root()), *_options(moto_s3))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("millpond doctor s3://millpond/t-")
    assert lines[1].startswith("PASS  credentials")
    assert "an access key from store_options" in lines[1]
    assert lines[-2].startswith("SKIP  sink")
    assert lines[-1] == "all checks passed"


def test_doctor_without_credentials_fails_fast_with_a_hint(moto_s3: S3Endpoint) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["AWS_METADATA_ENDPOINT"] = f"http://127.0.0.1:{free_ports(1)[0]}"
    env["AWS_ENDPOINT_URL"] = moto_s3.endpoint
    env["AWS_REGION"] = moto_s3.region
    result, seconds = _doctor(moto_s3.url_for("q"), env=env)
    assert seconds < 10
    assert result.returncode == 1
    assert "FAIL  credentials" in result.stdout
    assert "instance metadata service" in result.stdout
    assert "fix: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in result.stdout
    assert result.stdout.count("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") == 1
    assert result.stdout.splitlines()[-1] == "1 of 8 checks failed"


def test_doctor_names_a_missing_bucket(seaweedfs_s3: S3Endpoint) -> None:
    bucket = f"no-such-{unique_root()}"
    result, _ = _doctor(f"s3://{bucket}/q", *_options(seaweedfs_s3))
    assert result.returncode == 1
    assert "FAIL  bucket" in result.stdout
    assert f"bucket '{bucket}' does not exist" in result.stdout
    assert "fix: create the bucket, or fix the store URL" in result.stdout


def test_doctor_prints_each_fix_once(seaweedfs_s3: S3Endpoint) -> None:
    """The fix was printed twice: at the end of the failed check's line (the error's text)
    and again on its ``fix:`` line; in JSON, in ``detail`` and in ``hint``."""
    bucket = f"no-such-{unique_root()}"
    result, _ = _doctor(f"s3://{bucket}/q", *_options(seaweedfs_s3))
    lines = result.stdout.splitlines()
    failed = next(i for i, line in enumerate(lines) if line.startswith("FAIL"))
    assert lines[failed].split(None, 2) == [
        "FAIL",
        "bucket",
        f"s3://{bucket}/q: bucket '{bucket}' does not exist",
    ]
    assert lines[failed + 1].strip() == "fix: create the bucket, or fix the store URL"
    assert result.stdout.count("create the bucket") == 1
    result, _ = _doctor(f"s3://{bucket}/q", *_options(seaweedfs_s3), "--output", "json")
    check = next(c for c in json.loads(result.stdout)["checks"] if c["status"] == "fail")
    assert check["detail"] == f"s3://{bucket}/q: bucket '{bucket}' does not exist"
    assert check["hint"] == "create the bucket, or fix the store URL"


def test_doctor_fails_on_an_unreachable_database(moto_s3: S3Endpoint) -> None:
    port = free_ports(1)[0]
    sink = f"postgresql://app:hunter2@127.0.0.1:{port}/warehouse"
    result, _ = _doctor(moto_s3.url_for(unique_root()), *_options(moto_s3), "--sink", sink)
    assert result.returncode == 1
    assert "FAIL  sink" in result.stdout
    assert "hunter2" not in result.stdout + result.stderr
    assert "may CREATE TABLE and INSERT" in result.stdout
    # Only the sink failed: the store is fine.
    assert result.stdout.count("PASS") == 7
