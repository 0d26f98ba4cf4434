"""Staging: moving accepted ``produce()`` calls into the WAL, with group commit.

Two threads. The WAL writer (``millpond-wal-writer``) takes every call waiting in the inbox and
appends them in one write; the syncer (``millpond-wal-syncer``) makes everything written so far
durable with one ``fdatasync`` (``wal_sync="always"``) and only then marks the handles staged.
While the syncer waits for the disk, the writer already writes the next group — at most one
group ahead, so a stalled disk fills the inbox and pushes back on ``produce()``.

When the WAL is at ``wal_max_bytes`` the writer waits for the publisher to release space
(``backpressure``: the inbox fills and ``produce()`` blocks), or, under ``drop_oldest``, drops
the oldest staged data: whole batches, or the pending records of the oldest WAL file, and
never a batch whose manifest append is in flight (its outcome would make the count inexact).
Dropped data is recorded in the WAL (a DROP record) before its space is released, and every
dropped ``produce()`` call is counted and failed with ``BackpressureError``. A batch dropped
after an ambiguous append is settled later, by looking in the manifest.
"""

from __future__ import annotations

import logging

from millpond.errors import ClosedError
from millpond.formats.wal import DropBody
from millpond.producer._state import (
    Batch,
    BatchState,
    Input,
    Interrupted,
    Staged,
    State,
    Written,
)
from millpond.producer.config import ProducerConfig
from millpond.wal import Wal

__all__ = ["WalWriter"]

logger = logging.getLogger(__name__)

_SPACE_POLL = 0.1  # seconds; a safety net, releases notify the condition anyway
_GROUP_BYTES = 8 << 20  # at most this much is written per WAL group (one fdatasync)


class WalWriter:
    """The bodies of the ``millpond-wal-writer`` and ``millpond-wal-syncer`` threads.

    The writer encodes and writes groups; the syncer makes them durable and marks them
    staged. While the syncer waits for the disk, the writer already writes the next group, so
    a group costs max(encode + write, fdatasync) rather than their sum; one ``fdatasync``
    covers every group written before it started.
    """

    def __init__(self, state: State, wal: Wal, config: ProducerConfig) -> None:
        self._state = state
        self._wal = wal
        self._config = config
        # Bounded so that one sync never takes long: sealing and BIND syncs queue behind it.
        self._group_limit = max(1, min(config.rotate_bytes // 2, _GROUP_BYTES))
        self._dirty = False
        self._last_sync = state.clock.monotonic()
        self._floor = 0

    def run(self) -> None:
        state = self._state
        # The group taken from the inbox and not yet handed to the syncer: on a failure its
        # calls are in neither place, and only this thread can fail them.
        group: list[Input] | None = None
        try:
            while (group := self._take_group()) is not None:
                needed = sum(i.record_size for i in group)
                if not self._make_room(needed):
                    error = ClosedError(
                        "producer closed while the WAL was full; these entries were never staged"
                    )
                    with state.cond:
                        self._fail_group(group, self._floor, error)
                    group = None
                    continue
                placed = self._wal.append_data(
                    [(i.ingestion_time_ms, i.metadata, i.entries) for i in group]
                )
                with state.cond:
                    if state.fatal is not None:
                        # Another thread stopped the producer during the write: the syncer
                        # may be gone, and nothing staged now would be published. The
                        # records stay in the WAL for the next producer on it.
                        self._fail_group(group, self._floor, state.fatal)
                        group = None
                        continue
                    state.written.append((group, placed, self._floor))
                    group = None
                    state.syncer_wake.notify()
        except Interrupted:
            pass
        except BaseException as err:
            logger.exception("WAL writer failed; the producer stops accepting entries")
            with state.cond:
                if group is not None:
                    self._fail_group(group, self._floor, err)
                state.set_fatal(err)
        finally:
            with state.cond:
                state.writer_done = True
                state.syncer_wake.notify_all()

    def run_syncer(self) -> None:
        state = self._state
        # Groups taken from ``state.written`` and not yet staged: as in :meth:`run`.
        written: list[Written] | None = None
        try:
            while (written := self._take_written()) is not None:
                if self._config.wal_sync == "always":
                    self._sync()
                elif self._config.wal_sync == "interval":
                    self._dirty = self._dirty or bool(written)
                    elapsed = state.clock.monotonic() - self._last_sync
                    if self._dirty and elapsed >= self._config.wal_sync_interval:
                        self._sync()
                if written:
                    self._stage(written)
                written = None
            if self._dirty:
                self._sync()
        except BaseException as err:
            logger.exception("WAL sync failed; the producer stops accepting entries")
            with state.cond:
                for group, _, floor in written or ():
                    self._fail_group(group, floor, err)
                state.set_fatal(err)

    # -- one group ------------------------------------------------------------------------

    def _take_group(self) -> list[Input] | None:
        """The next group to write; ``None`` to stop."""
        state = self._state
        with state.cond:
            # One group may wait for the next sync while another syncs; more would let a
            # stalled disk drain the inbox into memory without ever pushing back.
            while not state.inbox or state.written:
                if state.fatal is not None:
                    return None
                if not state.inbox and (state.stop.is_set() or state.closing):
                    return None
                state.writer_wake.wait()
            group = [state.inbox.popleft()]
            size = group[0].record_size
            while state.inbox and size + state.inbox[0].record_size <= self._group_limit:
                item = state.inbox.popleft()
                group.append(item)
                size += item.record_size
            # Records of this group are not in ``pending`` until they are durable; the floor
            # keeps a concurrent release from passing them.
            self._floor = self._wal.next_seq
            state.unstaged_floors.append(self._floor)
            state.staging_bytes += sum(item.nbytes for item in group)
            state.room.notify(len(group))  # produce() calls waiting for inbox room
            return group

    def _take_written(self) -> list[Written] | None:
        """Groups written since the last call; ``[]`` when only an interval sync is due."""
        state = self._state
        with state.cond:
            while not state.written:
                if state.writer_done or state.fatal is not None:
                    return None
                timeout = None
                if self._dirty:
                    timeout = self._config.wal_sync_interval - (
                        state.clock.monotonic() - self._last_sync
                    )
                    if timeout <= 0:
                        return []
                state.syncer_wake.wait(timeout)
            written = list(state.written)
            state.written.clear()
            state.writer_wake.notify()  # the writer may write the next group now
            return written

    def _stage(self, written: list[Written]) -> None:
        state = self._state
        now = state.clock.monotonic()
        with state.cond:
            if state.fatal is not None:
                # Stopped while these were syncing (in neither list the stop failed): staged
                # now, for the next producer on the WAL, but this one publishes nothing more.
                for group, _placed, floor in written:
                    self._fail_group(group, floor, state.fatal, staged=True)
                return
            for group, placed, floor in written:
                for item, (seq, ref) in zip(group, placed, strict=True):
                    keep = state.mem_bytes + item.nbytes <= state.mem_budget
                    if keep:
                        state.mem_bytes += item.nbytes
                    state.pending.append(
                        Staged(
                            ordinal=item.ordinal,
                            seq=seq,
                            ref=ref,
                            ingestion_time_ms=item.ingestion_time_ms,
                            metadata=item.metadata,
                            entry_count=len(item.entries),
                            nbytes=item.nbytes,
                            entries=item.entries if keep else None,
                            handle=item.handle,
                            staged_at=now,
                        )
                    )
                    state.pending_bytes += item.nbytes
                    item.handle._set_staged()
                state.unstaged_floors.remove(floor)
                state.staging_bytes -= sum(item.nbytes for item in group)
                state.counters.add("records_staged", len(group))
                state.counters.add("bytes_staged", sum(ref.size for _, ref in placed))
            state.sealer_wake.notify()

    def _sync(self) -> None:
        self._wal.sync()
        self._dirty = False
        self._last_sync = self._state.clock.monotonic()
        self._state.counters.add("wal_syncs")

    def _fail_group(
        self, group: list[Input], floor: int, error: BaseException, *, staged: bool = False
    ) -> None:
        """Fail every call of a group that is not staged (``state.cond`` held); ``staged``:
        its records are in the WAL, synced (``wait_staged()`` returns, ``wait()`` raises)."""
        state = self._state
        if floor not in state.unstaged_floors:
            return  # staged already (a failure after the syncer staged it)
        state.unstaged_floors.remove(floor)
        state.staging_bytes -= sum(item.nbytes for item in group)
        for item in group:
            if staged:
                item.handle._set_staged()
            item.handle._set_failed(error)
            state.resolve(item.ordinal)

    # -- the size cap ---------------------------------------------------------------------

    def _make_room(self, needed: int) -> bool:
        """Wait (or drop) until ``needed`` bytes fit under ``wal_max_bytes``; False on stop."""
        state = self._state
        waited = False
        while self._wal.bytes_used + needed > self._config.wal_max_bytes:
            if state.stop.is_set():
                return False
            if self._config.size_cap_policy == "drop_oldest" and self._drop_head():
                continue
            with state.cond:
                if not waited:
                    state.counters.add("backpressure_waits")
                    waited = True
                    state.writer_waiting_for_space = True
                    # Nothing more is staged until an append releases space: the sealer and the
                    # committer stop waiting for more of it.
                    state.sealer_wake.notify()
                    state.committer_wake.notify()
                state.space.wait(_SPACE_POLL)
        if waited:
            with state.cond:
                state.writer_waiting_for_space = False
        return True

    def _drop_head(self) -> bool:
        """Drop the oldest staged unit if it may be dropped; True when something went."""
        state = self._state
        wal = self._wal
        with state.cond:
            if state.batches:
                head = state.batches[0]
                if head.state in (BatchState.BINDING, BatchState.APPENDING):
                    return False  # wait: its outcome decides whether it is lost
                body = DropBody(head.first_seq, head.last_seq)
                self._drop_batch(head)
            elif state.pending:
                oldest_file = state.pending[0].ref.file_no
                records: list[Staged] = []
                while state.pending and state.pending[0].ref.file_no == oldest_file:
                    record = state.pending.popleft()
                    state.pending_bytes -= record.nbytes
                    records.append(record)
                body = DropBody(records[0].seq, records[-1].seq)
                self._count_drop(records, batches=0)
            else:
                return False
        wal.append_drop(body)
        if self._config.wal_sync != "off":
            wal.sync()
        with state.cond:
            watermark = state.watermark(wal.next_seq)
        wal.release(watermark)
        return True

    def _drop_batch(self, batch: Batch) -> None:
        state = self._state
        state.batches.popleft()
        batch.dropped = True
        batch.payload = None
        if batch in state.upload_queue:
            state.upload_queue.remove(batch)
        if batch.state is BatchState.UNCERTAIN:
            # It may have landed: settled (and counted) once the manifest can be read.
            for record in batch.records:
                state.release_memory(record)
            state.unsettled.append(batch)
            logger.warning(
                "drop_oldest: dropped batch %s from the WAL; whether its ambiguous manifest "
                "append landed is checked once the store answers",
                batch.location,
            )
        else:
            self._count_drop(batch.records, batches=1)
        state.committer_wake.notify()
        state.sealer_wake.notify()  # one fewer batch in flight

    def _count_drop(self, records: list[Staged], *, batches: int) -> None:
        state = self._state
        logger.warning(
            "drop_oldest: the WAL is full; dropped %s entries of %s produce() calls",
            sum(r.entry_count for r in records),
            len(records),
        )
        state.fail_dropped(records, batches=batches)
