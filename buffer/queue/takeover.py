"""A consumer's takeover of the queue, in one place: checks, epoch bump, claims, first read.

The steps, in order, and why that order:

1. **Read side by side** (one round trip): the queue's claim (made here by a consumer that
   collects), the manifest (where the epoch bump starts from) and the epoch a consumer last
   recorded (:mod:`millpond.queue.epoch_mark`).
2. **Refuse before fencing anyone**: a claim naming another manifest or a longer grace period,
   a sink ahead of the queue, a manifest replaced since a consumer held it. An operator's
   mistake must not fence the consumer that is right.
3. **Bump the epoch** (:meth:`QueueConsumer.initialize`): from here on every older consumer's
   conditional write of the manifest fails. A consumer that held the queue before bumps only
   a manifest that still carries its epoch: one that lost the queue never takes it back.
4. **Record the epoch** (a failure is logged: the replaced-manifest check waits for the next).
5. **Claim the backlog index head** (created empty when there is none): from here on no head
   write of an older consumer lands either.
6. **Read the manifest** after the claim: the queue is the index's entries, then the
   manifest's past them (counted from the index head; no segment is read).

What the consumer does with it — positions, read-ahead, repairs, its collector — is its own.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from millpond.common.clock import Clock
from millpond.common.retry import RetryPolicy
from millpond.errors import InvalidInputError, ProgressBehindError
from millpond.formats.manifest import ManifestView
from millpond.queue.claim import QueueClaim, open_claim
from millpond.queue.dequeue import QueueConsumer
from millpond.queue.epoch_mark import (
    check_not_replaced,
    is_replaced,
    read_epoch_mark,
    write_epoch_mark,
)
from millpond.queue.index import BacklogIndex, queue_extent
from millpond.storage.store import ObjectStore

__all__ = ["Takeover", "check_not_ahead", "take_over_queue"]


@dataclass(frozen=True, slots=True)
class Takeover:
    """What a takeover hands the consumer that made it."""

    epoch: int
    """The epoch it holds now."""
    index: BacklogIndex
    """The backlog index head, claimed for that epoch (its segments are not read)."""
    manifest: ManifestView
    """The manifest as read after the claim; the queue is the index's entries, then the
    manifest's past them."""
    acked: int
    """The last sequence the sink has (the one given, or the one before the queue's first)."""
    first: int
    """The queue's first sequence (``next_sequence`` when it is empty)."""
    next_sequence: int
    """One past the queue's last sequence (the index's or the manifest's)."""
    unfinished_move: bool
    """The manifest still holds entries the index covers: a move stopped before its manifest
    write, which the consumer finishes."""


def take_over_queue(
    queue: QueueConsumer,
    store: ObjectStore,
    *,
    identity: str,
    manifest_path: str,
    data_path_prefix: str,
    last_acked: int | None,
    gc_grace_period: float | None,
    retry: RetryPolicy | None,
    clock: Clock,
) -> Takeover:
    """Take the queue over for ``queue`` (see the module doc for the steps).

    Args:
        queue: the consumer's side of the manifest; it holds the new epoch afterwards.
        store, manifest_path, data_path_prefix: where the queue is.
        identity: the queue's identity (store URL and manifest path), for messages.
        last_acked: the sink's last sequence, or ``None`` to start at the queue's first.
        gc_grace_period: the grace period of the consumer's own collector (it makes the claim
            when there is none, and must not be shorter than the queue's); ``None``: no
            collector.
        retry, clock: the index claim's retries; the clock also dates a new claim.

    Raises:
        ConfigError: the claim refuses this consumer.
        InvalidInputError: ``last_acked`` is not below the queue's ``next_sequence``, or the
            manifest was replaced.
        ProgressBehindError: ``last_acked`` is below the queue's first entry minus one.
        FencedError: another consumer took over meanwhile, or this one lost the queue before.
        FormatError, StorageError, StoreAccessError: the store's.
    """
    next_sequence, found_epoch, recorded = _look(
        queue, store, manifest_path, data_path_prefix, gc_grace_period=gc_grace_period, clock=clock
    )
    check_not_ahead(last_acked, next_sequence, identity)
    check_not_replaced(
        recorded,
        found_epoch,
        queue=identity,
        store_url=store.url,
        data_path_prefix=data_path_prefix,
    )
    epoch = queue.initialize()
    write_epoch_mark(store, data_path_prefix, manifest_path, epoch, clock=clock)
    index = BacklogIndex(
        store, data_path_prefix=data_path_prefix, epoch=epoch, retry=retry, clock=clock
    )
    index.claim()
    return _first_read(queue, index, last_acked=last_acked, identity=identity)


def _first_read(
    queue: QueueConsumer,
    index: BacklogIndex,
    *,
    last_acked: int | None,
    identity: str,
) -> Takeover:
    """Read the manifest after the claim and check the sink's progress against the queue (the
    index's entries, counted from its head, then the manifest's past them)."""
    # Without an index, the manifest as the epoch bump wrote it is as good as a read (appends
    # made since are found by the next refresh); with one, it is read after the claim.
    manifest = queue.read_view(reuse=not index.holds_anything)
    first, next_sequence = queue_extent(manifest, index.head)
    acked = _check_progress(last_acked, first, next_sequence, identity)
    assert queue.epoch is not None
    manifest_first = manifest.first_sequence
    return Takeover(
        epoch=queue.epoch,
        index=index,
        manifest=manifest,
        acked=acked,
        first=first,
        next_sequence=next_sequence,
        unfinished_move=manifest_first is not None and manifest_first <= index.end,
    )


def _look(
    queue: QueueConsumer,
    store: ObjectStore,
    manifest_path: str,
    data_path_prefix: str,
    *,
    gc_grace_period: float | None,
    clock: Clock,
) -> tuple[int, int, int | None]:
    """Read the claim (checking this consumer against it), the manifest and the epoch mark
    side by side: one round trip, not three. Returns the queue before the bump: the manifest's
    ``next_sequence`` and epoch, and the epoch a consumer last recorded, if any."""
    create = None
    if gc_grace_period is not None:
        create = QueueClaim(
            manifest_path=manifest_path,
            gc_grace_period=gc_grace_period,
            created_ms=clock.now_ms(),
        )
    with ThreadPoolExecutor(2, thread_name_prefix="millpond-peek") as peek:
        peeked = peek.submit(queue.peek)
        marked = peek.submit(read_epoch_mark, store, data_path_prefix)
        # Leaving the block waits for both reads, raise or not.
        claim = open_claim(
            store, data_path_prefix=data_path_prefix, manifest_path=manifest_path, create=create
        )
    if claim is not None and gc_grace_period is not None:
        claim.check_gc_grace(gc_grace_period, store_url=store.url)
    next_sequence, epoch = peeked.result()
    recorded = marked.result()
    if is_replaced(recorded, epoch):
        # Another consumer may have taken over between the two reads (its record is written
        # after its bump lands): a manifest read after the record tells.
        next_sequence, epoch = queue.peek()
    return next_sequence, epoch, recorded


def _check_progress(last_acked: int | None, first: int, next_sequence: int, identity: str) -> int:
    """The last sequence the sink has, checked against the queue as read after the claim.

    Raises:
        InvalidInputError: the sink is ahead of the queue.
        ProgressBehindError: entries the sink never saw were dequeued.
    """
    acked = first - 1 if last_acked is None else last_acked
    check_not_ahead(acked, next_sequence, identity)
    if acked < first - 1:
        raise ProgressBehindError(
            f"last_acked_sequence: expected >= {first - 1} (the queue starts at {first}), "
            f"found {acked}: entries {acked + 1}..{first - 1} were dequeued without this "
            "consumer's sink seeing them",
            found=acked,
            first=first,
        )
    return acked


def check_not_ahead(acked: int | None, next_sequence: int, identity: str) -> None:
    """Refuse progress at or past the queue's ``next_sequence``.

    Raises:
        InvalidInputError: the sink is ahead of this queue.
    """
    if acked is not None and acked >= next_sequence:
        raise InvalidInputError(
            f"last_acked_sequence: expected < next_sequence {next_sequence} of {identity}, "
            f"found {acked}: the sink is ahead of this queue (a manifest that was recreated, "
            "or a sink restored from another queue)"
        )
