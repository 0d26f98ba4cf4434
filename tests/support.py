"""Helpers shared by the test suites (fixtures live in ``conftest.py``)."""

from __future__ import annotations

import builtins
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from millpond.common.ulids import parse_batch_name, ulid_time_ms
from millpond.localstack import AzureEndpoint, GcsEndpoint, S3Endpoint
from millpond.storage.store import ForwardingStore, ObjectInfo, ObjectStore

__all__ = [
    "DOCTOR_CHECKS",
    "CliProcess",
    "ManualClock",
    "StoreTarget",
    "TestClockStore",
    "run_cli",
    "unique_root",
]

DOCTOR_CHECKS = [
    "credentials",
    "bucket",
    "permissions",
    "conditional_create",
    "conditional_update",
    "clock_skew",
    "manifest",
    "sink",
]
"""The checks ``millpond doctor --sink`` runs, in the order it prints them."""

MILLPOND = (sys.executable, "-m", "millpond.cli")
"""The ``millpond`` command, as every test runs it in a process of its own."""


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``millpond ARGS`` to the end; its output as text. ``env`` replaces the environment."""
    return subprocess.run(
        [*MILLPOND, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


class CliProcess:
    """A running ``millpond ARGS`` process whose stderr is collected line by line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*MILLPOND, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float = 120) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def stop(self) -> int:
        """SIGTERM, then the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.wait()

    def kill(self) -> None:
        """SIGKILL (if still running), then reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.wait()


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreTarget:
    """One object-store backend for one test: a URL with a fresh root, plus its options."""

    kind: str
    """``memory``, ``file``, ``moto``, ``seaweedfs``, ``external``, ``azurite`` or ``gcs``."""
    url: str
    """Store URL: ``memory://``, ``file:///…/t-<uuid>``, ``s3://bucket/t-<uuid>``,
    ``az://container/t-<uuid>`` or ``gs://bucket/t-<uuid>``."""
    options: dict[str, str] = field(default_factory=dict)
    """obstore options (endpoint and credentials); empty for memory and file."""
    endpoint: S3Endpoint | AzureEndpoint | GcsEndpoint | None = None
    """The server behind the URL, for tests that inspect or damage raw objects."""
    root: str = ""
    """Key prefix inside the bucket (S3) or the directory (file); empty for memory."""

    @property
    def is_s3(self) -> bool:
        """Whether this target is an S3 server (moto, SeaweedFS or external)."""
        return isinstance(self.endpoint, S3Endpoint)

    @property
    def shareable(self) -> bool:
        """Whether several OS processes can open this target and see the same objects."""
        return self.kind != "memory"

    def local_path(self) -> Path:
        """Return the directory of a ``file`` target.

        Raises:
            ValueError: not a ``file`` target.
        """
        if self.kind != "file":
            raise ValueError(f"expected a file target, found {self.kind!r}")
        return Path(self.root)


def unique_root() -> str:
    """Return a fresh root name, ``t-<32 hex digits>``."""
    return f"t-{uuid.uuid4().hex}"


class ClockOff:
    """This machine's clock, off by ``seconds`` (a producer or consumer with a skewed clock)."""

    def __init__(self, seconds: float) -> None:
        self.offset_ms = round(seconds * 1000)

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000 + self.offset_ms

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class ManualClock:
    """Wall clock the test moves by hand; monotonic time and sleep are real."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._lock = threading.Lock()
        self._now_ms = start_ms

    def now_ms(self) -> int:
        with self._lock:
            return self._now_ms

    def set(self, ms: int) -> None:
        with self._lock:
            self._now_ms = ms

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now_ms += round(seconds * 1000)

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class TestClockStore(ForwardingStore):
    """A real store that reports last-modified times on a test's clock.

    Garbage collection compares an object's last-modified time with the store's clock, which a
    test that moves a ``ManualClock`` cannot move. Through this wrapper, a write stamps the
    object with ``clock.now_ms()``; an object written around it reports the time its ULID name
    carries (a producer whose clock agrees with the store's), and anything else the real time.
    Only the times are the test's; every byte goes to the real store.
    """

    __test__ = False  # not a test class, despite the name

    def __init__(self, inner: ObjectStore, clock: Any) -> None:
        super().__init__(inner)
        self.clock = clock
        self._stamps: dict[str, int] = {}
        self._lock = threading.Lock()

    def _stamp(self, path: str) -> None:
        with self._lock:
            self._stamps[path] = int(self.clock.now_ms())

    def backdate(self, path: str, seconds: float) -> None:
        """Make ``path`` look last written ``seconds`` before now."""
        with self._lock:
            self._stamps[path] = int(self.clock.now_ms()) - round(seconds * 1000)

    def written_before(self, seconds: float) -> datetime:
        """The moment ``seconds`` before now, on this store's clock."""
        return datetime.fromtimestamp((self.clock.now_ms() - seconds * 1000) / 1000, tz=UTC)

    def _time(self, info: ObjectInfo) -> ObjectInfo:
        with self._lock:
            stamp = self._stamps.get(info.path)
        if stamp is None:
            ulid = parse_batch_name(info.path.rpartition("/")[2])
            if ulid is None:
                return info
            stamp = ulid_time_ms(ulid)
        moment = datetime.fromtimestamp(stamp / 1000, tz=UTC)
        return ObjectInfo(info.path, info.size, moment, info.etag)

    def put(self, path: str, data: bytes) -> str | None:
        etag = self.inner.put(path, data)
        self._stamp(path)
        return etag

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        etag = self.inner.put_if_absent(path, data)
        self._stamp(path)
        return etag

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        new = self.inner.put_if_match(path, data, etag)
        self._stamp(path)
        return new

    def head(self, path: str) -> ObjectInfo:
        return self._time(self.inner.head(path))

    def list(self, prefix: str = "", *, recursive: bool = True) -> builtins.list[ObjectInfo]:
        return [self._time(info) for info in self.inner.list(prefix, recursive=recursive)]
