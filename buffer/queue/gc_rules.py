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

Millpond is stricter than the RFC in three ways, so an RFC peer's objects are safe with it and
its own guarantees need nothing from a peer:

- the object's **last-modified time in the store** must be older than the grace period too,
  measured against the store's own clock (:mod:`millpond.storage.store_time`). A producer that
  recovers a batch long after naming it writes it again *under the same name* rather than
  giving it a new one (which the sink could not recognise as already written), and that fresh
  write is what protects it;
- a location a **hold** names is kept like a referenced one (:mod:`millpond.queue.holds`);
- a location the consumer's **backlog index** holds (:mod:`millpond.queue.index`) is
  referenced like a manifest entry, and counts for the queue's oldest ULID time too. An RFC
  peer's collector does not read the index: it would delete indexed batch objects;
- a pass sends **no delete later than half the queue's delete window** after its listing
  began (:class:`~millpond.queue.claim.QueueClaim`): a producer that rewrote an object waits
  the whole window before appending it, so a pass working from a listing older than the
  rewrite cannot delete it after the append.

Order of a pass: store clock probe, listing, holds, manifest, backlog index. Everything read
later can only make a pass keep more; the index comes after the manifest because the consumer
writes an entry into the index before removing it from the manifest.

Whatever the backlog, a pass lists only what could go: names sort as ULID times, so the
listing (in name order) stops at the first name at the queue's floor as a read of the
manifest and the index just before it found it; the floor the plan applies is read after
the listing, as above (a lower one keeps more of what was listed, a higher one only leaves
some for the next pass). No entry is decoded, no set of every location built: every entry's
batch time is at or past the floor, so nothing listed below it is referenced; the manifest
gives its floor from its locations alone, and each index segment carries its own in the
head. A pass lists at most 100,000 objects; the next goes on where its deletes left off.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from millpond.common.clock import Clock
from millpond.common.ulids import parse_batch_name, ulid_time_ms, ulid_time_prefix
from millpond.errors import NotFoundError, StorageError
from millpond.formats.manifest import Footer, Manifest, iter_locations, view_manifest
from millpond.queue.claim import (
    CLOCK_PROBE,
    QueueClaim,
    default_delete_window,
    internal_path,
    open_claim,
)
from millpond.queue.epoch_mark import check_not_replaced, read_epoch_mark
from millpond.queue.holds import held_locations
from millpond.queue.index import oldest_batch_ms, read_head, segment_oldest_ms
from millpond.storage.store import DeleteFailure, ObjectInfo, ObjectStore
from millpond.storage.store_time import probe_store_time, to_ms

__all__ = [
    "GcPlan",
    "GcReport",
    "KeepReason",
    "collect_once",
    "plan_collection",
]

logger = logging.getLogger(__name__)

_DELETE_CHUNK = 1000
_MOST_LISTED = 100_000
"""Objects one pass lists at most (they are held until the plan): the next pass goes on."""
_INDEX_READS = 5


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
    RECENTLY_WRITTEN = "recently_written"
    """Its last-modified time in the store is within the grace period (or unknown): it may have
    been written again by a producer about to append it."""
    HELD = "held"
    """A hold names it: a writer will append exactly this location (Spark stream commits)."""
    OUT_OF_TIME = "out_of_time"
    """Deletable, but the pass ran past half the delete window after its listing; the next pass
    takes it."""
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
    store_clock_offset_ms: float | None = None
    """Store clock minus this collector's clock, as the probe measured it (``None`` when the
    pass did not probe: a dry run)."""
    queue_floor_ms: int | None = None
    """The oldest batch time among the queue's entries (manifest and backlog index; ``None``:
    the queue is empty). Objects named at or past it were not listed: nothing there can go."""

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
            "store_clock_offset_ms": self.store_clock_offset_ms,
            "queue_floor_ms": self.queue_floor_ms,
        }


def plan_collection(
    objects: Iterable[ObjectInfo],
    manifest: Manifest,
    *,
    data_path_prefix: str,
    now_ms: int,
    grace_period_ms: int,
    store_now_ms: int | None = None,
    held: frozenset[str] | set[str] = frozenset(),
) -> GcPlan:
    """Apply the RFC's rules, and millpond's stricter ones, to a listing. Pure.

    Args:
        objects: the listing, paths relative to the store root.
        manifest: the manifest snapshot.
        data_path_prefix: where batch objects live, e.g. ``"ingest"``.
        now_ms: the current wall-clock time in milliseconds (for ULID times).
        grace_period_ms: minimum age, in milliseconds, of a deletable object.
        store_now_ms: the store's clock (a lower bound), for last-modified times; ``None``
            skips the last-modified rule (a plan made only to look at the RFC's rules).
        held: locations holds name.

    Returns:
        The objects to delete and the count of kept objects per reason.
    """
    locations = [entry.location for entry in manifest.entries]
    rules = _Rules(
        prefix=data_path_prefix.strip("/"),
        referenced=frozenset(locations),
        held=held,
        # Entries are in append order, but producers mint names before their CAS wins, so the
        # first entry is not always the oldest name: the minimum, which can only keep more
        # (no entry named by a ULID: nothing can be compared and nothing is deleted).
        queue_floor_ms=oldest_batch_ms(locations) if locations else None,
        now_ms=now_ms,
        grace_period_ms=grace_period_ms,
        store_now_ms=store_now_ms,
    )
    return _plan(objects, rules)


def _plan(objects: Iterable[ObjectInfo], rules: _Rules) -> GcPlan:
    delete: list[str] = []
    kept: Counter[KeepReason] = Counter()
    for info in objects:
        reason = rules.keep_reason(info)
        if reason is None:
            delete.append(info.path)
        else:
            kept[reason] += 1
    return GcPlan(delete=tuple(delete), kept=dict(kept))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Rules:
    """The deletion rules as one pass applies them: what each listed object is judged against."""

    prefix: str
    referenced: frozenset[str]
    held: frozenset[str] | set[str]
    queue_floor_ms: int | None
    """The oldest entry's ULID time; ``None``: the rule is off (an empty queue)."""
    now_ms: int
    grace_period_ms: int
    store_now_ms: int | None
    """The store's clock; ``None`` skips the last-modified rule."""

    def keep_reason(self, info: ObjectInfo) -> KeepReason | None:
        """Why ``info`` must be kept, the first rule it fails; ``None`` when it may be deleted."""
        parent, _, name = info.path.strip("/").rpartition("/")
        if parent != self.prefix:
            return KeepReason.OUTSIDE_PREFIX
        ulid = parse_batch_name(name)
        if ulid is None:
            return KeepReason.NOT_A_BATCH
        if info.path in self.referenced:
            return KeepReason.REFERENCED
        if info.path in self.held:
            return KeepReason.HELD
        created_ms = ulid_time_ms(ulid)
        if self.queue_floor_ms is not None and created_ms >= self.queue_floor_ms:
            return KeepReason.NOT_OLDER_THAN_QUEUE
        if self.now_ms - created_ms <= self.grace_period_ms:
            return KeepReason.IN_GRACE_PERIOD
        if self.store_now_ms is not None and (
            info.last_modified is None
            or self.store_now_ms - to_ms(info.last_modified) <= self.grace_period_ms
        ):
            return KeepReason.RECENTLY_WRITTEN
        return None


def collect_once(
    store: ObjectStore,
    *,
    manifest_path: str,
    data_path_prefix: str,
    clock: Clock,
    grace_period: float,
    dry_run: bool = False,
    check_manifest: Callable[[Footer], None] | None = None,
) -> GcReport:
    """One collection pass: probe the store clock, list, read holds and manifest, plan, delete.

    The listing comes *before* the holds and the manifest: an object enqueued while the pass
    runs is then seen as referenced, and an object dequeued meanwhile was already consumed.
    Reading the manifest first would leave a window where a just-enqueued object is listed but
    not yet in the snapshot. A dry run writes nothing (no clock probe: it compares
    last-modified times against this collector's clock).

    Args:
        store: the object store.
        manifest_path: the queue manifest, read without fencing (GC only observes it).
        data_path_prefix: where batch objects live.
        clock: this collector's clock (ULID times; the deadline of its deletes).
        grace_period: minimum age, in seconds, of a deletable object.
        dry_run: plan only, write nothing.
        check_manifest: called with the manifest's footer before anything is deleted; raising
            from it aborts the pass (the consumer uses it to stop once its epoch is gone).

    Returns:
        The report; failed deletes are in ``failures``, not raised.

    Raises:
        ConfigError: the queue's claim names another manifest, or asks for a longer grace
            period than ``grace_period`` (nothing is deleted).
        FormatError: the manifest, the claim or a hold is corrupt (nothing is deleted).
        InvalidInputError: the manifest was replaced (deleted and created again, or restored
            from an older copy: :mod:`millpond.queue.epoch_mark`); nothing is deleted.
        StorageError: the store failed before any delete (nothing is deleted).
    """
    collection = _Pass(
        store,
        manifest_path=manifest_path,
        prefix=data_path_prefix.strip("/"),
        clock=clock,
        grace_period=grace_period,
        dry_run=dry_run,
    )
    return collection.run(check_manifest)


class _Pass:
    """One run of :func:`collect_once`: what its steps share, and the steps in their order."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        manifest_path: str,
        prefix: str,
        clock: Clock,
        grace_period: float,
        dry_run: bool,
    ) -> None:
        self.store = store
        self.manifest_path = manifest_path
        self.prefix = prefix
        self.clock = clock
        self.grace_period = grace_period
        self.dry_run = dry_run
        self.started = clock.monotonic()
        self.now_ms = clock.now_ms()

    def run(self, check_manifest: Callable[[Footer], None] | None) -> GcReport:
        """Read everything in the order the module docstring gives, plan, delete, report."""
        claim = self._checked_claim()
        store_now_ms, offset_ms = self._store_now()
        # Only objects directly under the prefix (nested prefixes may hold other queues), and
        # only below the queue's floor as read just before: nothing at or past it can go; at
        # most _MOST_LISTED, in name order (the next pass goes on where this one's deletes
        # left off).
        below = self.store.list_range(self.prefix, end_before=self._listing_bound())
        listing = list(itertools.islice(below, _MOST_LISTED))
        held = held_locations(self.store, self.prefix)
        queue = self._read_queue()
        if queue is None:
            return self._nothing_deleted(listing)
        footer, floor_ms = queue
        if check_manifest is not None:
            check_manifest(footer)
        if claim is None and not self.dry_run:
            claim = self._claim()
        # Every entry's batch time is at or past the floor read after the listing, so no
        # object listed below it is referenced: the plan needs no set of every location.
        rules = _Rules(
            prefix=self.prefix,
            referenced=frozenset(),
            held=held,
            queue_floor_ms=floor_ms,
            now_ms=self.now_ms,
            grace_period_ms=round(self.grace_period * 1000),
            store_now_ms=store_now_ms,
        )
        plan = _plan(listing, rules)
        kept = dict(plan.kept)
        deleted, failures = self._delete(plan.delete, claim, kept)
        return GcReport(
            started_ms=self.now_ms,
            listed=len(listing),
            deleted=tuple(deleted),
            kept=kept,
            failures=tuple(failures),
            dry_run=self.dry_run,
            manifest_epoch=footer.epoch,
            store_clock_offset_ms=offset_ms,
            queue_floor_ms=floor_ms,
        )

    def _listing_bound(self) -> str | None:
        """Where the listing may stop: the first name at the queue's floor as read now, before
        the listing (``None``: no floor, list everything). The floor the plan applies is read
        after the listing; this one only saves listing what could not go anyway."""
        try:
            _footer, floor_ms = self._floor(self.store.get(self.manifest_path).data)
        except NotFoundError:
            return None  # no manifest: nothing is deleted (the read after the listing says so)
        if floor_ms is None:
            return None
        lead = f"{self.prefix}/" if self.prefix else ""
        return lead + ulid_time_prefix(floor_ms)

    def _floor(self, manifest: bytes) -> tuple[Footer, int | None]:
        """The manifest's footer and the queue's floor: the oldest batch time among the
        manifest's entries and the backlog index's (read after the manifest), each entry's
        location read once and nothing kept; ``None`` when the queue is empty."""
        view = view_manifest(manifest, name=self.manifest_path)
        floors = []
        if len(view):
            floors.append(
                oldest_batch_ms(location for _sequence, location in iter_locations(view.raw))
            )
        for _ in range(_INDEX_READS):
            head = read_head(self.store, self.prefix)
            try:
                indexed = [segment_oldest_ms(self.store, s) for s in head.segments] if head else []
            except NotFoundError:
                continue  # a segment drained since the head was read: read the newer head
            return view.footer, min([*floors, *indexed], default=None)
        raise StorageError(f"{self.store.url}: index segments kept vanishing while GC read them")

    def _checked_claim(self) -> QueueClaim | None:
        """The queue's claim, if any, once it allows this pass's grace period."""
        claim = open_claim(
            self.store, data_path_prefix=self.prefix, manifest_path=self.manifest_path
        )
        if claim is not None:
            claim.check_gc_grace(self.grace_period, store_url=self.store.url)
        return claim

    def _store_now(self) -> tuple[int, float | None]:
        """The store's clock and its offset from ours; a dry run probes nothing (no offset)."""
        if self.dry_run:
            return self.now_ms, None
        probe = probe_store_time(self.store, internal_path(self.prefix, CLOCK_PROBE), self.clock)
        return probe.stamp_ms, probe.offset_ms

    def _read_queue(self) -> tuple[Footer, int | None] | None:
        """The manifest's footer, checked not replaced, and the queue's floor (the index read
        after the manifest); ``None`` (and a warning) when there is no manifest."""
        # Read before the manifest: a record written by a takeover after the manifest read would
        # be newer than the manifest read, without anything being wrong.
        recorded = read_epoch_mark(self.store, self.prefix)
        try:
            data = self.store.get(self.manifest_path).data
        except NotFoundError:
            logger.warning("gc: no manifest at %s; deleting nothing", self.manifest_path)
            return None
        footer, floor_ms = self._floor(data)
        # A replaced manifest no longer names what was appended to the one it replaced.
        check_not_replaced(
            recorded,
            footer.epoch,
            queue=f"{self.store.url}/{self.manifest_path}",
            store_url=self.store.url,
            data_path_prefix=self.prefix,
        )
        return footer, floor_ms

    def _nothing_deleted(self, listing: list[ObjectInfo]) -> GcReport:
        """The report of a pass that found no manifest: every listed object kept."""
        return GcReport(
            started_ms=self.now_ms,
            listed=len(listing),
            deleted=(),
            kept={KeepReason.NO_MANIFEST: len(listing)} if listing else {},
            dry_run=self.dry_run,
        )

    def _claim(self) -> QueueClaim | None:
        """Claim a queue no millpond role has claimed yet (written by an RFC peer, or older).

        So a second queue pointed at this prefix is refused from now on.
        """
        return open_claim(
            self.store,
            data_path_prefix=self.prefix,
            manifest_path=self.manifest_path,
            create=QueueClaim(
                manifest_path=self.manifest_path,
                gc_grace_period=self.grace_period,
                created_ms=self.now_ms,
            ),
        )

    def _delete(
        self, paths: tuple[str, ...], claim: QueueClaim | None, kept: dict[KeepReason, int]
    ) -> tuple[list[str], list[DeleteFailure]]:
        """Delete ``paths`` in chunks until half the delete window after the pass began.

        A dry run deletes nothing and returns ``paths`` as deleted. What the deadline leaves is
        counted in ``kept`` as :attr:`KeepReason.OUT_OF_TIME`.

        Returns:
            The paths deleted, and the deletes that failed (logged, left for the next pass).
        """
        if self.dry_run:
            return list(paths), []
        window = (
            claim.delete_window if claim is not None else default_delete_window(self.grace_period)
        )
        deadline = self.started + window / 2
        deleted: list[str] = []
        failures: list[DeleteFailure] = []
        for begin in range(0, len(paths), _DELETE_CHUNK):
            chunk = paths[begin : begin + _DELETE_CHUNK]
            # A zero window (a zero grace period) means no producer may write to this queue
            # (they refuse to start), so nothing is rewritten and there is no deadline.
            if window > 0 and self.clock.monotonic() >= deadline:
                # A producer that rewrote one of these since our listing waits out the whole
                # window before appending it; deleting later could take its fresh copy.
                left = len(paths) - begin
                kept[KeepReason.OUT_OF_TIME] = kept.get(KeepReason.OUT_OF_TIME, 0) + left
                logger.warning(
                    "gc: pass ran past half the delete window (%.1f s); %s deletes left for the "
                    "next pass",
                    window / 2,
                    left,
                )
                break
            chunk_failures = self.store.delete_many(chunk)
            failed = {failure.path for failure in chunk_failures}
            deleted.extend(path for path in chunk if path not in failed)
            failures.extend(chunk_failures)
        for failure in failures:
            logger.warning(
                "gc: could not delete %s (%s); retrying next pass", failure.path, failure.reason
            )
        return deleted, failures
