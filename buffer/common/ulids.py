"""ULID batch names: minted monotonically, parsed strictly.

A batch object is ``{data_path_prefix}/{ULID}.batch``. GC reads the ULID's millisecond time,
so a name that is not exactly 26 Crockford base32 characters plus ``.batch`` is not a batch.
"""

from __future__ import annotations

import os
import re
import threading

from ulid import ULID

from millpond.common.clock import Clock, SystemClock

__all__ = [
    "BATCH_SUFFIX",
    "UlidMinter",
    "batch_location",
    "parse_batch_name",
    "ulid_time_ms",
    "ulid_time_prefix",
]

BATCH_SUFFIX = ".batch"
_BATCH_NAME = re.compile(r"^([0-7][0-9A-HJKMNP-TV-Z]{25})\.batch$")
_RANDOM_BITS = 80


class UlidMinter:
    """Mints strictly increasing ULIDs in this process (monotonic within a millisecond)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._last = 0

    def mint(self) -> str:
        with self._lock:
            now = self._clock.now_ms() << _RANDOM_BITS
            candidate = now | int.from_bytes(os.urandom(10), "big")
            # Never go back, even if the wall clock does: names minted later sort later.
            value = max(candidate, self._last + 1)
            self._last = value
        return str(ULID.from_int(value))


def batch_location(prefix: str, ulid: str) -> str:
    """``{prefix}/{ULID}.batch`` (just the name when ``prefix`` is empty)."""
    prefix = prefix.strip("/")
    return f"{prefix}/{ulid}{BATCH_SUFFIX}" if prefix else f"{ulid}{BATCH_SUFFIX}"


def parse_batch_name(name: str) -> str | None:
    """The ULID of ``{ULID}.batch``, or ``None`` for any other name."""
    match = _BATCH_NAME.match(name)
    return match.group(1) if match else None


def ulid_time_ms(ulid: str) -> int:
    """The millisecond timestamp in a ULID."""
    return int(ULID.from_str(ulid).milliseconds)


_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def ulid_time_prefix(time_ms: int) -> str:
    """The first ten characters of every ULID of ``time_ms`` (its time in Crockford base32):
    the ULIDs of earlier times sort below it, those of that time and later at or above it
    (fixed width, in an alphabet in ASCII order). ``""`` for a time before the epoch: no
    ULID sorts below it."""
    if time_ms < 0:
        return ""
    time_ms = min(time_ms, (1 << 48) - 1)
    return "".join(_CROCKFORD[(time_ms >> shift) & 31] for shift in range(45, -5, -5))
