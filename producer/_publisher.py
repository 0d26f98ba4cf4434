"""Publishing staged data: seal batches, upload them, append them to the manifest, release.

Three kinds of thread share :class:`~millpond.producer._state.State`:

* the **sealer** (``millpond-sealer``) cuts pending records into a batch when they exceed
  ``flush_size_bytes``, when the oldest waited ``flush_interval``, or on ``flush()``; it mints
  the batch's ULID (in publish order) and writes a BIND record — location and WAL range;
* **uploaders** (``millpond-upload-N``, ``upload_concurrency`` of them) encode a v1 batch, make
  sure the BIND record is durable (``fdatasync``, usually already done by a data sync), and
  PUT the batch create-if-absent, retrying until it lands (an "already exists" is our own
  earlier attempt: the ULID is ours);
* the **committer** (``millpond-committer``) appends every uploaded batch at the head of the
  line in one CAS (group commit), settles their handles, and releases their WAL region.

Crash-replay idempotency. Because the BIND record is durable before the PUT, a restarted
producer knows each batch's location. It looks for that location in the manifest before doing
anything else: found means the crash fell between the manifest append and the WAL release, and
the batch is only released; not found means it is uploaded again to the *same* location (the
object, if it landed, holds the same bytes) and appended. The same look happens after any
append that failed ambiguously. One window remains: the append landed, and before the
restarted producer read the manifest the consumer had already dequeued the entry. The
producer cannot see it and appends the location a second time; the consumer's sink records
each batch location with its rows and skips a location it has already written, so the batch
reaches the database once.

A batch whose ULID is older than ``remint_after`` and is still not in the manifest gets a
fresh ULID (a new BIND, a new upload): garbage collection deletes unreferenced batches older
than its grace period, and must never take one that is about to be enqueued.
"""

from __future__ import annotations

import logging

from millpond.common.clock import Clock
from millpond.common.retry import Backoff
from millpond.common.ulids import UlidMinter, batch_location, ulid_time_ms
from millpond.errors import (
    BackpressureError,
    ConflictError,
    FormatError,
    NotFoundError,
    StorageError,
)
from millpond.formats.batch import encode_batch
from millpond.formats.manifest import empty_manifest, find_locations
from millpond.formats.wal import BindBody
from millpond.producer._state import Batch, BatchState, Interrupted, Staged, State
from millpond.producer.config import ProducerConfig
from millpond.queue import QueueProducer
from millpond.storage.store import ObjectStore
from millpond.wal import Wal

__all__ = ["Committer", "Sealer", "Uploader"]

logger = logging.getLogger(__name__)

_MAX_GROUP = 256  # batches per manifest append


class _Binder:
    """Mints a ULID and writes the binding to the WAL (shared by sealer and committer).

    The uploader makes it durable before the PUT.
    """

    def __init__(self, wal: Wal, config: ProducerConfig, minter: UlidMinter) -> None:
        self._wal = wal
        self._config = config
        self._minter = minter

    def bind(self, batch: Batch) -> tuple[str, int]:
        ulid = self._minter.mint()
        location = batch_location(self._config.data_path_prefix, ulid)
        body = BindBody(batch.first_seq, batch.last_seq, len(batch.records), location)
        # Not synced here: the uploader syncs before its PUT (see Uploader.run), so sealing
        # never waits behind a large data sync.
        self._wal.append_bind(body)
        return location, ulid_time_ms(ulid)


def _encode(wal: Wal, config: ProducerConfig, records: list[Staged]) -> bytes:
    """The v1 batch of ``records``; entries no longer held in memory are read from the WAL."""
    entries: list[bytes | memoryview] = []
    for record in records:
        held = record.entries
        entries.extend(held if held is not None else wal.read_entries(record.ref))
    payload: bytes = encode_batch(entries, config.compression)
    return payload


def _fail_fatal(state: State, err: BaseException, who: str) -> None:
    logger.error("%s failed; the producer stops (staged data stays in the WAL): %s", who, err)
    with state.cond:
        state.set_fatal(err)


class Sealer:
    """The body of the ``millpond-sealer`` thread."""

    def __init__(self, state: State, wal: Wal, config: ProducerConfig, binder: _Binder) -> None:
        self._state = state
        self._config = config
        self._binder = binder
        # Every uploader busy plus two batches encoded and ready: an uploader that finishes a
        # PUT starts the next one at once (double buffering), and memory stays bounded.
        self._max_inflight = config.upload_concurrency + 2
        self._wal = wal

    def run(self) -> None:
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    return
                location, minted_ms = self._binder.bind(batch)
                # Encoded here, off the uploaders' path, so a PUT follows a PUT without a gap.
                try:
                    payload = _encode(self._wal, self._config, batch.records)
                except (StorageError, FormatError):
                    if not batch.dropped:
                        raise
                    payload = None  # dropped meanwhile: its WAL file went with it
                state = self._state
                with state.cond:
                    batch.location = location
                    batch.minted_ms = minted_ms
                    batch.payload = payload
                    for record in batch.records:
                        state.release_memory(record)  # the payload holds the bytes now
                    if batch.dropped:
                        continue
                    batch.state = BatchState.SEALED
                    state.upload_queue.append(batch)
                    state.counters.add("batches_sealed")
                    state.upload_wake.notify()
        except Interrupted:
            pass
        except BaseException as err:
            _fail_fatal(self._state, err, "sealer")

    def _next_batch(self) -> Batch | None:
        state = self._state
        with state.cond:
            while True:
                if state.stop.is_set() or state.fatal is not None:
                    return None
                delay = self._seal_delay()
                if delay is not None and delay <= 0:
                    break
                state.sealer_wake.wait(delay)
            records: list[Staged] = []
            size = 0
            while state.pending and (not records or size < self._config.flush_size_bytes):
                record = state.pending.popleft()
                records.append(record)
                size += record.nbytes
            state.pending_bytes -= size
            batch = Batch(records)
            state.batches.append(batch)
            return batch

    def _seal_delay(self) -> float | None:
        """0 to seal now, seconds to wait, or None to wait for a notification."""
        state = self._state
        if not state.pending:
            return None
        unsent = 0
        for batch in state.batches:
            if batch.recovered and batch.state in (BatchState.UNCERTAIN, BatchState.REMINT):
                return None  # replayed batches are minted and published first
            if batch.state in (BatchState.BINDING, BatchState.SEALED, BatchState.UPLOADING):
                unsent += 1
        if unsent >= self._max_inflight:
            return None
        if state.pending_bytes >= self._config.flush_size_bytes:
            return 0
        # flush() asked for it: seal now, unless more of what it waits for is still on its
        # way into the WAL; then fill the batch first (one batch per WAL group is wasteful).
        flushing = state.pending[0].ordinal <= state.flush_target
        if flushing and not state.unstaged_through(state.flush_target):
            return 0
        age = state.clock.monotonic() - state.pending[0].staged_at
        return float(self._config.flush_interval - age)


class Uploader:
    """The body of one ``millpond-upload-N`` thread."""

    def __init__(
        self, state: State, wal: Wal, config: ProducerConfig, store: ObjectStore, clock: Clock
    ) -> None:
        self._state = state
        self._wal = wal
        self._config = config
        self._store = store
        self._clock = clock

    def run(self) -> None:
        state = self._state
        try:
            while True:
                with state.cond:
                    while not state.upload_queue:
                        if state.stop.is_set() or state.fatal is not None:
                            return
                        state.upload_wake.wait()
                    batch = state.upload_queue.popleft()
                    batch.state = BatchState.UPLOADING
                    location = batch.location
                    records = list(batch.records)
                    payload = batch.payload
                if payload is None:  # replayed, or dropped and re-queued: encode now
                    try:
                        payload = _encode(self._wal, self._config, records)
                    except (StorageError, FormatError):
                        if batch.dropped:
                            continue  # its WAL file went with it
                        raise
                if self._config.wal_sync != "off":
                    # The BIND record must be durable before the PUT: a replay has to find the
                    # same location. Usually a data sync has covered it already (a no-op).
                    self._wal.sync()
                if not self._put(batch, location, payload):
                    continue
                with state.cond:
                    if batch.dropped or batch.location != location:
                        continue
                    batch.uploaded = True
                    batch.state = BatchState.UPLOADED
                    batch.payload = None
                    for record in records:
                        state.release_memory(record)
                    state.committer_wake.notify()
                    state.sealer_wake.notify()  # one fewer batch in flight
        except Interrupted:
            pass
        except BaseException as err:
            _fail_fatal(state, err, "uploader")

    def _put(self, batch: Batch, location: str, payload: bytes) -> bool:
        """PUT until it lands; False when the batch was dropped meanwhile."""
        state = self._state
        backoff = self._config.retry.start(self._clock)
        while True:
            if batch.dropped:
                return False
            try:
                self._store.put_if_absent(location, payload)
            except ConflictError:
                pass  # our own earlier attempt (or a replay's): the ULID is ours
            except StorageError as err:
                state.counters.add("put_retries")
                backoff = _pause(backoff, self._config, self._clock, f"PUT {location}", err)
                continue
            state.counters.add("uploads")
            state.counters.add("bytes_uploaded", len(payload))
            return True


def _pause(
    backoff: Backoff, config: ProducerConfig, clock: Clock, what: str, err: Exception
) -> Backoff:
    """Back off before the next attempt; after a spent round, log and start another."""
    if backoff.sleep():
        logger.debug("%s failed (attempt %s): %s", what, backoff.attempt, err)
        return backoff
    logger.warning(
        "%s still failing after %s attempts (%s); staged data is kept and retried",
        what,
        backoff.attempt,
        err,
    )
    fresh = config.retry.start(clock)
    fresh.sleep()
    return fresh


def _landed_sequences(batches: list[Batch], found: dict[str, int]) -> dict[Batch, int]:
    """Sequences of batches whose ambiguous append landed, inferred from its other batches."""
    landed: dict[Batch, int] = {}
    for batch in batches:
        group = batch.append_group
        if group is None or batch.location in found:
            continue
        for index, other in enumerate(group):
            if other.location in found:
                landed[batch] = found[other.location] - index + group.index(batch)
                break
    return landed


class Committer:
    """The body of the ``millpond-committer`` thread."""

    def __init__(
        self,
        state: State,
        wal: Wal,
        config: ProducerConfig,
        store: ObjectStore,
        queue: QueueProducer,
        binder: _Binder,
        clock: Clock,
    ) -> None:
        self._state = state
        self._wal = wal
        self._config = config
        self._store = store
        self._queue = queue
        self._binder = binder
        self._clock = clock
        self._backoff: Backoff | None = None
        self._last_append = float("-inf")

    def run(self) -> None:
        try:
            while True:
                work = self._next_work()
                if work is None:
                    return
                kind, batches = work
                if kind == "verify":
                    self._verify(batches)
                elif kind == "remint":
                    self._remint(batches[0])
                else:
                    self._append(batches)
        except Interrupted:
            pass
        except BaseException as err:
            _fail_fatal(self._state, err, "committer")

    def _next_work(self) -> tuple[str, list[Batch]] | None:
        state = self._state
        with state.cond:
            while True:
                if state.stop.is_set() or state.fatal is not None:
                    return None
                for batch in state.batches:
                    if batch.state is BatchState.REMINT:
                        return "remint", [batch]
                if state.batches:
                    head = state.batches[0]
                    if head.state is BatchState.UNCERTAIN:
                        group = []
                        for batch in state.batches:
                            if batch.state is not BatchState.UNCERTAIN:
                                break
                            group.append(batch)
                        return "verify", group + state.unsettled
                    if head.state is BatchState.UPLOADED:
                        linger = self._linger(head)
                        if linger > 0:
                            # More uploads may land meanwhile and share this append's CAS.
                            state.committer_wake.wait(linger)
                            continue
                        return self._append_group()
                if state.unsettled:
                    return "verify", list(state.unsettled)
                state.committer_wake.wait()

    def _linger(self, head: Batch) -> float:
        """Seconds to hold an uploaded batch back for ``commit_interval`` (0: append now)."""
        interval = self._config.commit_interval
        state = self._state
        if interval <= 0 or state.closing:
            return 0.0
        if head.records[0].ordinal <= state.flush_target:
            # flush() does not wait out the interval, but appends what it flushes in as few
            # CAS as the uploads allow: it cannot finish before its last upload anyway.
            return interval if self._flush_uploads_pending() else 0.0
        return self._last_append + interval - self._clock.monotonic()

    def _flush_uploads_pending(self) -> bool:
        in_flight = (BatchState.BINDING, BatchState.SEALED, BatchState.UPLOADING)
        target = self._state.flush_target
        return any(
            batch.state in in_flight and batch.records[0].ordinal <= target
            for batch in self._state.batches
        )

    def _append_group(self) -> tuple[str, list[Batch]]:
        group: list[Batch] = []
        for batch in self._state.batches:
            if batch.state is not BatchState.UPLOADED or len(group) == _MAX_GROUP:
                break
            if self._stale(batch):
                if not group:
                    batch.state = BatchState.REMINT
                    return "remint", [batch]
                break
            group.append(batch)
        for batch in group:
            batch.state = BatchState.APPENDING
        return "append", group

    def _stale(self, batch: Batch) -> bool:
        age_ms = int(self._state.clock.now_ms()) - batch.minted_ms
        return bool(age_ms > self._config.remint_after * 1000)

    # -- the three kinds of work ----------------------------------------------------------

    def _append(self, group: list[Batch]) -> None:
        self._last_append = self._clock.monotonic()
        state = self._state
        try:
            sequences = self._queue.append([batch.pending_entry() for batch in group])
        except (StorageError, Interrupted) as err:
            with state.cond:
                for batch in group:
                    batch.state = BatchState.UNCERTAIN
                    batch.append_group = group
                state.space.notify_all()  # drop_oldest may now drop them
            if isinstance(err, Interrupted):
                raise
            logger.warning(
                "manifest append of %s batches failed (%s); checking the manifest before retrying",
                len(group),
                err,
            )
            self._pause("manifest append", err)
            return
        self._backoff = None
        with state.cond:
            state.counters.add("manifest_appends")
            for batch, sequence in zip(group, sequences, strict=True):
                state.batches.remove(batch)
                self._settle_committed(batch, sequence, batch.location)
        self._release()

    def _verify(self, batches: list[Batch]) -> None:
        state = self._state
        locations = {location for batch in batches for location in batch.locations}
        try:
            try:
                raw = self._store.get(self._config.manifest_path).data
            except NotFoundError:
                raw = empty_manifest()
            state.counters.add("manifest_reads")
            found = find_locations(raw, locations)
        except StorageError as err:
            self._pause("manifest read", err)
            return
        self._backoff = None
        with state.cond:
            landed = _landed_sequences(batches, found)
            for batch in batches:
                hit = next((loc for loc in reversed(batch.locations) if loc in found), None)
                if hit is None and batch in landed:
                    # Another batch of the same append is in the manifest: this one landed
                    # too, and the consumer has already dequeued it.
                    self._settle_dequeued(batch, landed[batch])
                elif hit is not None:
                    if batch.dropped:
                        state.unsettled.remove(batch)
                        logger.info("dropped batch %s had landed after all", hit)
                    else:
                        state.batches.remove(batch)
                    self._settle_committed(batch, found[hit], hit)
                    batch.append_group = None
                elif batch.dropped:
                    state.unsettled.remove(batch)
                    self._count_unsettled_drop(batch)
                elif batch.uploaded and not self._stale(batch):
                    batch.state = BatchState.UPLOADED
                elif batch.reusable and not self._stale(batch):
                    batch.state = BatchState.SEALED
                    if batch is state.batches[0]:
                        state.upload_queue.appendleft(batch)
                    else:
                        state.upload_queue.append(batch)
                else:
                    batch.state = BatchState.REMINT
            state.upload_wake.notify_all()
            state.sealer_wake.notify_all()  # replayed batches resolved: new ones may follow
        self._release()

    def _remint(self, batch: Batch) -> None:
        state = self._state
        old = batch.location
        location, minted_ms = self._binder.bind(batch)
        with state.cond:
            if batch.dropped:
                return
            if old:
                batch.prior_locations.append(old)
            batch.location = location
            batch.minted_ms = minted_ms
            batch.uploaded = False
            batch.reusable = True
            batch.state = BatchState.SEALED
            if state.batches and batch is state.batches[0]:
                state.upload_queue.appendleft(batch)
            else:
                state.upload_queue.append(batch)
            state.counters.add("batches_reminted")
            state.upload_wake.notify_all()
        logger.info("batch %s re-minted as %s", old or "(replayed)", location)

    # -- helpers --------------------------------------------------------------------------

    def _settle_committed(self, batch: Batch, sequence: int, location: str) -> None:
        state = self._state
        state.counters.add("batches_committed")
        state.counters.add("entries_committed", batch.entry_count)
        state.settle_durable(batch, sequence, location)

    def _settle_dequeued(self, batch: Batch, sequence: int) -> None:
        state = self._state
        if batch.dropped:
            state.unsettled.remove(batch)
        else:
            state.batches.remove(batch)
        batch.append_group = None
        self._settle_committed(batch, sequence, batch.location)

    def _count_unsettled_drop(self, batch: Batch) -> None:
        state = self._state
        entries = batch.entry_count
        state.counters.add("batches_dropped")
        state.counters.add("records_dropped", len(batch.records))
        state.counters.add("entries_dropped", entries)
        logger.warning(
            "drop_oldest: batch %s (%s entries) was dropped and is not in the manifest",
            batch.location,
            entries,
        )
        state.settle_failed(
            batch.records,
            BackpressureError(
                "dropped by size_cap_policy='drop_oldest': the WAL reached wal_max_bytes "
                "before these entries were published"
            ),
        )

    def _release(self) -> None:
        state = self._state
        with state.cond:
            watermark = state.watermark(self._wal.next_seq)
        self._wal.release(watermark)
        with state.cond:
            state.space.notify_all()  # the WAL writer may be waiting for space

    def _pause(self, what: str, err: Exception) -> None:
        if self._backoff is None:
            self._backoff = self._config.retry.start(self._clock)
        self._backoff = _pause(self._backoff, self._config, self._clock, what, err)
