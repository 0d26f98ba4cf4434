"""The RFC's queue producer: appends a group of batch locations in one compare-and-swap.

Ambiguous writes. A write that failed on the wire, or a precondition failure on a request
obstore retried, may mean our own write landed. Before appending again, the producer looks for
its locations among the entries at or after the sequence it tried to write
(:mod:`millpond.queue.landed`): what is there, or provably dequeued, is settled; only the rest
is appended. If the write landed and the consumer dequeued all of it before the re-read, the
producer cannot tell and appends the same locations again; the sink, which records each batch
location with its rows, skips a location it has already written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from enum import Enum
from functools import partial

from millpond.common.clock import Clock
from millpond.common.metrics import Counters
from millpond.common.retry import RetryPolicy
from millpond.common.ulids import parse_batch_name
from millpond.errors import (
    CommitStateUnknownError,
    ConflictError,
    InvalidInputError,
    NotFoundError,
    StorageError,
)
from millpond.formats.manifest import (
    PendingEntry,
    Resume,
    append_entries,
    decode_footer,
    empty_manifest,
    find_locations,
    locations_from,
    resume_after,
)
from millpond.queue.cas import CasLoop, RawManifest
from millpond.queue.fenced import Version, fenced_manifest
from millpond.queue.landed import Landings, LandingStatus, resolve_landing
from millpond.queue.peek import Peek
from millpond.storage.store import ObjectStore, get_or_none

__all__ = ["QueueProducer"]

logger = logging.getLogger(__name__)


class QueueProducer:
    """Appends batch locations to the manifest (the RFC's queue producer)."""

    def __init__(
        self,
        store: ObjectStore,
        manifest_path: str = "ingest/manifest",
        *,
        retry: RetryPolicy | None = None,
        clock: Clock | None = None,
        counters: Counters | None = None,
    ) -> None:
        self._cas = CasLoop(store, manifest_path, retry=retry, clock=clock, counters=counters)
        # The manifest as we last wrote it: tried first, so an uncontended append costs one
        # request instead of a read plus a write.
        self._cached: RawManifest | None = None
        # Decides whether an append waits its turn first and how a lost race waits.
        self._pacer = self._cas.retry.pacer(self._cas.clock)
        self._seen_next = 0
        # The lowest sequence at which a write of ours whose outcome is unknown could still
        # land. A conditional write held back in the network lands whenever it arrives while
        # the manifest is still at the state it was conditional on — after a look that saw
        # nothing of it, even after a later write of ours that was never sent. Until one of
        # our writes lands (which moves the manifest past every state an earlier one was
        # conditional on), every read runs the landed-check from here on.
        self._in_doubt_from: int | None = None

    @property
    def counters(self) -> Counters:
        return self._cas.counters

    @property
    def path(self) -> str:
        """The manifest's path."""
        return self._cas.path

    @property
    def seen_next_sequence(self) -> int:
        """The highest ``next_sequence`` this writer has read or written (0 before any).

        ``next_sequence`` never goes back, so whatever this writer appends from now on lands
        at or after it: a lower bound a caller can hand to the landed-check later.
        """
        return self._seen_next

    def in_doubt_from(self, sequence: int | None) -> None:
        """Writes of these entries made elsewhere — by a previous run of this producer that
        died with a request in flight — may still land at or after ``sequence`` (the
        manifest's ``next_sequence`` when the caller last looked): every read runs the
        landed-check from there until one of this writer's writes lands (``None``: no change)."""
        if sequence is not None and (self._in_doubt_from is None or sequence < self._in_doubt_from):
            self._in_doubt_from = sequence

    def landings(self, *, recovered: bool = False) -> Landings:
        """One read of the manifest (none: empty) to look in for appends in doubt; ``recovered``:
        a run that died may have a write in flight on it, landing at its next sequence. Raises
        ``FormatError`` (a corrupt manifest) or ``StorageError`` (the read failed)."""
        got = get_or_none(self._cas.store, self.path)
        found = Landings(empty_manifest() if got is None else got.data, self.path)
        if recovered:
            self.in_doubt_from(found.next_sequence)
        return found

    def append(
        self,
        entries: Sequence[PendingEntry],
        *,
        maybe_landed_from: int | None = None,
        deadline: float | None = None,
        present_from: int | None = None,
        more: Callable[[], Sequence[PendingEntry]] | None = None,
        in_doubt_from: int | None = None,
    ) -> tuple[int, ...]:
        """Append ``entries`` in one CAS; returns the sequence each entry was given.

        Returns only when every entry is provably in the queue (in the manifest, or already
        dequeued by the consumer), in the order given; sequences are contiguous unless only a
        prefix of the group had landed (module doc: ambiguous writes).

        Args:
            entries: the group, in order.
            maybe_landed_from: an earlier attempt to append this very group (by this writer, or
                a coordinator acting for it) may have landed at or after this sequence and can
                no longer land later: look for it first, and append only what is missing.
            deadline: a time on the queue's clock after which no write is sent (what is known
                is then raised, as when the retry budget runs out). A coordinator promises its
                clients this way that it never writes their entries after they stopped waiting.
            present_from: entries may already be in the queue at or after this sequence,
                appended by another writer for the same producer (a coordinator's client that
                stopped waiting appends its own entries directly): one found there, in a state
                read or kept, is taken as in the queue and not written again.
            more: after a lost race, or a pause to let other writers go first, called
                before the next write for entries that became ready meanwhile; they join the
                group (after it, in the order returned) and the result covers them too.
            in_doubt_from: a write of these entries made elsewhere (a commit taken over) may
                still land at or after this sequence (:meth:`in_doubt_from`).

        Raises:
            InvalidInputError: an entry that does not fit the wire format (nothing written).
            FormatError: the stored manifest is corrupt.
            MillpondError: the manifest holds the group's locations in a way one append of
                them cannot explain (something else wrote them).
            CommitStateUnknownError: the retry budget ran out after a write that may have
                landed: ``sequences`` holds what is known per entry, ``maybe_landed_from`` where
                the rest may be (a caller that gives up must not claim they are absent).
            StorageError: the retry budget ran out before any write could have landed.
        """
        self.in_doubt_from(in_doubt_from)
        if not entries:
            raise InvalidInputError("entries: expected at least one entry, found none")
        return _Append(
            self,
            entries,
            maybe_landed_from=maybe_landed_from,
            deadline=deadline,
            present_from=present_from,
            more=more,
        ).run()

    def rewrite(
        self,
        change: Callable[[bytes], bytes | None],
        *,
        check: Callable[[bytes], None],
        what: str,
    ) -> bool:
        """Write ``change(manifest)`` on a consumer's behalf; whether a write landed.

        For a writer that also writes what is not an append (a coordinator dequeuing for a
        consumer): the write goes through the fenced-object primitive
        (:class:`~millpond.queue.fenced.FencedObject`) with the consumer's epoch ``check``,
        as the consumer's own writes do. The manifest this writer last wrote is tried first
        (no read); a lost race reads, checks and calls ``change`` again on what it found.
        ``change`` returns ``None`` when there is nothing to write; said of the cached bytes,
        that is confirmed on a fresh read. Nothing here appends, so a write of ours in doubt
        stays in doubt (the next append looks for it, as before).

        Raises:
            NotFoundError: no manifest.
            FencedError: ``check`` refused the manifest as read.
            StorageError: the retry budget ran out; whatever ``change`` raises, with nothing
                written for that call.
        """
        manifest = fenced_manifest(self._cas, check)

        def prepare(data: bytes | None) -> bytes | None:
            if data is None:
                raise NotFoundError(f"{self.path}: manifest not found")
            return change(data)

        known, self._cached = self._cached, None  # whatever happens, the next append may read
        known_version = None if known is None else Version(known.data, known.etag)
        done = manifest.update(prepare, what=what, known=known_version, prove=True, at_once=True)
        if done.wrote and done.version.value is not None and done.version.etag is not None:
            self._cached = RawManifest(done.version.value, done.version.etag)
        return done.wrote

    def _note_next_sequence(self, found: int) -> None:
        """Keep :attr:`seen_next_sequence` up to date with a manifest as read.

        ``next_sequence`` never goes back in one manifest, so a lower one means the manifest
        was replaced: said once, and the new manifest's taken as the bound from then on."""
        if found < self._seen_next:
            logger.warning(
                "append to %s: the manifest's next_sequence is %s, below %s seen before: it "
                "was replaced (deleted and created again, or restored from an older copy). "
                "Appending to it; a millpond consumer refuses it until an operator decides "
                "(docs/guarantees.md, 'A replaced manifest is refused')",
                self._cas.path,
                found,
                self._seen_next,
            )
        self._seen_next = found

    def _peek(self, current: RawManifest | None) -> Peek[RawManifest] | None:
        """Under contention, a read of the manifest sent just behind the write (and, when the
        policy asks, a second a moment later, for when the store served the first before
        applying the write)."""
        if current is None or current.etag is None:
            return None
        lag = self._pacer.peek_lag()
        if lag is None:
            return None
        return Peek(self._cas.read, lag, slot=self._pacer.slot, again=self._pacer.peek_again_lag())


class _Step(Enum):
    """What one phase of an append attempt leaves the loop to do."""

    DONE = "done"  # every entry is in the queue
    AGAIN = "again"  # start the loop over (a read failed, or sitting the race out)
    ON = "on"  # go on to the next phase


class _Append:
    """One :meth:`QueueProducer.append` call: the loop's state and its phases.

    Each pass: **look** (read the manifest when it must be read: after a write that may have
    landed, or with nothing kept; settle what landed, what another writer appended, and pace a
    lost race), **grow** (after a lost race, take what became ready meanwhile), **write** (one
    compare-and-swap; a write whose outcome is unknown makes the next look search from its
    first sequence).
    """

    def __init__(
        self,
        writer: QueueProducer,
        entries: Sequence[PendingEntry],
        *,
        maybe_landed_from: int | None,
        deadline: float | None,
        present_from: int | None,
        more: Callable[[], Sequence[PendingEntry]] | None,
    ) -> None:
        self.writer = writer
        self.cas = writer._cas
        self.entries = list(entries)
        self.locations = {entry.location for entry in self.entries}
        if len(self.locations) != len(self.entries):
            raise InvalidInputError("entries: expected distinct locations, found duplicates")
        self.deadline = deadline
        self.present_from = present_from
        self.more = more
        # The lowest sequence an attempt could have landed at: set once a write may have (or
        # given by the caller, for an attempt made elsewhere).
        self.maybe_landed_from = maybe_landed_from
        # Under a fair strategy a writer that just won lets the others go first; what became
        # ready while it let them go first joins its first write.
        self.grow = writer._pacer.take_turn()
        self.lost = False  # a write of this call has lost a race or failed
        self.current = writer._cached
        self.backoff = writer._pacer.start(cached=self.current is not None)
        self.result: list[int | None] = [None] * len(self.entries)
        self.todo = list(range(len(self.entries)))  # indices not yet known to be in the queue
        # The state a read sent alongside a lost write found; ``sat_out``: it was read while
        # sitting a race out (that read is counted by before_write, not as a read alongside).
        self.peeked: RawManifest | None = None
        self.sat_out = False
        self.written_on: RawManifest | None = None  # the state the last write in doubt was on

    def run(self) -> tuple[int, ...]:
        while True:
            try:
                step = self._look()
                if step is _Step.ON:
                    self._grow()
                    step = self._write()
            except StorageError as err:
                unknown = self._unknown(err)
                if unknown is None:
                    raise
                raise unknown from err
            if step is _Step.DONE:
                done = [sequence for sequence in self.result if sequence is not None]
                assert len(done) == len(self.result)
                return tuple(done)

    # -- look --------------------------------------------------------------------------------

    def _look(self) -> _Step:
        writer = self.writer
        if self.maybe_landed_from is None:
            # Until a write of ours lands, every attempt reads and looks first: a manifest
            # kept from an earlier call may hold what the write in doubt carried (it landed
            # before that read), and writing on it unread would append those locations again.
            self.maybe_landed_from = writer._in_doubt_from
        if self.current is not None and self.maybe_landed_from is None:
            if self.present_from is not None:
                # Written on as this writer kept it: entries another writer appended are in
                # it since it was read, maybe before this call (checker, seed 550989).
                self.todo = self._drop_present(self.present_from, self.todo)
                if not self.todo:
                    return _Step.DONE
            return _Step.ON
        if not self._read():
            return _Step.AGAIN
        current = self.current
        if current is not None:
            footer = decode_footer(current.data, name=self.cas.path)
            writer._note_next_sequence(footer.next_sequence)
            if self.present_from is not None:
                low = self.present_from
                if self.maybe_landed_from is not None:
                    low = min(low, self.maybe_landed_from)
                self.todo = self._drop_present(low, self.todo)
                if not self.todo:
                    writer._cached = current
                    return _Step.DONE
        if self.maybe_landed_from is None or current is None:
            return _Step.ON
        return self._settle(current)

    def _read(self) -> bool:
        """The state to look at: the one a read alongside found, or a read now; ``False``
        when the read failed (the backoff was taken)."""
        if self.peeked is not None:
            self.current, self.peeked = self.peeked, None
            if not self.sat_out:
                self.backoff.read_ahead()
            return True
        try:
            self.current = self.cas.read()
        except StorageError as err:
            self.cas.backoff(self.backoff, "manifest read", err)
            return False
        return True

    def _settle(self, current: RawManifest) -> _Step:
        """Settle what landed of a write in doubt; pace a lost race before writing again."""
        assert self.maybe_landed_from is not None
        # Only what was appended after the state written on is looked at, when nothing was
        # dequeued since (not the whole backlog).
        written_on = self.written_on
        resume = resume_after(written_on.data, current.data) if written_on is not None else None
        self.todo = self._settle_landed(current, resume)
        lost_from, self.maybe_landed_from = self.maybe_landed_from, None
        self.sat_out = False
        if not self.todo:
            self.writer._cached = current
            return _Step.DONE
        if not self.lost:
            return _Step.ON
        turn = self.backoff.before_write(
            partial(
                _oldest_against_winners, current.data, lost_from, self.entries, self.todo, resume
            )
        )
        if turn.pause > 0:
            self.cas.clock.sleep(turn.pause)
        if turn.sit_out:
            # Sitting the race out: the manifest as it is now is looked at as after a lost race
            # (a write of ours in doubt, this call's or an earlier one's held back in the
            # network, may have landed since ``current`` was read: whole-system checker, seeds
            # 510106 and 510858 before that look), then written on at once. A read that fails
            # or finds none leaves ``current`` to write on, as it would have been.
            try:
                found = self.cas.read()
            except StorageError as err:
                logger.debug(
                    "append to %s: reading again after a lost race failed: %s", self.cas.path, err
                )
                found = None
            if found is not None:
                self.peeked, self.maybe_landed_from = found, lost_from
                self.sat_out, self.lost = True, False
                return _Step.AGAIN
        return _Step.ON

    def _settle_landed(self, current: RawManifest, resume: Resume | None) -> list[int]:
        """Record which of ``todo`` landed; return the indices still to append."""
        todo, from_sequence, path = self.todo, self.maybe_landed_from, self.cas.path
        assert from_sequence is not None
        landing = resolve_landing(
            current.data,
            [self.entries[i].location for i in todo],
            from_sequence=from_sequence,
            name=path,
            resume=resume,
        )
        if landing.status is LandingStatus.UNKNOWN:
            logger.warning(
                "append to %s: none of %s entries is in the manifest, but entries from sequence "
                "%s on were dequeued since; appending the same locations again (the sink skips "
                "a location it has written)",
                path,
                len(todo),
                from_sequence,
            )
        elif landing.status in (LandingStatus.LANDED, LandingStatus.PARTIAL):
            logger.info(
                "append to %s had landed already for %s of %s entries (%s since dequeued)",
                path,
                len(todo) - len(landing.missing),
                len(todo),
                len(landing.dequeued),
            )
        for position, sequence in enumerate(landing.sequences):
            if sequence is not None:
                self.result[todo[position]] = sequence
        return [todo[position] for position in landing.missing]

    def _drop_present(self, from_sequence: int, looked: list[int]) -> list[int]:
        """Record which of ``looked`` ``self.current`` holds from ``from_sequence`` on; return
        the rest."""
        assert self.current is not None
        entries = self.entries
        found = find_locations(
            self.current.data, {entries[i].location for i in looked}, from_sequence=from_sequence
        )
        if found:
            logger.info(
                "append to %s: %s of %s entries are in the manifest already (appended by their "
                "producer); not writing them again",
                self.cas.path,
                len(found),
                len(looked),
            )
        for index in looked:
            sequence = found.get(entries[index].location)
            if sequence is not None:
                self.result[index] = sequence
        return [index for index in looked if entries[index].location not in found]

    # -- grow --------------------------------------------------------------------------------

    def _grow(self) -> None:
        """After a lost race (or a turn let go), take what became ready meanwhile."""
        if not self.grow or self.more is None:
            return
        extra = list(self.more())
        if any(e.location in self.locations for e in extra) or len(
            {e.location for e in extra}
        ) != len(extra):
            raise InvalidInputError(
                "more: expected locations not in the group yet, found duplicates"
            )
        self.locations.update(e.location for e in extra)
        joined = list(range(len(self.entries), len(self.entries) + len(extra)))
        self.entries.extend(extra)
        self.result.extend([None] * len(extra))
        in_doubt = self.writer._in_doubt_from
        if self.current is not None and in_doubt is not None:
            # A write in doubt may have carried them too (a run that died with its batches
            # in flight): look in the state about to be written on.
            joined = self._drop_present(in_doubt, joined)
        self.todo.extend(joined)

    # -- write -------------------------------------------------------------------------------

    def _write(self) -> _Step:
        writer, cas, current = self.writer, self.cas, self.current
        base = current.data if current is not None else empty_manifest()
        data, sequences = append_entries(base, [self.entries[i] for i in self.todo])
        if self.deadline is not None and cas.clock.monotonic() >= self.deadline:
            raise StorageError(f"{cas.path}: append deadline passed before the write")
        peek = writer._peek(current)  # None without a current state carrying an ETag
        read_etag = current.etag if current is not None else None
        try:
            if peek is not None and read_etag is not None:
                etag = peek.outrun(
                    partial(cas.write, current, data), read_etag, partial(_is_written, data)
                )
            else:
                etag = cas.write(current, data)
        except (ConflictError, CommitStateUnknownError) as err:
            # Either way our write may be in the manifest (a retried request can fail its
            # precondition on our own landed write): look before appending again.
            self.maybe_landed_from = sequences.start
            writer.in_doubt_from(sequences.start)
            self.written_on = current
            writer._cached = None
            self.grow = self.lost = True
            if peek is not None and read_etag is not None:
                self.peeked = peek.moved_from(read_etag)
            cas.backoff(self.backoff, "manifest append", err)
            return _Step.AGAIN
        except StorageError as err:
            writer._cached = None
            self.current = None
            self.grow = self.lost = True
            cas.backoff(self.backoff, "manifest append", err)
            return _Step.AGAIN
        for index, sequence in zip(self.todo, sequences, strict=True):
            self.result[index] = sequence
        writer._cached = RawManifest(data, etag) if etag is not None else None
        writer._seen_next = max(writer._seen_next, sequences.stop)
        writer._in_doubt_from = None
        writer._pacer.won(self.backoff)
        return _Step.DONE

    def _unknown(self, err: StorageError) -> CommitStateUnknownError | None:
        """Once the retries ran out: the error saying what is known, or ``None`` when nothing
        of the group can have landed (``err`` itself is raised)."""
        in_doubt = self.writer._in_doubt_from
        if self.maybe_landed_from is None and in_doubt is not None:
            self.maybe_landed_from = in_doubt  # a write of ours may still land
        if self.maybe_landed_from is None and all(seq is None for seq in self.result):
            return None
        # Out of retries after a write that may have landed, or with part of the group known
        # to be in: say what is known.
        return CommitStateUnknownError(
            str(err), sequences=tuple(self.result), maybe_landed_from=self.maybe_landed_from
        )


def _oldest_against_winners(
    data: bytes,
    from_sequence: int,
    entries: Sequence[PendingEntry],
    todo: Sequence[int],
    resume: Resume | None = None,
) -> tuple[str, str | None] | None:
    """The ULIDs of the oldest of ``todo`` and of the oldest batch appended from
    ``from_sequence`` on by others (the race's winners; ``None`` when none is named by a
    ULID); ``None`` when the batch names of ``todo`` do not tell.

    Batch names carry their mint time (ULIDs): a writer that lost to younger batches than its
    own has waited longest and should write at once, one that lost to older ones lets them go
    first, the longer the younger its own, or sits the next race out
    (:meth:`~millpond.common.retry.Backoff.before_write`).
    """
    mine = _oldest(entries[i].location for i in todo)
    if mine is None:
        return None
    ours = {entries[i].location for i in todo}
    winners = locations_from(data, from_sequence, resume=resume)
    return mine, _oldest(loc for loc in winners if loc not in ours)


def _is_written(data: bytes, state: RawManifest) -> bool:
    """Whether ``state`` is the manifest as ``data`` wrote it (nothing has followed it yet)."""
    return state.data == data


def _oldest(locations: Iterable[str]) -> str | None:
    """The oldest batch name's ULID (ULIDs sort by their mint time, then at random)."""
    ulids = [
        ulid
        for location in locations
        if (ulid := parse_batch_name(location.rsplit("/", 1)[-1])) is not None
    ]
    return min(ulids) if ulids else None
