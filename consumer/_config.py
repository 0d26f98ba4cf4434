"""``ConsumerConfig``: where the queue is and how the consumer reads, acks and collects."""

from __future__ import annotations

from dataclasses import dataclass

from millpond.common.clock import Clock
from millpond.common.durations import check_duration
from millpond.common.retry import RetryPolicy
from millpond.coordinator.wire import parse_coordinator_urls
from millpond.errors import ConfigError
from millpond.queue import QueueLocation

__all__ = ["ConsumerConfig"]

_MAX_READ_AHEAD = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerConfig(QueueLocation):
    """Configuration of a :class:`~millpond.consumer.Consumer` (RFC ``ConsumerConfig``)."""

    ack_batch_size: int = 1000
    """Fewest acks between two dequeues (manifest writes); ``flush()`` and ``close()`` dequeue
    the rest, and ``dequeue_max_delay`` bounds the wait. Default 1000 (100 before
    2026-11-27). A dequeue is a write the producers' appends contend with, and a coordinator
    appending for them pauses every few rounds while another writer writes: with 16
    producers at 50 ms a request through a coordinator one of them hosts, a consumer
    dequeuing every 100 acks (about once a second) took their ``wait()`` p99 to 6.3x and 6.8x
    a lone producer's p50 (two runs); every 1000 acks (about every 8 s), 4.3x and 5.5x."""
    dequeue_fraction: float = 0.1
    """With a backlog, a dequeue also waits until the acked entries number this fraction of the
    entries still queued behind them (0..1): each dequeue rewrites what is left of the
    manifest, so draining N entries then moves O(N) bytes instead of O(N^2). 0 dequeues every
    ``ack_batch_size`` acks whatever the backlog. Default 0.1."""
    dequeue_max_delay: float = 10.0
    """Seconds an acked entry waits at most for its dequeue: past it the next ack, or a
    ``next_batch()`` that finds nothing new, dequeues whatever is acked. Default 10."""
    backlog_index: bool = True
    """Move the oldest entries out of the manifest into the consumer's own backlog index
    (:mod:`millpond.queue.index`) once the manifest holds ``backlog_index_threshold`` entries,
    so appends stay cheap for every producer while the sink is behind. Only millpond's GC
    knows the index: switch it off (``False``, ``millpond consume --no-backlog-index``) where an
    RFC peer's GC (the Rust one) collects the data prefix, which would see indexed batch objects
    as unreferenced and delete them, or where an RFC peer's consumer may take over. A consumer
    drains an index it finds whatever this setting. Default ``True`` (``False`` before issue
    48: a day-long backlog then stayed in the manifest, and every append rewrote it)."""
    backlog_index_threshold: int = 1_000
    """Entries in the manifest (as the consumer last read it) that trigger a move into the
    backlog index; a move writes segments of this many to twice as many entries. Default 1,000
    (about 82 KB of manifest: a producer's append on a file store then costs at most about
    1.15x what it costs on an empty queue, 2.7x at 10,000, the default before issue 48)."""
    backlog_index_interval: float = 5.0
    """Seconds between two looks at the manifest (a conditional GET) by the thread that moves
    the backlog into the index while nothing is delivered (the sink is down). Default 5."""
    read_ahead: int = 4
    """Batch objects fetched and decoded concurrently ahead of delivery at first, and at least
    (1..256); batches are still delivered strictly in sequence order. Default 4."""
    read_ahead_max: int = 64
    """Most batch objects fetched ahead (1..256; never below ``read_ahead``): the read-ahead
    doubles each time a delivery waits for an object already in flight (a store far away), so
    a slow store does not cap the consumer at ``read_ahead`` objects per round trip. Default
    64."""
    read_ahead_bytes: int = 64 * 1024 * 1024
    """Memory budget of the read-ahead beyond ``read_ahead``: it grows no further than this
    many decoded bytes, as the batches delivered so far average. Default 64 MiB."""
    gc_enabled: bool = True
    """Run the garbage collector in a background thread of the consumer; it stops when the
    consumer closes or is fenced. Default ``True``."""
    gc_interval: float = 300.0
    """Seconds between two garbage-collection passes. Default 300 (5 minutes)."""
    gc_grace_period: float = 600.0
    """Seconds a batch object's ULID time must lie in the past before GC may delete it.
    Default 600 (10 minutes)."""
    retry: RetryPolicy | None = None
    """Backoff for manifest CAS loops (epoch bump, dequeue). Default ``RetryPolicy()``."""
    coordinator: str | None = None
    """``http://host:port`` of a ``millpond coordinator`` serving this queue: the consumer sends
    its dequeues there (written between the coordinator's rounds, so it neither races them nor
    makes the coordinator pause often), and dequeues directly whenever the coordinator does not
    answer ``dequeued``. Its token, if it has one, is ``MILLPOND_COORDINATOR_TOKEN`` in this
    process's environment. Default ``None``: always directly."""
    clock: Clock | None = None
    """Wall clock, monotonic clock and sleep; injectable for tests. Default the system's."""

    def __post_init__(self) -> None:
        QueueLocation.__post_init__(self)
        _check_int("ack_batch_size", self.ack_batch_size, 1, 1 << 32)
        _check_int("read_ahead", self.read_ahead, 1, _MAX_READ_AHEAD)
        _check_int("read_ahead_max", self.read_ahead_max, 1, _MAX_READ_AHEAD)
        _check_int("read_ahead_bytes", self.read_ahead_bytes, 1, 1 << 40)
        if not isinstance(self.backlog_index, bool):
            raise ConfigError(
                "backlog_index", f"expected True or False, found {self.backlog_index!r}"
            )
        _check_int("backlog_index_threshold", self.backlog_index_threshold, 1, 1 << 32)
        check_duration("backlog_index_interval", self.backlog_index_interval, allow_zero=False)
        if (
            isinstance(self.dequeue_fraction, bool)
            or not isinstance(self.dequeue_fraction, int | float)
            or not 0 <= self.dequeue_fraction <= 1
        ):
            raise ConfigError(
                "dequeue_fraction", f"expected a number in 0..1, found {self.dequeue_fraction!r}"
            )
        check_duration("dequeue_max_delay", self.dequeue_max_delay, allow_zero=True)
        if not isinstance(self.gc_enabled, bool):
            raise ConfigError("gc_enabled", f"expected True or False, found {self.gc_enabled!r}")
        check_duration("gc_interval", self.gc_interval, allow_zero=False)
        check_duration("gc_grace_period", self.gc_grace_period, allow_zero=True)
        urls = parse_coordinator_urls(self.coordinator)
        if len(urls) > 1:
            raise ConfigError("coordinator", f"expected one URL, found {len(urls)}")
        object.__setattr__(self, "coordinator", urls[0] if urls else None)

    def dequeue_step(self, behind: int) -> int:
        """Acked entries that make a dequeue due when ``behind`` entries are queued after
        them: ``max(ack_batch_size, dequeue_fraction * behind)``."""
        return max(self.ack_batch_size, int(self.dequeue_fraction * max(0, behind)))


def _check_int(key: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(key, f"expected an integer in {low}..{high}, found {value!r}")
