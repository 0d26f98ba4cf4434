"""The committer: append uploaded batches in order, and recover every way an append can fail.

The body of the ``millpond-committer`` thread. It appends every uploaded batch at the head of
the line in one CAS (group commit), settles their handles and has the WAL releaser
(:mod:`millpond.producer._releaser`) free their WAL region.

**A batch never changes its location.** The consumer's sink records each location it writes
and skips one it has seen, so a batch that may already be in the queue — or may have been in it
and consumed — must come back under the same name, never a new one. Each recovery path keeps it:

* *Crash between the append and the WAL release.* The BIND record is durable before the PUT,
  so a restarted producer knows each batch's location and looks for it in the manifest first
  (:meth:`Committer._verify`): found, the batch is only released; not found, it is uploaded
  again to the same location (the object, if it landed, holds the same records) and appended.
  If the append had landed and the consumer had already dequeued it, the producer cannot see
  it and appends the location a second time: the sink skips it.
* *An append whose outcome is unknown.* The same look, through the writer's
  :meth:`~millpond.queue.append.QueueProducer.landings`: members of the group found in the
  manifest, or provably dequeued, are settled; only a missing suffix (an earlier request for a
  prefix of the group that landed late) is appended again.
* *A batch that waited too long.* Garbage collection may delete an unreferenced object whose
  ULID *and* last-modified time are older than the grace period. A batch whose object was last
  written more than ``reupload_after`` ago (half the queue's grace period) is written again
  under the same name — refreshing its last-modified time — and appended only after the
  collectors' delete window has passed and a HEAD has found it: a collector that listed the old
  copy has finished deleting by then (:mod:`millpond.queue.gc_rules`). A replayed batch is aged
  by the time in its ULID, which is no later than its first upload. Stale batches are written
  again together: when the head of the line needs it, so does every batch behind it that would
  pass ``reupload_after`` before the head's delete window ends (none of them can be appended
  before the head). Each keeps its own window and HEAD; the head waits a little
  (``flush_interval``) for the rest of the group to land, then one pass of HEADs confirms
  whatever has passed its window, and the confirmed batches go into one append. A stale
  backlog of N batches takes one delete window plus N uploads, not N windows.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from functools import partial
from itertools import takewhile
from typing import TypeVar

from millpond.common.clock import Clock
from millpond.common.retry import Backoff
from millpond.common.tasks import BackgroundTask
from millpond.errors import (
    CommitStateUnknownError,
    NotFoundError,
    StorageError,
)
from millpond.formats.manifest import PendingEntry
from millpond.producer._publisher import encode_records, named_at, pause
from millpond.producer._session import QueueSession
from millpond.producer._state import Batch, BatchState, Interrupted, State
from millpond.producer.config import ProducerConfig
from millpond.queue import Appender, LandingStatus
from millpond.storage.store import ObjectStore
from millpond.wal import Wal

__all__ = ["Committer"]

logger = logging.getLogger(__name__)

_MAX_GROUP = 256  # batches per manifest append
_HEADS_AT_ONCE = 16  # HEAD requests in flight when batches written again are confirmed
# Writes of one batch back after a late append: a collector pass that listed the old copy can
# delete one write-back; a pass that starts after the append landed sees the reference.
_WRITE_BACKS = 3
_T = TypeVar("_T")
_I = TypeVar("_I")
_IN_FLIGHT = (BatchState.BINDING, BatchState.SEALED, BatchState.UPLOADING)
_Work = tuple[Callable[[list[Batch]], None], list[Batch]]
"""What the committer does next (verify, confirm or append) and the batches it does it to."""


class Committer:
    """The body of the ``millpond-committer`` thread."""

    def __init__(
        self,
        state: State,
        wal: Wal,
        config: ProducerConfig,
        store: ObjectStore,
        queue: Appender,
        session: QueueSession,
        clock: Clock,
    ) -> None:
        self._state = state
        self._wal = wal
        self._config = config
        self._store = store
        self._queue = queue
        self._session = session
        self._clock = clock
        self._backoff: Backoff | None = None
        self._last_append = float("-inf")

    def run(self) -> None:
        # The queue's claim and timing contract come first: staleness is measured against
        # them, and a queue that refuses this producer must stop it before anything moves.
        if self._session.claim is None:
            self._retrying(f"opening queue {self._config.manifest_path}", self._session.open)
        while (work := self._next_work()) is not None:
            do, batches = work
            do(batches)

    def _next_work(self) -> _Work | None:
        state = self._state
        with state.cond:
            while True:
                if state.stop.is_set() or state.fatal is not None:
                    return None
                if state.batches:
                    head = state.batches[0]
                    if head.state is BatchState.UNCERTAIN:
                        group = list(
                            takewhile(lambda b: b.state is BatchState.UNCERTAIN, state.batches)
                        )
                        return self._verify, group + state.unsettled
                    if head.state is BatchState.UPLOADED:
                        work = self._uploaded_head(head)
                        if isinstance(work, tuple):
                            return work
                        if work > 0:
                            state.wait(state.committer_wake, work)
                        continue
                if state.unsettled:
                    return self._verify, list(state.unsettled)
                state.committer_wake.wait()

    def _uploaded_head(self, head: Batch) -> _Work | float:
        """What to do about an uploaded head of the line: work, or seconds to wait first
        (0: look again at once). Holds ``state.cond``."""
        now = self._clock.monotonic()
        if self._must_rewrite(head, now):
            # None behind the head can be appended before its delete window ends.
            behind = self._stale_behind(now + self._session.delete_window)
            self._refresh([head, *behind])
            return 0.0
        if head.settle_until is not None:
            # Uploads that landed since, already too old when the head's window ends: written
            # again now, to share it (none written with the head is older than the head).
            late = self._stale_behind(head.settle_until)
            if late:
                self._refresh(late)
            wait = self._settle_wait(head, now)
            return (self._confirm, self._settled(now)) if wait <= 0 else wait
        linger = self._linger(head)
        if linger > 0:
            return linger  # more uploads may land meanwhile and share this append's CAS
        return self._append, self._extend_group([], self._state.batches)

    def _linger(self, head: Batch) -> float:
        """Seconds to hold the uploaded head back so more batches share its CAS (0: now).

        Every manifest append is one object-store request on top of each batch's PUT, so
        batches whose uploads land close together go in one append (group commit):

        * While other batches are being uploaded, the head waits for them, at most
          ``flush_interval`` after its own upload landed. A batch with nothing in flight
          behind it (a trickle of small ``produce()`` calls) is appended at once. Through a
          coordinator the head never waits: the coordinator writes many producers' batches
          in one compare-and-swap, so waiting saves no store request, and the batches uploaded
          while one request is out go together in the next.
        * ``flush()`` cannot finish before its last upload anyway: its batches wait until
          all it flushes is uploaded, so it costs as few appends as the uploads allow —
          at most half of ``reupload_after`` (the head is never written again for it)
          and ``_MAX_GROUP`` batches at a time.
        * ``commit_interval`` spaces this producer's appends at least that far apart.
        """
        state = self._state
        if state.closing:
            return 0.0
        now = self._clock.monotonic()
        ready_at = next((t for t in (head.ready_at, head.uploaded_at) if t is not None), now)
        if head.records[0].ordinal <= state.flush_target:
            if self._ready_count() >= _MAX_GROUP or not self._flush_uploads_pending():
                return 0.0
            return ready_at + self._session.reupload_after / 2 - now
        linger = 0.0
        if self._config.commit_interval > 0:
            linger = self._last_append + self._config.commit_interval - now
        if any(b.state in _IN_FLIGHT for b in state.batches) and not self._config.coordinator:
            linger = max(linger, ready_at + self._config.flush_interval - now)
        return linger

    def _ready_count(self) -> int:
        """Uploaded batches at the head of the line (what one append would take)."""
        ready = takewhile(lambda b: b.state is BatchState.UPLOADED, self._state.batches)
        return sum(1 for _ in ready)

    def _flush_uploads_pending(self) -> bool:
        """Whether some of what ``flush()`` waits for is not uploaded yet (staged, pending,
        sealed or uploading)."""
        state = self._state
        if state.writer_waiting_for_space:
            return False  # only an append releases the WAL space the rest needs to be staged
        target = state.flush_target
        if state.unstaged_through(target) or (state.pending and state.pending[0].ordinal <= target):
            return True
        return any(
            batch.state in _IN_FLIGHT and batch.records[0].ordinal <= target
            for batch in state.batches
        )

    def _extend_group(
        self,
        group: list[Batch],
        candidates: Iterable[Batch],
        *,
        uploaded_since: float | None = None,
    ) -> list[Batch]:
        """Take the uploaded batches of ``candidates`` into ``group`` until one is not ready
        (or, with ``uploaded_since``, was uploaded before it); returns those taken (holding
        ``state.cond``)."""
        start = len(group)
        for batch in candidates:
            if (
                batch.state is not BatchState.UPLOADED
                or len(group) == _MAX_GROUP
                or batch.settle_until is not None
                or self._stale_by(batch, self._clock.monotonic())
                or (
                    uploaded_since is not None
                    and (batch.uploaded_at is None or batch.uploaded_at < uploaded_since)
                )
            ):
                break
            batch.state = BatchState.APPENDING
            group.append(batch)
        return group[start:]

    def _more(self, group: list[Batch], oldest: float) -> Callable[[], list[PendingEntry]]:
        """What a lost race adds to the append: the batches uploaded meanwhile right behind
        ``group`` (which grows with them, so the result and every error still line up), none
        uploaded before ``oldest`` (the append's deadline was set by it)."""

        def more() -> list[PendingEntry]:
            state = self._state
            with state.cond:
                if not group or group[-1] not in state.batches:
                    return []
                behind = state.batches.index(group[-1]) + 1
                taken = self._extend_group(
                    group, itertools.islice(state.batches, behind, None), uploaded_since=oldest
                )
            return [batch.pending_entry() for batch in taken]

        return more

    def _stale_by(self, batch: Batch, moment: float) -> bool:
        """Whether the batch's object may have been written more than ``reupload_after``
        before ``moment`` (a monotonic time)."""
        uploaded_at = batch.uploaded_at
        return uploaded_at is None or moment - uploaded_at > self._session.reupload_after

    def _must_rewrite(self, head: Batch, now: float) -> bool:
        """Whether the head must be written again before it can be appended: it is stale now,
        or will be when the delete window it waits out ends (waiting would be in vain)."""
        settle_until = head.settle_until
        return self._stale_by(head, now if settle_until is None else max(now, settle_until))

    def _stale_behind(self, moment: float) -> list[Batch]:
        """The uploaded batches behind the head that would be stale at ``moment``: written
        again with the head, they wait out one delete window together (holding
        ``state.cond``)."""
        return [
            batch
            for batch in itertools.islice(self._state.batches, 1, None)
            if batch.state is BatchState.UPLOADED and self._stale_by(batch, moment)
        ]

    def _settle_wait(self, head: Batch, now: float) -> float:
        """Seconds before the HEAD pass that confirms the head after its delete window.

        The head waits for its own window, then up to ``flush_interval`` more for the batches
        written again with it that are still uploading or in their window, so one pass of HEADs
        and one append take the whole group.
        """
        assert head.settle_until is not None
        wait = head.settle_until - now
        if wait > 0:
            return wait
        group_end = self._refresh_group_end(head)
        if group_end is None:
            return 0.0
        return min(group_end, head.settle_until + self._config.flush_interval) - now

    def _refresh_group_end(self, head: Batch) -> float | None:
        """When the last window of the refreshed batches right behind the head ends (infinity
        while one is still uploading; ``None`` when none is pending)."""
        end: float | None = None
        for batch in itertools.islice(self._state.batches, 1, _MAX_GROUP):
            if batch.settle_until is not None and batch.state is BatchState.UPLOADED:
                moment = batch.settle_until
            elif batch.overwrite and batch.state in _IN_FLIGHT:
                moment = float("inf")
            else:
                break
            end = moment if end is None else max(end, moment)
        return end

    def _settled(self, now: float) -> list[Batch]:
        """Every uploaded batch whose delete window after its rewrite has passed, in line
        order: one pass of HEADs confirms them (holding ``state.cond``)."""
        return [
            batch
            for batch in self._state.batches
            if batch.state is BatchState.UPLOADED
            and batch.settle_until is not None
            and batch.settle_until <= now
        ]

    def _refresh(self, batches: list[Batch]) -> None:
        """Queue the batches to be written again under their names, ahead of every other
        upload and in line order (holding ``state.cond``)."""
        state = self._state
        for batch in batches:
            batch.overwrite = True
            batch.settle_until = None
            batch.state = BatchState.SEALED
        state.upload_queue.extendleft(reversed(batches))
        state.counters.add("batches_refreshed", len(batches))
        state.upload_wake.notify_all()
        logger.info(
            "%s batches (%s first) waited longer than reupload_after (%.0f s) for their append, "
            "or would before it; writing them again under the same names, then appending them "
            "once the delete window (%.1f s) has passed",
            len(batches),
            batches[0].location,
            self._session.reupload_after,
            self._session.delete_window,
        )

    # -- the three kinds of work ----------------------------------------------------------

    def _append(self, group: list[Batch]) -> None:
        self._last_append = self._clock.monotonic()
        state = self._state
        # No write of the group is sent once its oldest object may be near the GC's reach
        # (a producer paused or retrying that long): it is written again first (_refresh).
        oldest = min(b.uploaded_at if b.uploaded_at is not None else 0.0 for b in group)
        deadline = oldest + self._session.reupload_after
        try:
            sequences = self._queue.append(
                [batch.pending_entry() for batch in group],
                more=self._more(group, oldest),
                deadline=deadline,
            )
        except CommitStateUnknownError as err:
            self._after_unknown_append(group, err)
            self._pause("manifest append", err)
            return
        except StorageError as err:
            # Nothing could have landed (no write was ever in doubt): append them again.
            with state.cond:
                for batch in group:
                    batch.state = BatchState.UPLOADED
                state.space.notify_all()
            logger.warning("manifest append of %s batches failed (%s); retrying", len(group), err)
            self._pause("manifest append", err)
            return
        except Interrupted:
            with state.cond:
                self._mark_uncertain(group, 0)
            raise
        self._backoff = None
        state.append_latency.observe(self._clock.monotonic() - self._last_append)
        if self._clock.monotonic() >= deadline:
            self._write_back(group)
        with state.cond:
            state.counters.add("manifest_appends")
            for batch, sequence in zip(group, sequences, strict=True):
                self._settle_landed(batch, sequence)
        self._release()

    def _write_back(self, group: list[Batch]) -> None:
        """The append was sent before its deadline but answered after it: it may have landed
        after a collector took objects it names (the request was in flight longer than the
        grace period allows for). Write every object of it that is gone back under its name,
        from the WAL, which still holds the records; then wait out the collectors' delete
        window (a pass that listed the old copy may still delete the new one) and look again.
        """
        for batch in group:
            for written_back in range(_WRITE_BACKS + 1):
                if self._retrying(f"HEAD {batch.location}", partial(self._head, batch.location)):
                    break
                if written_back == _WRITE_BACKS or not batch.complete:
                    logger.error(
                        "batch %s is gone after a late append (written back %s times; WAL "
                        "complete: %s): the entry names nothing",
                        batch.location,
                        written_back,
                        batch.complete,
                    )
                    break
                logger.warning(
                    "batch %s is gone after its append landed late; writing it back",
                    batch.location,
                )
                payload = encode_records(self._wal, self._config, list(batch.records))
                self._retrying(
                    f"PUT {batch.location}", partial(self._store.put, batch.location, payload)
                )
                self._clock.sleep(self._session.delete_window)

    def _retrying(self, what: str, call: Callable[[], _T]) -> _T:
        """``call()``, retried on store errors for as long as it fails (the data is kept)."""
        backoff = self._config.retry.start(self._clock)
        while True:
            try:
                return call()
            except StorageError as err:
                backoff = pause(backoff, self._config, self._clock, what, err)

    def _after_unknown_append(self, group: list[Batch], err: CommitStateUnknownError) -> None:
        """Settle what the append knows landed; the rest is looked for before anything else."""
        state = self._state
        known = err.sequences or (None,) * len(group)
        with state.cond:
            rest: list[Batch] = []
            for batch, sequence in zip(group, known, strict=True):
                if sequence is not None:
                    self._settle_landed(batch, sequence)
                else:
                    rest.append(batch)
            self._mark_uncertain(rest, err.maybe_landed_from or 0)
        logger.warning(
            "manifest append of %s batches may or may not have landed (%s); checking the "
            "manifest before retrying",
            len(rest),
            err,
        )
        self._release()

    def _mark_uncertain(self, group: list[Batch], from_sequence: int) -> None:
        for batch in group:
            batch.state = BatchState.UNCERTAIN
            batch.append_group = group
            batch.append_from = from_sequence
        self._state.space.notify_all()  # drop_oldest may now drop them

    def _confirm(self, batches: list[Batch]) -> None:
        """After writing objects again and waiting out their delete window: are they there?
        One HEAD each, ``_HEADS_AT_ONCE`` at a time; a batch that vanished is written again,
        one the store did not answer for waits for the next pass."""
        answers = _in_parallel(self._look, batches, _HEADS_AT_ONCE)
        failed = next((err for err in answers if isinstance(err, StorageError)), None)
        if failed is None:
            self._backoff = None
        with self._state.cond:
            vanished = []
            for batch, found in zip(batches, answers, strict=True):
                if batch.dropped or batch.settle_until is None or not isinstance(found, bool):
                    continue
                if found:
                    batch.settle_until = None
                else:
                    # A collector working from a listing older than our write took it: again.
                    logger.warning("batch %s vanished after it was written again", batch.location)
                    vanished.append(batch)
            if vanished:
                self._refresh(vanished)
            self._state.committer_wake.notify()
        if failed is not None:
            self._pause("HEAD of batches written again", failed)

    def _look(self, batch: Batch) -> bool | StorageError:
        """Whether the batch's object is there (the store's error when it did not answer)."""
        try:
            return self._head(batch.location)
        except StorageError as err:
            return err

    def _head(self, location: str) -> bool:
        """Whether the object is there (``StorageError`` when the store did not answer)."""
        try:
            self._store.head(location)
        except NotFoundError:
            return False
        return True

    def _verify(self, batches: list[Batch]) -> None:
        state = self._state
        try:
            # The run before may have died with a manifest write in flight (``recovered``).
            found = self._queue.landings(recovered=any(batch.recovered for batch in batches))
            state.counters.add("manifest_reads")
        except StorageError as err:
            self._pause("manifest read", err)
            return
        self._backoff = None
        with state.cond:
            for group in _groups(batches):
                first = group[0]
                if len(group) == 1 and first.prior_locations:  # bound again by an older version
                    landing = found.of_any(first.locations)
                else:
                    landing = found.of([b.location for b in group], from_sequence=first.append_from)
                for batch, sequence in zip(group, landing.sequences, strict=True):
                    if sequence is not None:
                        batch.location = landing.location or batch.location
                        self._settle_landed(batch, sequence)
                    else:
                        self._not_landed(batch, landing.status)
            state.upload_wake.notify_all()
            state.sealer_wake.notify_all()  # replayed batches resolved: new ones may follow
        self._release()

    def _settle_landed(self, batch: Batch, sequence: int) -> None:
        """Settle a batch the manifest holds at ``sequence`` (holding ``state.cond``)."""
        state = self._state
        if batch.dropped:
            state.unsettled.remove(batch)
            logger.info("dropped batch %s had landed after all", batch.location)
        else:
            state.batches.remove(batch)
        batch.append_group = None
        state.counters.add("batches_committed")
        state.counters.add("entries_committed", batch.entry_count)
        state.settle_durable(batch, sequence)

    def _not_landed(self, batch: Batch, status: LandingStatus) -> None:
        state = self._state
        batch.append_group = None
        batch.append_from = 0
        if batch.dropped:
            state.unsettled.remove(batch)
            logger.warning(
                "drop_oldest: batch %s (%s entries) was dropped and is not in the manifest%s",
                batch.location,
                batch.entry_count,
                " (it may have been appended and consumed)"
                if status is LandingStatus.UNKNOWN
                else "",
            )
            state.fail_dropped(batch.records, batches=1)
        elif batch.uploaded_at is not None:
            batch.state = BatchState.UPLOADED  # the committer refreshes it if it waited long
        else:
            # Replayed and not in the queue: upload it (again) under its bound name, writing it
            # over any old copy if its name says it may be old enough for GC.
            limit = self._session.reupload_after
            batch.overwrite = self._clock.monotonic() - named_at(batch, self._clock) > limit
            if batch.overwrite:
                state.counters.add("batches_refreshed")
            batch.state = BatchState.SEALED
            if batch is state.batches[0]:
                state.upload_queue.appendleft(batch)
            else:
                state.upload_queue.append(batch)

    # -- helpers --------------------------------------------------------------------------

    def _release(self) -> None:
        """Have the WAL releaser free what is settled (:mod:`millpond.producer._releaser`)."""
        state = self._state
        with state.cond:
            state.release_owed = True
            state.release_wake.notify()

    def _pause(self, what: str, err: Exception) -> None:
        if self._backoff is None:
            self._backoff = self._config.retry.start(self._clock)
        self._backoff = pause(self._backoff, self._config, self._clock, what, err)


def _groups(batches: list[Batch]) -> list[list[Batch]]:
    """The batches to verify, as the append groups they were in (singletons otherwise)."""
    groups: list[list[Batch]] = []
    seen: set[int] = set()
    for batch in batches:
        group = batch.append_group
        if group is None:
            groups.append([batch])
        elif id(group) not in seen:
            seen.add(id(group))
            groups.append([member for member in group if member in batches])
    return groups


def _in_parallel(call: Callable[[_I], _T], items: list[_I], width: int) -> list[_T]:
    """``[call(item) for item in items]``, ``width`` calls at a time, on daemon threads (a
    store call that hangs must not keep the process from exiting, as on the committer's own);
    the first exception a call raised is raised here."""
    if len(items) <= 1:
        return [call(item) for item in items]
    results: dict[int, _T] = {}
    errors: list[BaseException] = []
    work = iter(enumerate(items))
    lock = threading.Lock()

    def worker() -> None:
        while not errors:
            with lock:
                job = next(work, None)
            if job is None:
                return
            results[job[0]] = call(job[1])

    workers = [
        BackgroundTask("millpond-committer-head", worker, on_error=errors.append).start()
        for _ in range(min(width, len(items)))
    ]
    for task in workers:
        task.join()
    if errors:
        raise errors[0]
    return [results[index] for index in range(len(items))]
