"""``millpond local`` as a newcomer runs it: a process that starts S3 (SeaweedFS) and
PostgreSQL on 127.0.0.1, prints the variables that point millpond at them, and stops both
(ports closed, data gone unless ``--keep``) on Ctrl-C, SIGTERM or ``kill $MILLPOND_LOCAL_PID``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from millpond.localstack._process import free_ports
from millpond.localstack.local import READY
from tests.support import MILLPOND, run_cli, unique_root


def _env() -> dict[str, str]:
    """No AWS_* of the caller's; the instance metadata service at a closed loopback port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["AWS_METADATA_ENDPOINT"] = f"http://127.0.0.1:{free_ports(1)[0]}"
    return env


def _exports(lines: list[str]) -> dict[str, str]:
    """The variables of ``export NAME=VALUE`` lines, as a shell reads them."""
    found = {}
    for line in lines:
        if line.startswith("export "):
            name, _, value = shlex.split(line)[1].partition("=")
            found[name] = value
    return found


def _data_dirs(lines: list[str]) -> list[Path]:
    line = next(line for line in lines if line.startswith("# data: "))
    return [Path(p) for p in line.removeprefix("# data: ").split()]


def _ports(variables: dict[str, str]) -> list[int]:
    return [
        int(urlsplit(variables[name]).port or 0) for name in ("AWS_ENDPOINT_URL", "MILLPOND_SINK")
    ]


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on ``port`` on this machine."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def _until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.1)  # polling a condition, with a deadline


def _both_serve(variables: dict[str, str], env: dict[str, str]) -> None:
    """Both bind 127.0.0.1 only, and millpond reaches both through the printed variables."""
    for port in _ports(variables):
        assert _listening_addresses(port) == {"0100007F"}, port  # 127.0.0.1, nothing else
    done = run_cli(
        "doctor",
        f"s3://millpond/{unique_root()}",
        "--sink",
        variables["MILLPOND_SINK"],
        env={**env, **variables},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "all checks passed"


def test_millpond_local_serves_until_ctrl_c_then_stops_both_and_deletes_their_data() -> None:
    env = _env()
    proc = subprocess.Popen(
        [*MILLPOND, "local", "--timeout", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # until it says both answer (its --timeout bounds the wait)
            lines.append(line.rstrip("\n"))
            if lines[-1] == READY:
                break
        assert lines[-1:] == [READY], (lines, proc.stderr.read() if proc.stderr else "")
        variables = _exports(lines)
        assert set(variables) == {
            "AWS_ENDPOINT_URL",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_REGION",
            "AWS_DEFAULT_REGION",
            "AWS_ALLOW_HTTP",
            "MILLPOND_SINK",
            "MILLPOND_LOCAL_PID",
        }
        assert variables["MILLPOND_LOCAL_PID"] == str(proc.pid)
        assert "# Ctrl-C here stops both and deletes (--keep keeps) their data" in lines
        data = _data_dirs(lines)
        assert all(d.is_dir() for d in data)
        _both_serve(variables, env)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert err == "millpond local: SIGINT: stopped S3 and PostgreSQL\n"
    assert all(_refused(port) for port in _ports(variables))
    assert not any(d.exists() for d in data)


def test_in_the_background_it_returns_and_kill_stops_both_keeping_data_with_keep() -> None:
    env = _env()
    done = run_cli("local", "--background", "--keep", "--timeout", "60", env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == READY
    variables = _exports(lines)
    pid = int(variables["MILLPOND_LOCAL_PID"])
    data = _data_dirs(lines)
    log = Path(next(line for line in lines if "its log: " in line).split("its log: ")[1])
    try:
        # What `eval "$(millpond local --background)"` gives a shell.
        shell = subprocess.run(
            [
                "bash",
                "-c",
                'eval "$1" && echo "$MILLPOND_SINK $AWS_ENDPOINT_URL"',
                "-",
                done.stdout,
            ],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        assert shell.stdout.split() == [variables["MILLPOND_SINK"], variables["AWS_ENDPOINT_URL"]]
        _both_serve(variables, env)
        os.kill(pid, signal.SIGTERM)  # kill $MILLPOND_LOCAL_PID
        _until(lambda: all(_refused(port) for port in _ports(variables)), "both stopped")
        _until(lambda: "stopped S3 and PostgreSQL" in log.read_text(), "its log says so")
        assert all(d.is_dir() for d in data)  # --keep
    finally:
        for path in [*data, data[0].parent]:
            shutil.rmtree(path, ignore_errors=True)
        log.unlink(missing_ok=True)
