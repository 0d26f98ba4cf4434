"""Thread-safe counters and latency summaries, readable as a plain dict."""

from __future__ import annotations

import threading
from collections import deque

__all__ = ["Counters", "LatencySummary"]


class LatencySummary:
    """Count, total, max and recent-sample percentiles of a latency, in seconds."""

    def __init__(self, window: int = 4096) -> None:
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=window)
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    def observe(self, seconds: float) -> None:
        with self._lock:
            self.count += 1
            self.total += seconds
            self.max = max(self.max, seconds)
            self._recent.append(seconds)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            recent = sorted(self._recent)
            count, total, top = self.count, self.total, self.max

        def pct(q: float) -> float:
            return recent[min(len(recent) - 1, int(q * len(recent)))] if recent else 0.0

        return {
            "count": count,
            "mean": total / count if count else 0.0,
            "p50": pct(0.50),
            "p99": pct(0.99),
            "max": top,
        }


class Counters:
    """Named monotonic counters. ``add`` is cheap; ``snapshot`` copies."""

    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = dict.fromkeys(names, 0)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def get(self, name: str) -> int:
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
