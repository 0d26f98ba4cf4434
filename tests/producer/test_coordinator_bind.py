"""Where ``millpond coordinator`` listens: an IPv6 loopback address works like 127.0.0.1, and an
address it cannot listen on is bad usage (exit 2, one line naming it), not a traceback.
Real child processes on a file store, loopback only."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from millpond.producer import Producer
from millpond.storage import open_store
from tests.producer.producer_support import all_entries, claim_queue, config
from tests.producer.test_coordinator_token import run_to_exit, service_command, service_env

DEADLINE = 120.0


def test_a_coordinator_on_ipv6_loopback_serves_its_producers(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    store = open_store(url)
    claim_queue(store)
    proc = subprocess.Popen(
        service_command(url, "--bind", "::1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=service_env(),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert " on http://[::1]:" in line, (line, proc.stderr.read() if not line else "")
        coordinator = line.rsplit(" on ", 1)[1].strip()
        with Producer(config(store, tmp_path / "wal", coordinator=coordinator)) as producer:
            producer.produce([b"over-ipv6"]).wait(DEADLINE)
            metrics = producer.metrics()
    finally:
        proc.terminate()
        proc.wait(30)
    assert metrics["coordinator_appends"] == 1, metrics
    assert metrics["direct_appends"] == 0, metrics
    assert all_entries(store) == [b"over-ipv6"]


def test_a_port_already_taken_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_to_exit(f"file://{tmp_path / 'store'}", "--port", str(port), env=service_env())
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1 port {port}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
