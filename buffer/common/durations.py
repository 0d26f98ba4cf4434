"""Checking configured durations and counts.

A duration is a finite number, not negative, and not zero unless allowed: NaN passes every
``value < 0`` test (all comparisons with it are false) and infinity makes every wait endless,
so both are refused by name rather than left to surface later as a busy loop, a wait that
never ends or a crashed thread. A count (how many of something) is an integer >= 1.
"""

from __future__ import annotations

import math

from millpond.errors import ConfigError

__all__ = ["check_count", "check_duration"]


def check_duration(key: str, value: float, *, allow_zero: bool, unit: str = "seconds") -> None:
    """Raise unless ``value`` is a finite number of ``unit`` above 0 (or 0 when allowed).

    Raises:
        ConfigError: naming ``key``, the bound and what was found.
    """
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and math.isfinite(value) and (value > 0 or (allow_zero and value == 0)):
        return
    bound = ">= 0" if allow_zero else "> 0"
    raise ConfigError(key, f"expected a finite number of {unit} {bound}, found {value!r}")


def check_count(key: str, value: int) -> None:
    """Raise unless ``value`` is an integer >= 1 (how many of something: never clamped).

    Raises:
        ConfigError: naming ``key`` and what was found.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"expected an integer >= 1, found {value!r}")
