"""Thread-safe counters and latency histograms, readable as a plain dict.

The roles count and time with these, cheaply and without any exporter in the hot path;
:mod:`millpond.common.exposition` turns them into Prometheus metrics when scraped.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["DEFAULT_BUCKETS", "Counters", "HistogramSnapshot", "LatencySummary"]

DEFAULT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Upper bounds in seconds of the histogram buckets (``+Inf`` is implied): from a 1 ms local
fsync to a minute-long GC pass over a large prefix."""


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Cumulative bucket counts, count and sum of a latency, in seconds (Prometheus' shape)."""

    buckets: tuple[tuple[float, int], ...]
    """``(upper bound, observations <= it)`` per bucket, ascending; ``+Inf`` not included."""
    count: int
    total: float

    def to_dict(self) -> dict[str, object]:
        return {
            "count": self.count,
            "sum": self.total,
            "buckets": {_le(bound): n for bound, n in self.buckets} | {"+Inf": self.count},
        }


def _le(bound: float) -> str:
    return repr(float(bound))


class LatencySummary:
    """Count, total, max, recent-sample percentiles and histogram buckets of a latency, in
    seconds."""

    def __init__(self, window: int = 4096, buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=window)
        self._bounds = tuple(sorted(buckets))
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    def observe(self, seconds: float) -> None:
        with self._lock:
            self.count += 1
            self.total += seconds
            self.max = max(self.max, seconds)
            self._recent.append(seconds)
            for index, bound in enumerate(self._bounds):
                if seconds <= bound:
                    self._counts[index] += 1
                    break

    @contextmanager
    def time(self) -> Iterator[None]:
        """Observe the wall time of the ``with`` block, when it completes without raising."""
        start = time.monotonic()
        yield
        self.observe(time.monotonic() - start)

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

    def histogram(self) -> HistogramSnapshot:
        """The cumulative buckets, count and sum, read under the lock (consistent)."""
        with self._lock:
            running = 0
            cumulative = []
            for bound, n in zip(self._bounds, self._counts, strict=True):
                running += n
                cumulative.append((bound, running))
            return HistogramSnapshot(tuple(cumulative), self.count, self.total)


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
