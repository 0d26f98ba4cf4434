"""Appending a Spark micro-batch or write exactly once, across driver restarts and reruns.

A stream's micro-batch (keyed by stream id and batch id) and a batch job run with the
``write_id`` option (keyed by the write id) are committed through a small state object, kept as
a *hold* (:mod:`millpond.queue.holds`) under the data prefix::

    pending    written with compare-and-swap BEFORE the append: the entries, the manifest's
               next_sequence when the append began, and the commit that owns it. As a hold it
               names the entries' locations, so no millpond collector deletes them while the
               outcome is open.
    committed  written AFTER the append: the sequences the entries got; it names no location.

Ownership. Only the commit that wrote a pending state appends its entries, and only for a
*lease* after that write (``lease`` seconds: the append's deadline, so no write of it is sent
later). Every decision to append writes the state first (a create, or a compare-and-swap on
what was read): the commit claims it, and the state changes with every claim. A commit that
finds another's pending state whose entries are not all in the queue does not append them: it
waits for that commit's outcome, reading the state now and then, and decides again when it
changes (committed: ``skipped``). Only once the state has stayed the same for a whole lease on
its own clock — the owner stopped, and sends nothing more — does it take the state over (a
claim conditional on the state it watched) and resolve it as below. Two jobs with one write id
at once, or a rerun started while the first run still commits, thus append once; a rerun after
a driver died mid-commit waits out one lease first. An append of remembered entries also looks
for them in the manifest before every write (the append's ``in_doubt_from``): a write of the
former owner sent just before its deadline and landing late is found, not doubled.

A commit that finds the state of its own key resolves it by looking, never by guessing:

* ``committed``: already enqueued; nothing to do (``skipped``);
* ``pending`` and the remembered locations are in the manifest, or provably dequeued as a prefix
  of it (the writer's ``landings``): enqueued; mark it committed (``skipped``). If only a
  prefix is there, the rest is appended;
* ``pending`` and none of them is there: append the *remembered* entries again — the same
  locations, which the hold kept in the store. If they had landed and were consumed meanwhile,
  the sink recognises their locations and skips them (``reappended``); otherwise they are simply
  enqueued now (``appended``). The rerun's own fresh uploads are never appended: they would be
  new locations the sink could not recognise.

One window remains, outside millpond's control: a collector that does not read holds (an RFC
peer's) deleting the held objects while the outcome is open. Then the commit refuses, naming the
state object and how to settle it by hand without a duplicate.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from hashlib import sha256
from typing import Any

from millpond.common.clock import Clock
from millpond.errors import (
    ConflictError,
    FormatError,
    MillpondError,
    NotFoundError,
    StorageError,
)
from millpond.formats.manifest import Metadata, PendingEntry
from millpond.queue import (
    Appender,
    Landing,
    Landings,
    LandingStatus,
    encode_hold,
    hold_path,
    locations_of,
)
from millpond.storage.store import ObjectStore

__all__ = [
    "CommitOutcome",
    "CommitState",
    "HoldTooLate",
    "commit_with_state",
    "read_state",
    "state_path",
]

logger = logging.getLogger(__name__)

_VERSION = 2
_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
PENDING = "pending"
COMMITTED = "committed"
# The most a commit waiting out another's lease goes without reading the state.
_POLL = 1.0
# Decisions made again within one attempt because the state changed under a write of ours or
# our lease ran out before the append was sent; then the commit's own retries take over.
_AGAIN = 8


class _LeaseOver(StorageError):
    """The append was not sent: this commit's lease ran out first (it was held up)."""


class HoldTooLate(StorageError):
    """The hold of fresh uploads was not written: their deadline passed first (the driver was
    held up after it judged them fresh), so a collector may have taken them. Copy them to
    fresh names again and decide again; nothing was written."""


@dataclass(frozen=True, slots=True)
class CommitOutcome:
    """How one commit was resolved."""

    status: str
    """``appended``, ``reappended`` (the same locations again after they may have been
    consumed), ``skipped`` (already enqueued) or ``empty``."""
    sequences: tuple[int, ...] | None = None
    """Where the entries went, when known."""


@dataclass(frozen=True, slots=True)
class CommitState:
    """The pending or committed state of one key."""

    key: str
    """``stream:{id}`` or ``write:{id}``."""
    batch_id: int
    """The micro-batch id (streams); 0 for a write id."""
    status: str
    next_sequence: int
    """The manifest's ``next_sequence`` when the append began."""
    entries: tuple[PendingEntry, ...]
    sequences: tuple[int, ...] | None = None
    owner: str | None = None
    """The commit that last claimed it (``None``: written before owners were recorded)."""
    claim: int = 0
    """How many claims it has seen: every claim writes one more, so the bytes change."""

    def encode(self) -> bytes:
        extra: dict[str, Any] = {
            "version": _VERSION,
            "key": self.key,
            "batch_id": self.batch_id,
            "status": self.status,
            "next_sequence": self.next_sequence,
            "sequences": list(self.sequences) if self.sequences is not None else None,
            "owner": self.owner,
            "claim": self.claim,
            "entries": [
                {
                    "location": e.location,
                    "metadata": [
                        [m.start_index, m.ingestion_time_ms, base64.b64encode(m.payload).decode()]
                        for m in e.metadata
                    ],
                }
                for e in self.entries
            ],
        }
        held = [e.location for e in self.entries] if self.status == PENDING else []
        return encode_hold(held, extra)

    @classmethod
    def decode(cls, data: bytes, *, name: str) -> CommitState:
        """Parse a state object.

        Raises:
            FormatError: not a commit state of this version.
        """
        locations_of(data, name=name)  # a hold first of all
        try:
            record = json.loads(data)
            if record.get("version") != _VERSION:
                raise FormatError(
                    f"{name}: version: expected {_VERSION}, found {record.get('version')!r}",
                    field="version",
                )
            entries = tuple(
                PendingEntry(
                    e["location"],
                    tuple(
                        Metadata(int(s), int(t), base64.b64decode(p)) for s, t, p in e["metadata"]
                    ),
                )
                for e in record["entries"]
            )
            sequences = record.get("sequences")
            owner = record.get("owner")
            return cls(
                key=str(record["key"]),
                batch_id=int(record["batch_id"]),
                status=str(record["status"]),
                next_sequence=int(record["next_sequence"]),
                entries=entries,
                sequences=tuple(int(s) for s in sequences) if sequences is not None else None,
                owner=str(owner) if owner is not None else None,
                claim=int(record.get("claim", 0)),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise FormatError(f"{name}: not a millpond commit state: {err}") from err


def state_path(data_path_prefix: str, kind: str, ident: str) -> str:
    """Where the state of ``kind`` (``stream`` or ``write``) ``ident`` lives: a hold. Ids that
    are not path-safe are hashed."""
    safe = ident if _SAFE_ID.match(ident) else sha256(ident.encode()).hexdigest()[:32]
    return hold_path(data_path_prefix, f"spark-{kind}-{safe}.json")


def commit_with_state(
    store: ObjectStore,
    queue: Appender,
    *,
    path: str,
    key: str,
    batch_id: int,
    fresh: tuple[PendingEntry, ...],
    hold_by: float,
    clock: Clock,
    owner: str,
    lease: float,
    on_wait: Callable[[], None],
) -> CommitOutcome:
    """One attempt at committing ``fresh`` under ``key`` (see the module docstring).

    ``hold_by``: a time on ``clock``'s monotonic time after which ``fresh`` is not held (nor
    appended): until its hold is written nothing keeps a collector from its uploads, and by
    then the oldest may be past the grace period.

    ``owner``: this commit, the same in each of its attempts, so that it goes on with a pending
    state it claimed in an earlier attempt. ``lease``: seconds after a claim during which its
    append may be sent, and for which another commit's pending state must stay unchanged
    before this one takes it over. ``on_wait``: called after each wait for another commit's
    outcome.

    Raises:
        HoldTooLate: ``hold_by`` passed before ``fresh`` was held (nothing written).
        ConflictError: the state object changed under us (decide again).
        CommitStateUnknownError: a state write or the append may or may not have landed
            (decide again: the state says what is known).
        MillpondError: an older batch id after a newer one, or an outcome that cannot be told.
        FormatError: the state or the manifest is corrupt.
        StorageError: the store failed.
    """
    return _Attempt(
        store, queue, path, key, batch_id, fresh, hold_by, clock, owner, lease, on_wait
    ).run()


@dataclass(slots=True)
class _Attempt:
    """One decision about one key, from the state and the manifest as they are now."""

    store: ObjectStore
    queue: Appender
    path: str
    key: str
    batch_id: int
    fresh: tuple[PendingEntry, ...]
    hold_by: float
    clock: Clock
    owner: str
    lease: float
    on_wait: Callable[[], None]
    etag: str | None = None
    seen: bytes | None = None
    manifest: Landings = Landings(b"")  # noqa: RUF009 - frozen; each decision reads it
    appended: CommitOutcome | None = None
    """What this commit's own append returned, before it marked the state committed."""

    def run(self) -> CommitOutcome:
        conflicts = 0
        while True:
            try:
                outcome = self._decide()
            except (ConflictError, _LeaseOver):
                # The state changed between our read and our write (another commit claimed or
                # marked it: its progress, not a failure of ours), or this commit was held up
                # past its lease before its append was sent: decide again at once.
                conflicts += 1
                if conflicts > _AGAIN:
                    raise
                continue
            if outcome is None:
                continue
            if (
                self.appended is not None
                and outcome.status == "skipped"
                and outcome.sequences == self.appended.sequences
            ):
                # Our append's outcome, marked committed by another commit that saw it land.
                return self.appended
            return outcome

    def _decide(self) -> CommitOutcome | None:
        """The outcome, or ``None`` when another commit's state changed while this one waited
        for it (decide again)."""
        state, self.etag, self.seen = read_state(self.store, self.path)
        # The owner's claim was sent before this moment: its lease ends a lease from now at
        # the latest.
        seen_at = self.clock.monotonic()
        if state is not None and state.batch_id > self.batch_id:
            # Spark only ever re-runs its latest batch: an older id means the checkpoint was
            # reset or two queries share one stream id. Skipping would lose data, appending may
            # double it.
            raise MillpondError(
                f"{self.key}: batch {self.batch_id} arrived after batch {state.batch_id} was "
                f"committed ({self.path}): the checkpoint was reset or another query uses the "
                "same id; give this query its own query_id option"
            )
        self.manifest = self.queue.landings()
        if state is not None and state.batch_id == self.batch_id:
            if state.status == COMMITTED:
                logger.warning(
                    "%s batch %s: already committed; skipping the re-run", self.key, self.batch_id
                )
                return CommitOutcome("skipped", state.sequences)
            landed = self._landing(state).status is LandingStatus.LANDED
            if state.owner != self.owner and not landed:
                # Another commit's, still open: its outcome, not ours to decide yet.
                if not self._outlast(state, seen_at):
                    return None
                # Unchanged for a whole lease: its owner sends nothing more. Take it over, on
                # the manifest as it is now.
                self.manifest = self.queue.landings()
            return self._resolve(state)
        if not self.fresh:
            return CommitOutcome("empty")
        return self._append_fresh(state)

    def _append_fresh(self, replacing: CommitState | None) -> CommitOutcome:
        """Hold the fresh entries (pending, claimed), append them, mark them committed."""
        next_sequence = self.manifest.next_sequence
        pending = CommitState(
            self.key,
            self.batch_id,
            PENDING,
            next_sequence,
            self.fresh,
            owner=self.owner,
            claim=replacing.claim + 1 if replacing is not None else 0,
        )
        if self.clock.monotonic() >= self.hold_by:
            raise HoldTooLate(
                f"{self.key} batch {self.batch_id}: its uploads got older than half the GC "
                f"grace period before {self.path} could hold them"
            )
        deadline = self.clock.monotonic() + self.lease
        self._write(pending)
        # Nobody else appends these (they are this commit's own) unless this commit stopped
        # past its lease and was taken over: look before every write anyway.
        sequences = self._append(self.fresh, deadline, next_sequence)
        self.appended = CommitOutcome("appended", sequences)
        self._write(replace(pending, status=COMMITTED, sequences=sequences))
        return self.appended

    def _append(self, todo: Sequence[PendingEntry], deadline: float, since: int) -> tuple[int, ...]:
        """Append under a claim whose lease ends at ``deadline``; an earlier write of them may
        land from ``since`` on (``Appender.append``'s ``in_doubt_from``).

        Raises:
            _LeaseOver: the append gave up with the lease over: this commit was held up, and
                sends nothing more under that claim (decide again; the state and the
                manifest say what is known).
            CommitStateUnknownError, StorageError, MillpondError: as ``Appender.append``.
        """
        try:
            return self.queue.append(todo, deadline=deadline, in_doubt_from=since)
        except StorageError as err:
            if self.clock.monotonic() < deadline:
                raise
            raise _LeaseOver(f"{self.path}: lease of {self.lease:.1f} s over: {err}") from err

    def _landing(self, state: CommitState) -> Landing:
        return self.manifest.of(
            [e.location for e in state.entries], from_sequence=state.next_sequence
        )

    def _outlast(self, state: CommitState, seen_at: float) -> bool:
        """Wait for another commit's outcome: ``False`` as soon as the state changes, ``True``
        once it has stayed as it was for a lease since ``seen_at`` (take it over then)."""
        until = seen_at + self.lease
        logger.warning(
            "%s batch %s: another commit (%s) holds %s pending and its entries are not all in "
            "the queue; waiting up to %.1f s for its outcome before taking it over",
            self.key,
            self.batch_id,
            state.owner or "owner not recorded",
            self.path,
            max(0.0, until - self.clock.monotonic()),
        )
        try:
            while True:
                left = until - self.clock.monotonic()
                if left <= 0:
                    logger.warning(
                        "%s batch %s: %s unchanged for %.1f s; taking it over",
                        self.key,
                        self.batch_id,
                        self.path,
                        self.lease,
                    )
                    return True
                self.clock.sleep(min(_POLL, self.lease / 8, left))
                try:
                    got = self.store.get(self.path)
                except NotFoundError:
                    return False
                except StorageError as err:
                    # Only a change matters; the claim that takes it over is conditional on it.
                    logger.debug("%s: reading it while waiting failed: %s", self.path, err)
                    continue
                if got.data != self.seen:
                    return False
        finally:
            self.on_wait()

    def _claim(self, state: CommitState) -> tuple[CommitState, float]:
        """Write ``state`` claimed by this commit; the claimed state, and the deadline of an
        append made under it."""
        claimed = replace(state, owner=self.owner, claim=state.claim + 1)
        deadline = self.clock.monotonic() + self.lease
        self._write(claimed)
        return claimed, deadline

    def _resolve(self, state: CommitState) -> CommitOutcome:
        where = f"{state.key} batch {state.batch_id}"
        landing = self._landing(state)
        known = list(landing.sequences)
        if landing.status is LandingStatus.LANDED:
            logger.warning(
                "%s: already enqueued (%s since dequeued); skipping the re-run",
                where,
                len(landing.dequeued),
            )
            sequences = tuple(s for s in known if s is not None)
            self._write(replace(state, status=COMMITTED, sequences=sequences))
            return CommitOutcome("skipped", sequences)
        missing = landing.missing
        gone = [
            state.entries[i].location for i in missing if not _exists(self.store, state.entries[i])
        ]
        if gone:
            if landing.status is LandingStatus.NOT_LANDED:
                # Provably never enqueued, and something took the held objects: the re-run's
                # own uploads take their place.
                if not self.fresh:
                    self._write(replace(state, status=COMMITTED, entries=(), sequences=()))
                    return CommitOutcome("empty")
                return self._append_fresh(state)
            raise MillpondError(
                f"{where}: cannot tell whether it was enqueued: its locations are not in the "
                f"manifest, entries from sequence {state.next_sequence} on were dequeued since, "
                f"and {len(gone)} of its held batch objects are gone (first: {gone[0]}; a "
                "collector that does not read millpond's holds?). Look for these locations in "
                "the sink's progress table. Found: the batch was written; replace "
                f'{self.path} with the same JSON and "status": "committed", and the re-run is '
                f"skipped. Not found: delete {self.path}; the re-run is then enqueued"
            )
        state, deadline = self._claim(state)
        # A write of the former owner, sent before its lease ended, may land yet: look for the
        # entries before every write, not only now.
        sequences = self._append([state.entries[i] for i in missing], deadline, state.next_sequence)
        for index, sequence in zip(missing, sequences, strict=True):
            known[index] = sequence
        done = tuple(s for s in known if s is not None)
        status = "reappended" if landing.status is LandingStatus.UNKNOWN else "appended"
        self.appended = CommitOutcome(status, done)
        self._write(replace(state, status=COMMITTED, sequences=done))
        if landing.status is LandingStatus.UNKNOWN:
            logger.warning(
                "%s: not in the manifest, which was dequeued past sequence %s since; appended "
                "the same %s locations again (the sink skips locations it has written)",
                where,
                state.next_sequence,
                len(missing),
            )
        return self.appended

    def _write(self, state: CommitState) -> None:
        data = state.encode()
        if self.etag is None:
            self.etag = self.store.put_if_absent(self.path, data)
        else:
            self.etag = self.store.put_if_match(self.path, data, self.etag)
        self.seen = data


def read_state(
    store: ObjectStore, path: str
) -> tuple[CommitState | None, str | None, bytes | None]:
    """The state at ``path`` (``None`` when there is none), its ETag and its bytes.

    Raises:
        FormatError: not a commit state of this version.
        StorageError: the store failed.
    """
    try:
        got = store.get(path)
    except NotFoundError:
        return None, None, None
    return CommitState.decode(got.data, name=f"{store.url}/{path}"), got.etag, got.data


def _exists(store: ObjectStore, entry: PendingEntry) -> bool:
    try:
        store.head(entry.location)
    except NotFoundError:
        return False
    return True
