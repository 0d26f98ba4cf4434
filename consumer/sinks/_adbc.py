"""The transaction both ADBC sinks share: claim the batch, evolve the table, bulk-ingest.

One write is one transaction::

    INSERT INTO progress (target_table, sequence, location, ...) ON CONFLICT DO NOTHING
    -- no row inserted: the sequence, or the location, is already recorded -> skip
    [CREATE TABLE | ALTER TABLE ... ADD COLUMN | ALTER COLUMN ... TYPE]   -- schema drift
    bulk ingest of the rows (ADBC ``adbc_ingest``: COPY on PostgreSQL)
    COMMIT

The progress table has the primary key ``(target_table, sequence)`` and a unique index on
``(target_table, location)`` over written batches. Claiming first means two consumers that
race on one batch (a fenced one that has not noticed yet, and its successor) serialize on the
progress row: the second blocks until the first commits, then finds the row and skips. A
skipped batch still gets a ``duplicate`` row, so :meth:`last_sequence` covers it and a resumed
consumer does not look for entries that were dequeued after being skipped.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa

from millpond.common.metrics import Counters
from millpond.consumer._batch import ConsumedBatch
from millpond.consumer.sinks._rows import batch_rows
from millpond.consumer.sinks.base import EntryFormat, SinkError
from millpond.errors import ConfigError
from millpond.formats.arrow import unify_tables

__all__ = ["AdbcSink", "TableName", "quote"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_QUICK_RETRIES = 3
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def quote(identifier: str) -> str:
    """A double-quoted SQL identifier (PostgreSQL and SQLite agree on this)."""
    if "\x00" in identifier:
        raise SinkError(f"identifier {identifier!r} contains a NUL byte", transient=False)
    return '"' + identifier.replace('"', '""') + '"'


@dataclass(frozen=True, slots=True)
class TableName:
    """``[schema.]table``; both parts plain identifiers."""

    name: str
    schema: str | None = None

    @classmethod
    def parse(cls, key: str, value: str) -> TableName:
        """Parse ``table`` or ``schema.table``.

        Raises:
            ConfigError: a part that is not ``[A-Za-z_][A-Za-z0-9_]*``.
        """
        parts = value.split(".") if isinstance(value, str) else []
        if not 1 <= len(parts) <= 2 or not all(_IDENTIFIER.match(part) for part in parts):
            raise ConfigError(
                key, f"expected a table name like 'rows' or 'schema.rows', found {value!r}"
            )
        return cls(name=parts[-1], schema=parts[0] if len(parts) == 2 else None)

    @property
    def sql(self) -> str:
        return f"{quote(self.schema)}.{quote(self.name)}" if self.schema else quote(self.name)

    def __str__(self) -> str:
        return f"{self.schema}.{self.name}" if self.schema else self.name


class _RolledBack(Exception):
    """Ends a probe transaction: it must roll back."""


class AdbcSink(ABC):
    """A sink over an ADBC DB-API connection; subclasses supply the dialect."""

    def __init__(
        self,
        *,
        description: str,
        table: str,
        entry_format: EntryFormat | str,
        sequence_column: str | None,
        progress_table: str,
    ) -> None:
        self._description = description
        self._table = TableName.parse("table", table)
        self._progress = TableName.parse("progress_table", progress_table)
        self._entry_format = EntryFormat.parse(entry_format)
        if sequence_column is not None and not sequence_column:
            raise ConfigError("sequence_column", "expected a column name or None, found ''")
        self._sequence_column = sequence_column
        self._conn: Any = None
        # The target table's columns as the database reports them, or None when unknown.
        # Cleared on every failed transaction: DDL that rolled back must not stay cached.
        self._columns: dict[str, pa.DataType] | None = None
        self.counters = Counters("batches_written", "batches_skipped", "rows_written")

    # -- Sink ------------------------------------------------------------------------------

    @property
    def rows_written(self) -> int:
        return self.counters.get("rows_written")

    @property
    def table(self) -> str:
        """The target table, ``[schema.]name``."""
        return str(self._table)

    def last_sequence(self) -> int | None:
        """The highest sequence recorded for this table, or ``None``.

        Raises:
            SinkError: the database failed.
        """
        rows = self._transaction(
            lambda cur: self._fetch(
                cur,
                f"SELECT max(sequence) FROM {self._progress.sql} WHERE target_table = "
                f"{self._param(1)}",
                (str(self._table),),
            )
        )
        value = rows[0][0] if rows else None
        return int(value) if value is not None else None

    def write(self, batch: ConsumedBatch) -> bool:
        """Write the batch's rows, sequence and location in one transaction.

        Returns:
            ``False`` when the sequence or the location was already recorded (skipped).

        Raises:
            FormatError: the entries cannot be read as rows (nothing written).
            SinkError: the database failed (nothing of this batch committed).
        """
        return self.write_many([batch])[0]

    def write_many(self, batches: Sequence[ConsumedBatch]) -> list[bool]:
        """Write several batches, in sequence order, in one transaction (all or nothing).

        Each batch's rows, sequence and location still commit together; sharing the
        transaction only saves commits when the consumer has a backlog.

        Returns:
            Per batch, ``True`` when written, ``False`` when skipped as already recorded.

        Raises:
            FormatError: a batch's entries cannot be read as rows, or the batches' schemas
                clash (nothing written; write them one by one to get the good ones in).
            SinkError: the database failed (nothing committed).
        """
        if not batches:
            return []
        rows = [
            batch_rows(batch, self._entry_format, sequence_column=self._sequence_column)
            for batch in batches
        ]
        written = self._transaction(lambda cur: self._write(cur, batches, rows))
        for batch, table, ok in zip(batches, rows, written, strict=True):
            if ok:
                self.counters.add("batches_written")
                self.counters.add("rows_written", table.num_rows)
            else:
                self.counters.add("batches_skipped")
                logger.info(
                    "sequence %s (%s) is already recorded in %s; skipped",
                    batch.sequence,
                    batch.location,
                    self._table,
                )
        return written

    def probe_write(self) -> None:
        """Connect, then create a scratch table and write a row into it, and roll back.

        For ``millpond doctor``: proves the database is reachable and the credentials may
        create tables and insert where the target table lives, and leaves nothing behind
        (the progress table, which connecting sets up, aside).

        Raises:
            SinkError: the database failed or refused.
        """
        scratch = TableName(f"millpond_doctor_{uuid.uuid4().hex[:12]}", self._table.schema)

        def work(cur: Any) -> None:
            cur.execute(f"CREATE TABLE {scratch.sql} (probe BIGINT NOT NULL)")
            cur.execute(f"INSERT INTO {scratch.sql} (probe) VALUES (1)")
            raise _RolledBack

        with contextlib.suppress(_RolledBack):
            self._transaction_once(work)

    def close(self) -> None:
        self._drop_connection()

    def __enter__(self) -> AdbcSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._description!r}, table={str(self._table)!r})"

    # -- dialect ---------------------------------------------------------------------------

    @abstractmethod
    def _open(self) -> Any:
        """A new DB-API connection, configured."""

    @abstractmethod
    def _begin(self, conn: Any, cur: Any) -> None:
        """Start a write transaction."""

    @abstractmethod
    def _commit(self, conn: Any, cur: Any) -> None: ...

    @abstractmethod
    def _rollback(self, conn: Any, cur: Any) -> None: ...

    @abstractmethod
    def _param(self, index: int) -> str:
        """The placeholder of the 1-based parameter ``index``."""

    @abstractmethod
    def _sql_type(self, column: str, dtype: pa.DataType) -> str:
        """The column type to declare for an Arrow type."""

    @abstractmethod
    def _reflect(self, conn: Any, cur: Any) -> dict[str, pa.DataType] | None:
        """The target table's columns, or ``None`` when it does not exist."""

    @abstractmethod
    def _widen(self, column: str, existing: pa.DataType, incoming: pa.DataType) -> str | None:
        """An ``ALTER COLUMN ... TYPE`` statement when ``incoming`` needs a wider column."""

    @abstractmethod
    def _conform(self, rows: pa.Table, columns: dict[str, pa.DataType]) -> pa.Table:
        """The rows cast to what the table's columns accept."""

    @abstractmethod
    def _is_transient(self, err: Exception) -> bool:
        """Whether a driver error means "try again later"."""

    @abstractmethod
    def _driver_errors(self) -> tuple[type[Exception], ...]:
        """The driver's exception classes, translated into :class:`SinkError`."""

    # -- the transaction -------------------------------------------------------------------

    def _write(
        self, cur: Any, batches: Sequence[ConsumedBatch], rows: Sequence[pa.Table]
    ) -> list[bool]:
        now_ms = time.time_ns() // 1_000_000
        # A location repeated inside the group is a duplicate of its first occurrence.
        seen: set[str] = set()
        candidates: list[ConsumedBatch] = []
        for batch in batches:
            if batch.location not in seen:
                candidates.append(batch)
            seen.add(batch.location)
        counts = {
            batch.sequence: table.num_rows for batch, table in zip(batches, rows, strict=True)
        }
        claimed = {
            int(row[0])
            for row in self._insert_progress(cur, candidates, counts, now_ms, duplicate=False)
        }
        skipped = [batch for batch in batches if batch.sequence not in claimed]
        if skipped:
            # Record skips under their own sequence too (unless the sequence itself is what
            # is recorded), so last_sequence() moves past them.
            self._insert_progress(cur, skipped, counts, now_ms, duplicate=True)
        tables = [
            table
            for batch, table in zip(batches, rows, strict=True)
            if batch.sequence in claimed and table.num_rows
        ]
        if tables:
            combined = tables[0] if len(tables) == 1 else unify_tables(tables)
            combined = self._prepare(cur, combined)
            cur.adbc_ingest(
                self._table.name, combined, mode="append", db_schema_name=self._table.schema
            )
        return [batch.sequence in claimed for batch in batches]

    def _insert_progress(
        self,
        cur: Any,
        batches: Sequence[ConsumedBatch],
        counts: dict[int, int],
        now_ms: int,
        *,
        duplicate: bool,
    ) -> list[tuple[Any, ...]]:
        """One multi-row INSERT of progress rows; returns the sequences actually inserted.

        Rows go in sequence order, so two consumers racing on overlapping groups take the
        row locks in the same order and cannot deadlock.
        """
        flag = "TRUE" if duplicate else "FALSE"
        groups: list[str] = []
        params: list[Any] = []
        for batch in batches:
            n = len(params)
            p = self._param
            groups.append(f"({p(n + 1)}, {p(n + 2)}, {p(n + 3)}, {p(n + 4)}, {flag}, {p(n + 5)})")
            params.extend(
                (str(self._table), batch.sequence, batch.location, counts[batch.sequence], now_ms)
            )
        return self._fetch(
            cur,
            f"INSERT INTO {self._progress.sql} (target_table, sequence, location, row_count, "
            f"duplicate, committed_at_ms) VALUES {', '.join(groups)} "
            "ON CONFLICT DO NOTHING RETURNING sequence",
            tuple(params),
        )

    def _prepare(self, cur: Any, rows: pa.Table) -> pa.Table:
        """Create or evolve the target table for ``rows``; return them conformed to it."""
        columns = self._columns
        if columns is None:
            columns = self._reflect(self._conn, cur)
        if columns is None:
            definitions = ", ".join(
                f"{quote(field.name)} {self._sql_type(field.name, field.type)}"
                for field in rows.schema
            )
            cur.execute(f"CREATE TABLE IF NOT EXISTS {self._table.sql} ({definitions})")
            columns = self._reflect(self._conn, cur) or {}
            logger.info("created table %s with %s columns", self._table, len(columns))
        changed = False
        for field in rows.schema:
            existing = columns.get(field.name)
            if existing is None:
                # Drifted schema: a new column, nullable so older rows read as NULL.
                cur.execute(
                    f"ALTER TABLE {self._table.sql} ADD COLUMN {quote(field.name)} "
                    f"{self._sql_type(field.name, field.type)}"
                )
                logger.info("added column %s to %s", field.name, self._table)
                changed = True
                continue
            statement = self._widen(field.name, existing, field.type)
            if statement is not None:
                cur.execute(statement)
                logger.info("widened column %s of %s for %s", field.name, self._table, field.type)
                changed = True
        if changed:
            columns = self._reflect(self._conn, cur) or {}
        self._columns = columns
        return self._conform(rows, columns)

    def _transaction(self, work: Callable[[Any], _T]) -> _T:
        # A few quick retries absorb the races of two consumers creating the same table and
        # a connection that dropped between writes; a database that stays down is the
        # caller's to wait out (the service backs off for as long as it takes).
        for attempt in range(_QUICK_RETRIES):
            try:
                return self._transaction_once(work)
            except SinkError as err:
                if not err.transient or attempt == _QUICK_RETRIES - 1:
                    raise
                logger.debug("transient sink error, retrying at once: %s", err)
                time.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    def _transaction_once(self, work: Callable[[Any], _T]) -> _T:
        try:
            conn = self._connection()
            cur = conn.cursor()
        except self._driver_errors() as err:
            self._drop_connection()
            raise self._translate(err) from err
        try:
            self._begin(conn, cur)
            result = work(cur)
            self._commit(conn, cur)
            return result
        except BaseException as err:
            self._columns = None
            try:
                self._rollback(conn, cur)
            except Exception:  # the connection is unusable; reopen next time
                self._drop_connection()
            if isinstance(err, self._driver_errors()):
                translated = self._translate(err)
                if translated.transient:
                    self._drop_connection()
                raise translated from err
            raise
        finally:
            try:
                cur.close()
            except Exception:  # closing a cursor of a dead connection
                logger.debug("closing a cursor failed", exc_info=True)

    def _translate(self, err: Exception) -> SinkError:
        transient = self._is_transient(err)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return SinkError(
            f"{self._description} table {self._table}: {type(err).__name__}: {first}",
            transient=transient,
        )

    def _connection(self) -> Any:
        if self._conn is None:
            conn = self._open()
            try:
                self._setup(conn)
            except BaseException:
                _close_quietly(conn)
                raise
            self._conn = conn
        return self._conn

    def _setup(self, conn: Any) -> None:
        cur = conn.cursor()
        try:
            self._begin(conn, cur)
            cur.execute(
                f"CREATE TABLE IF NOT EXISTS {self._progress.sql} ("
                "target_table TEXT NOT NULL, sequence BIGINT NOT NULL, location TEXT NOT NULL, "
                "row_count BIGINT NOT NULL, duplicate BOOLEAN NOT NULL, "
                "committed_at_ms BIGINT NOT NULL, PRIMARY KEY (target_table, sequence))"
            )
            cur.execute(
                f"CREATE UNIQUE INDEX IF NOT EXISTS {quote(self._progress.name + '_location')} "
                f"ON {self._progress.sql} (target_table, location) WHERE NOT duplicate"
            )
            self._commit(conn, cur)
        except BaseException:
            try:
                self._rollback(conn, cur)
            except Exception:
                logger.debug("rollback after a failed setup failed", exc_info=True)
            raise
        finally:
            cur.close()

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        self._columns = None
        if conn is not None:
            _close_quietly(conn)

    @staticmethod
    def _fetch(cur: Any, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        cur.execute(sql, params)
        rows: list[tuple[Any, ...]] = cur.fetchall()
        return rows


def _close_quietly(conn: Any) -> None:
    try:
        conn.close()
    except Exception:  # closing a dead connection
        logger.debug("closing a connection failed", exc_info=True)
