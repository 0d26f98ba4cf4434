"""Quarantined batches in a sink's progress: set aside on purpose, replayed exactly once.

A batch an operator quarantines (``millpond quarantine``) keeps two rows in the database:

* its **progress row**, shaped like a written batch's: ``(target_table, sequence, location,
  row_count 0, duplicate FALSE)``. ``last_sequence()`` counts it, so a resumed consumer starts
  after it, and its location stays in the unique index over written locations, so the same
  location appended again (a recovering producer) is skipped like any batch already written;
* a row of ``{progress_table}_quarantine``: the reason, where the batch object was copied (the
  dead-letter prefix), when; once replayed, when and how many rows.

Replaying marks that row and writes the rows in one transaction. The mark is an ``UPDATE ...
WHERE replayed_at_ms IS NULL``: a second replay, or two at once, find it taken and write
nothing (PostgreSQL re-checks the condition after the first transaction commits; SQLite
serializes writers with ``BEGIN IMMEDIATE``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

from millpond.consumer.sinks._rows import RoutedRows, batch_parts
from millpond.consumer.sinks.base import SinkError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from millpond.common.metrics import Counters
    from millpond.consumer._batch import ConsumedBatch
    from millpond.consumer.sinks._names import TableName
    from millpond.consumer.sinks.base import EntryFormat

__all__ = ["QUARANTINE_SUFFIX", "QuarantineLedger", "QuarantineRow", "SetAside"]

_T = TypeVar("_T")

QUARANTINE_SUFFIX = "_quarantine"
"""The quarantine table is the progress table's name with this suffix, in its schema."""


class SetAside(StrEnum):
    """What recording a quarantine found."""

    QUARANTINED = "quarantined"
    """Recorded now: the consumer moves past the sequence."""
    ALREADY_QUARANTINED = "already_quarantined"
    """Recorded before, with the same location (a retried quarantine)."""
    WRITTEN = "written"
    """The sequence is already recorded as written or skipped: nothing to set aside."""
    DUPLICATE = "duplicate"
    """The location is already recorded under another sequence (written or quarantined
    there): the sequence is recorded as a duplicate, like any location appended twice."""


@dataclass(frozen=True, slots=True, kw_only=True)
class QuarantineRow:
    """A quarantined batch as the sink records it."""

    sequence: int
    location: str
    reason: str
    dead_letter: str
    """Where the batch object was copied, a path in the queue's store."""
    quarantined_at_ms: int
    replayed_at_ms: int | None
    """When ``millpond replay`` wrote it, or ``None`` while it is set aside."""
    replayed_rows: int | None


class QuarantineLedger:
    """The quarantine half of :class:`~millpond.consumer.sinks.AdbcSink` (a mixin)."""

    if TYPE_CHECKING:
        _table: TableName
        _progress: TableName
        _quarantine: TableName
        _description: str
        _entry_format: EntryFormat
        _sequence_column: str | None
        counters: Counters

        def _transaction(self, work: Callable[[Any], _T]) -> _T: ...
        def _own(self, cur: Any, queue: str) -> None: ...
        def _param(self, index: int) -> str: ...
        def _insert_progress(
            self, cur: Any, rows: Sequence[tuple[int, str, int]], now_ms: int, *, duplicate: bool
        ) -> list[tuple[Any, ...]]: ...
        def _write_parts(
            self, cur: Any, queues: Sequence[str], parts: Sequence[RoutedRows]
        ) -> None: ...
        @staticmethod
        def _fetch(cur: Any, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]: ...

    @property
    def description(self) -> str:
        """The database, without credentials (``sqlite:///path``, ``postgresql://user@host``)."""
        return self._description

    @property
    def quarantine_table(self) -> str:
        """The table recording quarantined batches, ``[schema.]name``."""
        return str(self._quarantine)

    def record_quarantine(
        self, queue: str, *, sequence: int, location: str, reason: str, dead_letter: str
    ) -> SetAside:
        """Record ``sequence`` as quarantined, in one transaction with its progress row.

        Call it only once the batch object is safely copied to ``dead_letter``: from this
        commit on, a consumer moves past the sequence.

        Raises:
            SinkError: the table belongs to another queue, the sequence is quarantined with
                another location (permanent), or the database failed.
        """
        now_ms = time.time_ns() // 1_000_000

        def work(cur: Any) -> SetAside:
            self._own(cur, queue)
            table = str(self._table)  # as resolved by _own: what progress is keyed by
            p = self._param
            if self._insert_progress(cur, [(sequence, location, 0)], now_ms, duplicate=False):
                cur.execute(
                    f"INSERT INTO {self._quarantine.sql} (target_table, sequence, location, "
                    f"reason, dead_letter, quarantined_at_ms) VALUES ({p(1)}, {p(2)}, {p(3)}, "
                    f"{p(4)}, {p(5)}, {p(6)})",
                    (table, sequence, location, reason, dead_letter, now_ms),
                )
                return SetAside.QUARANTINED
            if self._fetch(
                cur,
                f"SELECT 1 FROM {self._progress.sql} WHERE target_table = {p(1)} "
                f"AND sequence = {p(2)}",
                (table, sequence),
            ):
                row = self._row(cur, sequence)
                if row is None:
                    return SetAside.WRITTEN
                self._check_location(row, location)
                return SetAside.ALREADY_QUARANTINED
            # The sequence is free but the location is not: recorded elsewhere already.
            self._insert_progress(cur, [(sequence, location, 0)], now_ms, duplicate=True)
            return SetAside.DUPLICATE

        return self._transaction(work)

    def skip_recorded(self, queue: str, *, sequence: int, location: str) -> int | None:
        """Record ``sequence`` as a duplicate when ``location`` is recorded under an earlier
        sequence (written or set aside), in one transaction; returns that earlier sequence, or
        ``None`` when the location was never recorded (then nothing is written).

        For an entry whose batch object is gone: a location appended again after its first
        entry was consumed (a producer or a Spark commit recovering) outlives its object once
        the garbage collector removed it. Its rows are in the table already; without this the
        consumer would stop on the missing object for good.

        Raises:
            SinkError: the table belongs to another queue, or the database failed.
        """
        now_ms = time.time_ns() // 1_000_000

        def work(cur: Any) -> int | None:
            self._own(cur, queue)
            table = str(self._table)  # as resolved by _own: what progress is keyed by
            p = self._param
            earlier = self._fetch(
                cur,
                f"SELECT min(sequence) FROM {self._progress.sql} WHERE target_table = {p(1)} "
                f"AND location = {p(2)} AND sequence < {p(3)}",
                (table, location, sequence),
            )
            if not earlier or earlier[0][0] is None:
                return None
            self._insert_progress(cur, [(sequence, location, 0)], now_ms, duplicate=True)
            return int(earlier[0][0])

        return self._transaction(work)

    def quarantined(self, queue: str, *, sequence: int | None = None) -> list[QuarantineRow]:
        """The quarantined batches of this table (replayed ones too), in sequence order.

        Raises:
            SinkError: the table belongs to another queue, or the database failed.
        """

        def work(cur: Any) -> list[QuarantineRow]:
            self._own(cur, queue)
            if sequence is not None:
                row = self._row(cur, sequence)
                return [row] if row is not None else []
            rows = self._fetch(
                cur,
                f"SELECT {_COLUMNS} FROM {self._quarantine.sql} WHERE target_table = "
                f"{self._param(1)} ORDER BY sequence",
                (str(self._table),),
            )
            return [_to_row(row) for row in rows]

        return self._transaction(work)

    def replay(self, batch: ConsumedBatch) -> int | None:
        """Write a quarantined batch's rows and mark it replayed, in one transaction.

        Returns:
            The rows written, or ``None`` when it was replayed before (nothing written).

        Raises:
            FormatError: the entries cannot be read as rows (nothing written).
            SinkError: the sequence is not quarantined in this table, or with another
                location (permanent); the table belongs to another queue; the database
                refused the rows (permanent: it stays quarantined) or failed.
        """
        parts = batch_parts(batch, self._entry_format, sequence_column=self._sequence_column)
        count = sum(int(part.rows.num_rows) for part in parts)
        now_ms = time.time_ns() // 1_000_000

        def work(cur: Any) -> int | None:
            self._own(cur, batch.queue)
            table = str(self._table)  # as resolved by _own: what progress is keyed by
            p = self._param
            marked = self._fetch(
                cur,
                f"UPDATE {self._quarantine.sql} SET replayed_at_ms = {p(1)}, replayed_rows = "
                f"{p(2)} WHERE target_table = {p(3)} AND sequence = {p(4)} AND location = {p(5)} "
                "AND replayed_at_ms IS NULL RETURNING sequence",
                (now_ms, count, table, batch.sequence, batch.location),
            )
            if not marked:
                row = self._row(cur, batch.sequence)
                if row is None:
                    raise SinkError(
                        f"{self._description} table {table}: sequence {batch.sequence} is not "
                        f"quarantined (no row in {self._quarantine}); nothing to replay",
                        transient=False,
                    )
                self._check_location(row, batch.location)
                return None
            self._write_parts(cur, [batch.queue], parts)
            cur.execute(
                f"UPDATE {self._progress.sql} SET row_count = {p(1)} WHERE target_table = "
                f"{p(2)} AND sequence = {p(3)}",
                (count, table, batch.sequence),
            )
            return count

        try:
            written = self._transaction(work)
        except SinkError as err:
            if err.transient:
                raise
            raise SinkError(
                f"replaying sequence {batch.sequence} ({batch.location}): {err}", transient=False
            ) from err
        if written is not None:
            self.counters.add("batches_written")
            self.counters.add("rows_written", written)
        return written

    # -- helpers ---------------------------------------------------------------------------

    def _create_quarantine_table(self, cur: Any) -> None:
        cur.execute(
            f"CREATE TABLE IF NOT EXISTS {self._quarantine.sql} ("
            "target_table TEXT NOT NULL, sequence BIGINT NOT NULL, location TEXT NOT NULL, "
            "reason TEXT NOT NULL, dead_letter TEXT NOT NULL, quarantined_at_ms BIGINT NOT NULL, "
            "replayed_at_ms BIGINT, replayed_rows BIGINT, PRIMARY KEY (target_table, sequence))"
        )

    def _row(self, cur: Any, sequence: int) -> QuarantineRow | None:
        rows = self._fetch(
            cur,
            f"SELECT {_COLUMNS} FROM {self._quarantine.sql} WHERE target_table = "
            f"{self._param(1)} AND sequence = {self._param(2)}",
            (str(self._table), sequence),
        )
        return _to_row(rows[0]) if rows else None

    def _check_location(self, row: QuarantineRow, location: str) -> None:
        if row.location != location:
            raise SinkError(
                f"{self._description} table {self._table}: sequence {row.sequence} is "
                f"quarantined with location {row.location}, not {location}",
                transient=False,
            )


_COLUMNS = (
    "sequence, location, reason, dead_letter, quarantined_at_ms, replayed_at_ms, replayed_rows"
)


def _to_row(row: tuple[Any, ...]) -> QuarantineRow:
    sequence, location, reason, dead_letter, at_ms, replayed_ms, replayed_rows = row
    return QuarantineRow(
        sequence=int(sequence),
        location=str(location),
        reason=str(reason),
        dead_letter=str(dead_letter),
        quarantined_at_ms=int(at_ms),
        replayed_at_ms=None if replayed_ms is None else int(replayed_ms),
        replayed_rows=None if replayed_rows is None else int(replayed_rows),
    )
