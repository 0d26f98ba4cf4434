"""Which batch objects garbage collection may delete (OpenData RFC 0001, "Garbage Collection").

This is the one place the RFC's deletion rules live. It sits in the core, not in ``millpond.gc``,
because two packages run collection passes and neither may import the other: the
``GarbageCollector`` of ``millpond.gc`` (a scheduled job, ``millpond gc``) and the consumer,
which runs the collector in its own process and stops it when fenced. Both call
:func:`collect_once`; :func:`plan_collection` is the pure rule, bytes-free and clock-free.

A batch object may be deleted only if all of these hold:

- it sits directly under the data prefix and is named ``{ULID}.batch`` (nested prefixes may
  belong to other queues; other names are not ours);
- no manifest entry references it;
- its ULID time is older than the oldest ULID time among the manifest's entries (an object
  written but not yet enqueued is newer than what is queued); with an empty manifest this rule
  does not apply, as the RFC says;
- its ULID time is older than the grace period, relative to now (a producer's CAS retries may
  delay the append of an object whose name is older than the queue's head).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from millpond.common.ulids import parse_batch_name, ulid_time_ms
from millpond.errors import NotFoundError
from millpond.formats.manifest import Manifest
from millpond.queue.cas import read_manifest
from millpond.storage.store import DeleteFailure, ObjectInfo, ObjectStore

__all__ = ["GcPlan", "GcReport", "KeepReason", "collect_once", "plan_collection"]

logger = logging.getLogger(__name__)

# The queue floor when no entry has a ULID name: no object can be older than it.
_NOTHING_IS_OLDER = -(1 << 63)


class KeepReason(StrEnum):
    """Why a listed object was not deleted."""

    NOT_A_BATCH = "not_a_batch"
    """The name is not ``{ULID}.batch`` (the manifest itself, anything else)."""
    OUTSIDE_PREFIX = "outside_prefix"
    """Not directly under the data prefix (a nested prefix, another folder)."""
    REFERENCED = "referenced"
    """A manifest entry points at it."""
    NOT_OLDER_THAN_QUEUE = "not_older_than_queue"
    """Its ULID time is not older than the oldest entry in the manifest."""
    IN_GRACE_PERIOD = "in_grace_period"
    """Its ULID time is within the grace period."""
    NO_MANIFEST = "no_manifest"
    """There is no manifest at the configured path: nothing is deleted, in case the path is
    wrong and the objects belong to a queue whose manifest lives elsewhere."""


@dataclass(frozen=True, slots=True)
class GcPlan:
    """What one pass would delete, and how many objects it keeps for each reason."""

    delete: tuple[str, ...]
    kept: Mapping[KeepReason, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class GcReport:
    """The outcome of one collection pass."""

    started_ms: int
    """Wall-clock milliseconds when the pass started (the "now" of the grace period)."""
    listed: int
    """Objects listed directly under the data prefix."""
    deleted: tuple[str, ...]
    """Objects deleted, or with ``dry_run`` the objects that would have been."""
    kept: Mapping[KeepReason, int] = field(default_factory=dict)
    """Objects kept, counted per reason."""
    failures: tuple[DeleteFailure, ...] = ()
    """Deletes that failed; the objects are still eligible and retried on the next pass."""
    dry_run: bool = False
    """Whether deletion was skipped."""
    manifest_epoch: int | None = None
    """Epoch of the manifest snapshot the pass used; ``None`` when there was no manifest."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "started_ms": self.started_ms,
            "listed": self.listed,
            "deleted": len(self.deleted),
            "deleted_paths": list(self.deleted),
            "kept": {str(reason): count for reason, count in sorted(self.kept.items())},
            "failures": [{"path": f.path, "reason": f.reason} for f in self.failures],
            "dry_run": self.dry_run,
            "manifest_epoch": self.manifest_epoch,
        }


def plan_collection(
    objects: Iterable[ObjectInfo],
    manifest: Manifest,
    *,
    data_path_prefix: str,
    now_ms: int,
    grace_period_ms: int,
) -> GcPlan:
    """Apply the RFC's rules to a listing and a manifest snapshot. Pure.

    Args:
        objects: the listing, paths relative to the store root.
        manifest: the manifest snapshot.
        data_path_prefix: where batch objects live, e.g. ``"ingest"``.
        now_ms: the current wall-clock time in milliseconds.
        grace_period_ms: minimum age, in milliseconds, of a deletable object.

    Returns:
        The objects to delete and the count of kept objects per reason.
    """
    prefix = data_path_prefix.strip("/")
    referenced = {entry.location for entry in manifest.entries}
    # The oldest ULID time among the entries. Entries are in append order, but producers mint
    # names before their CAS wins, so the first entry is not always the oldest name: take the
    # minimum, which can only keep more. An entry without a ULID name is ignored here; if no
    # entry has one, nothing can be compared and nothing is deleted.
    entry_times = [
        ulid_time_ms(ulid)
        for entry in manifest.entries
        if (ulid := parse_batch_name(entry.location.rpartition("/")[2])) is not None
    ]
    queue_floor_ms: int | None = None
    if manifest.entries:
        queue_floor_ms = min(entry_times, default=_NOTHING_IS_OLDER)
    delete: list[str] = []
    kept: Counter[KeepReason] = Counter()
    for info in objects:
        parent, _, name = info.path.strip("/").rpartition("/")
        if parent != prefix:
            kept[KeepReason.OUTSIDE_PREFIX] += 1
            continue
        ulid = parse_batch_name(name)
        if ulid is None:
            kept[KeepReason.NOT_A_BATCH] += 1
            continue
        if info.path in referenced:
            kept[KeepReason.REFERENCED] += 1
            continue
        created_ms = ulid_time_ms(ulid)
        if queue_floor_ms is not None and created_ms >= queue_floor_ms:
            kept[KeepReason.NOT_OLDER_THAN_QUEUE] += 1
            continue
        if now_ms - created_ms <= grace_period_ms:
            kept[KeepReason.IN_GRACE_PERIOD] += 1
            continue
        delete.append(info.path)
    return GcPlan(delete=tuple(delete), kept=dict(kept))


def collect_once(
    store: ObjectStore,
    *,
    manifest_path: str,
    data_path_prefix: str,
    now_ms: int,
    grace_period_ms: int,
    dry_run: bool = False,
    check_manifest: Callable[[Manifest], None] | None = None,
) -> GcReport:
    """One collection pass: list, read the manifest, plan, delete.

    The listing comes *before* the manifest read: an object enqueued while the pass runs is
    then seen as referenced, and an object dequeued meanwhile was already consumed. Reading
    the manifest first would leave a window where a just-enqueued object is listed but not
    yet in the snapshot.

    Args:
        store: the object store.
        manifest_path: the queue manifest, read without fencing (GC only observes it).
        data_path_prefix: where batch objects live.
        now_ms: the current wall-clock time in milliseconds.
        grace_period_ms: minimum age, in milliseconds, of a deletable object.
        dry_run: plan only, delete nothing.
        check_manifest: called with the snapshot before anything is deleted; raising from it
            aborts the pass (the consumer uses it to stop once its epoch is gone).

    Returns:
        The report; failed deletes are in ``failures``, not raised.

    Raises:
        FormatError: the manifest is corrupt (nothing is deleted).
        StorageError: listing or reading the manifest failed (nothing is deleted).
    """
    prefix = data_path_prefix.strip("/")
    # Only objects directly under the prefix: nested prefixes may hold other queues.
    listing = store.list(prefix, recursive=False)
    try:
        snapshot = read_manifest(store, manifest_path)
    except NotFoundError:
        logger.warning("gc: no manifest at %s; deleting nothing", manifest_path)
        return GcReport(
            started_ms=now_ms,
            listed=len(listing),
            deleted=(),
            kept={KeepReason.NO_MANIFEST: len(listing)} if listing else {},
            dry_run=dry_run,
        )
    if check_manifest is not None:
        check_manifest(snapshot.manifest)
    plan = plan_collection(
        listing,
        snapshot.manifest,
        data_path_prefix=prefix,
        now_ms=now_ms,
        grace_period_ms=grace_period_ms,
    )
    failures: list[DeleteFailure] = []
    if plan.delete and not dry_run:
        failures = store.delete_many(plan.delete)
        for failure in failures:
            logger.warning(
                "gc: could not delete %s (%s); retrying next pass", failure.path, failure.reason
            )
    failed = {failure.path for failure in failures}
    return GcReport(
        started_ms=now_ms,
        listed=len(listing),
        deleted=tuple(path for path in plan.delete if path not in failed),
        kept=plan.kept,
        failures=tuple(failures),
        dry_run=dry_run,
        manifest_epoch=snapshot.manifest.epoch,
    )
