"""``ProducerConfig``: the RFC's producer settings plus the local WAL's, validated up front.

Every setting can also be given as a string (``ProducerConfig.from_options``), which is how the
Spark integration and environment-driven entry points pass them: durations as seconds or with a
unit (``"0.1"``, ``"100ms"``, ``"5s"``, ``"2m"``), sizes as bytes or with a unit (``"64MiB"``,
``"64m"``, ``"1GB"``), enums by name (``"zstd"``, ``"drop_oldest"``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from millpond.common.clock import Clock, SystemClock
from millpond.common.durations import check_duration
from millpond.common.retry import RetryPolicy
from millpond.coordinator.wire import parse_coordinator_urls
from millpond.errors import ConfigError, InvalidInputError
from millpond.formats.batch import CompressionType
from millpond.queue import QueueLocation

__all__ = ["ProducerConfig", "parse_bool", "parse_duration", "parse_size"]

WalSync = Literal["always", "interval", "off"]
SizeCapPolicy = Literal["backpressure", "drop_oldest"]

MiB = 1 << 20
GiB = 1 << 30
_WAL_SYNC = ("always", "interval", "off")
_SIZE_CAP = ("backpressure", "drop_oldest")


def _default_retry() -> RetryPolicy:
    # One round of PUT or manifest retries; the producer starts another round after it (it
    # never gives up on staged data), so a round only needs to be long enough to ride out a
    # blip without re-reading the manifest.
    # Lost races are paced by age ("aging"): at real store latency several producers on one
    # queue otherwise leave the last winner winning while the others starve (issue 11).
    return RetryPolicy(
        max_attempts=50, max_elapsed=10.0, base_delay=0.01, max_delay=1.0, strategy="aging"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ProducerConfig(QueueLocation):
    """How a :class:`~millpond.producer.Producer` stages, batches and publishes entries."""

    wal_dir: str | os.PathLike[str]
    """Directory of the local write-ahead log. Required: where staged data survives a crash is
    a durability decision, so there is no default (a temp directory would not survive a
    reboot). One directory belongs to one live producer (an exclusive lock)."""
    flush_interval: float = 0.1
    """Seconds; a batch is flushed once its oldest entry waited this long (while an uploader
    is free: with every uploader busy it keeps filling). An uploaded batch also waits up to
    this long for uploads still in flight behind it, to share their manifest append.
    Default 0.1."""
    flush_size_bytes: int = 64 * MiB
    """Bytes; a batch is flushed once its entries exceed this (a loose limit). Default 64 MiB."""
    max_buffered_inputs: int = 1000
    """``produce()`` calls accepted but not yet written to the WAL; ``produce()`` blocks when
    this many are waiting. Default 1000."""
    batch_compression: CompressionType | Literal["none", "zstd"] = CompressionType.NONE
    """Compression of each batch's record block: ``"none"`` or ``"zstd"`` (stored as a
    :class:`~millpond.CompressionType`). Default none."""
    wal_sync: WalSync = "always"
    """``"always"``: ``wait_staged()`` returns after ``fdatasync`` (group commit: one sync for
    every append waiting); ``"interval"``: after the write, with an ``fdatasync`` at most every
    ``wal_sync_interval`` (a machine crash can lose that much); ``"off"``: never sync (benchmarks
    only). Default ``"always"``."""
    wal_sync_interval: float = 0.1
    """Seconds between syncs when ``wal_sync="interval"``. Default 0.1."""
    wal_max_bytes: int = 4 * GiB
    """Bytes; cap on the WAL's files on disk. When full, ``size_cap_policy`` applies.
    Default 4 GiB."""
    wal_rotate_bytes: int | None = None
    """Bytes; a WAL file is closed and a new one started past this size. Released files are
    deleted whole. Default ``min(64 MiB, wal_max_bytes // 8)``; at most ``wal_max_bytes // 4``."""
    size_cap_policy: SizeCapPolicy = "backpressure"
    """When the WAL is full: ``"backpressure"`` blocks ``produce()`` (``BackpressureError`` after
    its timeout); ``"drop_oldest"`` drops the oldest staged data not yet being appended to the
    manifest, counts it in ``entries_dropped`` and fails its handles. Default backpressure."""
    upload_concurrency: int = 4
    """Batches uploaded in parallel. Default 4."""
    retry: RetryPolicy = field(default_factory=_default_retry)
    """Backoff of one round of PUT or manifest-append retries. After a round fails the producer
    checks what landed and starts another: staged data is never given up. Default 50 attempts
    within 10 s, store failures backing off from 0.01 s doubling to 1 s, and lost races paced by
    age (``strategy="aging"``: the producer with the oldest batches writes first)."""
    commit_interval: float = 0.0
    """Seconds; at least this long between the start of two manifest appends of this producer,
    so that more uploaded batches share one compare-and-swap: fewer object-store requests per
    GiB, more latency. ``flush()`` and ``close()`` do not wait for it. Default 0 (append as soon
    as a batch is uploaded and no other upload is in flight, see ``flush_interval``)."""
    reupload_after: float | None = None
    """Seconds; a batch still not in the manifest this long after its object was last written
    is written again under the same name (so its last-modified time is fresh) and appended
    only after the collectors' delete window has passed: garbage collection can never take a
    batch about to be appended, and the batch keeps the location the sink may already have
    recorded. At most half the queue's GC grace period (checked at start against the queue's
    claim). Default: half the queue's grace period (300 s for the RFC's 10 minutes)."""
    coordinator: str | tuple[str, ...] | None = None
    """``millpond coordinator`` services to append through (``http://host:port``; several as
    a tuple or comma-separated, tried in order). A coordinator appends many producers' batches
    in one compare-and-swap per round, so latency stays flat as producers are added; when none
    answers, or one refuses, the producer appends directly, and a reply that never came is
    resolved by the same landed-check as its own ambiguous appends. A coordinator started
    with a token takes requests only with it: ``MILLPOND_COORDINATOR_TOKEN`` in this
    process's environment (read when the producer opens). Default none: append directly."""
    host_coordinator: bool | None = None
    """Share one append coordinator with the other producers of this queue on this machine
    (Spark's Python workers on one executor, several jobs on one host): the first to append
    hosts it on 127.0.0.1 and the others send their appends there with a token only this
    user's processes can read, so one compare-and-swap carries all of theirs; when its host
    exits another takes over, and meanwhile they append directly
    (docs/operator-guide/coordinator.md, "Producers on one machine"). ``True`` is refused with
    ``coordinator``. Default ``None``: shared when the store is S3, GCS or Azure (where a
    compare-and-swap costs a network round trip) and no ``coordinator`` is given; ``False``
    appends directly."""
    clock: Clock = field(default_factory=SystemClock, repr=False, compare=False)
    """Time source for ingestion times, ULIDs, deadlines and backoff. Default the system's."""

    def __post_init__(self) -> None:
        QueueLocation.__post_init__(self)
        if not str(self.wal_dir):
            raise ConfigError("wal_dir", "expected a directory path, found ''")
        check_duration("flush_interval", self.flush_interval, allow_zero=False)
        _check_int("flush_size_bytes", self.flush_size_bytes, 1)
        _check_int("max_buffered_inputs", self.max_buffered_inputs, 1)
        try:
            compression = CompressionType.parse(self.batch_compression)
        except InvalidInputError as err:
            raise ConfigError(
                "batch_compression",
                f"expected 'none' or 'zstd', found {self.batch_compression!r}",
            ) from err
        object.__setattr__(self, "batch_compression", compression)
        _check_choice("wal_sync", self.wal_sync, _WAL_SYNC)
        check_duration("wal_sync_interval", self.wal_sync_interval, allow_zero=False)
        _check_int("wal_max_bytes", self.wal_max_bytes, 64 * 1024)
        rotate = self.wal_rotate_bytes
        if rotate is None:
            object.__setattr__(self, "wal_rotate_bytes", min(64 * MiB, self.wal_max_bytes // 8))
        else:
            _check_int("wal_rotate_bytes", rotate, 4096)
            if rotate > self.wal_max_bytes // 4:
                raise ConfigError(
                    "wal_rotate_bytes",
                    f"expected at most wal_max_bytes // 4 = {self.wal_max_bytes // 4} (released "
                    f"space is reclaimed a whole file at a time), found {rotate}",
                )
        _check_choice("size_cap_policy", self.size_cap_policy, _SIZE_CAP)
        _check_int("upload_concurrency", self.upload_concurrency, 1)
        if not isinstance(self.retry, RetryPolicy):
            raise ConfigError("retry", f"expected a RetryPolicy, found {type(self.retry).__name__}")
        if self.reupload_after is not None:
            check_duration("reupload_after", self.reupload_after, allow_zero=False)
        interval = self.commit_interval
        if not (isinstance(interval, (int, float)) and 0 <= interval < 3600):
            raise ConfigError(
                "commit_interval",
                f"expected 0 <= seconds < 3600, found {self.commit_interval!r}",
            )
        object.__setattr__(self, "coordinator", parse_coordinator_urls(self.coordinator) or None)
        if self.host_coordinator is not None and not isinstance(self.host_coordinator, bool):
            raise ConfigError(
                "host_coordinator",
                f"expected True, False or None, found {self.host_coordinator!r}",
            )
        if self.host_coordinator and self.coordinator:
            raise ConfigError(
                "host_coordinator",
                "expected either coordinator URLs or host_coordinator=True, found both",
            )
        for method in ("now_ms", "monotonic", "sleep"):
            if not callable(getattr(self.clock, method, None)):
                raise ConfigError(
                    "clock", f"expected a Clock with {method}(), found {self.clock!r}"
                )

    @property
    def compression(self) -> CompressionType:
        """``batch_compression`` as a :class:`~millpond.CompressionType`."""
        return CompressionType.parse(self.batch_compression)

    @property
    def rotate_bytes(self) -> int:
        """``wal_rotate_bytes`` with its default resolved."""
        assert self.wal_rotate_bytes is not None  # resolved in __post_init__
        return self.wal_rotate_bytes

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> ProducerConfig:
        """Build a config from string options (Spark options, environment variables).

        Keys are the field names. ``store_options.<key>`` sets one obstore option and
        ``retry.<field>`` one field of the retry policy (``max_attempts``, ``max_elapsed``,
        ``base_delay``, ``max_delay``, ``strategy``: ``aging``, the default, or
        ``exponential``). ``clock`` cannot be given as a string.

        Raises:
            ConfigError: an unknown key (named) or a value that does not parse (key named,
                with what was expected and what was found).
        """
        kwargs: dict[str, Any] = {}
        store_options: dict[str, str] = {}
        retry: dict[str, Any] = {}
        for key, value in options.items():
            if not isinstance(value, str):
                raise ConfigError(key, f"expected a string value, found {type(value).__name__}")
            if key.startswith("store_options."):
                store_options[key.removeprefix("store_options.")] = value
            elif key.startswith("retry."):
                name = key.removeprefix("retry.")
                parser = _RETRY_PARSERS.get(name)
                if parser is None:
                    raise ConfigError(key, f"expected one of retry.{{{', '.join(_RETRY_PARSERS)}}}")
                retry[name] = _parse(key, value, parser)
            else:
                parser = _PARSERS.get(key)
                if parser is None:
                    raise ConfigError(
                        key,
                        f"unknown option; expected one of {', '.join(sorted(_PARSERS))}, "
                        "store_options.<key> or retry.<field>",
                    )
                kwargs[key] = _parse(key, value, parser)
        for required in ("store", "wal_dir"):
            if required not in kwargs:
                raise ConfigError(required, "expected a value, found none (required)")
        if store_options:
            kwargs["store_options"] = store_options
        if retry:
            try:
                kwargs["retry"] = dataclasses.replace(_default_retry(), **retry)
            except ConfigError as err:
                raise ConfigError(f"retry.{err.key}", str(err).split(": ", 1)[-1]) from err
        return cls(**kwargs)


# -- string parsing -------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 1000,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 1000**2,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 1000**3,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 1000**4,
}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|min|h)?\s*$")
_DURATION_UNITS = {None: 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_size(text: str) -> int:
    """Bytes from ``"1048576"``, ``"64MiB"``, ``"64m"`` (binary), ``"1GB"`` (decimal).

    Raises:
        ValueError: not a size.
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"expected a size such as 1048576, 64MiB or 1GB, found {text!r}")
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if value != int(value):
        raise ValueError(f"expected a whole number of bytes, found {text!r}")
    return int(value)


def parse_duration(text: str) -> float:
    """Seconds from ``"0.1"``, ``"100ms"``, ``"5s"``, ``"2m"``, ``"1h"``.

    Raises:
        ValueError: not a duration.
    """
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"expected a duration such as 0.1, 100ms, 5s or 2m, found {text!r}")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def _parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"expected an integer, found {text!r}") from None


def _parse_lower(text: str) -> str:
    return text.strip().lower()


_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_bool(text: str) -> bool:
    """``true``, ``1``, ``yes`` or ``false``, ``0``, ``no`` (any case).

    Raises:
        ValueError: anything else.
    """
    try:
        return _BOOLEANS[text.strip().lower()]
    except KeyError:
        raise ValueError(f"expected true or false, found {text!r}") from None


_PARSERS: dict[str, Callable[[str], Any]] = {
    "store": str,
    "wal_dir": str,
    "data_path_prefix": str,
    "manifest_path": str,
    "flush_interval": parse_duration,
    "flush_size_bytes": parse_size,
    "max_buffered_inputs": _parse_int,
    "batch_compression": _parse_lower,
    "wal_sync": _parse_lower,
    "wal_sync_interval": parse_duration,
    "wal_max_bytes": parse_size,
    "wal_rotate_bytes": parse_size,
    "size_cap_policy": _parse_lower,
    "upload_concurrency": _parse_int,
    "reupload_after": parse_duration,
    "commit_interval": parse_duration,
    "coordinator": str,
    "host_coordinator": parse_bool,
}
_RETRY_PARSERS: dict[str, Callable[[str], Any]] = {
    "max_attempts": _parse_int,
    "max_elapsed": parse_duration,
    "base_delay": parse_duration,
    "max_delay": parse_duration,
    "strategy": str,
}


def _parse(key: str, value: str, parser: Callable[[str], Any]) -> Any:
    try:
        return parser(value)
    except ValueError as err:
        raise ConfigError(key, str(err)) from err


# -- checks ---------------------------------------------------------------------------------


def _check_int(key: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, f"expected an int, found {type(value).__name__}")
    if value < low:
        raise ConfigError(key, f"expected >= {low}, found {value}")


def _check_choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        expected = " or ".join(repr(c) for c in choices)
        raise ConfigError(key, f"expected {expected}, found {value!r}")
