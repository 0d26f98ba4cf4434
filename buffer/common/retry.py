"""Capped, jittered exponential backoff bounded by attempts and by total time."""

from __future__ import annotations

import random
from dataclasses import dataclass

from millpond.common.clock import Clock, SystemClock
from millpond.errors import ConfigError

__all__ = ["Backoff", "RetryPolicy"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How long a retry loop may keep going."""

    max_attempts: int = 100
    """Attempts in all, the first included. Default 100."""
    max_elapsed: float = 60.0
    """Seconds from the first attempt after which no new attempt starts. Default 60."""
    base_delay: float = 0.01
    """Seconds; the cap of the first backoff. Default 0.01."""
    max_delay: float = 1.0
    """Seconds; no single backoff is longer. Default 1.0."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError("max_attempts", f"expected >= 1, found {self.max_attempts}")
        if self.max_elapsed <= 0:
            raise ConfigError("max_elapsed", f"expected > 0 seconds, found {self.max_elapsed}")
        if not 0 < self.base_delay <= self.max_delay:
            raise ConfigError(
                "base_delay",
                f"expected 0 < base_delay <= max_delay ({self.max_delay}), found {self.base_delay}",
            )

    def start(self, clock: Clock | None = None) -> Backoff:
        """A fresh backoff state for one retry loop."""
        return Backoff(self, clock or SystemClock())


class Backoff:
    """The state of one retry loop: ``attempt`` so far and the deadline."""

    def __init__(self, policy: RetryPolicy, clock: Clock) -> None:
        self._policy = policy
        self._clock = clock
        self._deadline = clock.monotonic() + policy.max_elapsed
        self.attempt = 1

    def next_delay(self) -> float | None:
        """The pause before the next attempt, or ``None`` when the budget is spent.

        Full jitter (uniform in ``[0, cap]``) spreads contending writers apart so a crowd
        of producers losing the same CAS does not retry in lockstep.
        """
        if self.attempt >= self._policy.max_attempts:
            return None
        remaining = self._deadline - self._clock.monotonic()
        if remaining <= 0:
            return None
        cap = min(
            self._policy.max_delay, self._policy.base_delay * (2 ** min(self.attempt - 1, 30))
        )
        self.attempt += 1
        return min(random.uniform(0, cap), remaining)

    def sleep(self) -> bool:
        """Sleep before the next attempt; ``False`` when the budget is spent."""
        delay = self.next_delay()
        if delay is None:
            return False
        self._clock.sleep(delay)
        return True
