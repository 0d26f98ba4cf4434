"""Poison batches, set aside on purpose: ``millpond quarantine`` and ``millpond replay``.

A batch the consumer cannot decode, or the database refuses for good, stops the consumer
(it never skips data by itself). An operator who decides to go on without it runs::

    millpond quarantine STORE_URL --sequence N --reason TEXT --sink URL [--table T ...]

which

1. checks that ``N`` is the batch the consumer is stopped on: in the queue, not yet recorded
   in the sink, and the next one after the sink's last recorded sequence (the only batch a
   consumer can be stopped on); a consumer whose report says it is writing normally is not
   stopped at all (``--force`` overrides that one check);
2. copies the batch object to the **dead-letter prefix** (default ``{data_prefix}-dead-letter``,
   outside the data prefix: garbage collection only ever deletes ``{ULID}.batch`` objects
   directly under the data prefix), as ``{sequence:020d}.batch``, with ``{sequence:020d}.json``
   beside it holding the manifest entry (location, metadata) and the reason;
3. records the sequence in the sink's progress as quarantined, with the reason (see
   :mod:`millpond.consumer.sinks._dead_letter`). From that commit on, a consumer resumes after
   it, and its location stays recognised: appended again, it is skipped like a written batch.

``millpond replay STORE_URL --sequence N --sink URL`` writes a quarantined batch from its
dead-letter copy once the cause is fixed (the table altered; the copy repaired), marking it
replayed in the same transaction: replaying twice writes once, and the location coming back in
the queue is skipped before and after the replay.

``millpond consume --on-bad-batch quarantine`` does step 2 and 3 by itself, for each batch it
would stop on (never by default), and counts them.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import shlex
from dataclasses import dataclass
from typing import Any

from millpond.cli.common import add_store_arguments, emit, parse_options, require_queue
from millpond.common.clock import Clock, SystemClock
from millpond.consumer._batch import ConsumedBatch
from millpond.consumer._config import ConsumerConfig
from millpond.consumer.app._report import ServiceState, read_report
from millpond.consumer.sinks import AdbcSink, QuarantineLedger, SetAside, open_sink
from millpond.errors import (
    ConfigError,
    FormatError,
    InvalidInputError,
    MillpondError,
    NotFoundError,
)
from millpond.formats.batch import decode_batch
from millpond.formats.manifest import Manifest, ManifestEntry, Metadata
from millpond.queue import (
    note_set_aside,
    queue_identity,
    queue_view,
    read_indexed,
    read_manifest,
)
from millpond.storage import ObjectStore, open_store

__all__ = [
    "DeadLetterRecord",
    "QuarantineOutcome",
    "ReplayOutcome",
    "add_arguments",
    "add_sink_arguments",
    "config_from_args",
    "dead_letter_paths",
    "dead_letter_prefix_for",
    "default_dead_letter_prefix",
    "quarantine",
    "quarantine_command",
    "replay",
    "run",
    "set_aside",
]

logger = logging.getLogger(__name__)

_DEAD_LETTER_SUFFIX = "-dead-letter"


def default_dead_letter_prefix(data_path_prefix: str) -> str:
    """``{data_path_prefix}-dead-letter``: a sibling of the data prefix, never inside it."""
    prefix = data_path_prefix.strip("/")
    return f"{prefix}{_DEAD_LETTER_SUFFIX}" if prefix else _DEAD_LETTER_SUFFIX.lstrip("-")


def dead_letter_paths(dead_letter_prefix: str, sequence: int) -> tuple[str, str]:
    """The copy of the batch object and its record, named by sequence (never ``{ULID}.batch``:
    no collector, ours or an RFC peer's, takes them for batch objects)."""
    base = f"{dead_letter_prefix.strip('/')}/{sequence:020d}"
    return f"{base}.batch", f"{base}.json"


def dead_letter_prefix_for(config: ConsumerConfig, given: str | None) -> str:
    """The dead-letter prefix to use: ``given``, or the default; never empty, never the data
    prefix (``millpond replay`` could not tell the copies from the queue's batches).

    Raises:
        ConfigError: ``given`` is empty or the data prefix.
    """
    data = config.data_path_prefix.strip("/")
    prefix = (given if given is not None else default_dead_letter_prefix(data)).strip("/")
    if not prefix or prefix == data:
        raise ConfigError(
            "dead_letter_prefix",
            f"expected a prefix other than the data prefix {data!r}, found {given!r}",
        )
    return prefix


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetterRecord:
    """What a dead-letter copy is: the manifest entry it came from, and why it is there."""

    sequence: int
    location: str
    queue: str
    reason: str
    quarantined_at_ms: int
    batch_path: str
    """The copy of the batch object, in the same store."""
    metadata: tuple[Metadata, ...] = ()

    def to_json(self) -> bytes:
        record = {
            "version": 1,
            "sequence": self.sequence,
            "location": self.location,
            "queue": self.queue,
            "reason": self.reason,
            "quarantined_at_ms": self.quarantined_at_ms,
            "batch_path": self.batch_path,
            "metadata": [
                {
                    "start_index": item.start_index,
                    "ingestion_time_ms": item.ingestion_time_ms,
                    "payload": base64.b64encode(item.payload).decode(),
                }
                for item in self.metadata
            ],
        }
        return json.dumps(record, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, *, name: str) -> DeadLetterRecord:
        """Raises:
        FormatError: not a dead-letter record.
        """
        try:
            raw = json.loads(data)
            if raw.get("version") != 1:
                raise FormatError(
                    f"{name}: expected version 1, found {raw.get('version')!r}", field="version"
                )
            return cls(
                sequence=int(raw["sequence"]),
                location=str(raw["location"]),
                queue=str(raw["queue"]),
                reason=str(raw["reason"]),
                quarantined_at_ms=int(raw["quarantined_at_ms"]),
                batch_path=str(raw["batch_path"]),
                metadata=tuple(
                    Metadata(
                        int(item["start_index"]),
                        int(item["ingestion_time_ms"]),
                        base64.b64decode(item["payload"]),
                    )
                    for item in raw["metadata"]
                ),
            )
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise FormatError(f"{name}: expected a dead-letter record, found {err!r}") from err


@dataclass(frozen=True, slots=True, kw_only=True)
class QuarantineOutcome:
    sequence: int
    location: str
    state: SetAside
    dead_letter: str | None
    """The copy of the batch object; ``None`` when nothing was set aside."""
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayOutcome:
    sequence: int
    location: str
    rows: int | None
    """Rows written; ``None`` when it had been replayed before (nothing written)."""


def set_aside(
    store: ObjectStore,
    sink: QuarantineLedger,
    *,
    queue: str,
    sequence: int,
    location: str,
    metadata: tuple[Metadata, ...],
    reason: str,
    dead_letter_prefix: str,
    clock: Clock | None = None,
) -> QuarantineOutcome:
    """Copy one batch to the dead-letter prefix, then record it quarantined in the sink.

    No checks of whether it should be (:func:`quarantine` makes them; the consumer service
    knows it is stopped on it). The copy lands before the sink's record commits, so a crash in
    between leaves a copy nothing refers to and the batch still in the queue; a retry
    overwrites the copy and records it.

    Raises:
        NotFoundError: the batch object is missing (nothing to set aside; nothing recorded).
        StorageError: the store failed (retry).
        SinkError: the database refused or failed.
    """
    batch_path, record_path = dead_letter_paths(dead_letter_prefix, sequence)
    _copy_batch(store, location, batch_path, sequence=sequence)
    record = DeadLetterRecord(
        sequence=sequence,
        location=location,
        queue=queue,
        reason=reason,
        quarantined_at_ms=(clock or SystemClock()).now_ms(),
        batch_path=batch_path,
        metadata=metadata,
    )
    store.put(record_path, record.to_json())
    state = sink.record_quarantine(
        queue, sequence=sequence, location=location, reason=reason, dead_letter=batch_path
    )
    kept: str | None = batch_path
    if state in (SetAside.WRITTEN, SetAside.DUPLICATE):
        # Its rows are in the table already (or set aside under another sequence): the copy
        # is not needed, and a dead-letter prefix holding it would say otherwise.
        kept = None
        for failure in store.delete_many([batch_path, record_path]):
            logger.warning("could not delete the unneeded copy %s: %s", failure.path, failure)
    else:
        logger.warning(
            "sequence %s (%s) quarantined: copied to %s; reason: %s",
            sequence,
            location,
            batch_path,
            reason,
        )
    return QuarantineOutcome(
        sequence=sequence, location=location, state=state, dead_letter=kept, reason=reason
    )


def _copy_batch(store: ObjectStore, location: str, batch_path: str, *, sequence: int) -> None:
    """Copy the batch object to ``batch_path`` in the dead-letter prefix.

    Raises:
        NotFoundError: the batch object is missing (nothing to set aside).
    """
    try:
        store.copy(location, batch_path)
    except NotFoundError as err:
        raise NotFoundError(
            f"sequence {sequence}: batch object {location} is missing; there is nothing to "
            "set aside"
        ) from err


def quarantine(
    config: ConsumerConfig,
    sink: AdbcSink,
    *,
    sequence: int,
    reason: str,
    dead_letter_prefix: str | None = None,
    force: bool = False,
) -> QuarantineOutcome:
    """Set aside the batch the consumer is stopped on (``millpond quarantine``).

    Args:
        config: the consumer's queue (store, manifest path, data prefix).
        sink: the consumer's sink (same table and progress table).
        sequence: the batch to set aside: the one the consumer is stopped on.
        reason: why, recorded with it.
        dead_letter_prefix: default ``{data_path_prefix}-dead-letter``.
        force: quarantine even though the consumer's report says it is running normally.

    Raises:
        InvalidInputError: ``sequence`` is not the batch the consumer is stopped on (not in
            the queue, already written, behind another one, or the consumer is running);
            nothing was copied or recorded.
        ConfigError: an empty reason or a bad dead-letter prefix.
        NotFoundError: no queue there, or the batch object is missing.
        StorageError, SinkError: the store or the database failed.
    """
    if not reason.strip():
        raise ConfigError("reason", "expected why the batch is set aside, found ''")
    prefix = dead_letter_prefix_for(config, dead_letter_prefix)
    store = open_store(config.store, config.store_options)
    queue = queue_identity(store.url, config.manifest_path)
    snapshot = read_manifest(store, config.manifest_path)
    # The entry may sit in the consumer's backlog index rather than the manifest.
    head, indexed = read_indexed(store, config.data_path_prefix)
    manifest = queue_view(snapshot.manifest, head, indexed)
    last = sink.last_sequence(queue)  # refuses a sink of another queue
    if last is not None and sequence <= last:
        return _quarantined_before(sink, queue, sequence=sequence, last=last)
    entry = _entry_stopped_on(manifest, sequence=sequence, last=last, config=config, sink=sink)
    _refuse_while_running(store, config, epoch=manifest.epoch, sequence=sequence, force=force)
    outcome = set_aside(
        store,
        sink,
        queue=queue,
        sequence=sequence,
        location=entry.location,
        metadata=entry.metadata,
        reason=reason,
        dead_letter_prefix=prefix,
    )
    if outcome.state == SetAside.QUARANTINED:
        _note_set_aside(store, config, queue=queue, sequence=sequence, reason=reason)
    return outcome


def _note_set_aside(
    store: ObjectStore, config: ConsumerConfig, *, queue: str, sequence: int, reason: str
) -> None:
    """List the batch as set aside in the consumer's written-through mark, so producers
    waiting for it (``wait_written``, ``await_sink``) fail naming it rather than return once
    the consumer moves past it. Best effort: the quarantine itself is done."""
    try:
        note_set_aside(
            store, config.data_path_prefix, queue=queue, sequence=sequence, reason=reason
        )
    except MillpondError as err:
        logger.warning(
            "sequence %s is quarantined, but the written-through mark could not list it (a "
            "producer waiting for it is not told): %s",
            sequence,
            err,
        )


def _quarantined_before(
    sink: AdbcSink, queue: str, *, sequence: int, last: int
) -> QuarantineOutcome:
    """``sequence`` is recorded in the sink already: quarantined before (nothing changes).

    Raises:
        InvalidInputError: it was written, not set aside; there is nothing to set aside.
    """
    rows = sink.quarantined(queue, sequence=sequence)
    if rows:
        row = rows[0]
        return QuarantineOutcome(
            sequence=sequence,
            location=row.location,
            state=SetAside.ALREADY_QUARANTINED,
            dead_letter=row.dead_letter,
            reason=row.reason,
        )
    raise InvalidInputError(
        f"sequence: sequence {sequence} is already recorded in {sink.description} (the "
        f"last recorded sequence is {last}); there is nothing to set aside"
    )


def _entry_stopped_on(
    manifest: Manifest,
    *,
    sequence: int,
    last: int | None,
    config: ConsumerConfig,
    sink: AdbcSink,
) -> ManifestEntry:
    """The queue's entry of ``sequence``, the batch a consumer of the sink stops on next.

    Raises:
        InvalidInputError: ``sequence`` is not in the queue, or another batch comes first.
    """
    entry = next((e for e in manifest.entries if e.sequence == sequence), None)
    if entry is None:
        held = (
            f"{manifest.entries[0].sequence}..{manifest.entries[-1].sequence}"
            if manifest.entries
            else "nothing"
        )
        raise InvalidInputError(
            f"sequence: expected a sequence in the queue {config.manifest_path} (it holds "
            f"{held}), found {sequence}"
        )
    expected = last + 1 if last is not None else manifest.entries[0].sequence
    if sequence != expected:
        raise InvalidInputError(
            f"sequence: expected {expected}, the batch a consumer of {sink.description} stops "
            f"on next (its last recorded sequence is {last}), found {sequence}: set aside only "
            "the batch the consumer is stopped on, one at a time"
        )
    return entry


def _refuse_while_running(
    store: ObjectStore, config: ConsumerConfig, *, epoch: int, sequence: int, force: bool
) -> None:
    """Raises:
    InvalidInputError: the consumer's report (of this epoch, not stale) says it is running
        normally, so it is not stopped on ``sequence``; unless ``force``.
    """
    report = read_report(store, config.data_path_prefix)
    if (
        not force
        and report is not None
        and report.state == ServiceState.RUNNING
        and report.epoch == epoch
        and not report.stale(SystemClock().now_ms())
    ):
        raise InvalidInputError(
            f"sequence: the consumer (epoch {report.epoch}, {report.host} pid {report.pid}) is "
            f"running, not stopped on sequence {sequence}; it would write it (pass --force to "
            "set it aside anyway)"
        )


def replay(
    config: ConsumerConfig,
    sink: AdbcSink,
    *,
    sequence: int,
    dead_letter_prefix: str | None = None,
) -> ReplayOutcome:
    """Write a quarantined batch from its dead-letter copy, exactly once (``millpond replay``).

    Raises:
        NotFoundError: no dead-letter copy of ``sequence``.
        InvalidInputError: the copy belongs to another queue.
        FormatError: the copy still cannot be decoded or read as rows (it stays quarantined).
        SinkError: the sink has no quarantine of ``sequence``, or refuses the rows (it stays
            quarantined), or failed.
        StorageError: the store failed.
    """
    prefix = dead_letter_prefix_for(config, dead_letter_prefix)
    store = open_store(config.store, config.store_options)
    queue = queue_identity(store.url, config.manifest_path)
    _batch_path, record_path = dead_letter_paths(prefix, sequence)
    try:
        raw = store.get(record_path).data
    except NotFoundError as err:
        raise NotFoundError(
            f"no dead-letter record of sequence {sequence} at {record_path} (was it "
            "quarantined with another --dead-letter-prefix?)"
        ) from err
    record = DeadLetterRecord.from_json(raw, name=record_path)
    if record.sequence != sequence:
        raise FormatError(
            f"{record_path}: expected the record of sequence {sequence}, found {record.sequence}",
            field="sequence",
        )
    if record.queue != queue:
        raise InvalidInputError(
            f"sequence: {record_path} belongs to queue {record.queue}, not {queue}"
        )
    rows = sink.quarantined(queue, sequence=sequence)
    if rows and rows[0].replayed_at_ms is not None:
        return ReplayOutcome(sequence=sequence, location=record.location, rows=None)
    data = store.get(record.batch_path).data
    try:
        entries = decode_batch(data, name=record.batch_path)
    except FormatError as err:
        raise FormatError(
            f"sequence {sequence} still cannot be decoded: {err}; repair or replace "
            f"{record.batch_path}, then replay again",
            field=err.field,
            offset=err.offset,
        ) from err
    batch = ConsumedBatch(
        entries=tuple(entries),
        sequence=sequence,
        location=record.location,
        metadata=record.metadata,
        queue=queue,
    )
    written = sink.replay(batch)
    return ReplayOutcome(sequence=sequence, location=record.location, rows=written)


def quarantine_command(
    store_url: str,
    sequence: int,
    *,
    sink: str,
    table: str = "millpond_rows",
    progress_table: str = "millpond_progress",
    manifest_path: str = "ingest/manifest",
    data_prefix: str = "ingest",
    dead_letter_prefix: str | None = None,
) -> str:
    """The ``millpond quarantine`` command line that sets ``sequence`` aside (with a reason
    to fill in); options at their defaults are left out."""
    words = ["millpond", "quarantine", store_url, "--sequence", str(sequence)]
    words += ["--reason", "WHY"]
    for flag, value, default in (
        ("--manifest-path", manifest_path, "ingest/manifest"),
        ("--data-prefix", data_prefix, "ingest"),
        ("--dead-letter-prefix", dead_letter_prefix, None),
        ("--sink", sink, None),
        ("--table", table, "millpond_rows"),
        ("--progress-table", progress_table, "millpond_progress"),
    ):
        if value is not None and value != default:
            words += [flag, value]
    return shlex.join(words)


# -- the command line ------------------------------------------------------------------------


def add_sink_arguments(parser: argparse.ArgumentParser) -> None:
    """The sink options of ``consume`` that quarantine and replay must repeat."""
    parser.add_argument(
        "--sink", required=True, metavar="URL", help="sqlite:///path.db or postgresql://..."
    )
    parser.add_argument("--table", default="millpond_rows", help="target table [schema.]name")
    parser.add_argument("--progress-table", default="millpond_progress")
    parser.add_argument(
        "--dead-letter-prefix",
        default=None,
        help="where set-aside batches are copied (default {data-prefix}-dead-letter)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument(
        "--sequence", type=int, required=True, help="the batch the consumer is stopped on"
    )
    parser.add_argument("--reason", required=True, help="why it is set aside (recorded)")
    add_sink_arguments(parser)
    parser.add_argument(
        "--force",
        action="store_true",
        help="set it aside even though the consumer's report says it is running normally",
    )


def config_from_args(args: argparse.Namespace) -> ConsumerConfig:
    return ConsumerConfig(
        store=args.store,
        store_options=parse_options(args.store_option),
        manifest_path=args.manifest_path,
        data_path_prefix=args.data_prefix,
        gc_enabled=False,
    )


def run(args: argparse.Namespace) -> int:
    """``millpond quarantine``.

    Raises:
        MillpondError: refused (exit 1) or a bad option (exit 2).
    """
    config = config_from_args(args)
    require_queue(open_store(config.store, config.store_options), config.manifest_path)
    with open_sink(args.sink, table=args.table, progress_table=args.progress_table) as sink:
        outcome = quarantine(
            config,
            sink,
            sequence=args.sequence,
            reason=args.reason,
            dead_letter_prefix=args.dead_letter_prefix,
            force=args.force,
        )
    record: dict[str, Any] = {
        "sequence": outcome.sequence,
        "location": outcome.location,
        "state": str(outcome.state),
        "dead_letter": outcome.dead_letter,
        "reason": outcome.reason,
    }
    text = {
        SetAside.QUARANTINED: f"sequence {outcome.sequence} ({outcome.location}) quarantined: "
        f"copied to {outcome.dead_letter}; a consumer moves past it",
        SetAside.ALREADY_QUARANTINED: f"sequence {outcome.sequence} ({outcome.location}) was "
        f"already quarantined (copy at {outcome.dead_letter}); nothing changed",
        SetAside.WRITTEN: f"sequence {outcome.sequence} was written meanwhile; nothing set aside",
        SetAside.DUPLICATE: f"sequence {outcome.sequence}: its location {outcome.location} is "
        "already recorded under another sequence; recorded as a duplicate, nothing set aside",
    }[outcome.state]
    emit(args, record, [text])
    return 1 if outcome.state == SetAside.WRITTEN else 0
