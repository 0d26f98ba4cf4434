"""Time, injectable: wall-clock milliseconds for ingestion times and ULIDs, a monotonic clock
for deadlines, and sleep. Tests (GC grace periods, backoff) substitute their own."""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "SystemClock"]


class Clock(Protocol):
    """What millpond asks of a clock."""

    def now_ms(self) -> int:
        """Wall-clock milliseconds since the Unix epoch."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back, for deadlines."""
        ...

    def sleep(self, seconds: float) -> None:
        """Block the calling thread."""
        ...


class SystemClock:
    """The real clocks of this machine."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)
