"""One queue, opened once: where it lives, who it is, and what each role takes from it.

A role (producer, consumer, collector) opens the queue from its config — every role's config
is a :class:`~millpond.queue.location.QueueLocation` — and takes the side of the protocol it
plays from here, instead of assembling the queue's inner modules itself:

```python
queue = Queue.open(config)
writer = queue.writer(retry=retry, clock=clock)        # appends, in-doubt resolution included
reader = queue.reader(retry=retry, clock=clock)        # reads, dequeues, fenced by the epoch
taken = queue.take_over(reader, last_acked=7, gc_grace_period=600.0, retry=retry, clock=clock)
report = queue.collect(grace_period=600.0, clock=clock)
```
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from millpond.common.clock import Clock, SystemClock
from millpond.common.metrics import Counters
from millpond.common.retry import RetryPolicy
from millpond.formats.manifest import Footer
from millpond.queue.append import QueueProducer
from millpond.queue.claim import queue_identity
from millpond.queue.dequeue import QueueConsumer
from millpond.queue.gc_rules import GcReport, collect_once
from millpond.queue.location import QueueLocation
from millpond.queue.takeover import Takeover, take_over_queue
from millpond.storage.store import ObjectStore

__all__ = ["Queue"]


@dataclass(frozen=True, slots=True)
class Queue:
    """A queue in its store: its location, its opened store and its identity."""

    location: QueueLocation
    store: ObjectStore

    @classmethod
    def open(cls, location: QueueLocation) -> Queue:
        """Open the queue's store (nothing is read or written).

        Raises:
            ConfigError: the store URL or options are invalid.
        """
        return cls(location=location, store=location.open_store())

    @property
    def identity(self) -> str:
        """Store URL and manifest path: what sinks key progress and ownership by."""
        return queue_identity(self.store.url, self.location.manifest_path)

    @property
    def data_path_prefix(self) -> str:
        """The data prefix, without surrounding slashes."""
        return self.location.data_path_prefix.strip("/")

    def writer(
        self,
        *,
        retry: RetryPolicy | None = None,
        clock: Clock | None = None,
        counters: Counters | None = None,
    ) -> QueueProducer:
        """The producer's side: appends in one compare-and-swap and resolves every append in
        doubt, its callers' through ``landings`` (:class:`~millpond.queue.append.QueueProducer`)."""
        return QueueProducer(
            self.store, self.location.manifest_path, retry=retry, clock=clock, counters=counters
        )

    def reader(
        self,
        *,
        retry: RetryPolicy | None = None,
        clock: Clock | None = None,
        counters: Counters | None = None,
    ) -> QueueConsumer:
        """The consumer's side of the manifest: reads and dequeues under its epoch
        (:class:`~millpond.queue.dequeue.QueueConsumer`); :meth:`take_over` gives it one."""
        return QueueConsumer(
            self.store, self.location.manifest_path, retry=retry, clock=clock, counters=counters
        )

    def take_over(
        self,
        reader: QueueConsumer,
        *,
        last_acked: int | None,
        gc_grace_period: float | None,
        retry: RetryPolicy | None = None,
        clock: Clock | None = None,
    ) -> Takeover:
        """Take the queue over for ``reader`` (:func:`~millpond.queue.takeover.take_over_queue`:
        checks, epoch bump, claims, first read).

        Raises:
            everything :func:`~millpond.queue.takeover.take_over_queue` raises.
        """
        return take_over_queue(
            reader,
            self.store,
            identity=self.identity,
            manifest_path=self.location.manifest_path,
            data_path_prefix=self.data_path_prefix,
            last_acked=last_acked,
            gc_grace_period=gc_grace_period,
            retry=retry,
            clock=clock or SystemClock(),
        )

    def collect(
        self,
        *,
        grace_period: float,
        clock: Clock | None = None,
        dry_run: bool = False,
        check_manifest: Callable[[Footer], None] | None = None,
    ) -> GcReport:
        """One garbage collection pass (:func:`~millpond.queue.gc_rules.collect_once`).

        Raises:
            everything :func:`~millpond.queue.gc_rules.collect_once` raises.
        """
        return collect_once(
            self.store,
            manifest_path=self.location.manifest_path,
            data_path_prefix=self.data_path_prefix,
            grace_period=grace_period,
            clock=clock or SystemClock(),
            dry_run=dry_run,
            check_manifest=check_manifest,
        )
