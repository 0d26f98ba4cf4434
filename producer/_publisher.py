"""Publishing staged data: seal batches and upload them (the committer appends them).

Four kinds of thread share :class:`~millpond.producer._state.State`:

* the **sealer** (``millpond-sealer``) cuts pending records into a batch when they exceed
  ``flush_size_bytes``, when the oldest waited ``flush_interval``, or on ``flush()``; it mints
  the batch's ULID (in publish order) and writes a BIND record — location and WAL range;
* **uploaders** (``millpond-upload-N``, ``upload_concurrency`` of them) encode a v1 batch, make
  sure the BIND record is durable (``fdatasync``, usually already done by a data sync), and
  PUT the batch create-if-absent, retrying until it lands (an "already exists" is our own
  earlier attempt: the ULID is ours) — or, for a batch that must be written again to refresh
  its last-modified time, PUT it unconditionally under the same name;
* the **committer** (``millpond-committer``, :mod:`millpond.producer._committer`) appends every
  uploaded batch at the head of the line in one CAS (group commit) and settles their handles;
* the **WAL releaser** (``millpond-wal-releaser``, :mod:`millpond.producer._releaser`) frees
  the WAL region of what is settled, beside the appends.

A batch keeps the location its BIND record gave it for good: the sink recognises an already
written batch by its location. :mod:`millpond.producer._committer` explains how crashes, an
ambiguous append and a long wait are recovered without ever changing it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

from millpond.common.clock import Clock
from millpond.common.retry import Backoff
from millpond.common.ulids import UlidMinter, batch_location, ulid_time_ms
from millpond.errors import (
    ConflictError,
    FormatError,
    NotFoundError,
    StorageError,
)
from millpond.formats.batch import encode_batch
from millpond.formats.wal import BindBody
from millpond.producer._session import QueueSession
from millpond.producer._state import Batch, BatchState, Interrupted, Staged, State
from millpond.producer.config import ProducerConfig
from millpond.storage.store import ObjectStore
from millpond.wal import Wal

__all__ = ["Sealer", "Uploader", "fail_fatal", "named_at", "pause"]

logger = logging.getLogger(__name__)


def encode_records(wal: Wal, config: ProducerConfig, records: list[Staged]) -> bytes:
    """The v1 batch of ``records``; entries no longer held in memory are read from the WAL."""
    entries: list[bytes | memoryview] = []
    for record in records:
        held = record.entries
        entries.extend(held if held is not None else wal.read_entries(record.ref))
    return encode_batch(entries, config.compression)


def fail_fatal(state: State, who: str) -> Callable[[BaseException], None]:
    """The ``on_error`` of the producer's thread ``who``: whatever ended it stops the producer,
    but for :class:`Interrupted` (a wait that ``close()`` cut short: the thread just ends)."""

    def failed(err: BaseException) -> None:
        if isinstance(err, Interrupted):
            return
        logger.error("%s failed; the producer stops (staged data stays in the WAL): %s", who, err)
        with state.cond:
            state.set_fatal(err)

    return failed


class Sealer:
    """The body of the ``millpond-sealer`` thread."""

    def __init__(self, state: State, wal: Wal, config: ProducerConfig, minter: UlidMinter) -> None:
        self._state = state
        self._config = config
        self._minter = minter
        # Every uploader busy plus two batches encoded and ready: an uploader that finishes a
        # PUT starts the next one at once (double buffering), and memory stays bounded.
        self._max_inflight = config.upload_concurrency + 2
        self._wal = wal

    def run(self) -> None:
        while (batch := self._next_batch()) is not None:
            location, minted_ms = self._bind(batch)
            # Encoded here, off the uploaders' path, so a PUT follows a PUT without a gap.
            try:
                payload = encode_records(self._wal, self._config, batch.records)
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

    def _bind(self, batch: Batch) -> tuple[str, int]:
        """Mint the batch's ULID and write its BIND record; its location and ULID time."""
        ulid = self._minter.mint()
        location = batch_location(self._config.data_path_prefix, ulid)
        body = BindBody(batch.first_seq, batch.last_seq, len(batch.records), location)
        # Not synced here: the uploader syncs before its PUT (see Uploader.run), so sealing
        # never waits behind a large data sync.
        self._wal.append_bind(body)
        return location, ulid_time_ms(ulid)

    def _next_batch(self) -> Batch | None:
        state = self._state
        with state.cond:
            while True:
                if state.stop.is_set() or state.fatal is not None:
                    return None
                delay = self._seal_delay()
                if delay is not None and delay <= 0:
                    break
                state.wait(state.sealer_wake, delay)
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
            if batch.recovered and batch.state is BatchState.UNCERTAIN:
                return None  # replayed batches are resolved and published first
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
        if age < self._config.flush_interval:
            return float(self._config.flush_interval - age)
        # Sealed by age, but not into a small object under load: the batch keeps filling while
        # every uploader is busy (it would only queue for one; each wakes the sealer when its
        # upload lands) and while calls already accepted but still on their way into the WAL
        # would fill it (they are staged at disk speed, and the stager wakes the sealer) —
        # unless the WAL writer waits for space, which only publishing what is pending frees.
        if unsent >= self._config.upload_concurrency:
            return None
        if not state.writer_waiting_for_space and self._unstaged_fill_it():
            return None
        return 0

    def _unstaged_fill_it(self) -> bool:
        """Whether calls accepted but not yet staged would fill the pending batch."""
        state = self._state
        missing = self._config.flush_size_bytes - state.pending_bytes - state.staging_bytes
        inbox = itertools.accumulate((item.nbytes for item in state.inbox), initial=0)
        return any(nbytes >= missing for nbytes in inbox)


class Uploader:
    """The body of one ``millpond-upload-N`` thread."""

    def __init__(
        self,
        state: State,
        wal: Wal,
        config: ProducerConfig,
        store: ObjectStore,
        clock: Clock,
        session: QueueSession,
    ) -> None:
        self._state = state
        self._wal = wal
        self._config = config
        self._store = store
        self._clock = clock
        self._session = session

    def run(self) -> None:
        state = self._state
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
                overwrite = batch.overwrite
                complete = batch.complete
            if overwrite and not complete:
                # Some records this BIND counted were lost with a damaged WAL file: an
                # object that landed before holds them all, and is written back as it is.
                payload = self._existing(batch, location)
            if payload is None:  # replayed, or dropped and re-queued: encode now
                try:
                    payload = encode_records(self._wal, self._config, records)
                except (StorageError, FormatError):
                    if batch.dropped:
                        continue  # its WAL file went with it
                    raise
            if self._config.wal_sync != "off":
                # The BIND record must be durable before the PUT: a replay has to find the
                # same location. Usually a data sync has covered it already (a no-op).
                self._wal.sync()
            times = self._put(batch, location, payload, overwrite=overwrite)
            if times is None:
                continue
            uploaded_at, landed_at = times
            with state.cond:
                if batch.dropped:
                    continue
                batch.uploaded_at = uploaded_at
                batch.ready_at = landed_at
                if overwrite:
                    # A collector that listed the old copy may still delete this one until
                    # its delete window has passed: appending before then could leave the
                    # entry pointing at nothing.
                    batch.overwrite = False
                    batch.settle_until = landed_at + self._session.delete_window
                batch.state = BatchState.UPLOADED
                batch.payload = None  # its records hold no entries since sealing (or replay)
                state.committer_wake.notify()
                state.sealer_wake.notify()  # one fewer batch in flight

    def _put(
        self, batch: Batch, location: str, payload: bytes, *, overwrite: bool
    ) -> tuple[float, float] | None:
        """PUT until it lands; ``(uploaded_at, landed_at)``, or None when dropped meanwhile.

        ``uploaded_at`` is no later than the object's last-modified time: the start of this
        round, or, when the object was already there, no later than the batch was named.
        """
        state = self._state
        clock = self._clock
        backoff = self._config.retry.start(clock)
        started = clock.monotonic()
        existed = False
        while not batch.dropped:
            try:
                if overwrite:
                    self._store.put(location, payload)
                else:
                    self._store.put_if_absent(location, payload)
            except ConflictError:
                existed = True  # our own earlier attempt (or a replay's): the ULID is ours
            except StorageError as err:
                state.counters.add("put_retries")
                backoff = pause(backoff, self._config, clock, f"PUT {location}", err)
                continue
            state.counters.add("uploads")
            state.counters.add("bytes_uploaded", len(payload))
            uploaded_at = min(started, named_at(batch, clock)) if existed else started
            return uploaded_at, clock.monotonic()
        return None

    def _existing(self, batch: Batch, location: str) -> bytes | None:
        """The object's bytes if it is there (read with retries), else ``None``."""
        backoff = self._config.retry.start(self._clock)
        while not batch.dropped:
            try:
                return self._store.get(location).data
            except NotFoundError:
                return None
            except StorageError as err:
                backoff = pause(backoff, self._config, self._clock, f"GET {location}", err)
        return None


def named_at(batch: Batch, clock: Clock) -> float:
    """When the batch was named, on the monotonic clock, from the wall time in its ULID.

    A wall clock that stands before the name (it was stepped back) gives minus infinity: the
    batch is then treated as old, which only costs a re-upload.
    """
    age_ms = clock.now_ms() - batch.minted_ms
    if age_ms < 0:
        return float("-inf")
    return clock.monotonic() - age_ms / 1000


def pause(
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
