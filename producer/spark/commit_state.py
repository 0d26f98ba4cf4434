"""Appending a Spark micro-batch or write exactly once, across driver restarts and reruns.

A stream's micro-batch (keyed by stream id and batch id) and a batch job run with the
``write_id`` option (keyed by the write id) are committed through a small state object, kept as
a *hold* (:mod:`millpond.queue.holds`) under the data prefix::

    pending    written with compare-and-swap BEFORE the append: the entries, and the manifest's
               next_sequence when the append began. As a hold it names the entries' locations,
               so no millpond collector deletes them while the outcome is open.
    committed  written AFTER the append: the sequences the entries got; it names no location.

A commit that finds the state of its own key resolves it by looking, never by guessing:

* ``committed``: already enqueued; nothing to do (``skipped``);
* ``pending`` and the remembered locations are in the manifest, or provably dequeued as a prefix
  of it (:func:`~millpond.queue.landed.resolve_landing`): enqueued; mark it committed
  (``skipped``). If only a prefix is there, the rest is appended;
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
import math
import re
from dataclasses import dataclass, replace
from hashlib import sha256
from typing import Any

from millpond.common.clock import Clock, SystemClock
from millpond.errors import FormatError, MillpondError, NotFoundError, StorageError
from millpond.formats.manifest import Metadata, PendingEntry, decode_footer, empty_manifest
from millpond.queue.cas import Appender
from millpond.queue.holds import encode_hold, hold_path, locations_of
from millpond.queue.landed import LandingStatus, resolve_landing
from millpond.storage.store import ObjectStore

__all__ = ["CommitOutcome", "CommitState", "HoldTooLate", "commit_with_state", "state_path"]

logger = logging.getLogger(__name__)

_VERSION = 2
_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
PENDING = "pending"
COMMITTED = "committed"


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

    def encode(self) -> bytes:
        extra: dict[str, Any] = {
            "version": _VERSION,
            "key": self.key,
            "batch_id": self.batch_id,
            "status": self.status,
            "next_sequence": self.next_sequence,
            "sequences": list(self.sequences) if self.sequences is not None else None,
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
            return cls(
                key=str(record["key"]),
                batch_id=int(record["batch_id"]),
                status=str(record["status"]),
                next_sequence=int(record["next_sequence"]),
                entries=entries,
                sequences=tuple(int(s) for s in sequences) if sequences is not None else None,
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
    manifest_path: str,
    hold_by: float | None = None,
    clock: Clock | None = None,
) -> CommitOutcome:
    """One attempt at committing ``fresh`` under ``key`` (see the module docstring).

    ``hold_by``: a time on ``clock``'s monotonic time after which ``fresh`` is not held (nor
    appended): until its hold is written nothing keeps a collector from its uploads, and by
    then the oldest may be past the grace period.

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
        store,
        queue,
        path,
        manifest_path,
        key,
        batch_id,
        fresh,
        math.inf if hold_by is None else hold_by,
        clock or SystemClock(),
    ).run()


@dataclass(slots=True)
class _Attempt:
    """One decision about one key, from the state and the manifest as they are now."""

    store: ObjectStore
    queue: Appender
    path: str
    manifest_path: str
    key: str
    batch_id: int
    fresh: tuple[PendingEntry, ...]
    hold_by: float
    clock: Clock
    etag: str | None = None
    raw: bytes = b""

    def run(self) -> CommitOutcome:
        state, self.etag = _read(self.store, self.path)
        if state is not None and state.batch_id > self.batch_id:
            # Spark only ever re-runs its latest batch: an older id means the checkpoint was
            # reset or two queries share one stream id. Skipping would lose data, appending may
            # double it.
            raise MillpondError(
                f"{self.key}: batch {self.batch_id} arrived after batch {state.batch_id} was "
                f"committed ({self.path}): the checkpoint was reset or another query uses the "
                "same id; give this query its own query_id option"
            )
        self.raw = _manifest(self.store, self.manifest_path)
        if state is not None and state.batch_id == self.batch_id:
            if state.status == COMMITTED:
                logger.warning(
                    "%s batch %s: already committed; skipping the re-run", self.key, self.batch_id
                )
                return CommitOutcome("skipped", state.sequences)
            return self._resolve(state)
        if not self.fresh:
            return CommitOutcome("empty")
        return self._append_fresh()

    def _append_fresh(self) -> CommitOutcome:
        """Hold the fresh entries (pending), append them, mark them committed."""
        next_sequence = decode_footer(self.raw, name=self.manifest_path).next_sequence
        pending = CommitState(self.key, self.batch_id, PENDING, next_sequence, self.fresh)
        if self.clock.monotonic() >= self.hold_by:
            raise HoldTooLate(
                f"{self.key} batch {self.batch_id}: its uploads got older than half the GC "
                f"grace period before {self.path} could hold them"
            )
        self._write(pending)
        sequences = self.queue.append(self.fresh)
        self._write(replace(pending, status=COMMITTED, sequences=sequences))
        return CommitOutcome("appended", sequences)

    def _resolve(self, state: CommitState) -> CommitOutcome:
        where = f"{state.key} batch {state.batch_id}"
        landing = resolve_landing(
            self.raw,
            [e.location for e in state.entries],
            from_sequence=state.next_sequence,
            name=self.manifest_path,
        )
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
                return self._append_fresh()
            raise MillpondError(
                f"{where}: cannot tell whether it was enqueued: its locations are not in the "
                f"manifest, entries from sequence {state.next_sequence} on were dequeued since, "
                f"and {len(gone)} of its held batch objects are gone (first: {gone[0]}; a "
                "collector that does not read millpond's holds?). Look for these locations in "
                "the sink's progress table. Found: the batch was written; replace "
                f'{self.path} with the same JSON and "status": "committed", and the re-run is '
                f"skipped. Not found: delete {self.path}; the re-run is then enqueued"
            )
        sequences = self.queue.append([state.entries[i] for i in missing])
        for index, sequence in zip(missing, sequences, strict=True):
            known[index] = sequence
        done = tuple(s for s in known if s is not None)
        self._write(replace(state, status=COMMITTED, sequences=done))
        if landing.status is LandingStatus.UNKNOWN:
            logger.warning(
                "%s: not in the manifest, which was dequeued past sequence %s since; appended "
                "the same %s locations again (the sink skips locations it has written)",
                where,
                state.next_sequence,
                len(missing),
            )
            return CommitOutcome("reappended", done)
        return CommitOutcome("appended", done)

    def _write(self, state: CommitState) -> None:
        data = state.encode()
        if self.etag is None:
            self.etag = self.store.put_if_absent(self.path, data)
        else:
            self.etag = self.store.put_if_match(self.path, data, self.etag)


def _read(store: ObjectStore, path: str) -> tuple[CommitState | None, str | None]:
    try:
        got = store.get(path)
    except NotFoundError:
        return None, None
    return CommitState.decode(got.data, name=f"{store.url}/{path}"), got.etag


def _manifest(store: ObjectStore, path: str) -> bytes:
    try:
        return store.get(path).data
    except NotFoundError:
        return empty_manifest()


def _exists(store: ObjectStore, entry: PendingEntry) -> bool:
    try:
        store.head(entry.location)
    except NotFoundError:
        return False
    return True
