"""Poison batches in the simulated world, set aside and replayed.

Two kinds of poison, each on a batch the queue still references:

* ``corrupt``: the batch object is overwritten with garbage (the consumer cannot decode it);
* ``refuse``: the database refuses the batch's rows for good (a trigger on the sink's table,
  as a constraint an operator added would; SQLite reports it as a permanent error).

The consumer stops on such a batch (the default), and the operator runs ``millpond quarantine``
for the sequence it names and starts it again; or the service sets it aside itself
(``--on-bad-batch quarantine``). Once everything is consumed the cause is fixed (the
dead-letter copy repaired, the trigger dropped) and every quarantined batch is replayed twice:
the first replay writes it, the second nothing.

The invariant before the replay: every staged record is in the sink once, or in exactly one
batch recorded as quarantined whose dead-letter copy is kept (never both). After the replay:
every staged record is in the sink once, as everywhere else.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path

from millpond.consumer import ConsumerConfig
from millpond.consumer.app.quarantine import quarantine, replay
from millpond.consumer.sinks import AdbcSink, SinkError
from millpond.errors import FormatError, MillpondError, NotFoundError, StorageError
from millpond.formats.batch import decode_batch
from millpond.formats.routing import split_table
from millpond.queue import read_manifest
from millpond.queue.claim import queue_identity
from tests.system.roles import RETRY, QueueSpec, open_world_sink, sink_rows
from tests.system.sim import Recorder, RoleStore

__all__ = ["GARBAGE", "Poisoner"]

GARBAGE = b"\x00 poisoned by the schedule \x00"
_SEQUENCE = re.compile(r"sequence (\d+)")


class Poisoner:
    """Poisons batches of one queue and plays the operator who sets them aside."""

    def __init__(
        self,
        recorder: Recorder,
        queue: QueueSpec,
        sink_path: Path,
        down: Callable[[], bool],
        *,
        tables: bool = False,
    ) -> None:
        self._tables = tables
        """The queue feeds upserted tables too (``ConsumerRole.tables``); only batches of its
        own table are poisoned: a batch of upserts set aside and replayed after newer writes
        of its keys would win over them, as its replay is a write made then."""
        self._recorder = recorder
        self._queue = queue
        self._sink_path = sink_path
        self._down = down
        self.originals: dict[str, bytes] = {}
        """Corrupted location -> its bytes before the first corruption."""
        self.refused: dict[str, list[bytes]] = {}
        """Location whose rows the database refuses -> those rows."""
        self._triggers = 0
        self.auto = False
        """Consumers set poison aside themselves (``--on-bad-batch quarantine``)."""
        self.by_operator = 0
        """Batches ``millpond quarantine`` set aside (the rest were set aside by services)."""
        self.rows_before_replay: list[bytes] = []
        self.set_aside: dict[str, list[bytes]] = {}
        """Before the replay: quarantined location -> the records it held."""

    @property
    def on_bad_batch(self) -> str:
        return "quarantine" if self.auto else "stop"

    @property
    def poisoned(self) -> int:
        return len(self.originals.keys() | self.refused.keys())

    def poison(self, index: int, how: str, mode: str) -> None:
        """Poison one batch the queue still references (``corrupt`` or ``refuse``)."""
        self.auto = self.auto or mode == "auto"
        try:
            entries = read_manifest(self._recorder, self._queue.manifest_path).manifest.entries
            if not entries:
                return
            entry = entries[index % len(entries)]
            if any(split_table(item.payload)[0] is not None for item in entry.metadata):
                return  # a batch of upserts (see __init__)
            location = entry.location
            data = self._recorder.get(location).data
        except NotFoundError:
            return
        if how == "corrupt":
            self.originals.setdefault(location, data)
            self._recorder.put(location, GARBAGE)
            return
        try:
            records = list(decode_batch(data, name=location))
        except FormatError:
            return  # corrupted already: the consumer stops on it for that
        if self._refuse(records):
            self.refused[location] = records

    def _refuse(self, records: list[bytes]) -> bool:
        """A trigger refusing ``records`` in the sink's table; ``False`` when there is no
        table yet (nothing was written)."""
        values = ", ".join(f"X'{record.hex()}'" for record in records)
        with contextlib.closing(sqlite3.connect(self._sink_path)) as conn:
            try:
                conn.execute(
                    f'CREATE TRIGGER "refuse_{self._triggers}" '
                    f'BEFORE INSERT ON "{self._queue.table}" WHEN NEW.payload IN ({values}) '
                    "BEGIN SELECT RAISE(ABORT, 'refused by the schedule'); END"
                )
            except sqlite3.OperationalError as err:
                if "no such table" in str(err):
                    return False
                raise
            conn.commit()
        self._triggers += 1
        return True

    def _fix_the_table(self) -> None:
        with contextlib.closing(sqlite3.connect(self._sink_path)) as conn:
            for number in range(self._triggers):
                conn.execute(f'DROP TRIGGER IF EXISTS "refuse_{number}"')
            conn.commit()

    def stopped_on_poison(self, err: BaseException) -> bool:
        """Whether a consumer stopped on a batch this schedule poisoned."""
        if isinstance(err, FormatError):
            return any(location in str(err) for location in self.originals)
        if isinstance(err, SinkError):
            return any(location in str(err) for location in self.refused)
        return False

    def operator_sets_aside(self, err: MillpondError) -> bool:
        """``millpond quarantine`` for the sequence the error names; ``False`` when the store
        is down (the operator tries again at the next stop).

        Raises:
            MillpondError: the quarantine was refused (a violation: it is the stopped batch).
        """
        found = _SEQUENCE.search(str(err))
        assert found is not None, f"the error names no sequence: {err}"
        store = RoleStore(self._recorder, "operator", self._down)
        try:
            with self._sink() as sink:
                quarantine(
                    self._config(store),
                    sink,
                    sequence=int(found.group(1)),
                    reason="poisoned by the schedule",
                )
        except StorageError:
            return False
        self.by_operator += 1
        return True

    def replay_all(self) -> list[str]:
        """Snapshot what is set aside, fix the causes, replay each batch twice (the second
        must write nothing). Returns the problems found."""
        problems: list[str] = []
        self.rows_before_replay = sink_rows(self._sink_path, self._queue.table)
        self._fix_the_table()
        store = RoleStore(self._recorder, "operator", lambda: False)
        with self._sink() as sink:
            rows = sink.quarantined(queue_identity(self._recorder.url, self._queue.manifest_path))
            for row in rows:
                if row.location not in self.originals and row.location not in self.refused:
                    problems.append(
                        f"sequence {row.sequence} ({row.location}) was set aside but never poisoned"
                    )
                    continue
                try:
                    copy = self._recorder.get(row.dead_letter).data
                except NotFoundError:
                    problems.append(f"the dead-letter copy {row.dead_letter} is gone")
                    continue
                original = self.originals.get(row.location)
                if original is not None:
                    self._recorder.put(row.dead_letter, original)  # the copy is repaired
                    copy = original
                records = list(decode_batch(copy, name=row.dead_letter))
                self.set_aside[row.location] = records
                first = replay(self._config(store), sink, sequence=row.sequence)
                again = replay(self._config(store), sink, sequence=row.sequence)
                if (first.rows, again.rows) != (len(records), None):
                    problems.append(
                        f"replaying sequence {row.sequence} wrote {first.rows}, then "
                        f"{again.rows} rows (expected {len(records)}, then none)"
                    )
        return problems

    def _config(self, store: RoleStore) -> ConsumerConfig:
        return ConsumerConfig(
            store=store,
            manifest_path=self._queue.manifest_path,
            data_path_prefix=self._queue.data_path_prefix,
            gc_enabled=False,
            retry=RETRY,
            clock=self._recorder.clock,
        )

    def _sink(self) -> AdbcSink:
        return open_world_sink(
            self._sink_path, self._queue.table, self._queue.progress_table, tables=self._tables
        )
