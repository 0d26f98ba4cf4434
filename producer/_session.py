"""What a producer must know about its queue before it appends: the claim and the store's clock.

On start (and, if the store does not answer then, before the first append) the producer

* reads the queue's claim, creating it if this is the first role to open the queue: a claim
  naming another manifest means two queues share one data prefix, and the producer refuses;
* takes its timing contract: ``reupload_after`` (how long an uploaded batch may wait for its
  append before it is written again) must be at most half the queue's GC grace period and
  longer than the collectors' delete window, and defaults to half the grace period;
* measures its clock against the store's: replayed batches are aged by their ULID time, which
  this clock wrote, so a skew beyond :data:`~millpond.queue.claim.MAX_CLOCK_SKEW` is refused.
  The start-up check of the store (:func:`~millpond.storage.checks.preflight`) reads the
  store's clock from the probe object it writes anyway and hands it over; when that check did
  not run (it runs once per store and process) or a later attempt opens the queue, a probe of
  its own (2 requests) measures it.

Permanent problems raise ``ConfigError``; a store that is down is waited out.
"""

from __future__ import annotations

import logging

from millpond.common.clock import Clock
from millpond.errors import ConfigError, StorageError
from millpond.producer.config import ProducerConfig
from millpond.queue import (
    CLOCK_PROBE,
    MAX_CLOCK_SKEW,
    QueueClaim,
    internal_path,
    open_claim,
)
from millpond.storage.store import ObjectStore
from millpond.storage.store_time import StoreTime, probe_store_time

__all__ = ["QueueSession"]

logger = logging.getLogger(__name__)


class QueueSession:
    """The producer's view of its queue's claim and timing contract. Thread-safe once open."""

    def __init__(self, store: ObjectStore, config: ProducerConfig, clock: Clock) -> None:
        self._store = store
        self._config = config
        self._clock = clock
        self.claim: QueueClaim | None = None
        self.reupload_after = 0.0
        """Seconds an uploaded batch may wait for its append before it is written again."""
        self.delete_window = 0.0
        """Seconds to wait after writing an object again before appending it."""

    def try_open(self, store_time: StoreTime | None = None) -> None:
        """:meth:`open`, logging a store that did not answer (the committer opens it before
        the first append, waiting the store out)."""
        try:
            self.open(store_time)
        except StorageError as err:
            logger.info(
                "queue %s not reachable yet (%s); checking again before publishing",
                self._config.manifest_path,
                err,
            )

    def open(self, store_time: StoreTime | None = None) -> None:
        """One attempt to read (or create) the claim and take the timing contract.

        Args:
            store_time: the store's clock, measured just now by the caller (the start-up
                check); ``None`` probes it.

        Raises:
            StorageError: the store did not answer (try again later).
            ConfigError: the queue refuses this producer (named).
            FormatError: the claim object is corrupt.
        """
        config = self._config
        store = self._store
        prefix = config.data_path_prefix
        claim = open_claim(
            store,
            data_path_prefix=prefix,
            manifest_path=config.manifest_path,
            create=QueueClaim(manifest_path=config.manifest_path, created_ms=self._clock.now_ms()),
        )
        assert claim is not None
        limit = claim.reupload_limit()
        reupload = config.reupload_after if config.reupload_after is not None else limit
        if reupload > limit:
            raise ConfigError(
                "reupload_after",
                f"expected at most half the queue's GC grace period ({limit:g} s of "
                f"{claim.gc_grace_period:g} s, {store.url}), found {reupload:g} s",
            )
        if reupload <= claim.delete_window:
            raise ConfigError(
                "reupload_after",
                f"expected more than the queue's GC delete window ({claim.delete_window:g} s), "
                f"found {reupload:g} s (the queue's GC grace period is "
                f"{claim.gc_grace_period:g} s): a batch could never be appended before GC may "
                "take it; give the queue a longer grace period",
            )
        probe = store_time or probe_store_time(
            store, internal_path(prefix, CLOCK_PROBE), self._clock
        )
        if probe.skew_seconds > MAX_CLOCK_SKEW:
            direction = "behind" if probe.offset_ms > 0 else "ahead of"
            raise ConfigError(
                "clock",
                f"this machine's clock is {abs(probe.offset_ms) / 1000:.0f} s {direction} the "
                f"store's ({store.url}); at most {MAX_CLOCK_SKEW:g} s is allowed, because "
                "garbage collection ages batches by the times producers write into their "
                "names: fix the clock (NTP)",
            )
        self.reupload_after = reupload
        self.delete_window = claim.delete_window
        self.claim = claim
