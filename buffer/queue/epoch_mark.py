"""The highest epoch a consumer of a queue has held, kept next to the queue.

Epochs only grow: every consumer bumps the manifest's epoch when it takes the queue over, and
nothing else changes it. A manifest whose epoch is *below* one a consumer of this queue once
held is therefore not the manifest that consumer read: it was deleted and created again (its
sequences start over at 0) or restored from an older copy (what was appended since is gone
from it). Either way a sink's progress — the last sequence it wrote — no longer names the same
entries, and a consumer resuming after it would skip entries it never wrote, without a word.

So each consumer, once its epoch bump has landed, records that epoch in
``{data_path_prefix}/_millpond/epoch``, and a consumer refuses to take over a manifest whose
epoch is below the recorded one (before bumping anything). The record is written conditionally
(:class:`~millpond.queue.fenced.FencedObject`): a fenced consumer's record never lands over a
higher one. RFC peers neither write nor read it (a manifest
replaced under a peer's consumer is not caught by this), and since epochs only grow, a peer's
consumer running in between cannot make the check fire.

To start a queue over on purpose, remove the sink's progress rows of the queue and this
object; the error says so.
"""

from __future__ import annotations

import json
import logging

from millpond.common.clock import Clock, SystemClock
from millpond.common.retry import RetryPolicy
from millpond.errors import (
    FencedError,
    FormatError,
    InvalidInputError,
    StorageError,
    StoreAccessError,
)
from millpond.queue.claim import internal_path
from millpond.queue.fenced import FencedObject
from millpond.storage.store import ObjectStore, get_or_none

__all__ = [
    "EPOCH_MARK_NAME",
    "check_not_replaced",
    "epoch_mark_path",
    "is_replaced",
    "read_epoch_mark",
    "write_epoch_mark",
]

logger = logging.getLogger(__name__)

EPOCH_MARK_NAME = "epoch"
_VERSION = 1
_MARK_RETRY = RetryPolicy(max_attempts=5, max_elapsed=5.0)
"""A lost race with another consumer's record is read again; a store that keeps failing is
left to the next consumer (the record is a safeguard, not the fence)."""


def epoch_mark_path(data_path_prefix: str) -> str:
    """Where the record of ``data_path_prefix``'s queue lives."""
    return internal_path(data_path_prefix, EPOCH_MARK_NAME)


def read_epoch_mark(store: ObjectStore, data_path_prefix: str) -> int | None:
    """The epoch recorded for the queue, or ``None`` when none is.

    Raises:
        FormatError: the record is not one this module wrote (naming it).
        StorageError: the store failed.
    """
    path = epoch_mark_path(data_path_prefix)
    got = get_or_none(store, path)
    return None if got is None else _decode(got.data, f"{store.url}/{path}")


def _decode(data: bytes, where: str) -> int:
    try:
        record = json.loads(data)
        epoch = record["epoch"]
        valid = isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0
    except (ValueError, TypeError, KeyError):
        valid = False
    if not valid:
        raise FormatError(
            f"{where}: expected a consumer epoch record, found {data[:80]!r}; "
            "delete it to have the next consumer write it again"
        )
    return int(epoch)


def write_epoch_mark(
    store: ObjectStore,
    data_path_prefix: str,
    manifest_path: str,
    epoch: int,
    *,
    clock: Clock | None = None,
) -> None:
    """Record ``epoch`` (just taken over) unless a newer one is recorded (a conditional write
    through :class:`~millpond.queue.fenced.FencedObject`: a fenced consumer's record never
    lands over its successor's). A failure is logged, not raised: the queue is consumed as
    before, and the check only waits for the next consumer to record one."""
    path = epoch_mark_path(data_path_prefix)

    def check(recorded: int) -> None:
        if recorded > epoch:
            raise FencedError(
                f"{store.url}/{path}: epoch {recorded} is recorded, this consumer holds {epoch}",
                expected_epoch=epoch,
                found_epoch=recorded,
            )

    mark = FencedObject(
        store,
        path,
        decode=lambda data: _decode(data, f"{store.url}/{path}"),
        encode=lambda e: json.dumps(
            {"version": _VERSION, "manifest_path": manifest_path, "epoch": e}
        ).encode(),
        check=check,
        retry=_MARK_RETRY,
        clock=clock or SystemClock(),
    )
    try:
        mark.update(lambda recorded: None if recorded == epoch else epoch, what="epoch record")
    except FencedError as err:
        logger.info("not recording epoch %s: a newer consumer took over (%s)", epoch, err)
    except (StorageError, StoreAccessError, FormatError) as err:
        logger.warning(
            "could not record epoch %s in %s/%s (a manifest replaced later may go unnoticed "
            "until a consumer records one): %s",
            epoch,
            store.url,
            path,
            err,
        )


def is_replaced(recorded: int | None, epoch: int) -> bool:
    """Whether a manifest read at ``epoch`` is below the ``recorded`` one (module docstring)."""
    return recorded is not None and epoch < recorded


def check_not_replaced(
    recorded: int | None, epoch: int, *, queue: str, store_url: str, data_path_prefix: str
) -> None:
    """Refuse a manifest whose ``epoch`` (as read, before any bump) is below ``recorded``.

    Raises:
        InvalidInputError: the manifest was replaced (module docstring), naming both epochs,
            the queue and what to do.
    """
    if not is_replaced(recorded, epoch):
        return
    path = epoch_mark_path(data_path_prefix)
    raise InvalidInputError(
        f"{queue}: the manifest's epoch is {epoch}, but a consumer of this queue held epoch "
        f"{recorded} (recorded in {store_url}/{path}): the manifest was deleted and created "
        "again, or restored from an older copy, so its sequences no longer match a sink's "
        "progress (resuming would skip entries) and it may not name batches appended to the "
        "manifest it replaced. Refused before changing anything. To start the queue over on "
        f"purpose, delete the sink's progress rows of this queue and {path}"
    )
