"""Helpers shared by the test suites (fixtures live in ``conftest.py``)."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from millpond.localstack import AzureEndpoint, GcsEndpoint, S3Endpoint

__all__ = ["ManualClock", "StoreTarget", "unique_root"]


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
