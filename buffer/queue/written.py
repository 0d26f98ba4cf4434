"""What a queue's consumer service has written into its database, for producers to wait on.

``millpond consume`` keeps one small JSON object, ``{data_path_prefix}/_millpond/written.json``
(beside the queue's claim and the service's report, in a nested prefix garbage collection never
lists): the highest sequence its sink has committed, with every one before it
(``written_through``), its epoch, its state and, while it is stopped on a batch, that batch and
why. It rewrites the object after every commit of the sink (coalesced: at most one write in
flight, a few a second at most) and, while nothing changes, every report interval, so a
reader can tell a consumer that is alive from one that died without a word.
:mod:`~millpond.queue.sink_wait` reads it: ``WriteHandle.wait_written()`` and the Spark
``await_sink`` option wait until it reaches the sequences they enqueued.

``written_through`` counts batches written, batches skipped as written already (their rows are
in the table under an earlier sequence) and batches set aside. The set-aside ones are listed in
``set_aside`` (the most recent :data:`MAX_SET_ASIDE`): their rows are not in the table, and a
waiter fails naming them instead of returning.

Per queue it only grows, across epochs too: a consumer that takes over starts from the sink's
progress, which holds everything an older one committed. An older consumer's write can still
land late with a lower value, so a waiter keeps the highest value it has read (a claim is never
false: it was true when it was written). Readers ignore keys they do not know (a newer writer
may add some) and refuse another version.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from millpond.common.clock import Clock, SystemClock
from millpond.common.retry import RetryPolicy
from millpond.errors import FencedError, FormatError
from millpond.queue.claim import internal_path
from millpond.queue.fenced import FencedObject
from millpond.storage.store import ObjectStore, get_or_none

__all__ = [
    "CONSUMER_STATES",
    "MAX_SET_ASIDE",
    "WRITTEN_NAME",
    "SetAsideMark",
    "WrittenMark",
    "note_set_aside",
    "read_written",
    "written_object",
    "written_path",
]

WRITTEN_NAME = "written.json"
MAX_SET_ASIDE = 100
"""Set-aside batches a mark lists, the most recent ones."""
CONSUMER_STATES = ("running", "retrying", "stopped_on_batch", "stopped", "fenced")
"""What a consumer service says it is doing (``millpond status`` shows the same words)."""
_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class SetAsideMark:
    """A batch the consumer moved past without writing its rows (quarantined)."""

    sequence: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WrittenMark:
    """One published state of a queue's consumer service."""

    queue: str
    """The queue, as ``queue_identity`` names it."""
    epoch: int | None
    written_through: int | None
    """The highest sequence committed in the sink with every one before it (``None``: none)."""
    state: str
    """One of :data:`CONSUMER_STATES`."""
    updated_ms: int
    """Wall-clock milliseconds of this write."""
    interval: float = 0.0
    """Seconds between writes while nothing changes (0: no such promise)."""
    host: str = ""
    pid: int = 0
    stopped_on: int | None = None
    """While ``stopped_on_batch``: the sequence it is stopped on."""
    error: str | None = None
    """Why it stopped, or the error it retries."""
    set_aside: tuple[SetAsideMark, ...] = ()
    version: int = field(default=_VERSION)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, *, name: str) -> WrittenMark:
        """Raises:
        FormatError: not a mark of this version (unknown keys are ignored).
        """
        try:
            raw: dict[str, Any] = json.loads(data)
            if not isinstance(raw, dict) or raw.get("version") != _VERSION:
                found = raw.get("version") if isinstance(raw, dict) else raw
                raise FormatError(
                    f"{name}: expected written-through version {_VERSION}, found {found!r}",
                    field="version",
                )
            known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
            marks = tuple(
                SetAsideMark(sequence=int(m["sequence"]), reason=str(m["reason"]))
                for m in known.pop("set_aside", ())
            )
            return cls(**known, set_aside=marks)
        except (ValueError, TypeError, KeyError) as err:
            raise FormatError(f"{name}: expected a written-through mark, found {err}") from err

    def stale(self, now_ms: int) -> bool:
        """Whether a consumer that says it is running missed its promised writes (it may have
        died): nothing for three intervals, and at least ten seconds past one."""
        if self.state not in ("running", "retrying") or self.interval <= 0:
            return False
        allowed = max(3 * self.interval, self.interval + 10.0)
        return (now_ms - self.updated_ms) / 1000 > allowed

    def with_set_aside(self, sequence: int, reason: str) -> WrittenMark:
        """This mark with ``sequence`` listed as set aside (the most recent
        :data:`MAX_SET_ASIDE` kept)."""
        kept = [m for m in self.set_aside if m.sequence != sequence]
        kept.append(SetAsideMark(sequence=sequence, reason=reason))
        kept.sort(key=lambda m: m.sequence)
        return replace(self, set_aside=tuple(kept[-MAX_SET_ASIDE:]))


def written_path(data_path_prefix: str) -> str:
    """Where the consumer of the queue whose batches live under ``data_path_prefix`` says what
    it has written."""
    return internal_path(data_path_prefix, WRITTEN_NAME)


def read_written(store: ObjectStore, data_path_prefix: str) -> WrittenMark | None:
    """The last mark, or ``None`` when no consumer service ever wrote one.

    Raises:
        FormatError: the object is not a mark this version reads.
        StorageError: the store failed.
    """
    path = written_path(data_path_prefix)
    got = get_or_none(store, path)
    return None if got is None else WrittenMark.from_json(got.data, name=path)


def written_object(
    store: ObjectStore, data_path_prefix: str, epoch: int | None, *, clock: Clock | None = None
) -> FencedObject[WrittenMark]:
    """The mark as the consumer service at ``epoch`` writes it
    (:class:`~millpond.queue.fenced.FencedObject`): each write conditional on the version it
    last wrote or read, refused with ``FencedError`` once a newer consumer's mark is there. A
    mark this version cannot read is written over."""
    path = written_path(data_path_prefix)

    def decode(data: bytes) -> WrittenMark:
        try:
            return WrittenMark.from_json(data, name=path)
        except FormatError:
            return WrittenMark(queue="", epoch=None, written_through=None, state="", updated_ms=0)

    def check(mark: WrittenMark) -> None:
        if epoch is not None and mark.epoch is not None and mark.epoch > epoch:
            raise FencedError(
                f"{store.url}/{path}: written by the consumer at epoch {mark.epoch}, this one "
                f"holds {epoch}",
                expected_epoch=epoch,
                found_epoch=mark.epoch,
            )

    return FencedObject(
        store,
        path,
        decode=decode,
        encode=WrittenMark.to_json,
        check=check,
        retry=RetryPolicy(max_attempts=2, max_elapsed=5.0),
        clock=clock or SystemClock(),
    )


def note_set_aside(
    store: ObjectStore,
    data_path_prefix: str,
    *,
    queue: str,
    sequence: int,
    reason: str,
    clock: Clock | None = None,
) -> WrittenMark:
    """List ``sequence`` as set aside in the mark (``millpond quarantine``, which runs while
    no consumer service does): a waiter for it fails naming it, once a consumer moves past it.

    Raises:
        FormatError: the object is not a mark this version reads.
        StorageError: the store failed.
    """
    mark = read_written(store, data_path_prefix)
    if mark is None:
        now_ms = (clock or SystemClock()).now_ms()
        mark = WrittenMark(
            queue=queue, epoch=None, written_through=None, state="stopped", updated_ms=now_ms
        )
    mark = mark.with_set_aside(sequence, reason)
    store.put(written_path(data_path_prefix), mark.to_json())
    return mark
